// K1 of the chunked KDA forward (SPEC §2.1), one block per (chunk, head), 8 warps.
//
// Legend: B batch, T tokens, H heads, K key dim, V value dim, C chunk 64, KP = K, V padded to 64|128,
//         rows i, j of the chunk, 16-row tiles ti, tj, d a key channel.
// Computes from the raw inputs: g = gate(g_raw), G = cumsum(g), Γ = exp(G), unit q, k, β = σ(beta_raw);
//   A_qk[i,j] = scale Σ_d q_id k_jd e^{G_id - G_jd} (j <= i), A_kk[i,j] = β_i Σ_d k_id k_jd e^{G_id - G_jd} (j < i),
//   M = (I + A_kk)^-1, W = M Diag(β) (K⊙Γ), U = M Diag(β) V, Qg = scale Q⊙Γ, Kd = K⊙e^{G_last - G}, Γ_last.
// Tiles of A are bf16 MMAs over the anchored factors e^{G_i - a} · e^{a - G_j} (a per row tile): the
// bounded path anchors at G_first + 7.5·lb, so every factor is within e^{±7.5|lb|} and the diagonal tiles
// are MMAs too; the exact path anchors past tiles at G_first (factors <= 1) and computes the diagonal
// tiles pair by pair in fp32. The bounded path's diagonal tiles and M (in W, U) are split into bf16 hi + lo
// parts (three and two MMAs), since those roundings dominate o's error; the forward stores A_qk, U and Kd
// in fp16 (the backward's recomputation keeps bf16 throughout, with P_kk and M for the chunk gradients).
// M: forward substitution in each 16x16 diagonal block, then the blocks below by column (right to left),
// as tf32 MMAs.
#include "ops/kda/cuda/launch.hpp"

