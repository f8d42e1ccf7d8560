// Per-chunk gradients of chunked KDA (SPEC §2.2), one block per (chunk, head), NWB = 16 warps, after the
// two recurrences have left S0 (state at the chunk start), dS (gradient at the chunk end), E and dE.
//
// Legend: B batch, T tokens, H heads, K key dim, V value dim, C chunk 64, KP = K, V padded to 64|128,
//         i, j, r, c chunk rows, d key channel, e value channel. Warp w owns rows 16*(w&3).. and key (or
//         value) columns KP/4*(w>>2).. of every [64][KP] gradient (columns 16*(w>>2).. of the 64-wide
//         chunk matrices); dq, dk, dG stay in its registers.
//   dQg = dO S0ᵀ,  dKd = E dSᵀ,  dW = -dE S0ᵀ,  dA_qk = dO Eᵀ,  dΓ_last = Γ_last ⊙ rowsum(S0 ⊙ dS)
//   dM = (dE Vᵀ + dW (K⊙Γ)ᵀ) Diag(β),  dv = β Mᵀ dE,  d(K⊙Γ) = β Mᵀ dW,  dA_kk = -(Mᵀ dM Mᵀ) strictly lower
//   the pairwise products P_qk, P_kk through the forward's anchored factors (row tile anchors), on the
//   row side (d q_r, d k_r) and the column side (d k_c); dG gets +x at r and -x at c for every pair, so
//   both sides use the same bf16-rounded factors and the two cancel in dg's cumulative sum as they do
//   exactly; the exact path does the diagonal tiles pair by pair in fp32.
//   Then dG's reverse cumulative sum, the gate, the L2 norms and the β sigmoid.
#include "core/cuda/reduce.cuh"
#include "ops/kda/cuda/launch.hpp"

