// Causal softmax attention (SPEC §3): naive reference, tiled forward/backward, absorbed MLA decode.
//
// Legend: T tokens, H query heads, Hkv kv heads (group G = H / Hkv), Dk q/k head dim, Dv v head dim,
//         Bq/Bk tile sizes (mq/nk: rows/keys actually present in a partial tile), n sequence, g kv head,
//         i query tile, j key tile, r0/c0 first row/key of a tile inside its sequence, Tn sequence length.
//
// Scores live in the log2 domain: Qs = q · scale · log2(e), so p = exp2(Qs·k − m) and the stored lse is
// converted back to natural log. K (and V for the backward) is packed once per call into transposed,
// zero-padded tiles KT [Hkv][tile][Dk][Bk], so S = Qs·KT is a plain row-major product with unit-stride
// vector loads; the padding keys are beyond the sequence end, hence always causally masked.
// Work items own their outputs (no atomics, bitwise deterministic for any thread count): the forward
// takes a group of query tiles of one head, the backward a group of key tiles (dK, dV) and, per head, either
// all of dQ (PerHead) or a second pass over query-tile groups (TwoPass). Within an item the tile that is
// shared by the group is the one fetched from memory once.
// Float products run on AVX-512 register-blocked kernels when compiled for it, else (and for double)
// through lm::ops::gemm per tile.
#include "ops/attention/attention.hpp"

#if defined(__AVX512F__)
// GCC 12's AVX-512 headers build _mm512_undefined_ps() from a self-initialised variable, which
// -Wuninitialized flags once the intrinsics are inlined (GCC PR 105593, fixed in 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define LM_ATTN_AVX512 1
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/gemm/gemm.hpp"

namespace lm::ops {

void check_attn_dims(const AttnDims& d) {
  LM_CHECK(d.T >= 0 && d.B >= 1, "attention: bad batch dims B={} T={}", d.B, d.T);
  LM_CHECK(d.H >= 1 && d.Dk >= 1 && d.Dv >= 1, "attention: bad head dims H={} Dk={} Dv={}", d.H, d.Dk, d.Dv);
  LM_CHECK(d.Hkv >= 0 && d.H % d.kv_heads() == 0, "attention: H={} is not a multiple of Hkv={}", d.H, d.kv_heads());
  if (d.cu_seqlens) {
    LM_CHECK(d.B == 1, "attention: varlen (cu_seqlens) needs B == 1, got B={}", d.B);
    LM_CHECK(d.N >= 1, "attention: varlen needs N >= 1 sequences, got {}", d.N);
    LM_CHECK(d.cu_seqlens[0] == 0, "attention: cu_seqlens[0] must be 0, got {}", d.cu_seqlens[0]);
    for (int64_t n = 0; n < d.N; ++n)
      LM_CHECK(d.cu_seqlens[n + 1] >= d.cu_seqlens[n], "attention: cu_seqlens decreases at {}", n + 1);
    LM_CHECK(d.cu_seqlens[d.N] == d.T, "attention: cu_seqlens[N]={} != T={}", d.cu_seqlens[d.N], d.T);
  }
}

namespace {

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

// ---- tile products: C[M,N] (= or +=) alpha · op(A) B, op(A) = A [M,K] or Aᵀ with A stored [K,M] ---------
template <class F>
void mm(bool ta, int64_t M, int64_t N, int64_t K, F alpha, const F* A, int64_t lda, const F* B, int64_t ldb,
        bool acc, F* C, int64_t ldc) {
  gemm(ta, false, M, N, K, alpha, A, lda, B, ldb, acc ? F(1) : F(0), C, ldc);
}

// ---- row softmax pieces (generic) ----------------------------------------------------------------------
// Entries at and beyond `nv` (valid count) are causally masked.
template <class F>
F row_max(const F* s, int64_t nv) {
  F m = -std::numeric_limits<F>::infinity();
  for (int64_t c = 0; c < nv; ++c) m = std::max(m, s[c]);
  return m;
}
// s[c] <- exp2(s[c] - m) for c < nv, 0 up to n; returns the sum.
template <class F>
F row_exp2_sum(F* s, int64_t n, int64_t nv, F m) {
  F sum = 0;
  for (int64_t c = 0; c < nv; ++c) sum += (s[c] = std::exp2(s[c] - m));
  for (int64_t c = nv; c < n; ++c) s[c] = 0;
  return sum;
}
// Backward: s <- P = exp2(s - lse2), dp <- dS' = scale · P ⊙ (dp - Drow).
template <class F>
void row_p_ds(F* s, F* dp, int64_t n, int64_t nv, F lse2, F Drow, F scale) {
  for (int64_t c = 0; c < nv; ++c) {
    const F p = std::exp2(s[c] - lse2);
    s[c] = p;
    dp[c] = scale * p * (dp[c] - Drow);
  }
  for (int64_t c = nv; c < n; ++c) s[c] = dp[c] = 0;
}
template <class F>
void row_scale(F* x, int64_t n, F a) {
  for (int64_t c = 0; c < n; ++c) x[c] *= a;
}

#if LM_ATTN_AVX512
// ---- float kernels (AVX-512): register-blocked C (=|+=) alpha·op(A)·B ---------------------------------
// MR rows × NV·16 columns of C stay in zmm registers over the whole K loop; A is broadcast element by
// element, B is read in 16-wide vectors along its rows (masked in the last vector when N % 16 != 0).
#ifndef LM_ATTN_MR
#define LM_ATTN_MR 8
#define LM_ATTN_NV 2
#endif
constexpr int kMR = LM_ATTN_MR, kNV = LM_ATTN_NV;

template <bool TA, int MR, int NV>
inline __attribute__((always_inline)) void ukernel(int64_t K, float alpha, const float* A, int64_t lda,
                                                   const float* B, int64_t ldb, bool acc, float* C, int64_t ldc,
                                                   __mmask16 last) {
  __m512 c[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K; ++p) {
    const float* b = B + p * ldb;
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, b + 16 * v) : _mm512_loadu_ps(b + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(TA ? A[p * lda + r] : A[r * lda + p]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_fmadd_ps(a, bv[v], c[r][v]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* cp = C + r * ldc + 16 * v;
      const __mmask16 mk = v == NV - 1 ? last : __mmask16(0xFFFF);
      __m512 x = _mm512_mul_ps(c[r][v], va);
      if (acc) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mk, cp));
      _mm512_mask_storeu_ps(cp, mk, x);
    }
}

template <bool TA, int NV, int MR = kMR>
void ukernel_rows(int mr, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, bool acc,
                  float* C, int64_t ldc, __mmask16 last) {
  if constexpr (MR > 1) {
    if (mr < MR) return ukernel_rows<TA, NV, MR - 1>(mr, K, alpha, A, lda, B, ldb, acc, C, ldc, last);
  }
  ukernel<TA, MR, NV>(K, alpha, A, lda, B, ldb, acc, C, ldc, last);
}
template <bool TA, int NV = kNV>
void ukernel_dispatch(int nvec, int mr, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                      int64_t ldb, bool acc, float* C, int64_t ldc, __mmask16 last) {
  if constexpr (NV > 1) {
    if (nvec < NV) return ukernel_dispatch<TA, NV - 1>(nvec, mr, K, alpha, A, lda, B, ldb, acc, C, ldc, last);
  }
  ukernel_rows<TA, NV>(mr, K, alpha, A, lda, B, ldb, acc, C, ldc, last);
}

template <bool TA>
void mm_f32(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
            bool acc, float* C, int64_t ldc) {
  for (int64_t j0 = 0; j0 < N; j0 += 16 * kNV) {
    const int64_t nc = std::min<int64_t>(16 * kNV, N - j0);
    const int nvec = static_cast<int>((nc + 15) / 16);
    const int rem = static_cast<int>(nc - 16 * (nvec - 1));
    const __mmask16 last = static_cast<__mmask16>(rem == 16 ? 0xFFFF : (1u << rem) - 1);
    for (int64_t i0 = 0; i0 < M; i0 += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, M - i0));
      ukernel_dispatch<TA>(nvec, mr, K, alpha, TA ? A + i0 : A + i0 * lda, lda, B + j0, ldb, acc, C + i0 * ldc + j0,
                           ldc, last);
    }
  }
}