namespace lm::kda::cuda::detail {
namespace {

template <int KP>
struct PrepSmem {
  static constexpr int LDB = KP + 8;  // bf16 tiles: rows 16 bytes apart mod 128, so ldmatrix is conflict-free
  static constexpr int LDG = KP + 8;  // f32 G: float2 fragment reads conflict-free
  static constexpr int LDM = 72;      // f32 A_kk / M
  static constexpr int LDX = 20;      // f32 16x16 scratch of the tf32 products
  static constexpr int LDQ = 68;      // A_qk partial sums (32-bit), in v's place until v is loaded
  static constexpr size_t VBYTES = size_t(64) * LDB * 2, QBYTES = size_t(64) * LDQ * 4;
  static constexpr size_t VSLOT = VBYTES > QBYTES ? VBYTES : QBYTES;
  static constexpr size_t bytes =
      size_t(2) * 64 * LDB * 2 + VSLOT + size_t(64) * LDG * 4 + size_t(64) * LDM * 4 + 2048 * 4 + 3 * 64 * 4 + 256 * 4;
};

__device__ __forceinline__ float2 f2(const float* p) { return *reinterpret_cast<const float2*>(p); }
// Partial sums of the A tiles in 2^29 fixed point (see the A-tile phase).
__device__ __forceinline__ int to_fixed(float x) { return __float2int_rn(x * 536870912.f); }
__device__ __forceinline__ float from_fixed(int v) { return float(v) * (1.f / 536870912.f); }
__device__ __forceinline__ float4 f4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 bf4(const bf16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = unpack_bf16(u.x), b = unpack_bf16(u.y);
  return make_float4(a.x, a.y, b.x, b.y);
}

// Barrier 1 for the 128 threads of warps 0..3 (the inversion), so the other warps need not wait.
__device__ __forceinline__ void named_sync_128() { asm volatile("bar.sync 1, 128;\n" ::: "memory"); }

// C (16x16, two n8 tiles) += A (16x16 f32, row-major) * B (16x16 f32, row-major) in tf32.
__device__ __forceinline__ void mm16_tf32(float (&C)[2][4], const float* A, int lda, const float* B, int ldb,
                                          int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const uint32_t a[4] = {tf32(A[g * lda + 8 * ks + t]), tf32(A[(g + 8) * lda + 8 * ks + t]),
                           tf32(A[g * lda + 8 * ks + t + 4]), tf32(A[(g + 8) * lda + 8 * ks + t + 4])};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
      mma_tf32(C[nt], a, tf32(B[(8 * ks + t) * ldb + 8 * nt + g]), tf32(B[(8 * ks + t + 4) * ldb + 8 * nt + g]));
  }
}

// STOP (benchmarks only): 0 the whole kernel; 1 ends before the A tiles, 2 right after them, so that the
// difference of the two times is the intra-chunk tile stage where the bounded and exact paths differ; 3 as 2
// with the diagonal tiles alone (the bounded MMAs or the exact pairwise sums), the diagonal-tile stage.
template <int KP, bool BOUNDED, typename GT, bool BWD, int STOP = 0>
__global__ void __launch_bounds__(256, 2) prep_kernel(const OpParams p) {
  constexpr bool F16 = !BWD;
  using SM = PrepSmem<KP>;
  constexpr int LDB = SM::LDB, LDG = SM::LDG, LDM = SM::LDM, LDX = SM::LDX, LDQ = SM::LDQ;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // raw q [64][LDB]
  bf16* sK = sQ + 64 * LDB;                   // raw k, later K⊙Γ (unit k)
  bf16* sV = sK + 64 * LDB;                   // v (loaded once the A tiles are done)
  int* sAqI = reinterpret_cast<int*>(sV);  // A_qk partial sums [64][LDQ], fixed point, before v
  float* sG = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sV) + SM::VSLOT);  // G [64][LDG]
  float* sM = sG + 64 * LDG;                             // A_kk, then M in place [64][LDM]
  int* sAkI = reinterpret_cast<int*>(sM);                // A_kk partial sums (fixed point), before M
  float* sScr = sM + 64 * LDM;                           // [2048]: exact diagonal tiles / tf32 scratch
  int* sScrI = reinterpret_cast<int*>(sScr);             // the same, as fixed-point partial sums
  float* sRq = sScr + 2048;                              // 1/|q_i|
  float* sRk = sRq + 64;                                 // 1/|k_i|
  float* sB = sRk + 64;                                  // β_i
  float* sTot = sB + 64;                                 // [256] cumsum part totals

  // heads fastest: the blocks in flight read the same token rows of every head, so DRAM sees long runs
  const int h = int(blockIdx.x % unsigned(p.H)), c = int(blockIdx.x / unsigned(p.H));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const ChunkInfo ci = p.chunks[c];
  // zero the fixed-point partial sums (A_kk in sM, A_qk in v's slot; the exact path's diagonal tiles in sScr)
  // while the chunk's row range is on its way
  for (int i = tid; i < 64 * LDM / 4; i += 256) reinterpret_cast<float4*>(sM)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (!BOUNDED)
    for (int i = tid; i < 2048 / 4; i += 256) reinterpret_cast<float4*>(sScr)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i = tid; i < 64 * LDQ / 4; i += 256) reinterpret_cast<int4*>(sAqI)[i] = make_int4(0, 0, 0, 0);
  const int len = ci.len;
  const int64_t row0 = ci.row0;
  const int H = p.H, K = p.K, V = p.V;
  const int64_t HK = int64_t(H) * K, HV = int64_t(H) * V;
  const int64_t ch = int64_t(c) * H + h;  // (chunk, head) index of the workspace
  const bool softplus = !BOUNDED && p.softplus != 0;  // the bounded path implies the lower-bound gate

  load_tile<64, KP, LDB, 256>(sQ, p.q + row0 * HK + int64_t(h) * K, HK, len, K, tid);
  load_tile<64, KP, LDB, 256>(sK, p.k + row0 * HK + int64_t(h) * K, HK, len, K, tid);
  // the raw gate input goes where G will be (a dense [64][KP] tile of GT), asynchronously with q, k
  load_raw<KP, int(sizeof(GT)), 256>(sG, static_cast<const GT*>(p.g_raw) + row0 * HK + int64_t(h) * K, HK, len, K, tid);
  cp_commit();

  // Gate and cumulative sum down the chunk: thread (d, part) owns RPT consecutive rows of channel d.
  constexpr int PARTS = 256 / KP, RPT = 64 / PARTS;
  const int dch = tid % KP, part = tid / KP;
  float gv[RPT];
  {
    const float a = expf(p.A_log[h]);
    const bool dok = dch < K;
    const float bias = dok ? p.dt_bias[int64_t(h) * K + dch] : 0.f;
    if (tid < 64) {
      const GT* braw = static_cast<const GT*>(p.beta_raw);
      sB[tid] = tid < len ? sigmoidf_(to_f(braw[(row0 + tid) * p.beta_ld + h])) : 0.f;
    }
    cp_wait<0>();
    __syncthreads();  // q, k, v and the raw gate input have landed
    const GT* sg = reinterpret_cast<const GT*>(sG);
    float run = 0.f;
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
      const int i = part * RPT + r;
      // padded rows and channels: no decay, so G_63 = G_last of the chunk. Computed for every row and then
      // selected (no branch), so the rows' exp/rcp latencies overlap.
      const float gx = gate_fwd(to_f(sg[i * KP + dch]) + bias, a, p.lb, softplus);  // finite: padding is zero
      const float gg = dok && i < len ? gx : 0.f;
      run += gg;
      gv[r] = run;
    }
    sTot[part * KP + dch] = run;
  }
  unit_row_norms<KP, LDB>(sQ, sK, sRq, sRk, warp, lane);  // under the gates' latency
  __syncthreads();  // every raw value is read before G overwrites it; the norms are in
  {
    float off = 0.f;
    for (int pp = 0; pp < part; ++pp) off += sTot[pp * KP + dch];
#pragma unroll
    for (int r = 0; r < RPT; ++r) sG[(part * RPT + r) * LDG + dch] = gv[r] + off;
  }
  __syncthreads();
  if (tid < KP) p.ws.Gl[ch * KP + tid] = expf(sG[63 * LDG + tid]);
  if constexpr (STOP == 1) return;

  uint16_t* Aqk = reinterpret_cast<uint16_t*>(p.ws.Aqk) + ch * 4096;  // fp16 (forward) or bf16 bits
  bf16* Pkk = BWD ? p.ws.Pkk + ch * 4096 : nullptr;
  // ---- A tiles as MMAs over the anchored factors ----
  // Warp (pair, quarter): row tiles {0, 3} or {1, 2} (five units (ti, tj <= ti) each, so the warps are
  // balanced) over a quarter of the key channels; a row tile's factors are built once per channel step and
  // reused for every column tile. The four quarters' partial sums meet in shared memory as 2^29 fixed point
  // (integer shared atomics are native, float ones a compare-and-swap loop): every partial is a dot product
  // of unit vectors over a subset of the channels with decays <= 1, so |value| <= 1 and the step 2^-29 is far
  // below the bf16 / fp16 rounding of the result. (Entries above the causal mask of a diagonal tile have growths
  // instead of decays and saturate or wrap; the finish below discards them.)
  {
    const float off = BOUNDED ? 7.5f * p.lb : 0.f;
    const int pair = warp >> 2, quarter = warp & 3;
    constexpr int KQ = KP / 64;  // channel steps of 16 per quarter
#pragma unroll 1
    for (int s = 0; s < 2; ++s) {
      const int ti = pair ? 1 + s : 3 * s;
      const int ntj = BOUNDED ? ti + 1 : (STOP == 3 ? 0 : ti);  // column tiles (exact path: below the diagonal)
      if (ntj == 0) continue;
      const int r0 = 16 * ti + g, r1 = r0 + 8;
      const float* Ga = sG + 16 * ti * LDG;  // anchor row
      const float rq0 = sRq[r0], rq1 = sRq[r1], rk0 = sRk[r0], rk1 = sRk[r1];
      float aq[4][2][4], ak[4][2][4];
#pragma unroll
      for (int tj = 0; tj < 4; ++tj)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int x = 0; x < 4; ++x) aq[tj][nt][x] = ak[tj][nt][x] = 0.f;
      auto arow = [&](int r, int dd, float2 an, float rq, float rk, uint32_t& oq, uint32_t& ok, uint32_t& lq,
                      uint32_t& lk) {
        const float2 G = f2(sG + r * LDG + dd);
        const float e0 = __expf(G.x - an.x), e1 = __expf(G.y - an.y);
        const float2 x = ld_bf16x2(sQ + r * LDB + dd), y = ld_bf16x2(sK + r * LDB + dd);
        split_bf16(x.x * rq * e0, x.y * rq * e1, oq, lq);
        split_bf16(y.x * rk * e0, y.y * rk * e1, ok, lk);
      };
      // column factors; the lo part only where it is used (the bounded diagonal tile)
      auto bcol = [&](int cc, int dd, float2 an, bool with_lo, uint32_t& lo) -> uint32_t {
        const float2 G = f2(sG + cc * LDG + dd);
        const float2 y = ld_bf16x2(sK + cc * LDB + dd);
        const float rc = sRk[cc];
        const float x0 = y.x * rc * __expf(an.x - G.x), x1 = y.y * rc * __expf(an.y - G.y);
        if (!with_lo) return pack_bf16(x0, x1);
        uint32_t hi;
        split_bf16(x0, x1, hi, lo);
        return hi;
      };
#pragma unroll
      for (int k2 = 0; k2 < KQ; ++k2) {
        const int kk = quarter * KQ + k2;
        const int d0 = 16 * kk + 2 * t, d1 = d0 + 8;
        float2 an0 = f2(Ga + d0), an1 = f2(Ga + d1);
        an0.x += off, an0.y += off, an1.x += off, an1.y += off;
        uint32_t fq[4], fk[4], lq[4], lk[4];
        arow(r0, d0, an0, rq0, rk0, fq[0], fk[0], lq[0], lk[0]);
        arow(r1, d0, an0, rq1, rk1, fq[1], fk[1], lq[1], lk[1]);
        arow(r0, d1, an1, rq0, rk0, fq[2], fk[2], lq[2], lk[2]);
        arow(r1, d1, an1, rq1, rk1, fq[3], fk[3], lq[3], lk[3]);
#pragma unroll
        for (int tj = 0; tj < 4; ++tj) {
          if (tj >= ntj) break;  // warp-uniform
          if (STOP == 3 && tj != ti) continue;
          // the bounded diagonal tile: hi/lo splits (three MMAs), since its rounding dominates o's error
          const bool split = BOUNDED && tj == ti;
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const int cc = 16 * tj + 8 * nt + g;
            uint32_t l0 = 0, l1 = 0;
            const uint32_t b0 = bcol(cc, d0, an0, split, l0), b1 = bcol(cc, d1, an1, split, l1);
            mma_bf16(aq[tj][nt], fq, b0, b1);
            mma_bf16(ak[tj][nt], fk, b0, b1);
            if (split) {
              mma_bf16(aq[tj][nt], fq, l0, l1);
              mma_bf16(ak[tj][nt], fk, l0, l1);
              mma_bf16(aq[tj][nt], lq, b0, b1);
              mma_bf16(ak[tj][nt], lk, b0, b1);
            }
          }
        }
      }
