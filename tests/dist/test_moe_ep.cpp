// Expert parallelism (dist/moe_ep.hpp): the routed experts split over the job's ranks (alone, or under mpirun with 2
// and 4), every rank with its own tokens and an uneven routing, give each rank's expert outputs and input gradients
// of one process running every expert over its rows, and the experts' weight gradients of one process over all the
// ranks' rows (summed across ranks), within 1e-5 relative RMS in float and 1e-12 in double.
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

namespace {

template <class F>
std::vector<F> randn(size_t n, uint64_t seed, double sd = 1.0) {
  std::vector<float> x = lm::testing::randn<float>(n, seed, sd);
  return std::vector<F>(x.begin(), x.end());
}
template <class F>
double rel(const std::vector<F>& ref, const std::vector<F>& x) {
  double e = 0, r = 0;
  for (size_t i = 0; i < ref.size(); ++i) e += (double(ref[i]) - x[i]) * (double(ref[i]) - x[i]), r += double(ref[i]) * ref[i];
  return r > 0 ? std::sqrt(e / r) : std::sqrt(e);
}

template <class F>
void check_ep(double tol) {
  dist::Comm& w = dist::world();
  const int R = w.size(), me = w.rank();
  const int64_t E = 8, k = 2, l = 16, I = 12, m = 37 + 11 * me;  // (ranks hold different numbers of tokens)
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
  const int64_t A = m * k;
  std::vector<F> zs(size_t(A * l));
  ops::moe_gather(z.data(), perm.rows.data(), zs.data(), m, k, l);
  const std::vector<F> d_eo = randn<F>(size_t(A * l), 30 + uint64_t(me));

  // One process: every expert over this rank's rows; weight gradients summed over every rank's rows.
  std::vector<F> eo_ref(size_t(A * l)), dzs_ref(size_t(A * l)), dWg_ref(Wg.size()), dWu_ref(Wu.size()),
      dWd_ref(Wd.size());
  for (int64_t j = 0; j < E; ++j) {
    const int64_t r0 = perm.offsets[size_t(j)], n = perm.expert_rows(j);
    model::GluFfnActs<F> a;
    const size_t wo = size_t(j * I * l);
    model::glu_ffn_forward(zs.data() + r0 * l, n, l, I, Wg.data() + wo, Wu.data() + wo, Wd.data() + wo, p,
                           eo_ref.data() + r0 * l, false, a);
    model::glu_ffn_backward(zs.data() + r0 * l, n, l, I, Wg.data() + wo, Wu.data() + wo, Wd.data() + wo, p,
                            d_eo.data() + r0 * l, dzs_ref.data() + r0 * l, false, dWg_ref.data() + wo,
                            dWu_ref.data() + wo, dWd_ref.data() + wo, a);
  }
  for (std::vector<F>* g : {&dWg_ref, &dWu_ref, &dWd_ref}) w.all_reduce_sum(g->data(), g->size());

  // Expert parallel: the local experts over the rows every rank sends them.
  const dist::ExpertExchange x = dist::expert_exchange(w, perm.offsets.data(), E);
  ASSERT_EQ(x.El, E / R);
  std::vector<F> gz(size_t(x.rows() * l)), geo(gz.size()), gdeo(gz.size()), gdz(gz.size());
  std::vector<F> eo(size_t(A * l)), dzs(size_t(A * l)), dWg(Wg.size()), dWu(Wu.size()), dWd(Wd.size());
  dist::to_experts(w, x, zs.data(), l, gz.data());
  dist::to_experts(w, x, d_eo.data(), l, gdeo.data());
  for (int64_t e = 0; e < x.El; ++e) {
    const int64_t r0 = x.local_offsets[size_t(e)], n = x.local_offsets[size_t(e) + 1] - r0;
    const size_t wo = size_t((x.first_expert() + e) * I * l);
    model::GluFfnActs<F> a;
    model::glu_ffn_forward(gz.data() + r0 * l, n, l, I, Wg.data() + wo, Wu.data() + wo, Wd.data() + wo, p,
                           geo.data() + r0 * l, false, a);
    model::glu_ffn_backward(gz.data() + r0 * l, n, l, I, Wg.data() + wo, Wu.data() + wo, Wd.data() + wo, p,
                            gdeo.data() + r0 * l, gdz.data() + r0 * l, false, dWg.data() + wo, dWu.data() + wo,
                            dWd.data() + wo, a);
  }
  dist::from_experts(w, x, geo.data(), l, eo.data());
  dist::from_experts(w, x, gdz.data(), l, dzs.data());
  for (std::vector<F>* g : {&dWg, &dWu, &dWd}) w.all_reduce_sum(g->data(), g->size());  // (each expert on one rank)

  int64_t total = 0;
  for (int64_t r : x.recv_rows) total += r;
  EXPECT_EQ(total, x.rows());
  const double e_o = rel(eo_ref, eo), e_dz = rel(dzs_ref, dzs), e_g = rel(dWg_ref, dWg), e_u = rel(dWu_ref, dWu),
               e_d = rel(dWd_ref, dWd);
  if (me == 0)
    std::printf("EP over %d ranks (%ld local experts, %ld grouped rows on rank 0): eo %.2e, dzs %.2e, dWg %.2e, dWu "
                "%.2e, dWd %.2e\n",
                R, long(x.El), long(x.rows()), e_o, e_dz, e_g, e_u, e_d);
  EXPECT_LE(e_o, tol);
  EXPECT_LE(e_dz, tol);
  EXPECT_LE(e_g, tol);
  EXPECT_LE(e_u, tol);
  EXPECT_LE(e_d, tol);
  // A layout the ranks cannot split: a clear error on every rank, before any collective.
  if (R > 1) {
    std::vector<int64_t> off(8, 0);
    EXPECT_THROW(dist::expert_exchange(w, off.data(), 7), lm::Error);
  }
}

}  // namespace

TEST(ExpertParallel, EqualsOneProcessFloat) { check_ep<float>(1e-5); }
TEST(ExpertParallel, EqualsOneProcessDouble) { check_ep<double>(1e-12); }
