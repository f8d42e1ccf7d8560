// Causal depthwise short convolution in front of q, k, v (SPEC §2), with optional fused SiLU.
// rows packed tokens, C channels, W taps, N sequences (B, or varlen through cu_seqlens).
// x, y [rows, C]; w [C, W] (HF's [C, 1, W]); cache [N, C, W-1], the W-1 inputs before each sequence,
// oldest first (absent: zeros).
//   pre[t, c] = sum_w w[c, w] * x[t - (W-1) + w, c],  y = silu ? pre * sigmoid(pre) : pre
// Each output is computed in double and rounded once, also for float (W products and one exp: cheap),
// which keeps fp32 noise out of q, k, v before KDA (a model with a lower-bounded gate amplifies it).
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/kda/kda.hpp"

namespace lm::kda {
namespace {

constexpr int64_t kChanBlock = 16;        // channels per task: contiguous inner loops, enough tasks
constexpr int64_t kSerialWork = 1 << 14;  // below this many multiply-adds a thread team costs more than it saves

// Dynamic-schedule loop that stays on the calling thread for tiny problems.
template <class Fn>
void for_items(int64_t n, int64_t work, Fn&& f) {
  if (work < kSerialWork) {
    for (int64_t i = 0; i < n; ++i) f(i);
  } else {
    parallel_for_dynamic(n, f);
  }
}

template <class F>
F sigmoid(F z) {
  if (z >= F(0)) return F(1) / (F(1) + std::exp(-z));
  const F e = std::exp(z);
  return e / (F(1) + e);
}

struct Seqs {
  int64_t n = 0;
  const ConvDims* d = nullptr;
  int64_t begin(int64_t i) const { return d->cu_seqlens ? d->cu_seqlens[i] : i * d->T; }
  int64_t len(int64_t i) const { return d->cu_seqlens ? d->cu_seqlens[i + 1] - d->cu_seqlens[i] : d->T; }
};

Seqs check_conv(const ConvDims& d) {
  LM_CHECK(d.W >= 1, "short conv: kernel width W must be >= 1, got {}", d.W);
  Dims dd;
  dd.B = d.B;
  dd.T = d.T;
  dd.H = 1;
  dd.K = d.C;
  dd.V = d.C;
  dd.cu_seqlens = d.cu_seqlens;
  dd.N = d.N;
  check_dims(dd);
  return Seqs{dd.num_seqs(), &d};
}

// Input at sequence position tau (tau < 0 reads the cache, or zero without one).
template <class F>
struct SeqInput {
  const F* x;      // first row of the sequence
  const F* cache;  // [C, W-1] of this sequence, or null
  int64_t C, W;
  F operator()(int64_t tau, int64_t c) const {
    if (tau >= 0) return x[tau * C + c];
    return cache ? cache[c * (W - 1) + (W - 1 + tau)] : F(0);
  }
};

}  // namespace

template <class F>
void short_conv_forward(const F* x, const F* w, const F* cache, F* y, const ConvDims& d, bool silu) {
  const Seqs s = check_conv(d);
  LM_CHECK(x != y, "short_conv_forward: y must not alias x");
  const int64_t C = d.C, W = d.W, nb = (C + kChanBlock - 1) / kChanBlock;
  for_items(s.n * nb, d.B * d.T * C * W, [&](int64_t item) {
    const int64_t n = item / nb, c0 = (item % nb) * kChanBlock, c1 = std::min(C, c0 + kChanBlock);
    const int64_t b = s.begin(n), L = s.len(n);
    const SeqInput<F> in{x + b * C, cache ? cache + n * C * (W - 1) : nullptr, C, W};
    for (int64_t t = 0; t < L; ++t) {
      F* yr = y + (b + t) * C;
      for (int64_t c = c0; c < c1; ++c) {
        double pre = 0;
        for (int64_t k = 0; k < W; ++k) pre += static_cast<double>(w[c * W + k]) * in(t - (W - 1) + k, c);
        yr[c] = static_cast<F>(silu ? pre * sigmoid(pre) : pre);
      }
    }
  });
}

template <class F>
void short_conv_backward(const F* x, const F* w, const F* cache, const F* dy, F* dx, F* dw, F* dcache,
                         const ConvDims& d, bool silu) {
  const Seqs s = check_conv(d);
  LM_CHECK(dx != x && (dcache == nullptr || dcache != cache),
           "short_conv_backward: dx must not alias x, nor dcache the cache (they are re-read)");
  const int64_t C = d.C, W = d.W, nb = (C + kChanBlock - 1) / kChanBlock;
  // One task per channel block, walking all sequences: it alone owns dw[c, :] of its channels.
  for_items(nb, 3 * d.B * d.T * C * W, [&](int64_t blk) {
    const int64_t c0 = blk * kChanBlock, c1 = std::min(C, c0 + kChanBlock), cn = c1 - c0;
    std::vector<F> dpre;  // [L, cn], the gradient w.r.t. the pre-activation
    for (int64_t n = 0; n < s.n; ++n) {
      const int64_t b = s.begin(n), L = s.len(n);
      const SeqInput<F> in{x + b * C, cache ? cache + n * C * (W - 1) : nullptr, C, W};
      dpre.assign(static_cast<size_t>(L * cn), F(0));
      for (int64_t t = 0; t < L; ++t) {
        const F* dyr = dy + (b + t) * C;
        for (int64_t c = c0; c < c1; ++c) {
          F g = dyr[c];
          if (silu) {  // silu'(p) = s (1 + p (1 - s))
            double pre = 0;
            for (int64_t k = 0; k < W; ++k) pre += static_cast<double>(w[c * W + k]) * in(t - (W - 1) + k, c);
            const double sg = sigmoid(pre);
            g *= static_cast<F>(sg * (1.0 + pre * (1.0 - sg)));
          }
          dpre[static_cast<size_t>(t * cn + (c - c0))] = g;
        }
      }
      // Input at position tau feeds outputs t = tau + (W-1) - k through tap k.
      for (int64_t tau = -(W - 1); tau < L; ++tau) {
        for (int64_t c = c0; c < c1; ++c) {
          F acc = 0;
          for (int64_t k = 0; k < W; ++k) {
            const int64_t t = tau + (W - 1) - k;
            if (t >= 0 && t < L) acc += w[c * W + k] * dpre[static_cast<size_t>(t * cn + (c - c0))];
          }
          if (tau >= 0) {
            dx[(b + tau) * C + c] = acc;
          } else if (dcache) {
            dcache[(n * C + c) * (W - 1) + (W - 1 + tau)] = acc;
          }
        }
      }
      for (int64_t c = c0; c < c1 && dw; ++c) {  // dw may be null: a frozen conv weight
        for (int64_t k = 0; k < W; ++k) {
          double acc = 0;  // a reduction over the whole sequence: double even for float
          for (int64_t t = 0; t < L; ++t) acc += dpre[static_cast<size_t>(t * cn + (c - c0))] * in(t - (W - 1) + k, c);
          dw[c * W + k] += static_cast<F>(acc);
        }
      }
    }
  });
}

template <class F>
void short_conv_step(const F* x, const F* w, F* cache, F* y, int64_t S, int64_t Cch, int64_t W, bool silu) {
  LM_CHECK(S >= 0 && Cch > 0 && W >= 1, "short_conv_step: bad shape S={} C={} W={}", S, Cch, W);
  parallel_for(
      S,
      [&](int64_t s) {
        for (int64_t c = 0; c < Cch; ++c) {
          F* hist = cache + (s * Cch + c) * (W - 1);
          const F xn = x[s * Cch + c];
          // Same summation order as short_conv_forward, so a streamed token matches bit for bit.
          double pre = 0;
          for (int64_t k = 0; k < W - 1; ++k) pre += static_cast<double>(w[c * W + k]) * hist[k];
          pre += static_cast<double>(w[c * W + W - 1]) * xn;
          for (int64_t k = 0; k + 1 < W - 1; ++k) hist[k] = hist[k + 1];
          if (W > 1) hist[W - 2] = xn;
          y[s * Cch + c] = static_cast<F>(silu ? pre * sigmoid(pre) : pre);
        }
      },
      std::max<int64_t>(1, kSerialWork / (Cch * W)));
}

template <class F>
void short_conv_final_cache(const F* x, const F* cache_in, F* cache_out, const ConvDims& d) {
  const Seqs s = check_conv(d);
  const int64_t C = d.C, W = d.W;
  if (W == 1) return;
  // Slot j holds the input at position L-(W-1)+j. Reading slot L+j of cache_in before writing slot j,
  // in increasing j, is safe even when cache_in == cache_out (reads never hit an already written slot).
  parallel_for(
      s.n,
      [&](int64_t n) {
        const int64_t b = s.begin(n), L = s.len(n);
        const SeqInput<F> in{x + b * C, cache_in ? cache_in + n * C * (W - 1) : nullptr, C, W};
        for (int64_t c = 0; c < C; ++c)
          for (int64_t j = 0; j < W - 1; ++j) cache_out[(n * C + c) * (W - 1) + j] = in(L - (W - 1) + j, c);
      },
      std::max<int64_t>(1, kSerialWork / (C * W)));
}

#define LM_KDA_CONV_INST(F)                                                                                        \
  template void short_conv_forward<F>(const F*, const F*, const F*, F*, const ConvDims&, bool);                    \
  template void short_conv_backward<F>(const F*, const F*, const F*, const F*, F*, F*, F*, const ConvDims&, bool); \
  template void short_conv_step<F>(const F*, const F*, F*, F*, int64_t, int64_t, int64_t, bool);                   \
  template void short_conv_final_cache<F>(const F*, const F*, F*, const ConvDims&);
LM_KDA_CONV_INST(float)
LM_KDA_CONV_INST(double)
#undef LM_KDA_CONV_INST

}  // namespace lm::kda