namespace lm::kda::cuda::detail {
namespace {

template <int KP, int NT>
struct BwdSmem {
  static constexpr int LDB = KP + 8, LDG = KP + 8, LDF = KP + 8, LDA = 72;
  static constexpr size_t T64 = size_t(64) * LDB * 2, TKP = size_t(KP) * LDB * 2, TA = size_t(64) * LDA * 2;
  static constexpr size_t cmax(size_t a, size_t b) { return a > b ? a : b; }
  // R1: S0, dS, E, dO | dW, K⊙Γ, dP_qk, dP_kk, dM, T | dq, dk, dG (f32)
  static constexpr size_t R1 = cmax(cmax(2 * TKP + 2 * T64, 2 * T64 + 4 * TA), size_t(3) * 64 * LDF * 4);
  // R2: q, k, G (f32), v, M, P_kk
  static constexpr size_t R2 = 3 * T64 + size_t(64) * LDG * 4 + 2 * TA;
  static constexpr size_t SMALL = (4 * 64 + 2 * KP + NT + 32) * 4;
  static constexpr size_t bytes = T64 + R1 + R2 + SMALL;
};

__device__ __forceinline__ float2 f2(const float* p) { return *reinterpret_cast<const float2*>(p); }

template <int KP, bool BOUNDED, typename GT, int NWB>
__global__ void __launch_bounds__(NWB * 32, 1) chunk_bwd_kernel(const OpParams p) {
  constexpr int NT = NWB * 32;  // threads
  using SM = BwdSmem<KP, NT>;
  constexpr int LDB = SM::LDB, LDG = SM::LDG, LDF = SM::LDF, LDA = SM::LDA;
  constexpr int NCH = NWB / 4;   // column groups (warps per row tile)
  constexpr int NTD = KP / NCH / 8;  // n8 tiles of a warp's KP / NCH key or value columns
  constexpr int AW = 64 / NCH;   // a warp's columns of the 64-wide chunk matrices
  constexpr int NTA = AW / 8;    // and their n8 tiles
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* base = smem;
  bf16* sdE = reinterpret_cast<bf16*>(base);
  unsigned char* r1 = base + SM::T64;
  unsigned char* r2 = r1 + SM::R1;
  // R1, phase 1
  bf16* sS0 = reinterpret_cast<bf16*>(r1);
  bf16* sdS = sS0 + KP * LDB;
  bf16* sE = sdS + KP * LDB;
  bf16* sdO = sE + 64 * LDB;
  // R1, phases 3-6
  bf16* sdW = reinterpret_cast<bf16*>(r1);
  bf16* sKg = sdW + 64 * LDB;
  bf16* sPq = sKg + 64 * LDB;  // dP_qk = scale dA_qk (j <= i)
  bf16* sPk = sPq + 64 * LDA;  // dP_kk = β dA_kk (j < i)
  bf16* sdM = sPk + 64 * LDA;
  bf16* sT = sdM + 64 * LDA;
  // R1, phase 7
  float* sDQ = reinterpret_cast<float*>(r1);
  float* sDK = sDQ + 64 * LDF;
  float* sDG = sDK + 64 * LDF;
  // R2
  bf16* sQ = reinterpret_cast<bf16*>(r2);
  bf16* sK = sQ + 64 * LDB;
  float* sG = reinterpret_cast<float*>(sK + 64 * LDB);
  bf16* sV = reinterpret_cast<bf16*>(sG + 64 * LDG);
  bf16* sM = sV + 64 * LDB;
  bf16* sP = sM + 64 * LDA;
  bf16* sPq2 = sV;  // exact path, phase 7: copies of dP_qk, dP_kk where v, M, P were
  bf16* sPk2 = sV + 64 * LDA;
  float* sm = reinterpret_cast<float*>(r2 + SM::R2);
  float* sRq = sm;
  float* sRk = sRq + 64;
  float* sB = sRk + 64;
  float* sdB = sB + 64;
  float* sGl = sdB + 64;
  float* sdGl = sGl + KP;
  float* sTot = sdGl + KP;
  float* sTot2 = sTot;  // the epilogue's ddt partials, once the cumsum totals are read
  float* sRed = sTot + NT;

  // heads fastest: the blocks in flight read the same token rows of every head, so DRAM sees long runs
  const int h = int(blockIdx.x % unsigned(p.H)), c = int(blockIdx.x / unsigned(p.H));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const ChunkInfo ci = p.chunks[c];
  const int len = ci.len;
  const int64_t row0 = ci.row0;
  const int H = p.H, K = p.K, V = p.V;
  const int64_t HK = int64_t(H) * K, HV = int64_t(H) * V;
  const int64_t ch = int64_t(c) * H + h;
  const float scale = p.scale;
  const bool softplus = !BOUNDED && p.softplus != 0;  // the bounded path implies the lower-bound gate

  // value columns >= V of the workspace are never written by the recurrences: zero-filled here
  load_tile<KP, KP, LDB, NT>(sS0, p.ws.S0 + ch * KP * KP, KP, KP, V, tid);
  load_tile<KP, KP, LDB, NT>(sdS, p.ws.dS + ch * KP * KP, KP, KP, V, tid);
  load_tile<64, KP, LDB, NT>(sE, p.ws.E + ch * 64 * KP, KP, 64, V, tid);
  load_tile<64, KP, LDB, NT>(sdE, p.ws.dE + ch * 64 * KP, KP, 64, V, tid);
  load_tile<64, KP, LDB, NT>(sdO, p.dout + row0 * HV + int64_t(h) * V, HV, len, V, tid);
  load_tile<64, KP, LDB, NT>(sQ, p.q + row0 * HK + int64_t(h) * K, HK, len, K, tid);
  load_tile<64, KP, LDB, NT>(sK, p.k + row0 * HK + int64_t(h) * K, HK, len, K, tid);
  load_tile<64, KP, LDB, NT>(sV, p.v + row0 * HV + int64_t(h) * V, HV, len, V, tid);
  load_tile<64, 64, LDA, NT>(sM, p.ws.M + ch * 4096, 64, 64, 64, tid);
  load_tile<64, 64, LDA, NT>(sP, p.ws.Pkk + ch * 4096, 64, 64, 64, tid);
  load_f32<KP, NT>(sGl, p.ws.Gl + ch * KP, tid);
  load_raw<KP, int(sizeof(GT)), NT>(sG, static_cast<const GT*>(p.g_raw) + row0 * HK + int64_t(h) * K, HK, len, K,
                                    tid);  // raw gate input, into G's place
  cp_commit();

  // gate and cumulative sum (as the forward)
  constexpr int PARTS = NT / KP, RPT = 64 / PARTS;
  const int dch = tid % KP, part = tid / KP;
  const GT* graw = static_cast<const GT*>(p.g_raw);
  const float aexp = expf(p.A_log[h]);
  const float bias = dch < K ? p.dt_bias[int64_t(h) * K + dch] : 0.f;
  {
    if (tid < 64) {
      const GT* braw = static_cast<const GT*>(p.beta_raw);
      sB[tid] = tid < len ? sigmoidf_(to_f(braw[(row0 + tid) * p.beta_ld + h])) : 0.f;
    }
    cp_wait<0>();
    __syncthreads();
    const GT* sg = reinterpret_cast<const GT*>(sG);
    float gv[RPT];
    float run = 0.f;
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int i = part * RPT + r;
      const float gx = gate_fwd(to_f(sg[i * KP + dch]) + bias, aexp, p.lb, softplus);  // as the forward
      const float gg = dch < K && i < len ? gx : 0.f;
      run += gg;
      gv[r] = run;
    }
    sTot[part * KP + dch] = run;
    unit_row_norms<KP, LDB>(sQ, sK, sRq, sRk, warp, lane);  // under the gates' latency
    __syncthreads();
    float off = 0.f;
    for (int pp = 0; pp < part; ++pp) off += sTot[pp * KP + dch];
#pragma unroll
    for (int r = 0; r < RPT; ++r) sG[(part * RPT + r) * LDG + dch] = gv[r] + off;
  }

