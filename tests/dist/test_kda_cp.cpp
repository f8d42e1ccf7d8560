// Context-parallel KDA (dist/kda_cp.hpp), its short convolution (dist/conv_cp.hpp) and MLA's attention (dist/mla_cp.hpp): a sequence of 4,096 tokens
// split over the job's ranks (alone, or under mpirun with 2 and 4) gives, on every rank's segment, the outputs and
// every gradient of the whole sequence run in one process (chunk_forward / chunk_backward, short_conv_*), within
// 1e-5 relative RMS in float and 1e-10 in double; the whole sequence's final state and dh0 (the conv's initial-cache
// gradient) too, with a non-zero initial state and final-state gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "dist/comm.hpp"
#include "dist/conv_cp.hpp"
#include "dist/kda_cp.hpp"
#include "dist/mla_cp.hpp"
#include "core/error.hpp"
#include "testing.hpp"

using namespace lm;

namespace {

template <class F>
std::vector<F> randn(size_t n, uint64_t seed, double sd = 1.0) {
  std::vector<float> x = lm::testing::randn<float>(n, seed, sd);
  return std::vector<F>(x.begin(), x.end());
}
template <class F>
double rel(const std::vector<F>& ref, const F* x, size_t off, size_t n) {
  double e = 0, r = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = double(ref[off + i]), b = double(x[i]);
    e += (a - b) * (a - b), r += a * a;
  }
  return r > 0 ? std::sqrt(e / r) : std::sqrt(e);
}

template <class F>
void check_cp(double tol) {
  dist::Comm& w = dist::world();
  const int R = w.size(), me = w.rank();
  const int64_t Ttot = 4096, B = 1, H = 2, K = 16, V = 16, T = Ttot / R;
  ASSERT_EQ(Ttot % R, 0);
  // The whole sequence on every rank (same seeds), unit-norm q, k, log decays in (-5, 0), beta in (0, 1).
  const size_t nqk = size_t(B * Ttot * H * K), nv = size_t(B * Ttot * H * V), nb = size_t(B * Ttot * H);
  std::vector<F> q = randn<F>(nqk, 1), k = randn<F>(nqk, 2), v = randn<F>(nv, 3), g = randn<F>(nqk, 4), beta(nb);
  auto unit = [&](std::vector<F>& x) {
    for (size_t r = 0; r < x.size() / size_t(K); ++r) {
      double s = 0;
      for (int64_t c = 0; c < K; ++c) s += double(x[r * K + c]) * double(x[r * K + c]);
      for (int64_t c = 0; c < K; ++c) x[r * K + c] = F(double(x[r * K + c]) / std::sqrt(s));
    }
  };
  unit(q), unit(k);
  // Slow decays and small betas, so a segment remembers its start state (with fast ones the state 2,048 tokens back
  // underflows to nothing and a wrong start state would go unseen).
  for (auto& x : g) x = F(-0.002 / (1.0 + std::exp(-double(x))));
  const std::vector<F> braw = randn<F>(nb, 5);
  for (size_t i = 0; i < nb; ++i) beta[i] = F(0.02 / (1.0 + std::exp(-double(braw[i]))));
  const std::vector<F> h0 = randn<F>(size_t(B * H * K * V), 6, 0.3), dht = randn<F>(size_t(B * H * K * V), 7),
                       dout = randn<F>(nv, 8);
  const F scale = F(1.0 / std::sqrt(double(K)));
  const kda::GateParams gate{kda::GateForm::LowerBound, -5.0};
  const kda::DiagPath path = kda::DiagPath::Auto;
  // The reference: one process, the whole sequence.
  kda::Dims dw;
  dw.B = B, dw.T = Ttot, dw.H = H, dw.K = K, dw.V = V;
  kda::CoreInputs<F> in{q.data(), k.data(), v.data(), g.data(), beta.data(), h0.data(), scale};
  std::vector<F> o_ref(nv), ht_ref(h0.size()), dq(nqk), dk(nqk), dv(nv), dg(nqk), db(nb), dh0(h0.size());
  kda::chunk_forward(in, dw, o_ref.data(), ht_ref.data(), path, gate);
  kda::chunk_backward(in, dw, dout.data(), dht.data(),
                      kda::CoreGrads<F>{dq.data(), dk.data(), dv.data(), dg.data(), db.data(), dh0.data()}, path, gate);
  // This rank's segment (B = 1: rows [me·T, (me+1)·T)).
  const size_t oqk = size_t(me * T * H * K), ov = size_t(me * T * H * V), ob = size_t(me * T * H);
  kda::Dims ds = dw;
  ds.T = T;
  kda::CoreInputs<F> seg{q.data() + oqk, k.data() + oqk, v.data() + ov, g.data() + oqk, beta.data() + ob, h0.data(),
                         scale};
  std::vector<F> o(size_t(T * H * V)), ht(h0.size()), sdq(size_t(T * H * K)), sdk(sdq.size()), sdv(o.size()),
      sdg(sdq.size()), sdb(size_t(T * H)), sdh0(h0.size());
  dist::KdaCpSaved<F> saved;
  dist::kda_cp_forward(w, seg, ds, o.data(), ht.data(), path, gate, saved);
  dist::kda_cp_backward(w, seg, ds, dout.data() + ov, dht.data(),
                        kda::CoreGrads<F>{sdq.data(), sdk.data(), sdv.data(), sdg.data(), sdb.data(), sdh0.data()},
                        path, gate, saved);
  const double errs[] = {rel(o_ref, o.data(), ov, o.size()),       rel(ht_ref, ht.data(), 0, ht.size()),
                         rel(dq, sdq.data(), oqk, sdq.size()),     rel(dk, sdk.data(), oqk, sdk.size()),
                         rel(dv, sdv.data(), ov, sdv.size()),      rel(dg, sdg.data(), oqk, sdg.size()),
                         rel(db, sdb.data(), ob, sdb.size()),      rel(dh0, sdh0.data(), 0, sdh0.size())};
  const char* names[] = {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"};
  double worst = 0;
  for (int i = 0; i < 8; ++i) {
    EXPECT_LE(errs[i], tol) << names[i] << " on rank " << me << " of " << R;
    worst = std::max(worst, errs[i]);
  }
  std::vector<double> all(static_cast<size_t>(R));
  w.all_gather(&worst, sizeof(double), all.data());
  if (me == 0) {
    double m = 0;
    for (double x : all) m = std::max(m, x);
    std::printf("[ measure  ] KDA over %d rank(s), T = 4096 (%s): worst relative RMS of o, ht and every gradient %.2e\n",
                R, sizeof(F) == 4 ? "float" : "double", m);
  }
}

}  // namespace

