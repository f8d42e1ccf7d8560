// Chunked LM head + cross-entropy on the CPU (see cross_entropy.hpp).
// Legend: T tokens, d hidden, V vocabulary, Vc vocabulary chunk, Bt token block, c0 first vocab row of a
//         chunk, ts/te token block range; tile [Bt, Vc] logits, then G in place.
#include "ops/cross_entropy/cross_entropy.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/simd_math.hpp"
#include "ops/gemm/gemm.hpp"

namespace lm::ops {

namespace {

constexpr int64_t kBlasTokenBlock = 1024;
constexpr int64_t kParallelTokenBlock = 128;

struct Plan {
  int64_t Vc, Bt;
  bool token_parallel;
  bool small;  // too little work for a parallel region: TokenBlocks then runs its blocks in a plain loop
};

// Runs f(i), i < n, in parallel unless the problem is small (same results either way: items are independent).
template <class Fn>
void blocks_for(int64_t n, bool small, Fn&& f) {
  if (small)
    for (int64_t i = 0; i < n; ++i) f(i);
  else
    parallel_for_dynamic(n, f);
}

// `auto_mode`: what CeParallel::Auto means for the calling entry point.
Plan make_plan(const char* who, int64_t T, int64_t d, int64_t V, const CeOptions& opt, CeParallel auto_mode) {
  LM_CHECK(T >= 0 && d > 0 && V > 0, "{}: need T >= 0, d > 0, V > 0; got T={} d={} V={}", who, T, d, V);
  LM_CHECK(opt.vocab_chunk > 0, "{}: vocab_chunk must be > 0, got {}", who, opt.vocab_chunk);
  LM_CHECK(opt.token_block >= 0, "{}: token_block must be >= 0, got {}", who, opt.token_block);
  LM_CHECK(V <= std::numeric_limits<int32_t>::max(), "{}: vocabulary {} does not fit int32 targets", who, V);
  const CeParallel mode = opt.parallel == CeParallel::Auto ? auto_mode : opt.parallel;
  const bool tp = mode == CeParallel::TokenBlocks;
  const int64_t bt = opt.token_block > 0 ? opt.token_block : (tp ? kParallelTokenBlock : kBlasTokenBlock);
  const bool small = static_cast<double>(T) * static_cast<double>(V) * static_cast<double>(d) < double(1 << 22);
  return {std::min(opt.vocab_chunk, V), std::max<int64_t>(1, std::min(bt, std::max<int64_t>(T, 1))), tp, small};
}

int64_t check_targets(const char* who, const int32_t* targets, int64_t T, int64_t V) {
  int64_t n_valid = 0;
  for (int64_t t = 0; t < T; ++t) {
    LM_CHECK(targets[t] < V, "{}: target id {} at position {} is out of the vocabulary [0, {})", who, targets[t], t, V);
    n_valid += targets[t] >= 0;
  }
  return n_valid;
}

// Run f(r) over the nt rows of a tile of width vc: in parallel (Blas mode, where the GEMMs are the only
// other parallel part) when each thread gets at least ~16K logits, since fork/join is not free.
template <class Fn>
void for_rows(int64_t nt, int64_t vc, bool par, Fn&& f) {
  if (par)
    parallel_for(nt, f, std::max<int64_t>(1, (int64_t{1} << 14) / vc));
  else
    for (int64_t r = 0; r < nt; ++r) f(r);
}

// Tile logits: L [nt, vc] = h[ts:ts+nt] W[c0:c0+vc]^T.
template <class F>
void tile_logits(const F* h, const F* W, int64_t ts, int64_t nt, int64_t c0, int64_t vc, int64_t d, F* L) {
  gemm(false, true, nt, vc, d, F(1), h + ts * d, d, W + c0 * d, d, F(0), L, vc);
}

// exp on the softmax path: the vectorisable polynomial for float (~2 ulp; flushes below e^-87.3 to 0,
// harmless for probabilities), std::exp for double.
template <class F>
LM_ALWAYS_INLINE F softmax_exp(F x) {
  if constexpr (std::is_same_v<F, float>)
    return exp_approx(x);
  else
    return std::exp(x);
}

template <class F>
inline F row_max(const F* Lr, int64_t vc) {
  F mc = -std::numeric_limits<F>::infinity();
#pragma omp simd reduction(max : mc)
  for (int64_t v = 0; v < vc; ++v) mc = std::max(mc, Lr[v]);
  return mc;
}

// Online log-sum-exp update of one token with one chunk row; tgt picks the target's logit.
// With `keep_exp` the row is overwritten by exp(L - m_new) (the fused pass needs it); returns the factor
// exp(m_old - m_new) that rescales everything accumulated so far.
template <class F>
inline F lse_update(F* Lr, int64_t vc, int64_t c0, int32_t target, F& m, F& s, F& tgt, bool keep_exp) {
  if (target >= c0 && target < c0 + vc) tgt = Lr[target - c0];
  const F mnew = std::max(m, row_max(Lr, vc));
  F sum = 0;
  if (keep_exp) {
#pragma omp simd reduction(+ : sum)
    for (int64_t v = 0; v < vc; ++v) {
      Lr[v] = softmax_exp(Lr[v] - mnew);
      sum += Lr[v];
    }
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t v = 0; v < vc; ++v) sum += softmax_exp(Lr[v] - mnew);
  }
  const F alpha = std::exp(m - mnew);  // m = -inf on the first chunk: alpha = 0 (and s = 0)
  s = s * alpha + sum;
  m = mnew;
  return alpha;
}

// Logits row -> G row = scale * (softmax - onehot) in place; zero for an ignored token.
template <class F>
inline void grad_row(F* Lr, int64_t vc, int64_t c0, int32_t target, F lse, F scale) {
  if (target < 0) {
    std::fill(Lr, Lr + vc, F(0));
    return;
  }
#pragma omp simd
  for (int64_t v = 0; v < vc; ++v) Lr[v] = softmax_exp(Lr[v] - lse) * scale;
  if (target >= c0 && target < c0 + vc) Lr[target - c0] -= scale;
}

// Forward over tokens [ts, te): fills m, s, tgt for those tokens.
template <class F>
void forward_block(const F* h, const F* W, const int32_t* targets, int64_t ts, int64_t te, int64_t d, int64_t V,
                   int64_t Vc, F* tile, F* m, F* s, F* tgt, bool par_rows) {
  const int64_t nt = te - ts;
  for (int64_t t = ts; t < te; ++t) {
    m[t] = -std::numeric_limits<F>::infinity();
    s[t] = 0;
    tgt[t] = 0;
  }
  for (int64_t c0 = 0; c0 < V; c0 += Vc) {
    const int64_t vc = std::min(Vc, V - c0);
    tile_logits(h, W, ts, nt, c0, vc, d, tile);
    for_rows(nt, vc, par_rows, [&](int64_t r) {
      const int64_t t = ts + r;
      lse_update(tile + r * vc, vc, c0, targets[t], m[t], s[t], tgt[t], false);
    });
  }
}

// Fused forward + dh over tokens [ts, te) in one sweep of the vocabulary (single-threaded: TokenBlocks mode).
// dh accumulates sum_c exp(L_c - m) W_c with the running max m, rescaled by exp(m_old - m_new) whenever m
// grows; at the end dh = scale * (acc / s - W[target]). Fills m, s, tgt like forward_block.
template <class F>
void fused_block(const F* h, const F* W, const int32_t* targets, int64_t ts, int64_t te, int64_t d, int64_t V,
                 int64_t Vc, F scale, F* tile, F* m, F* s, F* tgt, F* dh) {
  const int64_t nt = te - ts;
  for (int64_t t = ts; t < te; ++t) {
    m[t] = -std::numeric_limits<F>::infinity();
    s[t] = 0;
    tgt[t] = 0;
  }
  std::fill(dh + ts * d, dh + te * d, F(0));
  for (int64_t c0 = 0; c0 < V; c0 += Vc) {
    const int64_t vc = std::min(Vc, V - c0);
    tile_logits(h, W, ts, nt, c0, vc, d, tile);
    for (int64_t r = 0; r < nt; ++r) {
      const int64_t t = ts + r;
      const F alpha = lse_update(tile + r * vc, vc, c0, targets[t], m[t], s[t], tgt[t], true);
      if (alpha != F(1)) {
        F* dr = dh + t * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) dr[c] *= alpha;
      }
    }
    gemm(false, false, nt, d, vc, F(1), tile, vc, W + c0 * d, d, F(1), dh + ts * d, d);
  }
  for (int64_t t = ts; t < te; ++t) {
    F* dr = dh + t * d;
    if (targets[t] < 0) {
      std::fill(dr, dr + d, F(0));
      continue;
    }
    const F inv = scale / s[t];
    const F* wt = W + static_cast<int64_t>(targets[t]) * d;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) dr[c] = dr[c] * inv - scale * wt[c];
  }
}