void mm(bool ta, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
        int64_t ldb, bool acc, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (ta)
    mm_f32<true>(M, N, K, alpha, A, lda, B, ldb, acc, C, ldc);
  else
    mm_f32<false>(M, N, K, alpha, A, lda, B, ldb, acc, C, ldc);
}

// 2^x for x <= ~0 (scores minus a running max): round-to-nearest split x = n + f, |f| <= 1/2, degree-7
// polynomial of 2^f (relative error ~1e-8 before rounding), scalef for 2^n. Clamping at -200 makes
// masked (-inf) entries come out as exactly 0.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
inline __mmask16 lanes(int64_t c, int64_t lim) {  // lanes c..c+15 that are < lim
  const int64_t k = std::clamp<int64_t>(lim - c, 0, 16);
  return static_cast<__mmask16>(k == 16 ? 0xFFFF : (1u << k) - 1);
}

float row_max(const float* s, int64_t nv) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < nv; c += 16) m = _mm512_mask_max_ps(m, lanes(c, nv), m, _mm512_maskz_loadu_ps(lanes(c, nv), s + c));
  return _mm512_reduce_max_ps(m);
}
float row_exp2_sum(float* s, int64_t n, int64_t nv, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 in = lanes(c, n), ok = lanes(c, nv);
    const __m512 p = _mm512_maskz_mov_ps(ok, exp2_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(ok, s + c), vm)));
    _mm512_mask_storeu_ps(s + c, in, p);
    sum = _mm512_add_ps(sum, p);
  }
  return _mm512_reduce_add_ps(sum);
}
void row_p_ds(float* s, float* dp, int64_t n, int64_t nv, float lse2, float Drow, float scale) {
  const __m512 vl = _mm512_set1_ps(lse2), vD = _mm512_set1_ps(Drow), vs = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 in = lanes(c, n), ok = lanes(c, nv);
    const __m512 p = _mm512_maskz_mov_ps(ok, exp2_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(ok, s + c), vl)));
    const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(p, vs), _mm512_sub_ps(_mm512_maskz_loadu_ps(ok, dp + c), vD));
    _mm512_mask_storeu_ps(s + c, in, p);
    _mm512_mask_storeu_ps(dp + c, in, ds);
  }
}
#endif  // LM_ATTN_AVX512

