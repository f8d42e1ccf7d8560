// Quantile Balancing's histogram estimator at scale (SPEC §5): every rank routes its own tokens through the same
// model, counts the biased margins of its tokens, and one all-reduce per MoE layer (train::Balancer::reduce) sums
// the counts. The β it gives equals the exact estimator's over every rank's tokens (what one process routing the
// whole batch computes) within the width of the bin that holds the answer, on every MoE layer and expert; and the
// biases the Balancer installs are those of the summed histogram (hist) and of the gathered scores (exact).
// Alone, or under mpirun with 2 and 4 ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "dist/comm.hpp"
#include "model/micro_models.hpp"
#include "model/model.hpp"
#include "ops/moe/balance.hpp"
#include "train/balancer.hpp"

using namespace lm;
using namespace lm::testing::micro;

namespace {

// Width of the slot of the (default, rational) layout that holds x: dx/dφ · Δφ with φ = x / (|x| + scale).
double bin_width(const ops::QbHistogram& h, double x) {
  const double phi = x / (std::fabs(x) + h.scale), dphi = 2.0 / double(h.bins);
  return h.scale * dphi / ((1 - std::fabs(phi)) * (1 - std::fabs(phi)));
}

std::vector<float> biases(model::Model<float>& m, const std::vector<int64_t>& layers) {
  std::vector<float> b;
  for (int64_t i : layers) b.insert(b.end(), m.moe(i)->bias(), m.moe(i)->bias() + m.moe(i)->num_experts());
  return b;
}
void set_biases(model::Model<float>& m, const std::vector<int64_t>& layers, const std::vector<float>& b) {
  size_t o = 0;
  for (int64_t i : layers) {
    std::memcpy(m.moe(i)->bias(), b.data() + o, size_t(m.moe(i)->num_experts()) * sizeof(float));
    o += size_t(m.moe(i)->num_experts());
  }
}

}  // namespace

TEST(QbHistogram, DistributedCountsGiveTheExactBiasWithinABin) {
  dist::Comm& w = dist::world();
  const int R = w.size(), me = w.rank();
  const model::ModelConfig cfg = parse(kMicroK3);
  const int64_t B = 4, T = 96, rows = B * T, E = cfg.num_experts, k = cfg.num_experts_per_token;
  model::Model<float> m(cfg);
  randomise(m.params(), 17);  // (random biases: the quantiles sit off the zero atom)
  // Rank r's tokens: rows [r·rows, (r+1)·rows) of one batch.
  const std::vector<int32_t> ids = random_ids(R * rows, cfg.vocab_size, 23);
  m.forward(ids.data() + me * rows, model::Seqs::batch(B, T), model::ForwardOptions{}, nullptr);

  train::RunConfig rc;
  rc.balance = train::Balance::QB;
  rc.qb_estimator = "hist";
  train::Balancer hist(rc, m);
  rc.qb_estimator = "exact";
  train::Balancer exact(rc, m);
  const std::vector<int64_t>& layers = hist.layers();
  ASSERT_FALSE(layers.empty());
  const std::vector<float> b0 = biases(m, layers);
  ops::QbHistogram h;
  h.bins = rc.qb_bins;

  // What the estimators see: β_hist from this rank's counts summed over the ranks, β_exact from every rank's scores.
  double worst_bins = 0;
  int in_atom = 0;
  std::vector<float> want_hist, want_exact;
  for (size_t li = 0; li < layers.size(); ++li) {
    const auto& s = m.moe(layers[li])->scores();
    const float* b = b0.data() + li * size_t(E);
    std::vector<int64_t> counts(size_t(E * ops::qb_hist_slots(h)), 0);
    ops::qb_hist_accumulate(s.data(), b, static_cast<const float*>(nullptr), rows, E, k, h, counts.data());
    w.all_reduce_sum(counts.data(), counts.size());
    const std::vector<char> all = w.all_gather_v(s.data(), size_t(rows * E) * sizeof(float));
    ASSERT_EQ(all.size(), size_t(R * rows * E) * sizeof(float));
    std::vector<float> beta_h(static_cast<size_t>(E)), beta_x(beta_h), bias(beta_h);
    ops::qb_beta_from_hist(counts.data(), b, beta_h.data(), E, k, h);
    ops::qb_beta_exact(reinterpret_cast<const float*>(all.data()), b, static_cast<const float*>(nullptr),
                       beta_x.data(), R * rows, E, k);
    for (int64_t j = 0; j < E; ++j) {
      const double x = double(beta_x[size_t(j)]) + double(b[j]);  // the biased margin the bins see
      in_atom += x == 0;
      const double err = std::fabs(double(beta_h[size_t(j)]) - double(beta_x[size_t(j)]));
      worst_bins = std::max(worst_bins, err / bin_width(h, x));
    }
    ops::qb_bias_from_beta(beta_h.data(), bias.data(), E);
    want_hist.insert(want_hist.end(), bias.begin(), bias.end());
    ops::qb_bias_from_beta(beta_x.data(), bias.data(), E);
    want_exact.insert(want_exact.end(), bias.begin(), bias.end());
  }
  if (me == 0)
    std::printf("[ measure  ] QB over %d rank(s), %ld tokens, %zu MoE layers x %ld experts (%d quantiles in the zero "
                "atom): histogram vs exact within %.3f bin widths\n",
                R, long(R * rows), layers.size(), long(E), in_atom, worst_bins);
  EXPECT_LT(worst_bins, 1.0) << "the histogram's β leaves the answer's bin";
  EXPECT_LT(in_atom, int(layers.size() * size_t(E)));

  // The Balancer's own path: accumulate this rank's routing, reduce over the ranks, update the biases.
  for (train::Balancer* bal : {&hist, &exact}) {
    set_biases(m, layers, b0);
    bal->clear();
    bal->accumulate(rows);
    bal->reduce(w);
    bal->update();
    const std::vector<float> got = biases(m, layers);
    const std::vector<float>& want = bal == &hist ? want_hist : want_exact;
    for (size_t i = 0; i < got.size(); ++i) EXPECT_FLOAT_EQ(got[i], want[i]) << "bias " << i;
    // Every rank installs the same biases.
    std::vector<float> sum = got;
    w.all_reduce_sum(sum.data(), sum.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_FLOAT_EQ(sum[i], float(R) * got[i]);
  }
  // The loads are every rank's.
  int64_t total = 0;
  for (const auto& l : hist.loads())
    for (int64_t x : l) total += x;
  EXPECT_EQ(total, int64_t(layers.size()) * R * rows * k);
}
