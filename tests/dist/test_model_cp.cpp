// The whole CPU model under context parallelism (Model::set_context_parallel): sequences of 4,096 tokens split over
// the job's ranks (alone, or under mpirun with 2 and 4) give, on every rank's segment, the hidden states of every
// layer and the final hidden of one process over the whole sequences, the same loss (normalised over the whole
// batch's targets), and every parameter gradient (summed over the ranks) within 2e-4 relative RMS in float (see
// kFloatTol) and 1e-9 in double. Both micro models: K3 (KDA with the bounded gate, gated MLA with q-LoRA, LatentMoE,
// AttnRes) and Kimi Linear (softplus gate, plain MLA, residuals), so KDA state, the convs' halo and MLA all cross the
// split points.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.hpp"
#include "dist/comm.hpp"
#include "model/micro_models.hpp"
#include "model/model.hpp"

using namespace lm;
using namespace lm::model;
using namespace lm::testing::micro;

namespace {

template <class F>
double rel(const F* ref, const F* x, size_t n) {
  double e = 0, r = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = double(ref[i]), b = double(x[i]);
    e += (a - b) * (a - b), r += a * a;
  }
  return r > 0 ? std::sqrt(e / r) : std::sqrt(e);
}

// B sequences of Ttot tokens: rank `me`'s segment [B, T] of a [B, Ttot, width] array.
template <class T_>
std::vector<T_> segment(const std::vector<T_>& whole, int64_t B, int64_t Ttot, int64_t T, int me, int64_t width) {
  std::vector<T_> s(size_t(B * T * width));
  for (int64_t b = 0; b < B; ++b)
    std::copy_n(whole.data() + (b * Ttot + me * T) * width, T * width, s.data() + b * T * width);
  return s;
}

template <class F>
void check_model_cp(const char* config, int64_t B, int64_t Ttot, double tol) {
  dist::Comm& w = dist::world();
  const int R = w.size(), me = w.rank();
  ASSERT_EQ(Ttot % R, 0);
  const int64_t T = Ttot / R;
  const ModelConfig cfg = parse(config);
  const int64_t d = cfg.hidden_size, L = cfg.num_hidden_layers;
  // Next-token targets cut from the whole sequences (a segment's last target is the next segment's first token),
  // one ignored position and each sequence's last.
  const std::vector<int32_t> ids = random_ids(B * Ttot, cfg.vocab_size, 7);
  std::vector<int32_t> targets(ids.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Ttot; ++t) targets[b * Ttot + t] = t + 1 < Ttot ? ids[b * Ttot + t + 1] : -100;
  targets[5] = -100;
  const auto t0 = std::chrono::steady_clock::now();
  // The reference: one process over the whole sequences (on every rank).
  Model<F> one(cfg);
  randomise(one.params(), 3);
  one.params().enable_grads();
  const Seqs whole = Seqs::batch(B, Ttot);
  ForwardResult<F> ref;
  one.forward(ids.data(), whole, ForwardOptions{true, false, false}, &ref);
  const auto ref_st = one.forward_backward(ids.data(), targets.data(), whole);
  const auto t1 = std::chrono::steady_clock::now();
  // This rank's segment of every sequence.
  Model<F> cp(cfg);
  randomise(cp.params(), 3);
  cp.params().enable_grads();
  cp.set_context_parallel(&w);
  const Seqs part = Seqs::batch(B, T);
  const std::vector<int32_t> sids = segment(ids, B, Ttot, T, me, 1), stg = segment(targets, B, Ttot, T, me, 1);
  ForwardResult<F> got;
  cp.forward(sids.data(), part, ForwardOptions{true, false, false}, &got);
  int64_t n_total = cp.count_targets(stg.data(), B * T);
  w.all_reduce_sum(&n_total, 1);
  const auto st = cp.forward_backward(sids.data(), stg.data(), part, n_total);
  const auto t2 = std::chrono::steady_clock::now();
  double loss_sum = st.loss_sum;
  w.all_reduce_sum(&loss_sum, 1);
  EXPECT_EQ(n_total, ref_st.n_valid);
  double worst = std::abs(loss_sum - ref_st.loss_sum) / std::abs(ref_st.loss_sum);
  EXPECT_LE(worst, tol) << "loss on rank " << me << " of " << R;
  // Every layer's output and the final hidden, on this rank's rows.
  for (int64_t i = 0; i <= L; ++i) {
    const Buf<F>& a = i < L ? ref.hidden[size_t(i)] : ref.final_hidden;
    const Buf<F>& b = i < L ? got.hidden[size_t(i)] : got.final_hidden;
    const std::vector<F> want = segment(a, B, Ttot, T, me, d);
    const double e = rel(want.data(), b.data(), want.size());
    EXPECT_LE(e, tol) << (i < L ? "hidden of layer " + std::to_string(i) : std::string("final hidden")) << " on rank "
                      << me << " of " << R;
    worst = std::max(worst, e);
  }
  // Every parameter gradient, summed over the ranks.
  int checked = 0;
  double worst_grad = 0;
  for (auto& p : cp.params().all()) {
    if (!p.spec.trainable) continue;
    const size_t n = size_t(p.value.numel());
    std::vector<F> g(p.g(), p.g() + n);
    w.all_reduce_sum(g.data(), n);
    const double e = rel(one.params().at(p.spec.name).g(), g.data(), n);
    EXPECT_LE(e, tol) << "gradient of " << p.spec.name << " over " << R << " rank(s)";
    worst_grad = std::max(worst_grad, e);
    ++checked;
  }
  EXPECT_GT(checked, 40);
  // Packed batches are refused (before any collective, on every rank alike).
  EXPECT_THROW(cp.forward(sids.data(), Seqs::packed({0, T / 2, B * T}), ForwardOptions{}, nullptr), Error);
  std::vector<double> all(static_cast<size_t>(R));
  const double mine = std::max(worst, worst_grad);
  w.all_gather(&mine, sizeof(double), all.data());
  if (me == 0) {
    double m = 0;
    for (double x : all) m = std::max(m, x);
    const double ts = std::chrono::duration<double>(t1 - t0).count(),
                 tc = std::chrono::duration<double>(t2 - t1).count();
    std::printf("[ measure  ] model %s over %d rank(s), %lld x %lld tokens (%s): worst relative RMS of the loss, "
                "hidden states and %d gradients %.2e (one process %.2f s, context parallel %.2f s)\n",
                config == kMicroK3 ? "K3" : "KL", R, (long long)B, (long long)Ttot, sizeof(F) == 4 ? "float" : "double",
                checked, m, ts, tc);
  }
}

}  // namespace

// Float runs sum in another order than one process does (segment states, partial attention rows), so they
// agree to float rounding only: every gradient of the K3 model differs by 2-4e-5 at 4 ranks (Release, this session's
// machine; the lower-bound gate amplifies rounding, ../shared/golden/README.md), 1.1e-5 was the worst seen under
// ASan. 2e-4 is 5x that floor and within the golden README's fp32 bound for hidden states (1e-3); the double runs
// carry exactness.
constexpr double kFloatTol = 2e-4;

TEST(ModelContextParallel, K3EqualsOneProcessFloat) { check_model_cp<float>(kMicroK3, 1, 4096, kFloatTol); }
TEST(ModelContextParallel, K3EqualsOneProcessDouble) { check_model_cp<double>(kMicroK3, 1, 4096, 1e-9); }
TEST(ModelContextParallel, KimiLinearTwoSequencesEqualOneProcessFloat) {
  check_model_cp<float>(kMicroKL, 2, 4096, kFloatTol);
}
