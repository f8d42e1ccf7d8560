// MoE routing costs on the CPU: router (sigmoid + biased top-k + weights + α) and the Quantile
// Balancing update (exact and histogram) at m = 16384 tokens, next to the router GEMM that
// produces the logits, to show QB's per-step cost is small.
// Legend: m tokens, n experts, k experts per token, d hidden width (router GEMM only).
#include <benchmark/benchmark.h>

#include <cmath>
#include <vector>

#include "core/rng.hpp"
#include "ops/gemm/gemm.hpp"
#include "ops/moe/balance.hpp"
#include "ops/moe/permute.hpp"
#include "ops/moe/router.hpp"

namespace {

using namespace lm;
using namespace lm::ops;

constexpr int64_t kTokens = 16384;

// A skewed random router's logits and a small bias, as in training.
struct Batch {
  int64_t m, n, k;
  std::vector<float> logits, bias, scores, w, alpha;
  std::vector<int32_t> idx;
  Batch(int64_t n_, int64_t k_) : m(kTokens), n(n_), k(k_) {
    const Rng r{7, 0}, rb{8, 0};
    logits.resize(m * n);
    bias.resize(n);
    for (int64_t j = 0; j < n; ++j) bias[j] = 0.05f * rb.normal(static_cast<uint64_t>(j));
    for (int64_t t = 0; t < m * n; ++t)
      logits[t] = r.normal(static_cast<uint64_t>(t)) + 0.5f * rb.normal(static_cast<uint64_t>(1000 + t % n));
    scores.resize(m * n);
    w.resize(m * k);
    alpha.resize(m);
    idx.resize(m * k);
    route();
  }
  void route() {
    router_forward<float>(logits.data(), bias.data(), m, n, RouterConfig{k, true, 1.0},
                          {idx.data(), w.data(), scores.data(), nullptr, alpha.data()});
  }
};

void args(benchmark::internal::Benchmark* b) {
  for (int64_t n : {64, 256, 896})
    for (int64_t k : {8, 16}) b->Args({n, k});
  b->ArgNames({"n", "k"})->Unit(benchmark::kMillisecond)->UseRealTime();
}

void set_counters(benchmark::State& st, int64_t n) {
  st.SetItemsProcessed(st.iterations() * kTokens);  // tokens/s
  st.counters["scores"] = static_cast<double>(kTokens * n);
}

void BM_MoeRouterForward(benchmark::State& st) {
  Batch b(st.range(0), st.range(1));
  for (auto _ : st) {
    b.route();
    benchmark::DoNotOptimize(b.w.data());
  }
  set_counters(st, b.n);
}
BENCHMARK(BM_MoeRouterForward)->Apply(args);

void BM_MoeQbExact(benchmark::State& st) {
  Batch b(st.range(0), st.range(1));
  std::vector<float> b_new(b.n);
  for (auto _ : st) {
    qb_update_exact<float>(b.scores.data(), b.bias.data(), b.alpha.data(), b_new.data(), b.m, b.n, b.k);
    benchmark::DoNotOptimize(b_new.data());
  }
  set_counters(st, b.n);
}
BENCHMARK(BM_MoeQbExact)->Apply(args);

// Histogram path split as a distributed step runs it: count (per process), then β from counts.
void BM_MoeQbHistAccumulate(benchmark::State& st) {
  Batch b(st.range(0), st.range(1));
  const QbHistogram h{};
  std::vector<int64_t> counts(b.n * qb_hist_slots(h));
  for (auto _ : st) {
    std::fill(counts.begin(), counts.end(), 0);
    qb_hist_accumulate<float>(b.scores.data(), b.bias.data(), b.alpha.data(), b.m, b.n, b.k, h, counts.data());
    benchmark::DoNotOptimize(counts.data());
  }
  set_counters(st, b.n);
  st.counters["count_bytes"] = static_cast<double>(counts.size() * sizeof(int64_t));
}
BENCHMARK(BM_MoeQbHistAccumulate)->Apply(args);

void BM_MoeQbHistBeta(benchmark::State& st) {
  Batch b(st.range(0), st.range(1));
  const QbHistogram h{};
  std::vector<int64_t> counts(b.n * qb_hist_slots(h), 0);
  qb_hist_accumulate<float>(b.scores.data(), b.bias.data(), b.alpha.data(), b.m, b.n, b.k, h, counts.data());
  std::vector<float> beta(b.n), b_new(b.n);
  for (auto _ : st) {
    qb_beta_from_hist<float>(counts.data(), b.bias.data(), beta.data(), b.n, b.k, h);
    qb_bias_from_beta(beta.data(), b_new.data(), b.n);
    benchmark::DoNotOptimize(b_new.data());
  }
}
BENCHMARK(BM_MoeQbHistBeta)->Apply(args);

void BM_MoePermutationBuild(benchmark::State& st) {
  Batch b(st.range(0), st.range(1));
  std::vector<int64_t> offsets(b.n + 1), rows(b.m * b.k), pos(b.m * b.k);
  for (auto _ : st) {
    moe_build_permutation(b.idx.data(), b.m, b.k, b.n, offsets.data(), rows.data(), pos.data());
    benchmark::DoNotOptimize(rows.data());
  }
  set_counters(st, b.n);
}
BENCHMARK(BM_MoePermutationBuild)->Apply(args);

// For scale: the router GEMM logits = x W_rᵀ that precedes all of the above (d = 2304 Kimi
// Linear, 7168 K3).
void BM_MoeRouterGemm(benchmark::State& st) {
  const int64_t n = st.range(0), d = st.range(1), m = kTokens;
  const Rng r{9, 0};
  std::vector<float> x(m * d), W(n * d), logits(m * n);
  for (int64_t t = 0; t < m * d; ++t) x[t] = r.normal(static_cast<uint64_t>(t));
  for (int64_t t = 0; t < n * d; ++t) W[t] = 0.02f * r.normal(static_cast<uint64_t>(m * d + t));
  for (auto _ : st) {
    matmul<float>(x.data(), false, W.data(), true, logits.data(), m, n, d);
    benchmark::DoNotOptimize(logits.data());
  }
  st.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * static_cast<double>(m * n * d) * static_cast<double>(st.iterations()),
                         benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}
BENCHMARK(BM_MoeRouterGemm)
    ->ArgsProduct({{64, 256, 896}, {2304, 7168}})
    ->ArgNames({"n", "d"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