// Backward over tokens [ts, te): dh rows written; dW accumulated when non-null.
template <class F>
void backward_block(const F* h, const F* W, const int32_t* targets, const F* lse, int64_t ts, int64_t te, int64_t d,
                    int64_t V, int64_t Vc, F scale, const F* row_scale, F* tile, F* dh, F* dW, bool par_rows) {
  const int64_t nt = te - ts;
  for (int64_t c0 = 0; c0 < V; c0 += Vc) {
    const int64_t vc = std::min(Vc, V - c0);
    tile_logits(h, W, ts, nt, c0, vc, d, tile);
    for_rows(nt, vc, par_rows, [&](int64_t r) {
      grad_row(tile + r * vc, vc, c0, targets[ts + r], lse[ts + r], row_scale ? scale * row_scale[ts + r] : scale);
    });
    gemm(false, false, nt, d, vc, F(1), tile, vc, W + c0 * d, d, c0 == 0 ? F(0) : F(1), dh + ts * d, d);
    if (dW) gemm(true, false, vc, d, nt, F(1), tile, vc, h + ts * d, d, F(1), dW + c0 * d, d);
  }
}

// dW pass of TokenBlocks mode: vocabulary chunks in parallel (each owns its dW rows), token blocks in order.
template <class F>
void dw_pass(const F* h, const F* W, const int32_t* targets, const F* lse, int64_t T, int64_t d, int64_t V,
             const Plan& p, F scale, const F* row_scale, F* dW) {
  const int64_t nblocks = (T + p.Bt - 1) / p.Bt;
  // At least two chunks per thread for balance: narrower chunks (multiples of 64 rows) when V / Vc is small.
  int64_t Vc = p.Vc;
  const int64_t want = 2 * static_cast<int64_t>(num_threads());
  if ((V + Vc - 1) / Vc < want) Vc = std::min(Vc, std::max<int64_t>(64, ((V + want - 1) / want + 63) / 64 * 64));
  const int64_t nchunks = (V + Vc - 1) / Vc;
  blocks_for(nchunks, p.small, [&](int64_t c) {
    const int64_t c0 = c * Vc, vc = std::min(Vc, V - c0);
    std::vector<F> tile(static_cast<size_t>(p.Bt * vc));
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t ts = b * p.Bt, nt = std::min(T, ts + p.Bt) - ts;
      tile_logits(h, W, ts, nt, c0, vc, d, tile.data());
      for (int64_t r = 0; r < nt; ++r)
        grad_row(tile.data() + r * vc, vc, c0, targets[ts + r], lse[ts + r],
                 row_scale ? scale * row_scale[ts + r] : scale);
      gemm(true, false, vc, d, nt, F(1), tile.data(), vc, h + ts * d, d, F(1), dW + c0 * d, d);
    }
  });
}