TEST(KdaContextParallel, EqualsOneProcessFloat) { check_cp<float>(1e-5); }
TEST(KdaContextParallel, EqualsOneProcessDouble) { check_cp<double>(1e-10); }

// The conv halo: 4,096 rows of 2 sequences split over the ranks, with an initial cache; y, dx and dcache on every
// rank's segment, and dw summed over the ranks, equal one process's.
TEST(KdaContextParallel, ShortConvHaloEqualsOneProcess) {
  dist::Comm& w = dist::world();
  const int R = w.size(), me = w.rank();
  const int64_t Ttot = 4096, B = 2, C = 24, W = 4, T = Ttot / R;
  const std::vector<double> x = randn<double>(size_t(B * Ttot * C), 11), wt = randn<double>(size_t(C * W), 12),
                            cache = randn<double>(size_t(B * C * (W - 1)), 13), dy = randn<double>(x.size(), 14);
  kda::ConvDims dw_;
  dw_.B = B, dw_.T = Ttot, dw_.C = C, dw_.W = W;
  std::vector<double> y_ref(x.size()), dx_ref(x.size()), dW_ref(wt.size(), 0.0), dc_ref(cache.size());
  kda::short_conv_forward<double>(x.data(), wt.data(), cache.data(), y_ref.data(), dw_, true);
  kda::short_conv_backward<double>(x.data(), wt.data(), cache.data(), dy.data(), dx_ref.data(), dW_ref.data(),
                                   dc_ref.data(), dw_, true);
  // This rank's rows of each sequence, gathered into [B, T, C].
  auto seg = [&](const std::vector<double>& full) {
    std::vector<double> s(size_t(B * T * C));
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(full.data() + (b * Ttot + me * T) * C, T * C, s.data() + b * T * C);
    return s;
  };
  const std::vector<double> xs = seg(x), dys = seg(dy), y_want = seg(y_ref), dx_want = seg(dx_ref);
  kda::ConvDims ds = dw_;
  ds.T = T;
  std::vector<double> y(xs.size()), dx(xs.size()), dW(wt.size(), 0.0), dc(cache.size()), halo;
  dist::conv_cp_forward<double>(w, xs.data(), wt.data(), cache.data(), y.data(), ds, true, halo);
  dist::conv_cp_backward<double>(w, xs.data(), wt.data(), halo, dys.data(), dx.data(), dW.data(), dc.data(), ds, true);
  w.all_reduce_sum(dW.data(), dW.size());
  const double e[] = {rel(y_want, y.data(), 0, y.size()), rel(dx_want, dx.data(), 0, dx.size()),
                      rel(dW_ref, dW.data(), 0, dW.size()), rel(dc_ref, dc.data(), 0, dc.size())};
  for (double x_ : e) EXPECT_LE(x_, 1e-12) << "rank " << me << " of " << R;
  if (me == 0)
    std::printf("[ measure  ] short conv over %d rank(s): y %.1e, dx %.1e, dw %.1e, dcache %.1e relative\n", R, e[0],
                e[1], e[2], e[3]);
  std::vector<double> bad(size_t(B * (W - 2) * C), 0.0);  // a segment shorter than the halo is refused
  kda::ConvDims tiny = ds;
  tiny.T = W - 2;
  EXPECT_THROW(dist::conv_cp_forward<double>(w, bad.data(), wt.data(), nullptr, bad.data(), tiny, true, halo), Error);
}