  const int rt = warp & 3, chh = warp >> 2, dbase = chh * (KP / NCH);
  float dq[NTD][4], dk[NTD][4], dG[NTD][4];  // gradients w.r.t. unit q, unit k and G, warp region
  // dβ of rows 16 rt + g + 8 hh, this warp's column group's part (phases 4-5). The NCH parts of a row, like the four
  // row tiles' parts of dΓ_last's column sums (phase 3, in sTot), are added in a fixed order after phase 5: float
  // atomics would add them in a run-dependent order, and one bf16 rounding later that shows in the gradients.
  float dbacc[2] = {0.f, 0.f};
  static_assert(4 * KP <= NT, "the four row tiles' column sums fit sTot");

  // ---- phase 1: products over the value channels ----
  {
    float aQ[NTD][4], aW[NTD][4], aD[NTD][4], aA[NTA][4];
#pragma unroll
    for (int nt = 0; nt < NTD; ++nt)
#pragma unroll
      for (int x = 0; x < 4; ++x) aQ[nt][x] = aW[nt][x] = aD[nt][x] = 0.f;
#pragma unroll
    for (int nt = 0; nt < NTA; ++nt)
#pragma unroll
      for (int x = 0; x < 4; ++x) aA[nt][x] = 0.f;
#pragma unroll 1
    for (int ks = 0; ks < KP / 16; ++ks) {
      uint32_t fO[4], fdE[4], fE[4];
      ldsm4(fO, sdO + 16 * rt * LDB + 16 * ks + a_off(lane, LDB));
      ldsm4(fdE, sdE + 16 * rt * LDB + 16 * ks + a_off(lane, LDB));
      ldsm4(fE, sE + 16 * rt * LDB + 16 * ks + a_off(lane, LDB));
#pragma unroll
      for (int np = 0; np < NTD / 2; ++np) {
        uint32_t b[4];
        ldsm4(b, sS0 + (dbase + 16 * np) * LDB + 16 * ks + bn_off(lane, LDB));
        mma_bf16(aQ[2 * np], fO, b[0], b[1]);
        mma_bf16(aQ[2 * np + 1], fO, b[2], b[3]);
        mma_bf16(aW[2 * np], fdE, b[0], b[1]);
        mma_bf16(aW[2 * np + 1], fdE, b[2], b[3]);
        ldsm4(b, sdS + (dbase + 16 * np) * LDB + 16 * ks + bn_off(lane, LDB));
        mma_bf16(aD[2 * np], fE, b[0], b[1]);
        mma_bf16(aD[2 * np + 1], fE, b[2], b[3]);
      }
#pragma unroll
      for (int np = 0; np < NTA / 2; ++np) {
        uint32_t b[4];
        ldsm4(b, sE + (AW * chh + 16 * np) * LDB + 16 * ks + bn_off(lane, LDB));
        mma_bf16(aA[2 * np], fO, b[0], b[1]);
        mma_bf16(aA[2 * np + 1], fO, b[2], b[3]);
      }
    }
    // dΓ_last from Diag(Γ_last) S0: Γ_last[d] Σ_e S0[d,e] dS[d,e]
    {
      constexpr int TPR = NT / KP;
      const int d = tid / TPR, pr = tid % TPR;
      float s = 0.f;
      for (int e = pr * (KP / TPR); e < (pr + 1) * (KP / TPR); e += 2) {
        const float2 a = ld_bf16x2(sS0 + d * LDB + e), b = ld_bf16x2(sdS + d * LDB + e);
        s += a.x * b.x + a.y * b.y;
      }
#pragma unroll
      for (int o = TPR / 2; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (pr == 0) sdGl[d] = sGl[d] * s;
    }
    __syncthreads();  // R1's phase-1 tiles are dead from here on

    // ---- phase 3: the Γ, e^{G_last - G} factors; dW, K⊙Γ, dP_qk to shared memory ----
    float colsum[NTD][2];
#pragma unroll
    for (int nt = 0; nt < NTD; ++nt) {
      colsum[nt][0] = colsum[nt][1] = 0.f;
      const int d = dbase + 8 * nt + 2 * t;
      const float2 Gl = f2(sG + 63 * LDG + d);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = 16 * rt + g + 8 * hh;
        const float2 G = f2(sG + r * LDG + d);
        const float2 qv = ld_bf16x2(sQ + r * LDB + d), kv = ld_bf16x2(sK + r * LDB + d);
        const float rq = sRq[r], rk = sRk[r];
        float kg[2], dw[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float Gx = j ? G.y : G.x, Glx = j ? Gl.y : Gl.x;
          const float qn = (j ? qv.y : qv.x) * rq, kn = (j ? kv.y : kv.x) * rk;
          const float gam = __expf(Gx), dec = __expf(Glx - Gx);
          const float vQ = aQ[nt][2 * hh + j], vD = aD[nt][2 * hh + j];
          dq[nt][2 * hh + j] = vQ * scale * gam;
          dk[nt][2 * hh + j] = vD * dec;
          dG[nt][2 * hh + j] = vQ * scale * qn * gam - vD * kn * dec;
          colsum[nt][j] += vD * kn * dec;
          kg[j] = kn * gam;
          dw[j] = -aW[nt][2 * hh + j];
        }
        st_bf16x2(sKg + r * LDB + d, kg[0], kg[1]);
        st_bf16x2(sdW + r * LDB + d, dw[0], dw[1]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTD; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float s = colsum[nt][j];
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        s += __shfl_xor_sync(0xffffffffu, s, 8);
        s += __shfl_xor_sync(0xffffffffu, s, 16);
        if (g == 0) sTot[rt * KP + dbase + 8 * nt + 2 * t + j] = s;  // (sTot is free until the epilogue)
      }
#pragma unroll
    for (int nt = 0; nt < NTA; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = 16 * rt + g + 8 * hh, col = AW * chh + 8 * nt + 2 * t;
        st_bf16x2(sPq + r * LDA + col, col <= r ? scale * aA[nt][2 * hh] : 0.f,
                  col + 1 <= r ? scale * aA[nt][2 * hh + 1] : 0.f);
      }
  }
  __syncthreads();

  // ---- phase 4: dM, dv, d(K⊙Γ) ----
  {
    float aM[NTA][4];
#pragma unroll
    for (int nt = 0; nt < NTA; ++nt) aM[nt][0] = aM[nt][1] = aM[nt][2] = aM[nt][3] = 0.f;
#pragma unroll 1
    for (int ks = 0; ks < KP / 16; ++ks) {
      uint32_t fa[4], fw[4];
      ldsm4(fa, sdE + 16 * rt * LDB + 16 * ks + a_off(lane, LDB));
      ldsm4(fw, sdW + 16 * rt * LDB + 16 * ks + a_off(lane, LDB));
#pragma unroll
      for (int np = 0; np < NTA / 2; ++np) {
        uint32_t b[4];
        ldsm4(b, sV + (AW * chh + 16 * np) * LDB + 16 * ks + bn_off(lane, LDB));
        mma_bf16(aM[2 * np], fa, b[0], b[1]);
        mma_bf16(aM[2 * np + 1], fa, b[2], b[3]);
        ldsm4(b, sKg + (AW * chh + 16 * np) * LDB + 16 * ks + bn_off(lane, LDB));
        mma_bf16(aM[2 * np], fw, b[0], b[1]);
        mma_bf16(aM[2 * np + 1], fw, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTA; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = 16 * rt + g + 8 * hh, col = AW * chh + 8 * nt + 2 * t;
        st_bf16x2(sdM + r * LDA + col, col < r ? sB[col] * aM[nt][2 * hh] : 0.f,
                  col + 1 < r ? sB[col + 1] * aM[nt][2 * hh + 1] : 0.f);
      }
    // dB1 = Mᵀ dE (value columns dbase..) -> dv, dβ
    float aB[NTD][4];
#pragma unroll
    for (int nt = 0; nt < NTD; ++nt) aB[nt][0] = aB[nt][1] = aB[nt][2] = aB[nt][3] = 0.f;
#pragma unroll 1
    for (int ks = rt; ks < 4; ++ks) {  // M[a][i] = 0 for a < i
      uint32_t fa[4];
      ldsm4t(fa, sM + 16 * ks * LDA + 16 * rt + at_off(lane, LDA));
#pragma unroll
      for (int np = 0; np < NTD / 2; ++np) {
        uint32_t b[4];
        ldsm4t(b, sdE + 16 * ks * LDB + dbase + 16 * np + bt_off(lane, LDB));
        mma_bf16(aB[2 * np], fa, b[0], b[1]);
        mma_bf16(aB[2 * np + 1], fa, b[2], b[3]);
      }
    }
    {
      float db[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < NTD; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = 16 * rt + g + 8 * hh, e = dbase + 8 * nt + 2 * t;
          const float2 vv = ld_bf16x2(sV + r * LDB + e);
          db[hh] += vv.x * aB[nt][2 * hh] + vv.y * aB[nt][2 * hh + 1];
          if (r < len && e < V) {
            const float b = sB[r];
            st_bf16x2(p.dv + (row0 + r) * HV + int64_t(h) * V + e, b * aB[nt][2 * hh], b * aB[nt][2 * hh + 1]);
          }
        }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 1);
        db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 2);
        dbacc[hh] += db[hh];
      }
    }
    // dB2 = Mᵀ dW (key columns dbase..) -> d(K⊙Γ) = β dB2
#pragma unroll
    for (int nt = 0; nt < NTD; ++nt) aB[nt][0] = aB[nt][1] = aB[nt][2] = aB[nt][3] = 0.f;
#pragma unroll 1
    for (int ks = rt; ks < 4; ++ks) {
      uint32_t fa[4];
      ldsm4t(fa, sM + 16 * ks * LDA + 16 * rt + at_off(lane, LDA));
#pragma unroll
      for (int np = 0; np < NTD / 2; ++np) {
        uint32_t b[4];
        ldsm4t(b, sdW + 16 * ks * LDB + dbase + 16 * np + bt_off(lane, LDB));
        mma_bf16(aB[2 * np], fa, b[0], b[1]);
        mma_bf16(aB[2 * np + 1], fa, b[2], b[3]);
      }
    }
    {
      float db[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < NTD; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = 16 * rt + g + 8 * hh, d = dbase + 8 * nt + 2 * t;
          const float2 G = f2(sG + r * LDG + d);
          const float2 kv = ld_bf16x2(sK + r * LDB + d);
          const float rk = sRk[r], b = sB[r];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float gam = __expf(j ? G.y : G.x), kgv = (j ? kv.y : kv.x) * rk * gam;
            const float v = aB[nt][2 * hh + j];
            dk[nt][2 * hh + j] += b * v * gam;
            dG[nt][2 * hh + j] += b * v * kgv;
            db[hh] += kgv * v;
          }
        }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 1);
        db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 2);
        dbacc[hh] += db[hh];
      }
    }
  }
  __syncthreads();

  // ---- phase 5: dA_kk = -(Mᵀ dM Mᵀ), strictly lower ----
  {
    float aT[NTA][4];
#pragma unroll
    for (int nt = 0; nt < NTA; ++nt) aT[nt][0] = aT[nt][1] = aT[nt][2] = aT[nt][3] = 0.f;
#pragma unroll 1
    for (int ks = rt; ks < 4; ++ks) {
      uint32_t fa[4];
      ldsm4t(fa, sM + 16 * ks * LDA + 16 * rt + at_off(lane, LDA));
#pragma unroll
      for (int np = 0; np < NTA / 2; ++np) {
        uint32_t b[4];
        ldsm4t(b, sdM + 16 * ks * LDA + AW * chh + 16 * np + bt_off(lane, LDA));
        mma_bf16(aT[2 * np], fa, b[0], b[1]);
        mma_bf16(aT[2 * np + 1], fa, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTA; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = 16 * rt + g + 8 * hh, col = AW * chh + 8 * nt + 2 * t;
        st_bf16x2(sT + r * LDA + col, aT[nt][2 * hh], aT[nt][2 * hh + 1]);
      }
  }
  __syncthreads();
  {
    float aL[NTA][4];
#pragma unroll
    for (int nt = 0; nt < NTA; ++nt) aL[nt][0] = aL[nt][1] = aL[nt][2] = aL[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t fa[4];
      ldsm4(fa, sT + 16 * rt * LDA + 16 * ks + a_off(lane, LDA));
#pragma unroll
      for (int np = 0; np < NTA / 2; ++np) {
        uint32_t b[4];
        ldsm4(b, sM + (AW * chh + 16 * np) * LDA + 16 * ks + bn_off(lane, LDA));
        mma_bf16(aL[2 * np], fa, b[0], b[1]);
        mma_bf16(aL[2 * np + 1], fa, b[2], b[3]);
      }
    }
    float db[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < NTA; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = 16 * rt + g + 8 * hh, col = AW * chh + 8 * nt + 2 * t;
        const float a0 = col < r ? -aL[nt][2 * hh] : 0.f, a1 = col + 1 < r ? -aL[nt][2 * hh + 1] : 0.f;
        const float2 pk = ld_bf16x2(sP + r * LDA + col);
        db[hh] += a0 * pk.x + a1 * pk.y;
        const float b = sB[r];
        st_bf16x2(sPk + r * LDA + col, b * a0, b * a1);
      }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 1);
      db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 2);
      dbacc[hh] += db[hh];
    }
  }
  float* sDbPart = reinterpret_cast<float*>(sV);  // [NCH][64] (v is dead from here; the exact path's phase 7 reuses it)
  if (t == 0)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) sDbPart[chh * 64 + 16 * rt + g + 8 * hh] = dbacc[hh];
  __syncthreads();
  if (tid < 64) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < NCH; ++k) s += sDbPart[k * 64 + tid];
    sdB[tid] = s;
  }
  if (tid < KP) sdGl[tid] = (((sdGl[tid] + sTot[tid]) + sTot[KP + tid]) + sTot[2 * KP + tid]) + sTot[3 * KP + tid];
  // (read in the epilogue, after phase 6's barriers)

  // ---- phase 6: pairwise products through anchored factors ----
  {
    constexpr int NH = NTD / 2;  // n-tiles per half (register budget)
    const float off = BOUNDED ? 7.5f * p.lb : 0.f;
    auto qn_ = [&](int r, int d) { return __bfloat162float(sQ[r * LDB + d]) * sRq[r]; };
    auto kn_ = [&](int r, int d) { return __bfloat162float(sK[r * LDB + d]) * sRk[r]; };
    auto rb = [](float x) { return __bfloat162float(__float2bfloat16_rn(x)); };
    // Row side, rows r of tile rt, anchor a = G[16 rt] + off: [dQa; dKa] = [dP_qk; dP_kk] Kb,
    // Kb_c = k_c e^{a - G_c}, Qa_r = q_r e^{G_r - a}, Ka_r = k_r e^{G_r - a}.
    const int ncol = BOUNDED ? rt + 1 : rt;
    if (ncol > 0) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float rq[NH][4], rk[NH][4];
#pragma unroll
        for (int n4 = 0; n4 < NH; ++n4)
#pragma unroll
          for (int x = 0; x < 4; ++x) rq[n4][x] = rk[n4][x] = 0.f;
#pragma unroll 1
        for (int kc = 0; kc < ncol; ++kc) {
          uint32_t fq[4], fk[4];
          ldsm4(fq, sPq + 16 * rt * LDA + 16 * kc + a_off(lane, LDA));
          ldsm4(fk, sPk + 16 * rt * LDA + 16 * kc + a_off(lane, LDA));
          const int c0 = 16 * kc + 2 * t;
#pragma unroll
          for (int n4 = 0; n4 < NH; ++n4) {
            const int d = dbase + 8 * (half * NH + n4) + g;
            const float an = sG[16 * rt * LDG + d] + off;
            const uint32_t b0 = pack_bf16(kn_(c0, d) * __expf(an - sG[c0 * LDG + d]),
                                          kn_(c0 + 1, d) * __expf(an - sG[(c0 + 1) * LDG + d]));
            const uint32_t b1 = pack_bf16(kn_(c0 + 8, d) * __expf(an - sG[(c0 + 8) * LDG + d]),
                                          kn_(c0 + 9, d) * __expf(an - sG[(c0 + 9) * LDG + d]));
            mma_bf16(rq[n4], fq, b0, b1);
            mma_bf16(rk[n4], fk, b0, b1);
          }
        }
#pragma unroll
        for (int n4 = 0; n4 < NH; ++n4) {
          const int nt = half * NH + n4;
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int r = 16 * rt + g + 8 * (x >> 1), d = dbase + 8 * nt + 2 * t + (x & 1);
            const float an = sG[16 * rt * LDG + d] + off;
            const float ea = __expf(sG[r * LDG + d] - an);
            dq[nt][x] += rq[n4][x] * ea;
            dk[nt][x] += rk[n4][x] * ea;
            dG[nt][x] += rq[n4][x] * rb(qn_(r, d) * ea) + rk[n4][x] * rb(kn_(r, d) * ea);
          }
        }
      }
    }
    // Column side, columns c of tile rt, once per row tile i >= rt (exact: > rt) with that tile's anchor:
    // dKb_c = Σ_{r in tile i} dP_qk[r,c] Qa_r + dP_kk[r,c] Ka_r;  d k_c += dKb e^{a - G_c}, dG_c -= dKb Kb_c.