#pragma unroll
      for (int tj = 0; tj < 4; ++tj) {
        if (tj >= ntj) break;
        if (STOP == 3 && tj != ti) continue;  // the diagonal-tile stage adds the diagonal tile alone
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int row = x < 2 ? r0 : r1, col = 16 * tj + 8 * nt + 2 * t + (x & 1);
            atomicAdd(sAqI + row * LDQ + col, to_fixed(aq[tj][nt][x]));
            atomicAdd(sAkI + row * LDM + col, to_fixed(ak[tj][nt][x]));
          }
      }
    }
  }
  __syncthreads();  // every partial sum has landed
  // Finish the MMA tiles (scale, causal masks, β) and zero the tiles above the diagonal (K2 multiplies all
  // of A_qk); the exact path's diagonal tiles are left to the pairwise code below.
  for (int idx = tid; idx < 2048; idx += 256) {
    const int r = idx >> 5, cc = (idx & 31) * 2, ti = r >> 4, tj = cc >> 4;
    if (!BOUNDED && ti == tj) continue;
    float q0 = 0.f, q1 = 0.f, k0 = 0.f, k1 = 0.f;
    if (tj <= ti) {
      q0 = cc <= r ? p.scale * from_fixed(sAqI[r * LDQ + cc]) : 0.f;
      q1 = cc + 1 <= r ? p.scale * from_fixed(sAqI[r * LDQ + cc + 1]) : 0.f;
      k0 = cc < r ? from_fixed(sAkI[r * LDM + cc]) : 0.f;
      k1 = cc + 1 < r ? from_fixed(sAkI[r * LDM + cc + 1]) : 0.f;
    }
    *reinterpret_cast<uint32_t*>(Aqk + r * 64 + cc) = pack2<F16>(q0, q1);
    if (BWD) st_bf16x2(Pkk + r * 64 + cc, k0, k1);
    const float b = sB[r];
    *reinterpret_cast<float2*>(sM + r * LDM + cc) = make_float2(b * k0, b * k1);
  }
  if (!BOUNDED) {
    // Diagonal tiles pair by pair: warp (tile dt, channel half hf); lane (row pair pp, channel quarter qd).
    // A lane walks 17 pairs: row pp with columns 0..pp, then row 15-pp with columns 0..15-pp.
    const int dt = warp & 3, hf = warp >> 2, pp = lane & 7, qd = lane >> 3;
    constexpr int CPL = KP / 8;
    const int dbase = hf * (KP / 2) + qd * CPL;
    const int rA = 16 * dt + pp, rB = 16 * dt + 15 - pp;
    const float rqA = sRq[rA], rkA = sRk[rA], rqB = sRq[rB], rkB = sRk[rB];
    float xq[17], xk[17];
#pragma unroll
    for (int j = 0; j < 17; ++j) xq[j] = xk[j] = 0.f;
    for (int dd = 0; dd < CPL; dd += 4) {
      const int d = dbase + dd;
      const float4 GA = f4(sG + rA * LDG + d), GB = f4(sG + rB * LDG + d);
      float4 qA = bf4(sQ + rA * LDB + d), kA = bf4(sK + rA * LDB + d);
      float4 qB = bf4(sQ + rB * LDB + d), kB = bf4(sK + rB * LDB + d);
      qA.x *= rqA, qA.y *= rqA, qA.z *= rqA, qA.w *= rqA;
      kA.x *= rkA, kA.y *= rkA, kA.z *= rkA, kA.w *= rkA;
      qB.x *= rqB, qB.y *= rqB, qB.z *= rqB, qB.w *= rqB;
      kB.x *= rkB, kB.y *= rkB, kB.z *= rkB, kB.w *= rkB;
#pragma unroll
      for (int j = 0; j < 17; ++j) {
        const bool first = j <= pp;
        const int col = 16 * dt + (first ? j : j - pp - 1);
        const float4 Gr = first ? GA : GB, qr = first ? qA : qB, kr = first ? kA : kB;
        const float4 Gc = f4(sG + col * LDG + d);
        float4 kc = bf4(sK + col * LDB + d);
        const float rc = sRk[col];
        const float e0 = __expf(Gr.x - Gc.x) * kc.x * rc, e1 = __expf(Gr.y - Gc.y) * kc.y * rc;
        const float e2 = __expf(Gr.z - Gc.z) * kc.z * rc, e3 = __expf(Gr.w - Gc.w) * kc.w * rc;
        xq[j] += qr.x * e0 + qr.y * e1 + qr.z * e2 + qr.w * e3;
        xk[j] += kr.x * e0 + kr.y * e1 + kr.z * e2 + kr.w * e3;
      }
    }
#pragma unroll
    for (int j = 0; j < 17; ++j) {
      xq[j] += __shfl_xor_sync(0xffffffffu, xq[j], 8);
      xq[j] += __shfl_xor_sync(0xffffffffu, xq[j], 16);
      xk[j] += __shfl_xor_sync(0xffffffffu, xk[j], 8);
      xk[j] += __shfl_xor_sync(0xffffffffu, xk[j], 16);
    }
    if (qd == 0) {
#pragma unroll
      for (int j = 0; j < 17; ++j) {
        const bool first = j <= pp;
        const int r = first ? pp : 15 - pp, cc = first ? j : j - pp - 1;
        atomicAdd(sScrI + dt * 256 + r * 16 + cc, to_fixed(xq[j]));
        atomicAdd(sScrI + 1024 + dt * 256 + r * 16 + cc, to_fixed(xk[j]));
      }
    }
    __syncthreads();
    for (int idx = tid; idx < 1024; idx += 256) {
      const int dtt = idx >> 8, r = (idx >> 4) & 15, cc = idx & 15;
      const int row = 16 * dtt + r, col = 16 * dtt + cc;
      Aqk[row * 64 + col] = bits16<F16>(cc <= r ? p.scale * from_fixed(sScrI[idx]) : 0.f);
      const float pk = cc < r ? from_fixed(sScrI[1024 + idx]) : 0.f;
      sM[row * LDM + col] = sB[row] * pk;
      if (BWD) Pkk[row * 64 + col] = __float2bfloat16_rn(pk);
    }
  }
  __syncthreads();  // A_qk's partial sums are read: v can land in their place, under the next phases
  if constexpr (STOP >= 2) return;
  load_tile<64, KP, LDB, 256>(sV, p.v + row0 * HV + int64_t(h) * V, HV, len, V, tid);
  cp_commit();

  // Warps 0..3 invert (I + A_kk) (M in sM, named barrier 1 among them) while warps 4..7 write Qg, Kd and turn
  // sK into K⊙Γ: the two phases touch disjoint data, and the inversion is a short serial chain.
  if (warp < 4) {
    // ---- inverse of the diagonal 16x16 blocks (forward substitution, lane = column) ----
    {
      float* L = sM + 16 * warp * LDM + 16 * warp;
      const int cc = lane & 15;
      float m[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        float acc = r == cc ? 1.f : 0.f;
#pragma unroll
        for (int q = 0; q < r; ++q) acc -= L[r * LDM + q] * m[q];
        m[r] = r < cc ? 0.f : acc;
      }
      __syncwarp();
      if (lane < 16)
#pragma unroll
        for (int r = 0; r < 16; ++r) L[r * LDM + cc] = m[r];
    }
    named_sync_128();  // every diagonal block is inverted
    // ---- blocks below the diagonal, column j from right to left: M_ij = -(Σ_{k=j+1..i} M_ik L_kj) M_jj ----
    for (int j = 2; j >= 0; --j) {
      const bool active = warp < 3 - j;
      const int i = j + 1 + warp;
      float res[2][4] = {};
      if (active) {
        float X[2][4] = {};
#pragma unroll 1
        for (int kb = j + 1; kb <= i; ++kb)
          mm16_tf32(X, sM + 16 * i * LDM + 16 * kb, LDM, sM + 16 * kb * LDM + 16 * j, LDM, lane);
        float* sx = sScr + warp * 16 * LDX;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          sx[g * LDX + 8 * nt + 2 * t] = X[nt][0];
          sx[g * LDX + 8 * nt + 2 * t + 1] = X[nt][1];
          sx[(g + 8) * LDX + 8 * nt + 2 * t] = X[nt][2];
          sx[(g + 8) * LDX + 8 * nt + 2 * t + 1] = X[nt][3];
        }
        __syncwarp();
        mm16_tf32(res, sx, LDX, sM + 16 * j * LDM + 16 * j, LDM, lane);
      }
      named_sync_128();  // every read of column j's L blocks is done
      if (active) {
        float* Mb = sM + 16 * i * LDM + 16 * j;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          Mb[g * LDM + 8 * nt + 2 * t] = -res[nt][0];
          Mb[g * LDM + 8 * nt + 2 * t + 1] = -res[nt][1];
          Mb[(g + 8) * LDM + 8 * nt + 2 * t] = -res[nt][2];
          Mb[(g + 8) * LDM + 8 * nt + 2 * t + 1] = -res[nt][3];
        }
      }
      named_sync_128();
    }
  } else {
    // ---- Qg = scale q⊙Γ, Kd = k⊙e^{G_last - G} to the workspace; sK becomes K⊙Γ ----
    bf16* Qg = p.ws.Qg + ch * 64 * KP;
    bf16* Kd = p.ws.Kd + ch * 64 * KP;
    for (int idx = tid - 128; idx < 64 * (KP / 8); idx += 128) {
      const int i = idx / (KP / 8), d = (idx % (KP / 8)) * 8;
      const uint4 qr = *reinterpret_cast<const uint4*>(sQ + i * LDB + d);
      const uint4 kr = *reinterpret_cast<const uint4*>(sK + i * LDB + d);
      const uint32_t qw[4] = {qr.x, qr.y, qr.z, qr.w}, kw[4] = {kr.x, kr.y, kr.z, kr.w};
      const float rq = sRq[i] * p.scale, rk = sRk[i];
      uint32_t oq[4], od[4], og[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 G = f2(sG + i * LDG + d + 2 * j), Gl = f2(sG + 63 * LDG + d + 2 * j);
        const float2 x = unpack_bf16(qw[j]), y = unpack_bf16(kw[j]);
        const float g0 = __expf(G.x), g1 = __expf(G.y);
        oq[j] = pack_bf16(x.x * rq * g0, x.y * rq * g1);
        od[j] = pack2<F16>(y.x * rk * __expf(Gl.x - G.x), y.y * rk * __expf(Gl.y - G.y));
        og[j] = pack_bf16(y.x * rk * g0, y.y * rk * g1);
      }
      *reinterpret_cast<uint4*>(Qg + i * KP + d) = make_uint4(oq[0], oq[1], oq[2], oq[3]);
      *reinterpret_cast<uint4*>(Kd + i * KP + d) = make_uint4(od[0], od[1], od[2], od[3]);
      *reinterpret_cast<uint4*>(sK + i * LDB + d) = make_uint4(og[0], og[1], og[2], og[3]);
    }
  }
  cp_wait<0>();
  __syncthreads();  // M, K⊙Γ and v are in
  if (BWD) {
    bf16* Mo = p.ws.M + ch * 4096;
    for (int idx = tid; idx < 2048; idx += 256) {
      const int r = idx >> 5, cc = (idx & 31) * 2;
      st_bf16x2(Mo + r * 64 + cc, sM[r * LDM + cc], sM[r * LDM + cc + 1]);
    }
  }
  // ---- W = (M Diag(β)) (K⊙Γ), U = (M Diag(β)) V; M Diag(β) as bf16 hi + lo ----
  // Warp (pair, which, column half): row tiles {0, 3} or {1, 2} (M is lower triangular, so five 16-row k steps
  // either way: the warps are balanced) of W or U, over half of the columns.
  {
    const int pair = warp & 1, which = (warp >> 1) & 1, half = warp >> 2;
    const bf16* src = which ? sV : sK;
    uint16_t* dst = reinterpret_cast<uint16_t*>(which ? p.ws.U : p.ws.W) + ch * 64 * KP;
    const bool f16out = F16 && which;  // U (fp16 in the forward); W stays bf16
    constexpr int NP = KP / 32;        // 16-column ldmatrix groups per half
    const int c0 = half * (KP / 2);
#pragma unroll 1
    for (int s = 0; s < 2; ++s) {
      const int rt = pair ? 1 + s : 3 * s;
      float acc[2 * NP][4];
#pragma unroll
      for (int nt = 0; nt < 2 * NP; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
      const float* M0 = sM + (16 * rt + g) * LDM;
      const float* M1 = M0 + 8 * LDM;
#pragma unroll 1
      for (int ks = 0; ks <= rt; ++ks) {
        const int cA = 16 * ks + 2 * t;
        const float b0 = sB[cA], b1 = sB[cA + 1], b8 = sB[cA + 8], b9 = sB[cA + 9];
        uint32_t a[4], al[4];
        split_bf16(M0[cA] * b0, M0[cA + 1] * b1, a[0], al[0]);
        split_bf16(M1[cA] * b0, M1[cA + 1] * b1, a[1], al[1]);
        split_bf16(M0[cA + 8] * b8, M0[cA + 9] * b9, a[2], al[2]);
        split_bf16(M1[cA + 8] * b8, M1[cA + 9] * b9, a[3], al[3]);
#pragma unroll
        for (int np = 0; np < NP; ++np) {
          uint32_t b[4];
          ldsm4t(b, src + 16 * ks * LDB + c0 + 16 * np + bt_off(lane, LDB));
          mma_bf16(acc[2 * np], a, b[0], b[1]);
          mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
          mma_bf16(acc[2 * np], al, b[0], b[1]);
          mma_bf16(acc[2 * np + 1], al, b[2], b[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2 * NP; ++nt) {
        const int col = c0 + 8 * nt + 2 * t;
        uint32_t* d0 = reinterpret_cast<uint32_t*>(dst + (16 * rt + g) * KP + col);
        uint32_t* d1 = reinterpret_cast<uint32_t*>(dst + (16 * rt + g + 8) * KP + col);
        *d0 = f16out ? pack_f16(acc[nt][0], acc[nt][1]) : pack_bf16(acc[nt][0], acc[nt][1]);
        *d1 = f16out ? pack_f16(acc[nt][2], acc[nt][3]) : pack_bf16(acc[nt][2], acc[nt][3]);
      }
    }
  }
}

template <int KP, bool BND, typename GT, bool BWD, int STOP = 0>
void launch_b(const OpParams& p, cudaStream_t s) {
  const size_t smem = PrepSmem<KP>::bytes;
  static bool attr = false;
  if (!attr) {
    cudaFuncSetAttribute(prep_kernel<KP, BND, GT, BWD, STOP>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    attr = true;
  }
  prep_kernel<KP, BND, GT, BWD, STOP><<<unsigned(p.NC) * unsigned(p.H), 256, smem, s>>>(p);
}
template <int KP, bool BND, typename GT>
void launch_t(const OpParams& p, bool bwd, int stop, cudaStream_t s) {
  if (bwd) launch_b<KP, BND, GT, true>(p, s);
  else if (stop == 1) launch_b<KP, BND, GT, false, 1>(p, s);
  else if (stop == 2) launch_b<KP, BND, GT, false, 2>(p, s);
  else if (stop == 3) launch_b<KP, BND, GT, false, 3>(p, s);
  else launch_b<KP, BND, GT, false>(p, s);
}

template <int KP, bool BND>
void launch_g(const OpParams& p, bool gate_f32, bool bwd, int stop, cudaStream_t s) {
  if (gate_f32) launch_t<KP, BND, float>(p, bwd, stop, s);
  else launch_t<KP, BND, bf16>(p, bwd, stop, s);
}

}  // namespace

void launch_prep(const OpParams& p, int KP, bool bounded, bool gate_f32, bool bwd, cudaStream_t s, int stop) {
  if (p.NC == 0) return;
  if (KP == 64) {
    if (bounded) launch_g<64, true>(p, gate_f32, bwd, stop, s);
    else launch_g<64, false>(p, gate_f32, bwd, stop, s);
  } else {
    if (bounded) launch_g<128, true>(p, gate_f32, bwd, stop, s);
    else launch_g<128, false>(p, gate_f32, bwd, stop, s);
  }
}

}  // namespace lm::kda::cuda::detail