// ---- buffers ------------------------------------------------------------------------------------------
// Per-thread buffers kept between calls: slots 0-5 hold tiles inside work items, slots 8-13 the packed
// copies of a whole call (on the calling thread). Reusing them avoids a page fault per 4 KiB per call,
// which costs as much as the packing itself; the price is that the largest call's copies stay allocated.
template <class F>
F* scratch(int slot, int64_t n) {
  thread_local std::vector<F> bufs[14];
  auto& b = bufs[slot];
  if (b.size() < static_cast<size_t>(n)) b.resize(static_cast<size_t>(n));
  return b.data();
}
enum Slot { kPackK = 8, kPackV = 9, kPackQ = 10, kPackDO = 11, kLse2 = 12, kDrow = 13 };

struct Tiles {
  int64_t bq, bk, group;
};
Tiles resolve_tiles(const AttnConfig& cfg) {
  // 64×64 measured best on Zen 5 for Dk = 192, Dv = 128 (bench_attention): larger key tiles waste more
  // work on the causal diagonal, smaller ones pay the per-row softmax reductions and rescales more often.
  // Groups of 4 tiles per work item: a key (query) tile fetched from L3 serves 4 query (key) tiles from L2.
  Tiles t{cfg.bq > 0 ? cfg.bq : 64, cfg.bk > 0 ? cfg.bk : 64, cfg.group > 0 ? cfg.group : 4};
  LM_CHECK(t.bk % 16 == 0, "attention: key tile bk={} must be a multiple of 16", t.bk);
  return t;
}

// Sequence geometry shared by forward and backward.
struct Geometry {
  const AttnDims& d;
  Tiles t;
  int64_t Hkv, G;
  std::vector<int64_t> ktile0;  // first global key tile of each sequence (+ total at the end)
  Geometry(const AttnDims& dims, Tiles tiles) : d(dims), t(tiles), Hkv(d.kv_heads()), G(d.H / d.kv_heads()) {
    ktile0.push_back(0);
    for (int64_t n = 0; n < d.num_seqs(); ++n) ktile0.push_back(ktile0.back() + (d.seq_len(n) + t.bk - 1) / t.bk);
  }
  int64_t total_ktiles() const { return ktile0.back(); }
  int64_t nkt(int64_t n) const { return ktile0[n + 1] - ktile0[n]; }
  int64_t nqt(int64_t n) const { return (d.seq_len(n) + t.bq - 1) / t.bq; }
  int64_t nqg(int64_t n) const { return (nqt(n) + t.group - 1) / t.group; }  // query tile groups
  int64_t nkg(int64_t n) const { return (nkt(n) + t.group - 1) / t.group; }  // key tile groups
  // Valid keys of row (r0 + r) in key tile starting at c0 (causal): clamp(r0 + r - c0 + 1, 0, bk).
  int64_t valid(int64_t row, int64_t c0) const { return std::clamp<int64_t>(row - c0 + 1, 0, t.bk); }
};

// One transposed tile: dst[e][c] = src[c·ld + e] for c < nk, 0 for nk <= c < Bk.
template <class F>
void transpose_tile(const F* src, int64_t ld, int64_t nk, int64_t D, int64_t bk, F* dst) {
  for (int64_t cb = 0; cb < nk; cb += 16)  // 16×16 blocks: each touched line of src and dst is used whole
    for (int64_t eb = 0; eb < D; eb += 16)
      for (int64_t c = cb; c < std::min(cb + 16, nk); ++c)
        for (int64_t e = eb; e < std::min(eb + 16, D); ++e) dst[e * bk + c] = src[c * ld + e];
  for (int64_t e = 0; e < D; ++e)
    for (int64_t c = nk; c < bk; ++c) dst[e * bk + c] = 0;
}
#if LM_ATTN_AVX512
// 16 keys at a time with a gather per channel: the 16 source rows stay in L1 across the channels.
void transpose_tile(const float* src, int64_t ld, int64_t nk, int64_t D, int64_t bk, float* dst) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(ld)));
  for (int64_t cb = 0; cb < bk; cb += 16) {
    const __mmask16 ok = lanes(cb, nk);
    const float* s = src + std::min(cb, nk) * ld;  // a fully padded block gathers nothing
    for (int64_t e = 0; e < D; ++e)
      _mm512_storeu_ps(dst + e * bk + cb, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), ok, rows, s + e, 4));
  }
}
#endif

// Packs x [rows, Hkv, D] into transposed zero-padded tiles out [Hkv][tile][D][Bk].
template <class F>
void pack_transposed(const F* x, int64_t D, const Geometry& geo, F* out) {
  const int64_t N = geo.d.num_seqs(), bk = geo.t.bk, Hkv = geo.Hkv, nt = geo.total_ktiles();
  LM_CHECK(16 * Hkv * D < (int64_t(1) << 31), "attention: row stride Hkv·D={} too large", Hkv * D);
  struct Item {
    int64_t n, j;
  };
  std::vector<Item> items;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < geo.nkt(n); ++j) items.push_back({n, j});
  parallel_for(static_cast<int64_t>(items.size()) * Hkv, [&](int64_t it) {
    const Item& I = items[static_cast<size_t>(it / Hkv)];
    const int64_t g = it % Hkv, c0 = I.j * bk, nk = std::min(bk, geo.d.seq_len(I.n) - c0);
    transpose_tile(x + ((geo.d.seq_begin(I.n) + c0) * Hkv + g) * D, Hkv * D, nk, D, bk,
                   out + (g * nt + geo.ktile0[I.n] + I.j) * D * bk);
  });
}

}  // namespace

