// Expert parallelism (dist/moe_ep.hpp): the routed experts split over the job's ranks (alone, or under mpirun with 2
// and 4), every rank with its own tokens and an uneven routing, through fixed-capacity buffers, give each rank's
// expert outputs and input gradients of one process running every expert over its rows, and the experts' weight
// gradients of one process over all the ranks' rows (summed across ranks), within 1e-5 relative RMS in float and
// 1e-12 in double; with a capacity below the load, the same for the rows kept, zeros for the dropped ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "dist/comm.hpp"
#include "dist/moe_ep.hpp"
#include "model/layers.hpp"
#include "ops/moe/permute.hpp"
#include "testing.hpp"

using namespace lm;
using lm::testing::rel_rms_vec;

namespace {

template <class F>
std::vector<F> randn(size_t n, uint64_t seed, double sd = 1.0) {
  std::vector<float> x = lm::testing::randn<float>(n, seed, sd);
  return std::vector<F>(x.begin(), x.end());
}

// Expert outputs eo, input gradients dzs [A, l] and weight gradients dW* [E, ...] of this rank's rows: by one process
// running every expert over the first keep(e) rows of expert e (the rest give 0), or expert parallel over `w` with
// capacity C. Weight gradients summed over the ranks.
template <class F>
struct Result {
  std::vector<F> eo, dzs, dWg, dWu, dWd;
  int64_t dropped = 0, grouped = 0;
};

template <class F>
void check_ep(double tol, double capacity_factor) {
  dist::Comm& w = dist::world();
  const int R = w.size(), me = w.rank();
  const int64_t E = 8, k = 2, l = 16, I = 12, m = 37;
  const ops::GluParams p = ops::GluParams::situ();
  // Every expert's weights, the same on every rank.
  const std::vector<F> Wg = randn<F>(size_t(E * I * l), 1, 0.3), Wu = randn<F>(size_t(E * I * l), 2, 0.3),
                       Wd = randn<F>(size_t(E * l * I), 3, 0.3);
  // This rank's tokens and routing: two distinct experts per token, skewed towards experts 0 and 5 (expert 7 may get
  // no row at all on some ranks).
  const std::vector<F> z = randn<F>(size_t(m * l), 10 + uint64_t(me));
  std::vector<int32_t> idx(size_t(m * k));
  const Rng rng{uint64_t(20 + me), 1};
  for (int64_t i = 0; i < m; ++i) {
    const uint32_t b0 = rng.bits(uint64_t(i)).v[0], b1 = rng.bits(uint64_t(i)).v[1];
    const int32_t e0 = b0 % 3 == 0 ? 0 : b0 % 3 == 1 ? 5 : int32_t(b0 % 7);
    idx[size_t(i * k)] = e0, idx[size_t(i * k + 1)] = int32_t((e0 + 1 + b1 % (E - 1)) % E);
  }
  const ops::MoePermutation perm = ops::moe_permutation(idx.data(), m, k, E);
  const int64_t A = m * k, C = dist::expert_capacity(m, k, E, capacity_factor);
  std::vector<F> zs(size_t(A * l));
  ops::moe_gather(z.data(), perm.rows.data(), zs.data(), m, k, l);
  const std::vector<F> d_eo = randn<F>(size_t(A * l), 30 + uint64_t(me));

  // One process: every expert over this rank's first min(rows, C) rows of it; weight gradients summed over the ranks.
  Result<F> ref{std::vector<F>(size_t(A * l)), std::vector<F>(size_t(A * l)), std::vector<F>(Wg.size()),
                std::vector<F>(Wu.size()), std::vector<F>(Wd.size())};
  for (int64_t j = 0; j < E; ++j) {
    const int64_t r0 = perm.offsets[size_t(j)], n = std::min(perm.expert_rows(j), C);
    ref.dropped += perm.expert_rows(j) - n;
    model::GluFfnActs<F> a;
    const size_t wo = size_t(j * I * l);
    model::glu_ffn_forward(zs.data() + r0 * l, n, l, I, Wg.data() + wo, Wu.data() + wo, Wd.data() + wo, p,
                           ref.eo.data() + r0 * l, false, a);
    model::glu_ffn_backward(zs.data() + r0 * l, n, l, I, Wg.data() + wo, Wu.data() + wo, Wd.data() + wo, p,
                            d_eo.data() + r0 * l, ref.dzs.data() + r0 * l, false, ref.dWg.data() + wo,
                            ref.dWu.data() + wo, ref.dWd.data() + wo, a);
  }
  for (std::vector<F>* g : {&ref.dWg, &ref.dWu, &ref.dWd}) w.all_reduce_sum(g->data(), g->size());

  // Expert parallel: the local experts over the rows every rank sends them, through buffers of C rows.
  dist::ExpertDispatch x;
  dist::plan_dispatch(w, perm.offsets.data(), E, C, x);
  ASSERT_EQ(x.El, E / R);
  std::vector<F> gz, gdeo;
  Result<F> got{std::vector<F>(size_t(A * l)), std::vector<F>(size_t(A * l)), std::vector<F>(Wg.size()),
                std::vector<F>(Wu.size()), std::vector<F>(Wd.size())};
  dist::dispatch(w, x, zs.data(), l, gz);
  std::vector<F> geo(gz.size()), gdz(gz.size());
  std::vector<model::GluFfnActs<F>> acts(size_t(x.El));
  auto expert = [&](int64_t e, int64_t& r0, int64_t& n, size_t& wo) {
    r0 = x.local_offsets[size_t(e)], n = x.local_offsets[size_t(e) + 1] - r0;
    wo = size_t((x.first_expert() + e) * I * l);
  };
  for (int64_t e = 0; e < x.El; ++e) {
    int64_t r0, n;
    size_t wo;
    expert(e, r0, n, wo);
    model::glu_ffn_forward(gz.data() + r0 * l, n, l, I, Wg.data() + wo, Wu.data() + wo, Wd.data() + wo, p,
                           geo.data() + r0 * l, false, acts[size_t(e)]);
  }
  dist::combine(w, x, geo.data(), l, got.eo.data());
  dist::dispatch(w, x, d_eo.data(), l, gdeo);  // the backward: the same plan
  for (int64_t e = 0; e < x.El; ++e) {
    int64_t r0, n;
    size_t wo;
    expert(e, r0, n, wo);
    model::GluFfnActs<F>& a = acts[size_t(e)];
    model::glu_ffn_backward(gz.data() + r0 * l, n, l, I, Wg.data() + wo, Wu.data() + wo, Wd.data() + wo, p,
                            gdeo.data() + r0 * l, gdz.data() + r0 * l, false, got.dWg.data() + wo,
                            got.dWu.data() + wo, got.dWd.data() + wo, a);
  }
  dist::combine(w, x, gdz.data(), l, got.dzs.data());
  for (std::vector<F>* g : {&got.dWg, &got.dWu, &got.dWd}) w.all_reduce_sum(g->data(), g->size());  // (one rank each)

  // Every row arrives once: the rows all ranks sent are the rows all ranks' experts received.
  int64_t sent = 0, received = x.rows(), dropped = x.dropped;
  for (int64_t e = 0; e < E; ++e) sent += x.sent(e);
  for (int64_t* v : {&sent, &received, &dropped}) w.all_reduce_sum(v, 1);
  EXPECT_EQ(sent, received);
  EXPECT_EQ(x.dropped, ref.dropped);
  const double e_o = rel_rms_vec(ref.eo, got.eo), e_dz = rel_rms_vec(ref.dzs, got.dzs),
               e_g = rel_rms_vec(ref.dWg, got.dWg), e_u = rel_rms_vec(ref.dWu, got.dWu),
               e_d = rel_rms_vec(ref.dWd, got.dWd);
  if (me == 0)
    std::printf("[ measure  ] EP over %d rank(s), capacity %ld rows (factor %g; %ld of %ld assignments dropped): eo "
                "%.2e, dzs %.2e, dWg %.2e, dWu %.2e, dWd %.2e\n",
                R, long(C), capacity_factor, long(dropped), long(A * R), e_o, e_dz, e_g, e_u, e_d);
  EXPECT_LE(e_o, tol);
  EXPECT_LE(e_dz, tol);
  EXPECT_LE(e_g, tol);
  EXPECT_LE(e_u, tol);
  EXPECT_LE(e_d, tol);
  if (capacity_factor == 0) {
    EXPECT_EQ(dropped, 0);
  } else if (capacity_factor < 1) {
    EXPECT_GT(dropped, 0);  // (the skewed routing overflows half the balanced load)
  }
  // A layout the ranks cannot split: a clear error on every rank, before any collective.
  if (R > 1) {
    std::vector<int64_t> off(8, 0);
    dist::ExpertDispatch bad;
    EXPECT_THROW(dist::plan_dispatch(w, off.data(), 7, C, bad), lm::Error);
  }
}

}  // namespace

TEST(ExpertParallel, EqualsOneProcessFloat) { check_ep<float>(1e-5, 0); }
TEST(ExpertParallel, EqualsOneProcessDouble) { check_ep<double>(1e-12, 0); }
// Half the balanced load per expert and source rank: the overflow is dropped (an expert's first rows in token order
// kept), counted, and what is kept equals one process over the same rows.
TEST(ExpertParallel, OverflowIsDroppedDeterministicallyAndCounted) { check_ep<double>(1e-12, 0.5); }
TEST(ExpertParallel, CapacityFollowsTheFactor) {
  EXPECT_EQ(dist::expert_capacity(100, 2, 8, 0), 100);   // lossless
  EXPECT_EQ(dist::expert_capacity(100, 2, 8, 1.0), 25);  // the balanced load
  EXPECT_EQ(dist::expert_capacity(100, 2, 8, 1.3), 33);
  EXPECT_EQ(dist::expert_capacity(100, 2, 8, 50), 100);  // never more than the tokens
  EXPECT_THROW(dist::expert_capacity(100, 2, 8, -1), lm::Error);
}
