// Google Benchmark: chunked KDA on the CPU, bounded vs exact diagonal tiles (fp32, H = 4, K = V = 128).
// Counters: tokens/s and GFLOP/s by the SPEC §2.1 forward FLOP count (x3 for forward+backward).
#include <benchmark/benchmark.h>

#include <cmath>
#include <vector>

#include "core/rng.hpp"
#include "ops/kda/kda.hpp"

namespace {

using namespace lm::kda;

struct Inputs {
  int64_t T, H = 4, K = 128, V = 128;
  std::vector<float> q, k, v, g, beta, h0, o, ht, dO, dht, dq, dk, dv, dg, dbeta, dh0;
  explicit Inputs(int64_t T_) : T(T_) {
    const int64_t nqk = T * H * K, nv = T * H * V, ns = H * K * V;
    lm::Rng r{42, 0};
    auto fill = [&](std::vector<float>& x, int64_t n, float sd, uint64_t off) {
      x.resize(n);
      for (int64_t i = 0; i < n; ++i) x[i] = sd * r.normal(off + i);
    };
    fill(q, nqk, 1, 0), fill(k, nqk, 1, 1ull << 32), fill(v, nv, 1, 2ull << 32), fill(dO, nv, 1, 3ull << 32);
    fill(h0, ns, 0.1f, 4ull << 32), fill(dht, ns, 1, 5ull << 32);
    for (int64_t row = 0; row < T * H; ++row) {  // unit-norm q, k rows as the L2 norm leaves them
      double sq = 0, sk = 0;
      for (int64_t d = 0; d < K; ++d) sq += q[row * K + d] * q[row * K + d], sk += k[row * K + d] * k[row * K + d];
      for (int64_t d = 0; d < K; ++d) q[row * K + d] /= std::sqrt(sq), k[row * K + d] /= std::sqrt(sk);
    }
    g.resize(nqk);
    for (int64_t i = 0; i < nqk; ++i) g[i] = -5.0f * r.uniform((6ull << 32) + i);  // bounded gate range
    beta.resize(T * H);
    for (int64_t i = 0; i < T * H; ++i) beta[i] = r.uniform((7ull << 32) + i);
    o.resize(nv), ht.resize(ns), dq.resize(nqk), dk.resize(nqk), dv.resize(nv), dg.resize(nqk), dbeta.resize(T * H);
    dh0.resize(ns);
  }
  CoreInputs<float> in() const {
    return {q.data(), k.data(), v.data(), g.data(), beta.data(), h0.data(), 1.0f / std::sqrt(float(K))};
  }
  CoreGrads<float> grads() { return {dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), dh0.data()}; }
  double flops() const { return double(H) * (6.0 * T * K * V + 3.0 * T * 64 * K + T * 64.0 * 64); }
};

void run(benchmark::State& st, DiagPath path, bool backward) {
  Inputs x(st.range(0));
  const Dims d{1, x.T, x.H, x.K, x.V};
  const GateParams gate{GateForm::LowerBound, -5.0};
  for (auto _ : st) {
    chunk_forward(x.in(), d, x.o.data(), x.ht.data(), path, gate);
    if (backward) chunk_backward(x.in(), d, x.dO.data(), x.dht.data(), x.grads(), path, gate);
    benchmark::ClobberMemory();
  }
  st.counters["tokens/s"] = benchmark::Counter(double(x.T), benchmark::Counter::kIsIterationInvariantRate);
  st.counters["GFLOP/s"] =
      benchmark::Counter((backward ? 3 : 1) * x.flops() / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_KdaFwdBounded(benchmark::State& s) { run(s, DiagPath::Bounded, false); }
void BM_KdaFwdExact(benchmark::State& s) { run(s, DiagPath::Exact, false); }
void BM_KdaFwdBwdBounded(benchmark::State& s) { run(s, DiagPath::Bounded, true); }
void BM_KdaFwdBwdExact(benchmark::State& s) { run(s, DiagPath::Exact, true); }

BENCHMARK(BM_KdaFwdBounded)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_KdaFwdExact)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_KdaFwdBwdBounded)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_KdaFwdBwdExact)->Arg(4096)->Arg(16384)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