// ================================ reference ==========================================================
template <class F>
void attention_reference(const F* q, const F* k, const F* v, F* o, F* lse, const AttnDims& d, F scale) {
  check_attn_dims(d);
  const int64_t H = d.H, Hkv = d.kv_heads(), G = H / Hkv, Dk = d.Dk, Dv = d.Dv;
  std::vector<double> s, acc(static_cast<size_t>(Dv));
  for (int64_t n = 0; n < d.num_seqs(); ++n) {
    const int64_t s0 = d.seq_begin(n), Tn = d.seq_len(n);
    s.resize(static_cast<size_t>(Tn));
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / G;
      for (int64_t t = 0; t < Tn; ++t) {
        const F* qt = q + ((s0 + t) * H + h) * Dk;
        double m = -INFINITY;
        for (int64_t u = 0; u <= t; ++u) {
          const F* ku = k + ((s0 + u) * Hkv + g) * Dk;
          double dot = 0;
          for (int64_t e = 0; e < Dk; ++e) dot += double(qt[e]) * double(ku[e]);
          s[u] = double(scale) * dot;
          m = std::max(m, s[u]);
        }
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t u = 0; u <= t; ++u) {
          const double p = std::exp(s[u] - m);
          sum += p;
          const F* vu = v + ((s0 + u) * Hkv + g) * Dv;
          for (int64_t e = 0; e < Dv; ++e) acc[e] += p * double(vu[e]);
        }
        F* ot = o + ((s0 + t) * H + h) * Dv;
        for (int64_t e = 0; e < Dv; ++e) ot[e] = F(acc[e] / sum);
        if (lse) lse[(s0 + t) * H + h] = F(m + std::log(sum));
      }
    }
  }
}

template <class F>
void attention_reference_backward(const F* q, const F* k, const F* v, const F* do_, F* dq, F* dk, F* dv,
                                  const AttnDims& d, F scale) {
  check_attn_dims(d);
  const int64_t H = d.H, Hkv = d.kv_heads(), G = H / Hkv, Dk = d.Dk, Dv = d.Dv, rows = d.rows();
  std::vector<double> gq(static_cast<size_t>(rows * H * Dk), 0.0), gk(static_cast<size_t>(rows * Hkv * Dk), 0.0),
      gv(static_cast<size_t>(rows * Hkv * Dv), 0.0);
  for (int64_t n = 0; n < d.num_seqs(); ++n) {
    const int64_t s0 = d.seq_begin(n), Tn = d.seq_len(n);
    std::vector<double> P(static_cast<size_t>(Tn * Tn), 0.0), dP(static_cast<size_t>(Tn * Tn), 0.0);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / G;
      auto Q = [&](int64_t t, int64_t e) { return double(q[((s0 + t) * H + h) * Dk + e]); };
      auto K = [&](int64_t t, int64_t e) { return double(k[((s0 + t) * Hkv + g) * Dk + e]); };
      auto V = [&](int64_t t, int64_t e) { return double(v[((s0 + t) * Hkv + g) * Dv + e]); };
      auto dO = [&](int64_t t, int64_t e) { return double(do_[((s0 + t) * H + h) * Dv + e]); };
      for (int64_t t = 0; t < Tn; ++t) {
        double m = -INFINITY;
        for (int64_t u = 0; u <= t; ++u) {
          double dot = 0, dpv = 0;
          for (int64_t e = 0; e < Dk; ++e) dot += Q(t, e) * K(u, e);
          for (int64_t e = 0; e < Dv; ++e) dpv += dO(t, e) * V(u, e);
          P[t * Tn + u] = double(scale) * dot;
          dP[t * Tn + u] = dpv;
          m = std::max(m, P[t * Tn + u]);
        }
        double sum = 0;
        for (int64_t u = 0; u <= t; ++u) sum += (P[t * Tn + u] = std::exp(P[t * Tn + u] - m));
        double rowdot = 0;  // Σ_u P ⊙ dP: the softmax Jacobian's projection term
        for (int64_t u = 0; u <= t; ++u) rowdot += (P[t * Tn + u] /= sum) * dP[t * Tn + u];
        for (int64_t u = 0; u <= t; ++u) {
          const double p = P[t * Tn + u], ds = p * (dP[t * Tn + u] - rowdot) * double(scale);
          for (int64_t e = 0; e < Dk; ++e) {
            gq[static_cast<size_t>(((s0 + t) * H + h) * Dk + e)] += ds * K(u, e);
            gk[static_cast<size_t>(((s0 + u) * Hkv + g) * Dk + e)] += ds * Q(t, e);
          }
          for (int64_t e = 0; e < Dv; ++e) gv[static_cast<size_t>(((s0 + u) * Hkv + g) * Dv + e)] += p * dO(t, e);
        }
      }
    }
  }
  std::transform(gq.begin(), gq.end(), dq, [](double x) { return F(x); });
  std::transform(gk.begin(), gk.end(), dk, [](double x) { return F(x); });
  std::transform(gv.begin(), gv.end(), dv, [](double x) { return F(x); });
}

