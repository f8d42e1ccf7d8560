// Chunked KDA (bounded and exact diagonal paths) against the token-by-token reference, finite
// differences of its backward in float64, state carry-over, varlen, decode, extreme decays.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/kda/kda.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::kda;
using lm::testing::fd_check;
using lm::testing::randn;
using lm::testing::randu;
using lm::testing::rel_rms_vec;

namespace {

// Processed core inputs: unit-norm q, k, β in (0, 1), g from the chosen gate form.
template <class F>
struct Case {
  Dims d;
  std::vector<F> q, k, v, g, beta, h0, dO, dht;
  std::vector<int64_t> cu;
  F scale;
  GateParams gate;
  CoreInputs<F> in() const { return CoreInputs<F>{q.data(), k.data(), v.data(), g.data(), beta.data(), h0.data(), scale}; }
};

template <class F>
void unit_rows(std::vector<F>& x, int64_t D) {
  for (size_t r = 0; r < x.size() / D; ++r) {
    double s = 0;
    for (int64_t i = 0; i < D; ++i) s += double(x[r * D + i]) * x[r * D + i];
    for (int64_t i = 0; i < D; ++i) x[r * D + i] = F(x[r * D + i] / std::sqrt(s + 1e-6));
  }
}

template <class F>
Case<F> make_case(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, GateForm form, uint64_t seed,
                  std::vector<int64_t> cu = {}) {
  Case<F> c;
  c.d = Dims{B, T, H, K, V};
  c.cu = std::move(cu);
  if (!c.cu.empty()) {
    c.d.cu_seqlens = c.cu.data();
    c.d.N = static_cast<int64_t>(c.cu.size()) - 1;
  }
  const int64_t N = c.d.num_seqs(), rows = B * T;
  c.q = randn<F>(rows * H * K, seed + 1);
  c.k = randn<F>(rows * H * K, seed + 2);
  unit_rows(c.q, K);
  unit_rows(c.k, K);
  c.v = randn<F>(rows * H * V, seed + 3);
  c.beta = randu<F>(rows * H, seed + 4, 0.05, 0.95);
  c.gate.form = form;
  c.gate.lower_bound = -5.0;
  // Decays typical of the two gates: bounded in (-5, 0); softplus up to ~-8 with a heavy tail.
  const auto u = randu<F>(rows * H * K, seed + 5, 0.0, 1.0);
  c.g.resize(u.size());
  for (size_t i = 0; i < u.size(); ++i)
    c.g[i] = form == GateForm::LowerBound ? F(-5.0 * u[i] * u[i]) : F(-0.02 - 8.0 * std::pow(double(u[i]), 4.0));
  c.h0 = randn<F>(N * H * K * V, seed + 6, 0.1);
  c.dO = randn<F>(rows * H * V, seed + 7);
  c.dht = randn<F>(N * H * K * V, seed + 8);
  c.scale = F(1.0 / std::sqrt(double(K)));
  return c;
}

template <class F>
struct Out {
  std::vector<F> o, ht;
};
template <class F>
Out<F> run_ref(const Case<F>& c) {
  Out<F> r{std::vector<F>(c.v.size()), std::vector<F>(c.h0.size())};
  reference_forward(c.in(), c.d, r.o.data(), r.ht.data());
  return r;
}
template <class F>
Out<F> run_chunk(const Case<F>& c, DiagPath p) {
  Out<F> r{std::vector<F>(c.v.size()), std::vector<F>(c.h0.size())};
  chunk_forward(c.in(), c.d, r.o.data(), r.ht.data(), p, c.gate);
  return r;
}

template <class F>
struct Grads {
  std::vector<F> dq, dk, dv, dg, dbeta, dh0;
  explicit Grads(const Case<F>& c)
      : dq(c.q.size()), dk(c.k.size()), dv(c.v.size()), dg(c.g.size()), dbeta(c.beta.size()), dh0(c.h0.size()) {}
  CoreGrads<F> ptrs() { return CoreGrads<F>{dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), dh0.data()}; }
};