// lse, token losses and the stats from the per-token online state.
template <class F>
CeStats finish_forward(const int32_t* targets, int64_t T, const std::vector<F>& m, const std::vector<F>& s,
                       const std::vector<F>& tgt, int64_t n_valid, F* lse, F* token_loss) {
  CeStats st;
  st.n_valid = n_valid;
  for (int64_t t = 0; t < T; ++t) {
    const auto ti = static_cast<size_t>(t);
    const F l = m[ti] + std::log(s[ti]);
    if (lse) lse[t] = l;
    const F loss = targets[t] >= 0 ? l - tgt[ti] : F(0);
    if (token_loss) token_loss[t] = loss;
    st.loss_sum += static_cast<double>(loss);
  }
  return st;
}

}  // namespace

template <class F>
CeStats cross_entropy_forward(const F* h, const F* W, const int32_t* targets, int64_t T, int64_t d, int64_t V, F* lse,
                              F* token_loss, const CeOptions& opt) {
  const Plan p = make_plan("cross_entropy_forward", T, d, V, opt, CeParallel::TokenBlocks);
  const int64_t n_valid = check_targets("cross_entropy_forward", targets, T, V);
  if (T == 0) return CeStats{};
  const auto Tn = static_cast<size_t>(T);
  std::vector<F> m(Tn), s(Tn), tgt(Tn);
  const int64_t nblocks = (T + p.Bt - 1) / p.Bt;
  if (p.token_parallel) {
    blocks_for(nblocks, p.small, [&](int64_t b) {
      const int64_t ts = b * p.Bt, te = std::min(T, ts + p.Bt);
      std::vector<F> tile(static_cast<size_t>((te - ts) * p.Vc));
      forward_block(h, W, targets, ts, te, d, V, p.Vc, tile.data(), m.data(), s.data(), tgt.data(), false);
    });
  } else {
    std::vector<F> tile(static_cast<size_t>(p.Bt * p.Vc));
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t ts = b * p.Bt, te = std::min(T, ts + p.Bt);
      forward_block(h, W, targets, ts, te, d, V, p.Vc, tile.data(), m.data(), s.data(), tgt.data(), true);
    }
  }
  return finish_forward(targets, T, m, s, tgt, n_valid, lse, token_loss);
}