// ================================ tiled forward =======================================================
template <class F>
void attention_forward(const F* q, const F* k, const F* v, F* o, F* lse, const AttnDims& d, F scale,
                       const AttnConfig& cfg) {
  check_attn_dims(d);
  const Geometry geo(d, resolve_tiles(cfg));
  const int64_t H = d.H, Hkv = geo.Hkv, G = geo.G, Dk = d.Dk, Dv = d.Dv, bq = geo.t.bq, bk = geo.t.bk;
  const int64_t nt = geo.total_ktiles();
  F* KT = scratch<F>(kPackK, Hkv * nt * Dk * bk);
  pack_transposed(k, Dk, geo, KT);

  // Items (sequence, head, group of query tiles), heaviest (most tile pairs) first for the dynamic schedule.
  struct Item {
    int64_t n, h, ig, cost;
  };
  std::vector<Item> items;
  const int64_t qg = geo.t.group, BQ = qg * bq;  // BQ rows per item
  for (int64_t n = 0; n < d.num_seqs(); ++n)
    for (int64_t ig = 0; ig < geo.nqg(n); ++ig) {
      int64_t cost = 0;
      for (int64_t r0 = ig * BQ; r0 < std::min(d.seq_len(n), (ig + 1) * BQ); r0 += bq)
        cost += std::min(d.seq_len(n) - 1, r0 + bq - 1) / bk + 1;
      for (int64_t h = 0; h < H; ++h) items.push_back({n, h, ig, cost});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const F qscale = scale * F(kLog2e);
  parallel_for_dynamic(static_cast<int64_t>(items.size()), [&](int64_t it) {
    const Item& I = items[static_cast<size_t>(it)];
    const int64_t s0 = d.seq_begin(I.n), Tn = d.seq_len(I.n), R0 = I.ig * BQ, MQ = std::min(BQ, Tn - R0);
    const int64_t g = I.h / G;
    F* Qs = scratch<F>(0, BQ * Dk);
    F* S = scratch<F>(1, bq * bk);
    F* Oacc = scratch<F>(2, BQ * Dv);
    F* ml = scratch<F>(3, 2 * BQ);  // running max m (log2 domain), denominator l
    F *m = ml, *l = ml + BQ;
    for (int64_t r = 0; r < MQ; ++r) {
      const F* src = q + ((s0 + R0 + r) * H + I.h) * Dk;
      for (int64_t e = 0; e < Dk; ++e) Qs[r * Dk + e] = src[e] * qscale;
      m[r] = -std::numeric_limits<F>::infinity();
      l[r] = 0;
    }
    std::fill(Oacc, Oacc + MQ * Dv, F(0));
    // Key tiles outer, the group's query tiles inner: each key tile is fetched once per item. Pairs whose
    // keys all lie after the query tile's last row are skipped (causal).
    for (int64_t j = 0; j <= (R0 + MQ - 1) / bk; ++j) {
      const int64_t c0 = j * bk, nk = std::min(bk, Tn - c0);
      const F* KTj = KT + (g * nt + geo.ktile0[I.n] + j) * Dk * bk;
      for (int64_t r0 = R0; r0 < R0 + MQ; r0 += bq) {
        const int64_t mq = std::min(bq, R0 + MQ - r0), o0 = r0 - R0;
        if (c0 > r0 + mq - 1) continue;
        mm(false, mq, bk, Dk, F(1), Qs + o0 * Dk, Dk, KTj, bk, false, S, bk);
        const bool diag = c0 + bk - 1 > r0;
        for (int64_t r = 0; r < mq; ++r) {
          F* sr = S + r * bk;
          const int64_t nv = diag ? geo.valid(r0 + r, c0) : bk;
          if (nv == 0) {  // row entirely before this key tile (only when Bq > Bk)
            std::fill(sr, sr + bk, F(0));
            continue;
          }
          F &mr = m[o0 + r], &lr = l[o0 + r];
          const F m_new = std::max(mr, row_max(sr, nv));
          const F alpha = std::exp2(mr - m_new);
          lr = lr * alpha + row_exp2_sum(sr, bk, nv, m_new);
          mr = m_new;
          if (alpha != F(1)) row_scale(Oacc + (o0 + r) * Dv, Dv, alpha);
        }
        mm(false, mq, Dv, nk, F(1), S, bk, v + ((s0 + c0) * Hkv + g) * Dv, Hkv * Dv, true, Oacc + o0 * Dv, Dv);
      }
    }
    for (int64_t r = 0; r < MQ; ++r) {
      F* dst = o + ((s0 + R0 + r) * H + I.h) * Dv;
      const F inv = F(1) / l[r];
      for (int64_t e = 0; e < Dv; ++e) dst[e] = Oacc[r * Dv + e] * inv;
      if (lse) lse[(s0 + R0 + r) * H + I.h] = (m[r] + std::log2(l[r])) * F(kLn2);
    }
  });
}

// ================================ tiled backward ======================================================
namespace {

template <class F>
struct BwdCtx {
  const AttnDims& d;
  const Geometry& geo;
  const F *k, *KT, *VT, *Qs, *dOp, *lse2, *Drow;  // Qs [H][rows][Dk], dOp [H][rows][Dv], lse2/Drow [H][rows]
  F scale;

  // P and dS' = scale·P⊙(dP − D) of query tile (rows r0.., mq of them) × key tile j of head h, into
  // S and dP [mq × Bk]. Masked and padding entries come out 0.
  void tile_p_ds(int64_t n, int64_t h, int64_t r0, int64_t mq, int64_t j, F* S, F* dP) const {
    const int64_t bk = geo.t.bk, Dk = d.Dk, Dv = d.Dv, rows = d.rows(), g = h / geo.G, nt = geo.total_ktiles();
    const int64_t row0 = d.seq_begin(n) + r0, c0 = j * bk, tile = g * nt + geo.ktile0[n] + j;
    mm(false, mq, bk, Dk, F(1), Qs + (h * rows + row0) * Dk, Dk, KT + tile * Dk * bk, bk, false, S, bk);
    mm(false, mq, bk, Dv, F(1), dOp + (h * rows + row0) * Dv, Dv, VT + tile * Dv * bk, bk, false, dP, bk);
    const bool diag = c0 + bk - 1 > r0;
    for (int64_t r = 0; r < mq; ++r) {
      const int64_t nv = diag ? geo.valid(r0 + r, c0) : bk;
      row_p_ds(S + r * bk, dP + r * bk, bk, nv, lse2[h * rows + row0 + r], Drow[h * rows + row0 + r], scale);
    }
  }

  // dK, dV of key tile group J of kv head g from every query tile of the group's heads; optionally
  // dq += dS'·K_j straight into the output (only when this item owns all of the sequence's dq rows of
  // these heads). Query tiles outer, the group's key tiles inner: each query tile is fetched once.
  void key_group(int64_t n, int64_t g, int64_t J, F* dq, F* dk, F* dv) const {
    const int64_t bq = geo.t.bq, bk = geo.t.bk, Dk = d.Dk, Dv = d.Dv, H = d.H, Hkv = geo.Hkv, rows = d.rows();
    const int64_t s0 = d.seq_begin(n), Tn = d.seq_len(n), BK = geo.t.group * bk, C0 = J * BK;
    const int64_t NK = std::min(BK, Tn - C0);
    F* S = scratch<F>(0, bq * bk);
    F* dP = scratch<F>(1, bq * bk);
    F* dKacc = scratch<F>(2, BK * Dk);
    F* dVacc = scratch<F>(3, BK * Dv);
    std::fill(dKacc, dKacc + NK * Dk, F(0));
    std::fill(dVacc, dVacc + NK * Dv, F(0));
    for (int64_t h = g * geo.G; h < (g + 1) * geo.G; ++h)
      for (int64_t i = C0 / bq; i < geo.nqt(n); ++i) {
        const int64_t r0 = i * bq, mq = std::min(bq, Tn - r0), row0 = s0 + r0;
        for (int64_t c0 = C0; c0 < C0 + NK && c0 <= r0 + mq - 1; c0 += bk) {
          const int64_t nk = std::min(bk, Tn - c0), o0 = c0 - C0;
          tile_p_ds(n, h, r0, mq, c0 / bk, S, dP);
          mm(true, nk, Dv, mq, F(1), S, bk, dOp + (h * rows + row0) * Dv, Dv, true, dVacc + o0 * Dv, Dv);
          mm(true, nk, Dk, mq, F(1), dP, bk, Qs + (h * rows + row0) * Dk, Dk, true, dKacc + o0 * Dk, Dk);
          if (dq)
            mm(false, mq, Dk, nk, F(1), dP, bk, k + ((s0 + c0) * Hkv + g) * Dk, Hkv * Dk, true,
               dq + (row0 * H + h) * Dk, H * Dk);
        }
      }
    // Qs carries scale·log2(e); dk = Σ dS'ᵀ q.
    const F unq = F(1) / (scale * F(kLog2e));
    for (int64_t c = 0; c < NK; ++c) {
      F* dkr = dk + ((s0 + C0 + c) * Hkv + g) * Dk;
      F* dvr = dv + ((s0 + C0 + c) * Hkv + g) * Dv;
      for (int64_t e = 0; e < Dk; ++e) dkr[e] = dKacc[c * Dk + e] * unq;
      for (int64_t e = 0; e < Dv; ++e) dvr[e] = dVacc[c * Dv + e];
    }
  }

  // dq of query tile group IG of head h (second pass of TwoPass): recomputes P and dP per tile pair.
  void query_group(int64_t n, int64_t h, int64_t IG, F* dq) const {
    const int64_t bq = geo.t.bq, bk = geo.t.bk, Dk = d.Dk, H = d.H, Hkv = geo.Hkv, g = h / geo.G;
    const int64_t s0 = d.seq_begin(n), Tn = d.seq_len(n), BQ = geo.t.group * bq, R0 = IG * BQ;
    const int64_t MQ = std::min(BQ, Tn - R0);
    F* S = scratch<F>(0, bq * bk);
    F* dP = scratch<F>(1, bq * bk);
    F* dQacc = scratch<F>(4, BQ * Dk);
    std::fill(dQacc, dQacc + MQ * Dk, F(0));
    for (int64_t j = 0; j <= (R0 + MQ - 1) / bk; ++j) {
      const int64_t c0 = j * bk, nk = std::min(bk, Tn - c0);
      for (int64_t r0 = R0; r0 < R0 + MQ; r0 += bq) {
        const int64_t mq = std::min(bq, R0 + MQ - r0);
        if (c0 > r0 + mq - 1) continue;
        tile_p_ds(n, h, r0, mq, j, S, dP);
        mm(false, mq, Dk, nk, F(1), dP, bk, k + ((s0 + c0) * Hkv + g) * Dk, Hkv * Dk, true, dQacc + (r0 - R0) * Dk,
           Dk);
      }
    }
    for (int64_t r = 0; r < MQ; ++r)
      std::copy(dQacc + r * Dk, dQacc + (r + 1) * Dk, dq + ((s0 + R0 + r) * H + h) * Dk);
  }
};

// PerHead when a greedy (longest first) assignment of the (sequence, kv head) items to the threads is
// close to balanced: TwoPass costs ~(4Dk + 3Dv)/(3Dk + 2Dv) ≈ 1.4× the products.
bool per_head_balanced(const AttnDims& d, int64_t Hkv) {
  const int P = num_threads();
  if (P <= 1 || omp_in_parallel()) return true;
  std::vector<double> w;
  for (int64_t n = 0; n < d.num_seqs(); ++n)
    for (int64_t g = 0; g < Hkv; ++g) w.push_back(double(d.seq_len(n)) * double(d.seq_len(n)));
  std::sort(w.begin(), w.end(), std::greater<>());
  std::vector<double> bins(static_cast<size_t>(P), 0.0);
  for (double x : w) *std::min_element(bins.begin(), bins.end()) += x;
  const double total = std::accumulate(bins.begin(), bins.end(), 0.0);
  return total == 0 || *std::max_element(bins.begin(), bins.end()) <= 1.25 * total / P;
}

}  // namespace

template <class F>
void attention_backward(const F* q, const F* k, const F* v, const F* o, const F* lse, const F* do_, F* dq, F* dk,
                        F* dv, const AttnDims& d, F scale, const AttnConfig& cfg) {
  check_attn_dims(d);
  LM_CHECK(lse != nullptr, "attention_backward: needs the forward's lse");
  const Geometry geo(d, resolve_tiles(cfg));
  const int64_t H = d.H, Hkv = geo.Hkv, Dk = d.Dk, Dv = d.Dv, bk = geo.t.bk, rows = d.rows();
  const int64_t nt = geo.total_ktiles();
  F *KT = scratch<F>(kPackK, Hkv * nt * Dk * bk), *VT = scratch<F>(kPackV, Hkv * nt * Dv * bk);
  pack_transposed(k, Dk, geo, KT);
  pack_transposed(v, Dv, geo, VT);
  // Head-major copies so a tile of rows is contiguous; Drow = rowsum(do ⊙ o) = Σ_s P·dP (softmax Jacobian).
  F *Qs = scratch<F>(kPackQ, H * rows * Dk), *dOp = scratch<F>(kPackDO, H * rows * Dv),
    *lse2 = scratch<F>(kLse2, H * rows), *Drow = scratch<F>(kDrow, H * rows);
  const F qscale = scale * F(kLog2e);
  parallel_for(rows, [&](int64_t t) {
    for (int64_t h = 0; h < H; ++h) {
      const F* qs = q + (t * H + h) * Dk;
      const F *os = o + (t * H + h) * Dv, *ds = do_ + (t * H + h) * Dv;
      F* qd = Qs + (h * rows + t) * Dk;
      F* dd = dOp + (h * rows + t) * Dv;
      for (int64_t e = 0; e < Dk; ++e) qd[e] = qs[e] * qscale;
      F D = 0;
      for (int64_t e = 0; e < Dv; ++e) {
        dd[e] = ds[e];
        D += ds[e] * os[e];
      }
      Drow[h * rows + t] = D;
      lse2[h * rows + t] = lse[t * H + h] * F(kLog2e);
      std::fill(dq + (t * H + h) * Dk, dq + (t * H + h + 1) * Dk, F(0));
    }
  });
  const BwdCtx<F> ctx{d, geo, k, KT, VT, Qs, dOp, lse2, Drow, scale};

  AttnBwdSplit split = cfg.split;
  if (split == AttnBwdSplit::Auto) split = per_head_balanced(d, Hkv) ? AttnBwdSplit::PerHead : AttnBwdSplit::TwoPass;
  struct Item {
    int64_t n, a, b, cost;
  };
  std::vector<Item> items;
  auto run_sorted = [&](auto&& body) {
    std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
    parallel_for_dynamic(static_cast<int64_t>(items.size()), [&](int64_t it) { body(items[static_cast<size_t>(it)]); });
  };
  if (split == AttnBwdSplit::PerHead) {
    for (int64_t n = 0; n < d.num_seqs(); ++n)
      for (int64_t g = 0; g < Hkv; ++g) items.push_back({n, g, 0, d.seq_len(n)});
    run_sorted([&](const Item& I) {
      for (int64_t J = 0; J < geo.nkg(I.n); ++J) ctx.key_group(I.n, I.a, J, dq, dk, dv);
    });
  } else {
    const int64_t BK = geo.t.group * bk, BQ = geo.t.group * geo.t.bq;
    for (int64_t n = 0; n < d.num_seqs(); ++n)
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t J = 0; J < geo.nkg(n); ++J) items.push_back({n, g, J, d.seq_len(n) - J * BK});
    run_sorted([&](const Item& I) { ctx.key_group(I.n, I.a, I.b, nullptr, dk, dv); });
    items.clear();
    for (int64_t n = 0; n < d.num_seqs(); ++n)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t IG = 0; IG < geo.nqg(n); ++IG) items.push_back({n, h, IG, IG * BQ});
    run_sorted([&](const Item& I) { ctx.query_group(I.n, I.a, I.b, dq); });
  }
}