#pragma unroll 1
    for (int i = BOUNDED ? rt : rt + 1; i < 4; ++i) {
      uint32_t fq[4], fk[4];
      ldsm4t(fq, sPq + 16 * i * LDA + 16 * rt + at_off(lane, LDA));
      ldsm4t(fk, sPk + 16 * i * LDA + 16 * rt + at_off(lane, LDA));
      const int r0 = 16 * i + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float cb[NH][4];
#pragma unroll
        for (int n4 = 0; n4 < NH; ++n4) {
          cb[n4][0] = cb[n4][1] = cb[n4][2] = cb[n4][3] = 0.f;
          const int d = dbase + 8 * (half * NH + n4) + g;
          const float an = sG[16 * i * LDG + d] + off;
          const float e0 = __expf(sG[r0 * LDG + d] - an), e1 = __expf(sG[(r0 + 1) * LDG + d] - an);
          const float e8 = __expf(sG[(r0 + 8) * LDG + d] - an), e9 = __expf(sG[(r0 + 9) * LDG + d] - an);
          const uint32_t q0 = pack_bf16(qn_(r0, d) * e0, qn_(r0 + 1, d) * e1);
          const uint32_t q1 = pack_bf16(qn_(r0 + 8, d) * e8, qn_(r0 + 9, d) * e9);
          const uint32_t k0 = pack_bf16(kn_(r0, d) * e0, kn_(r0 + 1, d) * e1);
          const uint32_t k1 = pack_bf16(kn_(r0 + 8, d) * e8, kn_(r0 + 9, d) * e9);
          mma_bf16(cb[n4], fq, q0, q1);
          mma_bf16(cb[n4], fk, k0, k1);
        }
#pragma unroll
        for (int n4 = 0; n4 < NH; ++n4) {
          const int nt = half * NH + n4;
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int cc = 16 * rt + g + 8 * (x >> 1), d = dbase + 8 * nt + 2 * t + (x & 1);
            const float an = sG[16 * i * LDG + d] + off;
            const float eb = __expf(an - sG[cc * LDG + d]);
            dk[nt][x] += cb[n4][x] * eb;
            dG[nt][x] -= cb[n4][x] * rb(kn_(cc, d) * eb);
          }
        }
      }
    }
  }
  __syncthreads();
  if (!BOUNDED) {  // keep dP_qk, dP_kk (R1 is about to hold the f32 gradients)
    for (int idx = tid; idx < 64 * 8; idx += NT) {
      const int r = idx >> 3, cc = (idx & 7) * 8;
      *reinterpret_cast<uint4*>(sPq2 + r * LDA + cc) = *reinterpret_cast<const uint4*>(sPq + r * LDA + cc);
      *reinterpret_cast<uint4*>(sPk2 + r * LDA + cc) = *reinterpret_cast<const uint4*>(sPk + r * LDA + cc);
    }
    __syncthreads();
  }
