// KDA token-by-token reference (SPEC §2): float64 finite-difference gradients, decode/split/varlen
// consistency, stability with a very negative gate, and the golden op files (fla naive_recurrent_kda
// after the in-kernel L2 norm, gate and beta sigmoid).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "io/safetensors.hpp"
#include "ops/kda/kda.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::kda;
using lm::testing::dot;
using lm::testing::fd_check;
using lm::testing::randn;
using lm::testing::randu;
using lm::testing::rel_rms_vec;

namespace {

using Vec = std::vector<double>;
constexpr double kFdTol = 1e-6;

size_t sz(int64_t n) { return static_cast<size_t>(n); }

double max_abs_diff(const Vec& a, const Vec& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// Rows [t0, t1) of every batch entry of x [B, T, width] -> [B, t1 - t0, width].
template <class F>
std::vector<F> slice_t(const std::vector<F>& x, int64_t B, int64_t T, int64_t width, int64_t t0, int64_t t1) {
  std::vector<F> out;
  for (int64_t b = 0; b < B; ++b)
    out.insert(out.end(), x.begin() + (b * T + t0) * width, x.begin() + (b * T + t1) * width);
  return out;
}
// Inverse of slice_t for two halves: [B, t1, w] ++ [B, T - t1, w] -> [B, T, w].
Vec join_t(const Vec& a, const Vec& b, int64_t B, int64_t T, int64_t width, int64_t t1) {
  Vec out;
  for (int64_t i = 0; i < B; ++i) {
    out.insert(out.end(), a.begin() + i * t1 * width, a.begin() + (i + 1) * t1 * width);
    out.insert(out.end(), b.begin() + i * (T - t1) * width, b.begin() + (i + 1) * (T - t1) * width);
  }
  return out;
}

// A random core problem (already-processed inputs). Batch or varlen (cu non-empty).
struct Core {
  Dims d;
  std::vector<int64_t> cu;
  Vec q, k, v, g, beta, h0;
  bool with_h0 = true;
  double scale = 0;
  Core(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, std::vector<int64_t> cu_in, uint64_t seed,
       bool h0_on = true)
      : cu(std::move(cu_in)), with_h0(h0_on) {
    d.B = B;
    d.T = T;
    d.H = H;
    d.K = K;
    d.V = V;
    if (!cu.empty()) {
      d.cu_seqlens = cu.data();
      d.N = static_cast<int64_t>(cu.size()) - 1;
    }
    const int64_t rows = B * T;
    q = randn(sz(rows * H * K), seed, 0.5);
    k = randn(sz(rows * H * K), seed + 1, 0.5);
    v = randn(sz(rows * H * V), seed + 2);
    g = randu(sz(rows * H * K), seed + 3, -1.0, -0.02);
    beta = randu(sz(rows * H), seed + 4, 0.1, 0.9);
    h0 = randn(sz(nseq() * H * K * V), seed + 5, 0.3);
    scale = 1.0 / std::sqrt(static_cast<double>(K));
  }
  int64_t nseq() const { return d.num_seqs(); }
  int64_t rows() const { return d.B * d.T; }
  size_t n_o() const { return sz(rows() * d.H * d.V); }
  size_t n_state() const { return sz(nseq() * d.H * d.K * d.V); }
  CoreInputs<double> in() const {
    return CoreInputs<double>{q.data(), k.data(), v.data(), g.data(), beta.data(), with_h0 ? h0.data() : nullptr,
                              scale};
  }
  void forward(Vec& o, Vec& ht) const {
    o.assign(n_o(), 0.0);
    ht.assign(n_state(), 0.0);
    reference_forward(in(), d, o.data(), ht.data());
  }
  double loss(const Vec& dO, const Vec* dht) const {
    Vec o, ht;
    forward(o, ht);
    return dot(o, dO) + (dht ? dot(ht, *dht) : 0.0);
  }
  struct Grads {
    Vec dq, dk, dv, dg, dbeta, dh0;
  };
  Grads backward(const Vec& dO, const Vec* dht) const {
    Grads r;
    const size_t nqk = sz(rows() * d.H * d.K);
    // Poisoned: every entry must be written.
    r.dq.assign(nqk, NAN);
    r.dk.assign(nqk, NAN);
    r.dg.assign(nqk, NAN);
    r.dv.assign(n_o(), NAN);
    r.dbeta.assign(sz(rows() * d.H), NAN);
    r.dh0.assign(n_state(), NAN);
    reference_backward(
        in(), d, dO.data(), dht ? dht->data() : nullptr,
        CoreGrads<double>{r.dq.data(), r.dk.data(), r.dv.data(), r.dg.data(), r.dbeta.data(), r.dh0.data()});
    return r;
  }
};

void check_core_grads(Core& c, bool use_dht, uint64_t seed) {
  const Vec dO = randn(c.n_o(), seed);
  const Vec dht = randn(c.n_state(), seed + 1);
  const Vec* pd = use_dht ? &dht : nullptr;
  const Core::Grads gr = c.backward(dO, pd);
  auto f = [&] { return c.loss(dO, pd); };
  EXPECT_LT(fd_check(c.q, gr.dq, f), kFdTol) << "dq";
  EXPECT_LT(fd_check(c.k, gr.dk, f), kFdTol) << "dk";
  EXPECT_LT(fd_check(c.v, gr.dv, f), kFdTol) << "dv";
  EXPECT_LT(fd_check(c.g, gr.dg, f), kFdTol) << "dg";
  EXPECT_LT(fd_check(c.beta, gr.dbeta, f), kFdTol) << "dbeta";
  EXPECT_LT(fd_check(c.h0, gr.dh0, f), kFdTol) << "dh0";
}

TEST(KdaReference, GradientsMatchFiniteDifferences) {
  for (bool use_dht : {true, false}) {
    SCOPED_TRACE(::testing::Message() << "dht=" << use_dht);
    Core c(2, 9, 2, 4, 3, {}, 100);
    check_core_grads(c, use_dht, 110);
  }
}

TEST(KdaReference, GradientsMatchFiniteDifferencesVarlen) {
  // Includes an empty sequence and one longer than the backward's 64-token checkpoint segment.
  for (bool use_dht : {true, false}) {
    SCOPED_TRACE(::testing::Message() << "dht=" << use_dht);
    Core c(1, 84, 2, 3, 4, {0, 4, 4, 13, 84}, 120);
    check_core_grads(c, use_dht, 130);
  }
}

TEST(KdaReference, GradientsWithoutInitialStateMatchFiniteDifferences) {
  Core c(1, 140, 1, 4, 2, {}, 140, /*h0_on=*/false);
  const Vec dO = randn(c.n_o(), 141), dht = randn(c.n_state(), 142);
  const Core::Grads gr = c.backward(dO, &dht);
  auto f = [&] { return c.loss(dO, &dht); };
  EXPECT_LT(fd_check(c.k, gr.dk, f), kFdTol);
  EXPECT_LT(fd_check(c.g, gr.dg, f), kFdTol);
  EXPECT_LT(fd_check(c.beta, gr.dbeta, f), kFdTol);
  // dh0 is still the gradient w.r.t. the (zero) initial state: compare with the run that passes zeros.
  c.with_h0 = true;
  std::fill(c.h0.begin(), c.h0.end(), 0.0);
  EXPECT_LT(fd_check(c.h0, gr.dh0, f), kFdTol);
}

TEST(KdaReference, DecodeStepsEqualForward) {
  const int64_t B = 3, T = 20, H = 2, K = 6, V = 5;
  Core c(B, T, H, K, V, {}, 200);
  Vec o, ht;
  c.forward(o, ht);
  Vec state = c.h0;
  for (int64_t t = 0; t < T; ++t) {
    const Vec qt = slice_t(c.q, B, T, H * K, t, t + 1), kt = slice_t(c.k, B, T, H * K, t, t + 1);
    const Vec gt = slice_t(c.g, B, T, H * K, t, t + 1), vt = slice_t(c.v, B, T, H * V, t, t + 1);
    const Vec bt = slice_t(c.beta, B, T, H, t, t + 1);
    Vec ot(sz(B * H * V));
    decode_step(state.data(), qt.data(), kt.data(), vt.data(), gt.data(), bt.data(), ot.data(), B, H, K, V, c.scale);
    EXPECT_LT(max_abs_diff(ot, slice_t(o, B, T, H * V, t, t + 1)), 1e-14) << "t=" << t;
  }
  EXPECT_LT(max_abs_diff(state, ht), 1e-14);

  // float: same arithmetic in both paths.
  auto tof = [](const Vec& x) { return std::vector<float>(x.begin(), x.end()); };
  const auto qf = tof(c.q), kf = tof(c.k), vf = tof(c.v), gf = tof(c.g), bf = tof(c.beta), h0f = tof(c.h0);
  std::vector<float> of(c.n_o()), htf(c.n_state());
  reference_forward(
      CoreInputs<float>{qf.data(), kf.data(), vf.data(), gf.data(), bf.data(), h0f.data(), static_cast<float>(c.scale)},
      c.d, of.data(), htf.data());
  std::vector<float> sf = h0f;
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    const auto qt = slice_t(qf, B, T, H * K, t, t + 1), kt = slice_t(kf, B, T, H * K, t, t + 1);
    const auto gt = slice_t(gf, B, T, H * K, t, t + 1), vt = slice_t(vf, B, T, H * V, t, t + 1);
    const auto bt = slice_t(bf, B, T, H, t, t + 1);
    std::vector<float> ot(sz(B * H * V));
    decode_step(sf.data(), qt.data(), kt.data(), vt.data(), gt.data(), bt.data(), ot.data(), B, H, K, V,
                static_cast<float>(c.scale));
    const auto ref = slice_t(of, B, T, H * V, t, t + 1);
    for (size_t i = 0; i < ot.size(); ++i) worst = std::max(worst, static_cast<double>(std::abs(ot[i] - ref[i])));
  }
  EXPECT_LT(worst, 1e-6);
  // And the float forward agrees with the double one to float precision.
  EXPECT_LT(rel_rms_vec(o, Vec(of.begin(), of.end())), 1e-5);
}

TEST(KdaReference, SplitWithCarriedStateEqualsOnePass) {
  // Forward and backward; T crosses the backward's 64-token checkpoint segments.
  const int64_t B = 2, T = 150, H = 2, K = 8, V = 8, t1 = 70;
  Core full(B, T, H, K, V, {}, 300);
  const Vec dO = randn(full.n_o(), 310), dht = randn(full.n_state(), 311);
  Vec o, ht;
  full.forward(o, ht);
  const Core::Grads gfull = full.backward(dO, &dht);

  auto part = [&](int64_t a, int64_t b, const Vec& h0) {
    Core p(B, b - a, H, K, V, {}, 300);
    p.q = slice_t(full.q, B, T, H * K, a, b);
    p.k = slice_t(full.k, B, T, H * K, a, b);
    p.g = slice_t(full.g, B, T, H * K, a, b);
    p.v = slice_t(full.v, B, T, H * V, a, b);
    p.beta = slice_t(full.beta, B, T, H, a, b);
    p.h0 = h0;
    return p;
  };
  Core p1 = part(0, t1, full.h0);
  Vec o1, ht1;
  p1.forward(o1, ht1);
  Core p2 = part(t1, T, ht1);
  Vec o2, ht2;
  p2.forward(o2, ht2);
  EXPECT_LT(max_abs_diff(join_t(o1, o2, B, T, H * V, t1), o), 1e-13);
  EXPECT_LT(max_abs_diff(ht2, ht), 1e-13);

  const Core::Grads g2 = p2.backward(slice_t(dO, B, T, H * V, t1, T), &dht);
  const Core::Grads g1 = p1.backward(slice_t(dO, B, T, H * V, 0, t1), &g2.dh0);
  EXPECT_LT(max_abs_diff(join_t(g1.dq, g2.dq, B, T, H * K, t1), gfull.dq), 1e-12);
  EXPECT_LT(max_abs_diff(join_t(g1.dk, g2.dk, B, T, H * K, t1), gfull.dk), 1e-12);
  EXPECT_LT(max_abs_diff(join_t(g1.dv, g2.dv, B, T, H * V, t1), gfull.dv), 1e-12);
  EXPECT_LT(max_abs_diff(join_t(g1.dg, g2.dg, B, T, H * K, t1), gfull.dg), 1e-12);
  EXPECT_LT(max_abs_diff(join_t(g1.dbeta, g2.dbeta, B, T, H, t1), gfull.dbeta), 1e-12);
  EXPECT_LT(max_abs_diff(g1.dh0, gfull.dh0), 1e-12);
}

TEST(KdaReference, VarlenEqualsSeparateRuns) {
  const std::vector<int64_t> cu = {0, 5, 5, 19, 90};
  const int64_t H = 2, K = 5, V = 4, N = 4;
  Core packed(1, cu.back(), H, K, V, cu, 400);
  const Vec dO = randn(packed.n_o(), 410), dht = randn(packed.n_state(), 411);
  Vec o, ht;
  packed.forward(o, ht);
  const Core::Grads gp = packed.backward(dO, &dht);
  const int64_t KV = K * V, st = H * KV;
  for (int64_t n = 0; n < N; ++n) {
    SCOPED_TRACE(::testing::Message() << "sequence " << n);
    const int64_t a = cu[n], b = cu[n + 1];
    const Vec h0n(packed.h0.begin() + n * st, packed.h0.begin() + (n + 1) * st);
    const Vec dhtn(dht.begin() + n * st, dht.begin() + (n + 1) * st);
    const Vec htn(ht.begin() + n * st, ht.begin() + (n + 1) * st);
    const Vec dh0n(gp.dh0.begin() + n * st, gp.dh0.begin() + (n + 1) * st);
    if (a == b) {  // empty: the state passes through untouched, and so does its gradient
      EXPECT_EQ(htn, h0n);
      EXPECT_EQ(dh0n, dhtn);
      continue;
    }
    Core s(1, b - a, H, K, V, {}, 400);
    s.q = slice_t(packed.q, 1, cu.back(), H * K, a, b);
    s.k = slice_t(packed.k, 1, cu.back(), H * K, a, b);
    s.g = slice_t(packed.g, 1, cu.back(), H * K, a, b);
    s.v = slice_t(packed.v, 1, cu.back(), H * V, a, b);
    s.beta = slice_t(packed.beta, 1, cu.back(), H, a, b);
    s.h0 = h0n;
    Vec os, hts;
    s.forward(os, hts);
    EXPECT_EQ(os, slice_t(o, 1, cu.back(), H * V, a, b));
    EXPECT_EQ(hts, htn);
    const Core::Grads gs = s.backward(slice_t(dO, 1, cu.back(), H * V, a, b), &dhtn);
    EXPECT_EQ(gs.dq, slice_t(gp.dq, 1, cu.back(), H * K, a, b));
    EXPECT_EQ(gs.dk, slice_t(gp.dk, 1, cu.back(), H * K, a, b));
    EXPECT_EQ(gs.dv, slice_t(gp.dv, 1, cu.back(), H * V, a, b));
    EXPECT_EQ(gs.dg, slice_t(gp.dg, 1, cu.back(), H * K, a, b));
    EXPECT_EQ(gs.dbeta, slice_t(gp.dbeta, 1, cu.back(), H, a, b));
    EXPECT_EQ(gs.dh0, dh0n);
  }
}

TEST(KdaReference, StableWithVeryNegativeGate) {
  // Softplus gate with large raw inputs: g = -exp(0) * softplus(200) = -200 per step. The state is
  // wiped every step, so S_t = k_t e_t^T with e_t = beta_t v_t and o_t = scale beta_t (q_t . k_t) v_t.
  const int64_t T = 40, H = 2, K = 8, V = 6, rows = T;
  const Vec qr = randn(sz(rows * H * K), 500), kr = randn(sz(rows * H * K), 501), v = randn(sz(rows * H * V), 502);
  const Vec braw = randn(sz(rows * H), 503), h0 = randn(sz(H * K * V), 504), dO = randn(sz(rows * H * V), 505);
  const Vec graw(sz(rows * H * K), 200.0), A_log(sz(H), 0.0), dt(sz(H * K), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  auto run = [&](auto zero) {
    using F = decltype(zero);
    auto cv = [](const Vec& x) { return std::vector<F>(x.begin(), x.end()); };
    const auto qrf = cv(qr), krf = cv(kr), vf = cv(v), brf = cv(braw), h0f = cv(h0), dOf = cv(dO), grf = cv(graw);
    const auto Af = cv(A_log), dtf = cv(dt);
    std::vector<F> q(qrf.size()), k(krf.size()), b(brf.size()), g(grf.size());
    l2norm_forward(qrf.data(), q.data(), rows * H, K);
    l2norm_forward(krf.data(), k.data(), rows * H, K);
    sigmoid_forward(brf.data(), b.data(), rows * H);
    gate_forward(grf.data(), Af.data(), dtf.data(), g.data(), rows, H, K, GateParams{GateForm::Softplus, 0.0});
    EXPECT_EQ(g[0], F(-200));
    const CoreInputs<F> in{q.data(), k.data(), vf.data(), g.data(), b.data(), h0f.data(), static_cast<F>(scale)};
    Dims d;
    d.T = T;
    d.H = H;
    d.K = K;
    d.V = V;
    std::vector<F> o(vf.size()), ht(h0f.size());
    reference_forward(in, d, o.data(), ht.data());
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < H; ++h) {
        double qk = 0;
        for (int64_t i = 0; i < K; ++i) qk += double(q[(r * H + h) * K + i]) * double(k[(r * H + h) * K + i]);
        for (int64_t j = 0; j < V; ++j) {
          const double expect = scale * double(b[r * H + h]) * qk * double(vf[(r * H + h) * V + j]);
          const double got = double(o[(r * H + h) * V + j]);
          EXPECT_TRUE(std::isfinite(got));
          worst = std::max(worst, std::abs(got - expect));
        }
      }
    std::vector<F> dq(q.size()), dk(k.size()), dv(vf.size()), dg(g.size()), db(b.size()), dh0(h0f.size());
    reference_backward(in, d, dOf.data(), static_cast<const F*>(nullptr),
                       CoreGrads<F>{dq.data(), dk.data(), dv.data(), dg.data(), db.data(), dh0.data()});
    std::vector<F> dgr(g.size()), dA(sz(H), F(0)), ddt(sz(H * K), F(0));
    gate_backward(grf.data(), Af.data(), dtf.data(), dg.data(), dgr.data(), dA.data(), ddt.data(), rows, H, K,
                  GateParams{GateForm::Softplus, 0.0});
    for (const auto* vec : {&dq, &dk, &dv, &dg, &db, &dh0, &dgr, &dA, &ddt})
      for (F x : *vec) EXPECT_TRUE(std::isfinite(x));
    double dh0max = 0;
    for (F x : dh0) dh0max = std::max(dh0max, std::abs(double(x)));
    EXPECT_LT(dh0max, 1e-80);  // exp(-200) or exactly 0 in float
    return worst;
  };
  EXPECT_LT(run(0.0), 1e-13);
  EXPECT_LT(run(0.0f), 1e-5);
}

TEST(KdaReference, CheckDimsRejectsBadShapes) {
  Dims ok;
  ok.T = 4;
  ok.K = 2;
  ok.V = 2;
  EXPECT_NO_THROW(check_dims(ok));
  Dims d = ok;
  d.K = 0;
  EXPECT_THROW(check_dims(d), Error);
  d = ok;
  d.T = -1;
  EXPECT_THROW(check_dims(d), Error);
  std::vector<int64_t> good = {0, 1, 4}, start = {1, 2, 4}, dec = {0, 3, 2, 4}, end = {0, 2, 3};
  d = ok;
  d.cu_seqlens = good.data();
  d.N = 2;
  EXPECT_NO_THROW(check_dims(d));
  d.B = 2;
  EXPECT_THROW(check_dims(d), Error);  // varlen needs B == 1
  d.B = 1;
  d.N = 0;
  EXPECT_THROW(check_dims(d), Error);
  d.cu_seqlens = start.data();
  d.N = 2;
  EXPECT_THROW(check_dims(d), Error);
  d.cu_seqlens = dec.data();
  d.N = 3;
  EXPECT_THROW(check_dims(d), Error);
  d.cu_seqlens = end.data();
  d.N = 2;
  EXPECT_THROW(check_dims(d), Error);
}

// ---- golden op files ------------------------------------------------------------------------

struct GoldenChain {
  std::vector<std::string> names = {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"};
  std::vector<Vec> out;
};

Vec load(const io::SafeTensorsFile& f, const std::string& name) {
  const Tensor t = f.get_as(name, DType::F64).contiguous();
  const double* p = t.data<double>();
  return Vec(p, p + t.numel());
}

// l2norm(q), l2norm(k), sigmoid(beta), gate(g) -> reference, and back through all of them, in F.
template <class F>
std::vector<Vec> run_golden_chain(const io::SafeTensorsFile& f) {
  auto cv = [](const Vec& x) { return std::vector<F>(x.begin(), x.end()); };
  auto back = [](const std::vector<F>& x) { return Vec(x.begin(), x.end()); };
  const auto qs = f.info("q").shape, vs = f.info("v").shape;
  EXPECT_EQ(qs.size(), 4u);
  const int64_t B = qs[0], T = qs[1], H = qs[2], K = qs[3], V = vs[3], rows = B * T;
  const std::string lb = f.metadata().at("lower_bound");
  const GateParams gp =
      lb == "none" ? GateParams{GateForm::Softplus, 0.0} : GateParams{GateForm::LowerBound, std::stod(lb)};
  const F scale = static_cast<F>(std::stod(f.metadata().at("scale")));
  const auto q = cv(load(f, "q")), k = cv(load(f, "k")), v = cv(load(f, "v")), graw = cv(load(f, "g"));
  const auto braw = cv(load(f, "beta")), A_log = cv(load(f, "A_log")), dt = cv(load(f, "dt_bias"));
  const auto h0 = cv(load(f, "h0")), dO = cv(load(f, "do")), dht = cv(load(f, "dht"));

  std::vector<F> qn(q.size()), kn(k.size()), b(braw.size()), g(graw.size());
  l2norm_forward(q.data(), qn.data(), rows * H, K);
  l2norm_forward(k.data(), kn.data(), rows * H, K);
  sigmoid_forward(braw.data(), b.data(), rows * H);
  gate_forward(graw.data(), A_log.data(), dt.data(), g.data(), rows, H, K, gp);
  Dims d;
  d.B = B;
  d.T = T;
  d.H = H;
  d.K = K;
  d.V = V;
  const CoreInputs<F> in{qn.data(), kn.data(), v.data(), g.data(), b.data(), h0.data(), scale};
  std::vector<F> o(v.size()), ht(h0.size());
  reference_forward(in, d, o.data(), ht.data());

  std::vector<F> dqn(q.size()), dkn(k.size()), dv(v.size()), dg(g.size()), db(b.size()), dh0(h0.size());
  reference_backward(in, d, dO.data(), dht.data(),
                     CoreGrads<F>{dqn.data(), dkn.data(), dv.data(), dg.data(), db.data(), dh0.data()});
  std::vector<F> dq(q.size()), dk(k.size()), dgraw(g.size()), dbraw(b.size()), dA(A_log.size(), F(0)),
      ddt(dt.size(), F(0));
  l2norm_backward(q.data(), dqn.data(), dq.data(), rows * H, K);
  l2norm_backward(k.data(), dkn.data(), dk.data(), rows * H, K);
  sigmoid_backward(braw.data(), db.data(), dbraw.data(), rows * H);
  gate_backward(graw.data(), A_log.data(), dt.data(), dg.data(), dgraw.data(), dA.data(), ddt.data(), rows, H, K, gp);
  return {back(o), back(ht), back(dq), back(dk), back(dv), back(dgraw), back(dbraw), back(dA), back(ddt), back(dh0)};
}

template <class F>
void check_golden(double tol_out, double tol_grad, const char* label) {
  LM_REQUIRE_GOLDEN(dir);
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir + "/kda")) {
    if (entry.path().extension() != ".safetensors") continue;
    ++files;
    const auto f = io::SafeTensorsFile::open(entry.path().string());
    const std::vector<Vec> got = run_golden_chain<F>(f);
    const GoldenChain names;
    std::string line;
    for (size_t i = 0; i < names.names.size(); ++i) {
      const std::string& n = names.names[i];
      const double err = rel_rms_vec(load(f, n), got[i]);
      EXPECT_LT(err, i < 2 ? tol_out : tol_grad) << entry.path().filename() << " " << n;
      char buf[64];
      std::snprintf(buf, sizeof buf, " %s %.1e", n.c_str(), err);
      line += buf;
    }
    std::printf("[%s] %s:%s\n", label, entry.path().filename().string().c_str(), line.c_str());
  }
  EXPECT_GT(files, 0) << "no golden KDA files in " << dir << "/kda";
}

TEST(KdaReference, GoldenFloat64) { check_golden<double>(1e-6, 1e-5, "f64"); }
// The README's fp32 tolerance for op outputs and gradients.
TEST(KdaReference, GoldenFloat32) { check_golden<float>(1e-4, 1e-4, "f32"); }

}  // namespace