template <class F>
void cross_entropy_backward(const F* h, const F* W, const int32_t* targets, const F* lse, int64_t T, int64_t d,
                            int64_t V, F grad_scale, F* dh, F* dW, const CeOptions& opt, const F* row_scale) {
  const Plan p = make_plan("cross_entropy_backward", T, d, V, opt, CeParallel::Blas);
  check_targets("cross_entropy_backward", targets, T, V);
  if (T == 0) return;
  const int64_t nblocks = (T + p.Bt - 1) / p.Bt;
  if (!p.token_parallel) {
    std::vector<F> tile(static_cast<size_t>(p.Bt * p.Vc));
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t ts = b * p.Bt, te = std::min(T, ts + p.Bt);
      backward_block(h, W, targets, lse, ts, te, d, V, p.Vc, grad_scale, row_scale, tile.data(), dh, dW, true);
    }
    return;
  }
  // Pass A: dh, token blocks in parallel (each owns its dh rows). Pass B: dW.
  blocks_for(nblocks, p.small, [&](int64_t b) {
    const int64_t ts = b * p.Bt, te = std::min(T, ts + p.Bt);
    std::vector<F> tile(static_cast<size_t>((te - ts) * p.Vc));
    backward_block(h, W, targets, lse, ts, te, d, V, p.Vc, grad_scale, row_scale, tile.data(), dh,
                   static_cast<F*>(nullptr), false);
  });
  if (dW) dw_pass(h, W, targets, lse, T, d, V, p, grad_scale, row_scale, dW);
}