#pragma unroll
  for (int nt = 0; nt < NTD; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * rt + g + 8 * hh, d = dbase + 8 * nt + 2 * t;
      *reinterpret_cast<float2*>(sDQ + r * LDF + d) = make_float2(dq[nt][2 * hh], dq[nt][2 * hh + 1]);
      *reinterpret_cast<float2*>(sDK + r * LDF + d) = make_float2(dk[nt][2 * hh], dk[nt][2 * hh + 1]);
      *reinterpret_cast<float2*>(sDG + r * LDF + d) = make_float2(dG[nt][2 * hh], dG[nt][2 * hh + 1]);
    }
  __syncthreads();
  if (!BOUNDED) {
    // Diagonal tiles pair by pair: thread (tile, channel d) owns 16 rows of channel d.
#pragma unroll 1
    for (int item = tid; item < 4 * KP; item += NT) {
      const int dt = item / KP, d = item % KP;
      float qv[16], kv[16], Gv[16], aq[16], ak[16], ag[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int row = 16 * dt + r;
        Gv[r] = sG[row * LDG + d];
        qv[r] = __bfloat162float(sQ[row * LDB + d]) * sRq[row];
        kv[r] = __bfloat162float(sK[row * LDB + d]) * sRk[row];
        aq[r] = ak[r] = ag[r] = 0.f;
      }
#pragma unroll
      for (int r = 0; r < 16; ++r)
#pragma unroll
        for (int cc = 0; cc <= r; ++cc) {
          const float e = __expf(Gv[r] - Gv[cc]);
          const float tq = __bfloat162float(sPq2[(16 * dt + r) * LDA + 16 * dt + cc]);
          const float tk = __bfloat162float(sPk2[(16 * dt + r) * LDA + 16 * dt + cc]);
          const float side = (tq * qv[r] + tk * kv[r]) * e;
          aq[r] += tq * kv[cc] * e;
          ak[r] += tk * kv[cc] * e;
          ak[cc] += side;
          const float x = side * kv[cc];
          ag[r] += x;
          ag[cc] -= x;
        }
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int row = 16 * dt + r;
        sDQ[row * LDF + d] += aq[r];
        sDK[row * LDF + d] += ak[r];
        sDG[row * LDF + d] += ag[r];
      }
    }
    __syncthreads();
  }

  // ---- epilogue: dg = reverse cumsum of dG (G_last's gradient on the last row), then the gate ----
  {
    float run = 0.f;  // in place in sDG: the gate loop below then needs no unrolling (code size)
#pragma unroll 1
    for (int r = RPT - 1; r >= 0; --r) {
      const int i = part * RPT + r;
      run += sDG[i * LDF + dch] + (i == 63 ? sdGl[dch] : 0.f);
      sDG[i * LDF + dch] = run;
    }
    sTot[part * KP + dch] = run;
    __syncthreads();
    float offs = 0.f;
    for (int pp = part + 1; pp < PARTS; ++pp) offs += sTot[pp * KP + dch];
    float ddt = 0.f, dAl = 0.f;
    if (dch < K) {
      GT* dgo = static_cast<GT*>(p.dg_raw);
      const int iend = min((part + 1) * RPT, len);
#pragma unroll 4
      for (int i = part * RPT; i < iend; ++i) {
        const int64_t idx = (row0 + i) * HK + int64_t(h) * K + dch;
        float dx, dA;
        gate_bwd(to_f(graw[idx]) + bias, aexp, p.lb, softplus, sDG[i * LDF + dch] + offs, dx, dA);
        dgo[idx] = from_f<GT>(dx);
        ddt += dx;
        dAl += dA;
      }
    }
    __syncthreads();  // every thread has read its cumsum offset from sTot (= sTot2)
    sTot2[part * KP + dch] = ddt;
    dAl = warp_sum(dAl);
    if (lane == 0) sRed[warp] = dAl;
  }
  // L2-norm backward: dx = (dy - y (y·dy)) / |x|
  for (int rr = 0; rr < 64 / NWB; ++rr) {
    const int i = warp * (64 / NWB) + rr;
    float dotq = 0.f, dotk = 0.f;
    const float rq = sRq[i], rk = sRk[i];
#pragma unroll
    for (int d0 = lane * 2; d0 < KP; d0 += 64) {
      const float2 x = ld_bf16x2(sQ + i * LDB + d0), y = ld_bf16x2(sK + i * LDB + d0);
      const float2 gq = f2(sDQ + i * LDF + d0), gk = f2(sDK + i * LDF + d0);
      dotq += x.x * rq * gq.x + x.y * rq * gq.y;
      dotk += y.x * rk * gk.x + y.y * rk * gk.y;
    }
    const float2 dots = warp_sum(make_float2(dotq, dotk));
    dotq = dots.x, dotk = dots.y;
    if (i < len) {
#pragma unroll
      for (int d0 = lane * 2; d0 < KP; d0 += 64) {
        if (d0 < K) {
          const float2 x = ld_bf16x2(sQ + i * LDB + d0), y = ld_bf16x2(sK + i * LDB + d0);
          const float2 gq = f2(sDQ + i * LDF + d0), gk = f2(sDK + i * LDF + d0);
          const int64_t o = (row0 + i) * HK + int64_t(h) * K + d0;
          st_bf16x2(p.dq + o, rq * (gq.x - x.x * rq * dotq), rq * (gq.y - x.y * rq * dotq));
          st_bf16x2(p.dk + o, rk * (gk.x - y.x * rk * dotk), rk * (gk.y - y.y * rk * dotk));
        }
      }
    }
  }
  if (tid < len) {
    const float b = sB[tid];
    static_cast<GT*>(p.dbeta_raw)[(row0 + tid) * p.beta_ld + h] = from_f<GT>(sdB[tid] * b * (1.f - b));
  }
  __syncthreads();
  if (part == 0) {
    float s = 0.f;
    for (int pp = 0; pp < PARTS; ++pp) s += sTot2[pp * KP + dch];
    p.ws.ddt_part[ch * KP + dch] = s;
  }
  if (tid == 0) {
    float s = 0.f;
    for (int w = 0; w < NWB; ++w) s += sRed[w];
    p.ws.dA_part[ch] = s;
  }
}