struct Shape5 {
  int64_t B, T, H, K, V;
};

}  // namespace

TEST(KdaChunk, ForwardMatchesReferenceFloat64) {
  for (GateForm form : {GateForm::LowerBound, GateForm::Softplus}) {
    for (Shape5 s : {Shape5{1, 1, 1, 8, 8}, Shape5{1, 7, 2, 16, 8}, Shape5{2, 16, 1, 8, 12}, Shape5{1, 64, 2, 16, 16},
                     Shape5{2, 100, 2, 32, 24}, Shape5{1, 200, 1, 16, 32}, Shape5{1, 129, 3, 8, 8}}) {
      const auto c = make_case<double>(s.B, s.T, s.H, s.K, s.V, form, 100 + s.T);
      const auto ref = run_ref(c);
      for (DiagPath p : {DiagPath::Exact, DiagPath::Bounded}) {
        if (p == DiagPath::Bounded && form == GateForm::Softplus) continue;
        const auto got = run_chunk(c, p);
        EXPECT_LT(rel_rms_vec(ref.o, got.o), 1e-12) << diag_path_name(p) << " T=" << s.T;
        EXPECT_LT(rel_rms_vec(ref.ht, got.ht), 1e-12) << diag_path_name(p) << " T=" << s.T;
      }
    }
  }
}

TEST(KdaChunk, Fp32MatchesFloat64Reference) {
  for (GateForm form : {GateForm::LowerBound, GateForm::Softplus}) {
    const auto c = make_case<double>(2, 150, 2, 32, 32, form, 7);
    auto cf = make_case<float>(2, 150, 2, 32, 32, form, 7);
    const auto ref = run_ref(c);
    for (DiagPath p : {DiagPath::Exact, DiagPath::Bounded}) {
      if (p == DiagPath::Bounded && form == GateForm::Softplus) continue;
      const auto got = run_chunk(cf, p);
      std::vector<double> o(got.o.begin(), got.o.end()), ht(got.ht.begin(), got.ht.end());
      EXPECT_LT(rel_rms_vec(ref.o, o), 2e-6) << diag_path_name(p);
      EXPECT_LT(rel_rms_vec(ref.ht, ht), 2e-6) << diag_path_name(p);
    }
  }
}

TEST(KdaChunk, BoundedRejectsSoftplusGate) {
  auto c = make_case<float>(1, 8, 1, 8, 8, GateForm::Softplus, 1);
  std::vector<float> o(c.v.size());
  EXPECT_THROW(chunk_forward(c.in(), c.d, o.data(), static_cast<float*>(nullptr), DiagPath::Bounded, c.gate), Error);
  EXPECT_EQ(resolve_diag_path(DiagPath::Auto, c.gate), DiagPath::Exact);
  EXPECT_EQ(resolve_diag_path(DiagPath::Auto, GateParams{GateForm::LowerBound, -5.0}), DiagPath::Bounded);
}

TEST(KdaChunk, BackwardMatchesReferenceBackward) {
  for (GateForm form : {GateForm::LowerBound, GateForm::Softplus}) {
    const auto c = make_case<double>(2, 90, 2, 16, 12, form, 31);
    Grads<double> gref(c), gch(c);
    reference_backward(c.in(), c.d, c.dO.data(), c.dht.data(), gref.ptrs());
    for (DiagPath p : {DiagPath::Exact, DiagPath::Bounded}) {
      if (p == DiagPath::Bounded && form == GateForm::Softplus) continue;
      chunk_backward(c.in(), c.d, c.dO.data(), c.dht.data(), gch.ptrs(), p, c.gate);
      EXPECT_LT(rel_rms_vec(gref.dq, gch.dq), 1e-11) << diag_path_name(p);
      EXPECT_LT(rel_rms_vec(gref.dk, gch.dk), 1e-11) << diag_path_name(p);
      EXPECT_LT(rel_rms_vec(gref.dv, gch.dv), 1e-11) << diag_path_name(p);
      EXPECT_LT(rel_rms_vec(gref.dg, gch.dg), 1e-11) << diag_path_name(p);
      EXPECT_LT(rel_rms_vec(gref.dbeta, gch.dbeta), 1e-11) << diag_path_name(p);
      EXPECT_LT(rel_rms_vec(gref.dh0, gch.dh0), 1e-11) << diag_path_name(p);
    }
  }
}

