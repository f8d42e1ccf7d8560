// Causal attention on the CPU at MLA head shapes (T tokens, H = 4 heads, Dk = 192, Dv = 128), float32,
// with OpenBLAS sgemm through lm::ops::gemm as the yardstick.
// FLOPs: forward 2·(T²/2)·H·(Dk + Dv) (the causal half of both products); backward counted as 2.5× that.
#include <benchmark/benchmark.h>

#include <cmath>
#include <vector>

#include "ops/attention/attention.hpp"
#include "ops/gemm/gemm.hpp"

namespace {

constexpr int64_t kH = 4, kDk = 192, kDv = 128;

struct AttnData {
  int64_t T;
  std::vector<float> q, k, v, o, lse, dout, dq, dk, dv;
  explicit AttnData(int64_t t) : T(t) {
    const auto nq = static_cast<size_t>(T * kH * kDk), nv = static_cast<size_t>(T * kH * kDv);
    q.resize(nq);
    k.resize(nq);
    v.resize(nv);
    dout.resize(nv);
    for (size_t i = 0; i < nq; ++i) {
      q[i] = std::sin(0.37f * static_cast<float>(i % 9973));
      k[i] = std::cos(0.11f * static_cast<float>(i % 7919));
    }
    for (size_t i = 0; i < nv; ++i) {
      v[i] = std::sin(0.05f * static_cast<float>(i % 6007));
      dout[i] = std::cos(0.7f * static_cast<float>(i % 5003));
    }
    o.resize(nv);
    lse.resize(static_cast<size_t>(T * kH));
    dq.resize(nq);
    dk.resize(nq);
    dv.resize(nv);
  }
  lm::ops::AttnDims dims() const { return {1, T, kH, 0, kDk, kDv}; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(kDk)); }
  double fwd_flops() const { return 2.0 * double(T) * double(T) / 2 * kH * (kDk + kDv); }
};

void BM_AttentionForward(benchmark::State& st) {
  AttnData a(st.range(0));
  for (auto _ : st) {
    lm::ops::attention_forward<float>(a.q.data(), a.k.data(), a.v.data(), a.o.data(), a.lse.data(), a.dims(),
                                      a.scale());
    benchmark::DoNotOptimize(a.o.data());
  }
  st.counters["GFLOP/s"] = benchmark::Counter(a.fwd_flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_AttentionForwardBackward(benchmark::State& st) {
  AttnData a(st.range(0));
  for (auto _ : st) {
    lm::ops::attention_forward<float>(a.q.data(), a.k.data(), a.v.data(), a.o.data(), a.lse.data(), a.dims(),
                                      a.scale());
    lm::ops::attention_backward<float>(a.q.data(), a.k.data(), a.v.data(), a.o.data(), a.lse.data(), a.dout.data(),
                                       a.dq.data(), a.dk.data(), a.dv.data(), a.dims(), a.scale());
    benchmark::DoNotOptimize(a.dq.data());
  }
  st.counters["GFLOP/s"] =
      benchmark::Counter(3.5 * a.fwd_flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// The yardstick: a square sgemm C = A·Bᵀ (the QKᵀ form) through the project's OpenBLAS wrapper.
void BM_AttentionSgemmYardstick(benchmark::State& st) {
  const int64_t n = st.range(0);
  std::vector<float> A(static_cast<size_t>(n * n), 0.5f), B(A.size(), 0.25f), C(A.size());
  for (auto _ : st) {
    lm::ops::gemm(false, true, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n);
    benchmark::DoNotOptimize(C.data());
  }
  st.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * double(n) * double(n) * double(n) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Absorbed MLA decode over a K3-shaped latent cache [Tc, 512 + 64] (16 heads): memory bound, so the
// rate that matters is the cache bytes streamed per second.
void BM_MlaDecodeAbsorbed(benchmark::State& st) {
  const int64_t Tc = st.range(0), H = 16, R = 512, Dr = 64, W = R + Dr;
  std::vector<float> cache(static_cast<size_t>(Tc * W)), q_lat(static_cast<size_t>(H * R)),
      q_rope(static_cast<size_t>(H * Dr)), o_lat(static_cast<size_t>(H * R)), lse(static_cast<size_t>(H));
  for (size_t i = 0; i < cache.size(); ++i) cache[i] = std::sin(0.013f * static_cast<float>(i % 10007));
  for (size_t i = 0; i < q_lat.size(); ++i) q_lat[i] = std::cos(0.3f * static_cast<float>(i));
  for (size_t i = 0; i < q_rope.size(); ++i) q_rope[i] = std::sin(0.2f * static_cast<float>(i));
  const lm::ops::DecodeDims d{H, Tc, R, Dr, W, W, 256};
  for (auto _ : st) {
    lm::ops::mla_decode_absorbed<float>(q_lat.data(), q_rope.data(), cache.data(), cache.data() + R, o_lat.data(),
                                        lse.data(), d, 1.0f / std::sqrt(192.0f));
    benchmark::DoNotOptimize(o_lat.data());
  }
  st.counters["GB/s"] = benchmark::Counter(double(Tc * W) * 4e-9, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * double(H) * double(Tc) * double(2 * R + Dr) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK(BM_AttentionForward)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AttentionForwardBackward)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AttentionSgemmYardstick)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MlaDecodeAbsorbed)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond)->UseRealTime();