// dA_log[h] = Σ_chunks dA_part, ddt_bias[h, d] = Σ_chunks ddt_part (fixed order: deterministic).
__global__ void reduce_kernel(const OpParams p, int KP) {
  const int h = blockIdx.x, d = threadIdx.x;
  float s = 0.f;
  for (int c = 0; c < p.NC; ++c) s += p.ws.ddt_part[(int64_t(c) * p.H + h) * KP + d];
  if (d < p.K) p.ddt_bias[int64_t(h) * p.K + d] = s;
  if (d == 0) {
    float a = 0.f;
    for (int c = 0; c < p.NC; ++c) a += p.ws.dA_part[int64_t(c) * p.H + h];
    p.dA_log[h] = a;
  }
}

template <int KP, bool BND, typename GT, int NWB>
void launch_w(const OpParams& p, cudaStream_t s) {
  const size_t smem = BwdSmem<KP, NWB * 32>::bytes;
  static_assert(BwdSmem<KP, NWB * 32>::bytes <= 227 * 1024, "one block's shared memory on Hopper");
  static bool attr = false;
  if (!attr) {
    cudaFuncSetAttribute(chunk_bwd_kernel<KP, BND, GT, NWB>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    attr = true;
  }
  chunk_bwd_kernel<KP, BND, GT, NWB><<<unsigned(p.NC) * unsigned(p.H), NWB * 32, smem, s>>>(p);
}
// 16 warps per block: 128 registers each and twice the warps of the 8-warp form, which had 255 registers,
// one block of 8 warps per SM and 1.5x the time (docs/gpu.md).
template <int KP, bool BND, typename GT>
void launch_t(const OpParams& p, cudaStream_t s) {
  launch_w<KP, BND, GT, 16>(p, s);
}
template <int KP, bool BND>
void launch_g(const OpParams& p, bool gate_f32, cudaStream_t s) {
  if (gate_f32) launch_t<KP, BND, float>(p, s);
  else launch_t<KP, BND, bf16>(p, s);
}

}  // namespace

void launch_chunk_bwd(const OpParams& p, int KP, bool bounded, bool gate_f32, cudaStream_t s) {
  if (p.NC == 0) return;
  if (KP == 64) {
    if (bounded) launch_g<64, true>(p, gate_f32, s);
    else launch_g<64, false>(p, gate_f32, s);
  } else {
    if (bounded) launch_g<128, true>(p, gate_f32, s);
    else launch_g<128, false>(p, gate_f32, s);
  }
}

void launch_reduce(const OpParams& p, int KP, cudaStream_t s) { reduce_kernel<<<p.H, KP, 0, s>>>(p, KP); }

}  // namespace lm::kda::cuda::detail