// Finite differences of L = sum(o * dO) + sum(ht * dht) through the chunked path itself.
TEST(KdaChunk, BackwardFiniteDifferencesFloat64) {
  for (GateForm form : {GateForm::LowerBound, GateForm::Softplus}) {
    for (DiagPath p : {DiagPath::Exact, DiagPath::Bounded}) {
      if (p == DiagPath::Bounded && form == GateForm::Softplus) continue;
      auto c = make_case<double>(1, 70, 2, 8, 8, form, 77);
      Grads<double> gr(c);
      chunk_backward(c.in(), c.d, c.dO.data(), c.dht.data(), gr.ptrs(), p, c.gate);
      auto loss = [&] {
        const auto r = run_chunk(c, p);
        return lm::testing::dot(r.o, c.dO) + lm::testing::dot(r.ht, c.dht);
      };
      EXPECT_LT(fd_check(c.q, gr.dq, loss), 1e-6) << "dq " << diag_path_name(p);
      EXPECT_LT(fd_check(c.k, gr.dk, loss), 1e-6) << "dk " << diag_path_name(p);
      EXPECT_LT(fd_check(c.v, gr.dv, loss), 1e-6) << "dv " << diag_path_name(p);
      EXPECT_LT(fd_check(c.g, gr.dg, loss), 1e-6) << "dg " << diag_path_name(p);
      EXPECT_LT(fd_check(c.beta, gr.dbeta, loss), 1e-6) << "dbeta " << diag_path_name(p);
      EXPECT_LT(fd_check(c.h0, gr.dh0, loss), 1e-6) << "dh0 " << diag_path_name(p);
    }
  }
}

TEST(KdaChunk, SplitWithCarriedStateEqualsOnePass) {
  for (GateForm form : {GateForm::LowerBound, GateForm::Softplus}) {
    const int64_t T = 150, H = 2, K = 16, V = 16;
    for (int64_t split : {1, 37, 64, 100, 149}) {
      const auto whole = make_case<float>(1, T, H, K, V, form, 5);
      const auto full = run_chunk(whole, DiagPath::Auto);
      // First part: rows [0, split), then the rest from its final state.
      auto part = [&](int64_t t0, int64_t t1, const std::vector<float>& h0) {
        Case<float> c = whole;
        c.d.T = t1 - t0;
        auto cut = [&](const std::vector<float>& x, int64_t w) {
          return std::vector<float>(x.begin() + t0 * H * w, x.begin() + t1 * H * w);
        };
        c.q = cut(whole.q, K);
        c.k = cut(whole.k, K);
        c.g = cut(whole.g, K);
        c.v = cut(whole.v, V);
        c.beta = cut(whole.beta, 1);
        c.h0 = h0;
        return run_chunk(c, DiagPath::Auto);
      };
      const auto a = part(0, split, whole.h0);
      const auto b = part(split, T, a.ht);
      std::vector<float> o(a.o);
      o.insert(o.end(), b.o.begin(), b.o.end());
      EXPECT_LT(rel_rms_vec(full.o, o), 1e-5) << "split " << split;
      EXPECT_LT(rel_rms_vec(full.ht, b.ht), 1e-5) << "split " << split;
    }
  }
}