// MLA's attention over the gathered latents: 4,096 positions split over the ranks give each rank's outputs, query
// and latent gradients, and (summed over the ranks) W_kvb's gradient of one process over the whole sequence.
TEST(KdaContextParallel, MlaAttentionEqualsOneProcess) {
  dist::Comm& w = dist::world();
  const int R = w.size(), me = w.rank();
  const int64_t Ttot = 4096, T = Ttot / R, H = 2, Dn = 16, Dr = 8, Dv = 16, Rl = 32, Dq = Dn + Dr, RD = Rl + Dr,
                Dkv = Dn + Dv;
  const std::vector<double> lat = randn<double>(size_t(Ttot * RD), 21), q = randn<double>(size_t(Ttot * H * Dq), 22),
                            W = randn<double>(size_t(H * Dkv * Rl), 23, 0.2), dout = randn<double>(size_t(Ttot * H * Dv), 24);
  const double scale = 1.0 / std::sqrt(double(Dq));
  dist::MlaCpDims whole{Ttot, H, Dn, Dr, Dv, Rl}, part{T, H, Dn, Dr, Dv, Rl};
  // The reference: one process over the whole sequence.
  std::vector<double> o_ref(size_t(Ttot * H * Dv)), dq_ref(q.size()), dl_ref(lat.size()), dW_ref(W.size(), 0.0);
  dist::MlaCpSaved<double> s1;
  dist::mla_cp_forward<double>(dist::single(), lat.data(), q.data(), W.data(), o_ref.data(), whole, scale, s1);
  dist::mla_cp_backward<double>(dist::single(), W.data(), dout.data(), dq_ref.data(), dl_ref.data(), dW_ref.data(),
                                whole, scale, s1);
  std::vector<double> o(size_t(T * H * Dv)), dq(size_t(T * H * Dq)), dl(size_t(T * RD)), dW(W.size(), 0.0);
  dist::MlaCpSaved<double> s;
  dist::mla_cp_forward<double>(w, lat.data() + me * T * RD, q.data() + me * T * H * Dq, W.data(), o.data(), part, scale, s);
  dist::mla_cp_backward<double>(w, W.data(), dout.data() + me * T * H * Dv, dq.data(), dl.data(), dW.data(), part, scale, s);
  w.all_reduce_sum(dW.data(), dW.size());
  const double e[] = {rel(o_ref, o.data(), size_t(me * T * H * Dv), o.size()),
                      rel(dq_ref, dq.data(), size_t(me * T * H * Dq), dq.size()),
                      rel(dl_ref, dl.data(), size_t(me * T * RD), dl.size()), rel(dW_ref, dW.data(), 0, dW.size())};
  for (double x_ : e) EXPECT_LE(x_, 1e-10) << "rank " << me << " of " << R;
  if (me == 0)
    std::printf("[ measure  ] MLA attention over %d rank(s): o %.1e, dq %.1e, dlatent %.1e, dW_kvb %.1e relative\n", R,
                e[0], e[1], e[2], e[3]);
}