template <class F>
CeStats cross_entropy_forward_backward(const F* h, const F* W, const int32_t* targets, int64_t T, int64_t d, int64_t V,
                                       F grad_scale, F* dh, F* dW, F* lse, F* token_loss, const CeOptions& opt) {
  const Plan p = make_plan("cross_entropy_forward_backward", T, d, V, opt, CeParallel::TokenBlocks);
  const int64_t n_valid = check_targets("cross_entropy_forward_backward", targets, T, V);
  if (T == 0) return CeStats{};
  const auto Tn = static_cast<size_t>(T);
  std::vector<F> lse_buf(lse ? 0 : Tn);
  F* lse_out = lse ? lse : lse_buf.data();
  if (!p.token_parallel) {
    // BLAS-threaded tiles: the forward sweep then the backward sweep (4 T V d MACs either way).
    CeOptions blas = opt;
    blas.parallel = CeParallel::Blas;
    const CeStats st = cross_entropy_forward(h, W, targets, T, d, V, lse_out, token_loss, blas);
    cross_entropy_backward(h, W, targets, lse_out, T, d, V, grad_scale, dh, dW, blas);
    return st;
  }
  // Pass A: forward and dh fused per token block (2 GEMMs per tile); pass B: dW (2 GEMMs per tile).
  std::vector<F> m(Tn), s(Tn), tgt(Tn);
  const int64_t nblocks = (T + p.Bt - 1) / p.Bt;
  blocks_for(nblocks, p.small, [&](int64_t b) {
    const int64_t ts = b * p.Bt, te = std::min(T, ts + p.Bt);
    std::vector<F> tile(static_cast<size_t>((te - ts) * p.Vc));
    fused_block(h, W, targets, ts, te, d, V, p.Vc, grad_scale, tile.data(), m.data(), s.data(), tgt.data(), dh);
  });
  const CeStats st = finish_forward(targets, T, m, s, tgt, n_valid, lse_out, token_loss);
  if (dW) dw_pass(h, W, targets, lse_out, T, d, V, p, grad_scale, static_cast<const F*>(nullptr), dW);
  return st;
}

template <class F>
CeStats cross_entropy_mean_forward_backward(const F* h, const F* W, const int32_t* targets, int64_t T, int64_t d,
                                            int64_t V, F* dh, F* dW, const CeOptions& opt) {
  const int64_t n_valid = cross_entropy_count_valid(targets, T, V);
  const F scale = n_valid > 0 ? F(1) / static_cast<F>(n_valid) : F(0);
  return cross_entropy_forward_backward(h, W, targets, T, d, V, scale, dh, dW, static_cast<F*>(nullptr),
                                        static_cast<F*>(nullptr), opt);
}

int64_t cross_entropy_count_valid(const int32_t* targets, int64_t T, int64_t V) {
  LM_CHECK(T >= 0 && V > 0, "cross_entropy_count_valid: need T >= 0, V > 0; got T={} V={}", T, V);
  return check_targets("cross_entropy_count_valid", targets, T, V);
}

template <class F>
void lm_head_logits(const F* h, const F* W, int64_t rows, int64_t d, int64_t V, F* logits) {
  LM_CHECK(rows >= 0 && d > 0 && V > 0, "lm_head_logits: need rows >= 0, d > 0, V > 0; got rows={} d={} V={}", rows, d,
           V);
  gemm(false, true, rows, V, d, F(1), h, d, W, d, F(0), logits, V);
}

#define LM_INSTANTIATE(F)                                                                                              \
  template CeStats cross_entropy_forward<F>(const F*, const F*, const int32_t*, int64_t, int64_t, int64_t, F*, F*,     \
                                            const CeOptions&);                                                         \
  template void cross_entropy_backward<F>(const F*, const F*, const int32_t*, const F*, int64_t, int64_t, int64_t, F,  \
                                          F*, F*, const CeOptions&, const F*);                                         \
  template CeStats cross_entropy_forward_backward<F>(const F*, const F*, const int32_t*, int64_t, int64_t, int64_t, F, \
                                                     F*, F*, F*, F*, const CeOptions&);                                \
  template CeStats cross_entropy_mean_forward_backward<F>(const F*, const F*, const int32_t*, int64_t, int64_t,        \
                                                          int64_t, F*, F*, const CeOptions&);                          \
  template void lm_head_logits<F>(const F*, const F*, int64_t, int64_t, int64_t, F*);
LM_INSTANTIATE(float)
LM_INSTANTIATE(double)
#undef LM_INSTANTIATE

}  // namespace lm::ops