TEST(KdaChunk, VarlenEqualsSeparateRuns) {
  const int64_t H = 2, K = 16, V = 8;
  const std::vector<int64_t> cu{0, 5, 70, 70, 200, 201};
  for (GateForm form : {GateForm::LowerBound, GateForm::Softplus}) {
    const auto packed = make_case<double>(1, 201, H, K, V, form, 9, cu);
    const auto out = run_chunk(packed, DiagPath::Auto);
    Grads<double> gp(packed);
    chunk_backward(packed.in(), packed.d, packed.dO.data(), packed.dht.data(), gp.ptrs(), DiagPath::Auto, packed.gate);
    for (size_t n = 0; n + 1 < cu.size(); ++n) {
      const int64_t t0 = cu[n], t1 = cu[n + 1], L = t1 - t0;
      Case<double> c = packed;
      c.cu.clear();
      c.d = Dims{1, L, H, K, V};
      auto cut = [&](const std::vector<double>& x, int64_t w) {
        return std::vector<double>(x.begin() + t0 * H * w, x.begin() + t1 * H * w);
      };
      auto cut_state = [&](const std::vector<double>& x) {
        return std::vector<double>(x.begin() + n * H * K * V, x.begin() + (n + 1) * H * K * V);
      };
      c.q = cut(packed.q, K), c.k = cut(packed.k, K), c.g = cut(packed.g, K), c.v = cut(packed.v, V);
      c.beta = cut(packed.beta, 1), c.dO = cut(packed.dO, V);
      c.h0 = cut_state(packed.h0), c.dht = cut_state(packed.dht);
      if (L == 0) {  // an empty sequence passes its state (and the state's gradient) through
        EXPECT_EQ(cut_state(out.ht), c.h0) << "seq " << n;
        EXPECT_EQ(cut_state(gp.dh0), c.dht) << "seq " << n;
        continue;
      }
      const auto r = run_ref(c);
      EXPECT_LT(rel_rms_vec(r.ht, cut_state(out.ht)), 1e-12) << "seq " << n;
      EXPECT_LT(rel_rms_vec(r.o, cut(out.o, V)), 1e-12) << "seq " << n;
      Grads<double> gs(c);
      reference_backward(c.in(), c.d, c.dO.data(), c.dht.data(), gs.ptrs());
      EXPECT_LT(rel_rms_vec(gs.dh0, cut_state(gp.dh0)), 1e-11) << "seq " << n;
      EXPECT_LT(rel_rms_vec(gs.dq, cut(gp.dq, K)), 1e-11) << "seq " << n;
      EXPECT_LT(rel_rms_vec(gs.dk, cut(gp.dk, K)), 1e-11) << "seq " << n;
      EXPECT_LT(rel_rms_vec(gs.dv, cut(gp.dv, V)), 1e-11) << "seq " << n;
      EXPECT_LT(rel_rms_vec(gs.dg, cut(gp.dg, K)), 1e-11) << "seq " << n;
      EXPECT_LT(rel_rms_vec(gs.dbeta, cut(gp.dbeta, 1)), 1e-11) << "seq " << n;
    }
  }
}

TEST(KdaChunk, DecodeStepsContinueChunkedPrefill) {
  const int64_t T = 100, P = 77, H = 2, K = 32, V = 32;
  const auto c = make_case<float>(1, T, H, K, V, GateForm::LowerBound, 12);
  const auto full = run_chunk(c, DiagPath::Bounded);
  Case<float> pre = c;
  pre.d.T = P;
  const auto pout = run_chunk(pre, DiagPath::Bounded);  // reads only the first P rows
  std::vector<float> S = pout.ht, o(H * V);
  double num = 0, den = 0;
  for (int64_t t = P; t < T; ++t) {
    decode_step(S.data(), &c.q[t * H * K], &c.k[t * H * K], &c.v[t * H * V], &c.g[t * H * K], &c.beta[t * H],
                o.data(), 1, H, K, V, c.scale);
    for (int64_t i = 0; i < H * V; ++i) {
      const double r = full.o[t * H * V + i];
      num += (r - o[i]) * (r - o[i]);
      den += r * r;
    }
  }
  EXPECT_LT(std::sqrt(num / den), 1e-5);
  EXPECT_LT(rel_rms_vec(full.ht, S), 1e-5);
  EXPECT_LT(rel_rms_vec(std::vector<float>(full.o.begin(), full.o.begin() + P * H * V),
                        std::vector<float>(pout.o.begin(), pout.o.begin() + P * H * V)),
            1e-6);
}