// ================================ absorbed MLA decode =================================================
template <class F>
void mla_decode_absorbed(const F* q_lat, const F* q_rope, const F* c, const F* k_r, F* o_lat, F* lse,
                         const DecodeDims& dd, F scale) {
  const int64_t H = dd.H, Tc = dd.Tc, R = dd.R, Dr = dd.Dr, chunk = dd.chunk;
  const int64_t ldc = dd.ldc > 0 ? dd.ldc : R, ldkr = dd.ldkr > 0 ? dd.ldkr : Dr;
  LM_CHECK(H >= 1 && R >= 1 && Dr >= 0 && Tc >= 1, "mla_decode: bad dims H={} Tc={} R={} Dr={}", H, Tc, R, Dr);
  LM_CHECK(chunk >= 1, "mla_decode: chunk={} must be >= 1", chunk);
  LM_CHECK(ldc >= R && (Dr == 0 || ldkr >= Dr), "mla_decode: row strides ldc={} ldkr={} below R={} Dr={}", ldc, ldkr,
           R, Dr);
  LM_CHECK(Dr == 0 || (q_rope && k_r), "mla_decode: Dr={} needs q_rope and k_r", Dr);
  // Split the chunks over the threads (flash-decoding): each part keeps its own (m, l, acc), merged by
  // log-sum-exp afterwards; deterministic for a given thread count.
  const int64_t nch = (Tc + chunk - 1) / chunk;
  const int64_t parts = omp_in_parallel() ? 1 : std::min<int64_t>(num_threads(), nch);
  std::vector<F> acc(static_cast<size_t>(parts * H * R)), ml(static_cast<size_t>(parts * 2 * H));
  // Scores as Sᵀ = c·q̃ᵀ [chunk × H]: the cache rows are read in place (no transposed copy of the cache),
  // only the small queries are transposed, once per call and pre-scaled.
  const F qscale = scale * F(kLog2e);
  std::vector<F> qT(static_cast<size_t>((R + Dr) * H));  // [R + Dr, H]
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t a = 0; a < R; ++a) qT[static_cast<size_t>(a * H + h)] = q_lat[h * R + a] * qscale;
    for (int64_t a = 0; a < Dr; ++a) qT[static_cast<size_t>((R + a) * H + h)] = q_rope[h * Dr + a] * qscale;
  }
  parallel_for(parts, [&](int64_t p) {
    const int64_t ch0 = nch * p / parts, ch1 = nch * (p + 1) / parts;
    F* A = acc.data() + p * H * R;
    F *m = ml.data() + p * 2 * H, *l = m + H;
    F* ST = scratch<F>(4, H * chunk);
    F* S = scratch<F>(5, H * chunk);
    std::fill(A, A + H * R, F(0));
    std::fill(m, m + H, -std::numeric_limits<F>::infinity());
    std::fill(l, l + H, F(0));
    for (int64_t ch = ch0; ch < ch1; ++ch) {
      const int64_t t0 = ch * chunk, nc = std::min(chunk, Tc - t0);
      mm(false, nc, H, R, F(1), c + t0 * ldc, ldc, qT.data(), H, false, ST, H);
      if (Dr > 0) mm(false, nc, H, Dr, F(1), k_r + t0 * ldkr, ldkr, qT.data() + R * H, H, true, ST, H);
      for (int64_t t = 0; t < nc; ++t)
        for (int64_t h = 0; h < H; ++h) S[h * nc + t] = ST[t * H + h];
      for (int64_t h = 0; h < H; ++h) {
        F* sr = S + h * nc;
        const F m_new = std::max(m[h], row_max(sr, nc));
        const F alpha = std::exp2(m[h] - m_new);
        l[h] = l[h] * alpha + row_exp2_sum(sr, nc, nc, m_new);
        m[h] = m_new;
        if (alpha != F(1)) row_scale(A + h * R, R, alpha);
      }
      mm(false, H, R, nc, F(1), S, nc, c + t0 * ldc, ldc, true, A, R);
    }
  });
  for (int64_t h = 0; h < H; ++h) {
    F M = -std::numeric_limits<F>::infinity();
    for (int64_t p = 0; p < parts; ++p) M = std::max(M, ml[p * 2 * H + h]);
    F L = 0;
    std::fill(o_lat + h * R, o_lat + (h + 1) * R, F(0));
    for (int64_t p = 0; p < parts; ++p) {
      const F w = std::exp2(ml[p * 2 * H + h] - M);  // parts that saw no chunk have l = 0 and m = -inf: w = 0
      L += w * ml[p * 2 * H + H + h];
      const F* A = acc.data() + (p * H + h) * R;
      for (int64_t e = 0; e < R; ++e) o_lat[h * R + e] += w * A[e];
    }
    for (int64_t e = 0; e < R; ++e) o_lat[h * R + e] /= L;
    if (lse) lse[h] = (M + std::log2(L)) * F(kLn2);
  }
}

#define LM_ATTN_INSTANTIATE(F)                                                                                  \
  template void attention_reference<F>(const F*, const F*, const F*, F*, F*, const AttnDims&, F);              \
  template void attention_reference_backward<F>(const F*, const F*, const F*, const F*, F*, F*, F*,            \
                                                const AttnDims&, F);                                           \
  template void attention_forward<F>(const F*, const F*, const F*, F*, F*, const AttnDims&, F, const AttnConfig&); \
  template void attention_backward<F>(const F*, const F*, const F*, const F*, const F*, const F*, F*, F*, F*,   \
                                      const AttnDims&, F, const AttnConfig&);                                  \
  template void mla_decode_absorbed<F>(const F*, const F*, const F*, const F*, F*, F*, const DecodeDims&, F);
LM_ATTN_INSTANTIATE(float)
LM_ATTN_INSTANTIATE(double)
#undef LM_ATTN_INSTANTIATE

}  // namespace lm::ops