// The bounded path at the bound on every step: the diagonal tiles' factors reach e^{±37.5}.
TEST(KdaChunk, BoundedStaysAccurateAtTheBound) {
  auto c = make_case<double>(1, 256, 2, 32, 32, GateForm::LowerBound, 21);
  auto cf = make_case<float>(1, 256, 2, 32, 32, GateForm::LowerBound, 21);
  for (auto& x : cf.g) x = -5.0f + 1e-6f;  // g -> lb from above on every step and channel
  for (auto& x : c.g) x = double(-5.0f + 1e-6f);
  const auto ref = run_ref(c);
  const auto got = run_chunk(cf, DiagPath::Bounded);
  std::vector<double> o(got.o.begin(), got.o.end());
  for (float x : got.o) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LT(rel_rms_vec(ref.o, o), 1e-5);
  Grads<float> gr(cf);
  chunk_backward(cf.in(), cf.d, cf.dO.data(), cf.dht.data(), gr.ptrs(), DiagPath::Bounded, cf.gate);
  Grads<double> gref(c);
  reference_backward(c.in(), c.d, c.dO.data(), c.dht.data(), gref.ptrs());
  for (auto* v : {&gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dbeta, &gr.dh0})
    for (float x : *v) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LT(rel_rms_vec(gref.dq, std::vector<double>(gr.dq.begin(), gr.dq.end())), 1e-4);
  EXPECT_LT(rel_rms_vec(gref.dk, std::vector<double>(gr.dk.begin(), gr.dk.end())), 1e-4);
  EXPECT_LT(rel_rms_vec(gref.dg, std::vector<double>(gr.dg.begin(), gr.dg.end())), 1e-4);
}

// The exact path with g = -200 per step (only the softplus gate produces this): finite, and equal to
// the reference, where every past contribution has vanished.
TEST(KdaChunk, ExactStaysFiniteWithHugeDecay) {
  auto c = make_case<float>(1, 130, 2, 16, 16, GateForm::Softplus, 22);
  for (auto& x : c.g) x = -200.0f;
  const auto got = run_chunk(c, DiagPath::Exact);
  for (float x : got.o) ASSERT_TRUE(std::isfinite(x));
  for (float x : got.ht) ASSERT_TRUE(std::isfinite(x));
  const auto ref = run_ref(c);
  EXPECT_LT(rel_rms_vec(ref.o, got.o), 1e-5);
  Grads<float> gr(c);
  chunk_backward(c.in(), c.d, c.dO.data(), c.dht.data(), gr.ptrs(), DiagPath::Exact, c.gate);
  for (auto* v : {&gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dbeta, &gr.dh0})
    for (float x : *v) ASSERT_TRUE(std::isfinite(x));
}

// Backward from the chunk-start states saved by forward equals backward that recomputes them.
TEST(KdaChunk, SavedChunkStatesGiveTheSameBackward) {
  const std::vector<int64_t> cu{0, 10, 10, 150, 215};
  for (GateForm form : {GateForm::LowerBound, GateForm::Softplus}) {
    const auto c = make_case<double>(1, 215, 2, 16, 8, form, 41, cu);
    const int64_t n_states = chunk_state_count(c.d);
    EXPECT_EQ(n_states, 2 * (1 + 0 + 3 + 2));
    std::vector<double> states(n_states * 16 * 8, -1.0), o(c.v.size()), ht(c.h0.size());
    chunk_forward(c.in(), c.d, o.data(), ht.data(), DiagPath::Auto, c.gate, states.data());
    Grads<double> a(c), b(c);
    chunk_backward(c.in(), c.d, c.dO.data(), c.dht.data(), a.ptrs(), DiagPath::Auto, c.gate);
    chunk_backward(c.in(), c.d, c.dO.data(), c.dht.data(), b.ptrs(), DiagPath::Auto, c.gate,
                   static_cast<const double*>(states.data()));
    EXPECT_EQ(a.dq, b.dq);
    EXPECT_EQ(a.dg, b.dg);
    EXPECT_EQ(a.dh0, b.dh0);
    EXPECT_EQ(a.dbeta, b.dbeta);
  }
}
