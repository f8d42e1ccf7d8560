// Causal attention: tiled forward/backward against the naive definition, finite differences, varlen,
// thread-count determinism, and the absorbed MLA decode against the expanded form.
// T tokens, H heads, Hkv kv heads, Dk q/k head dim, Dv v head dim, Bq/Bk tile sizes, R kv_lora_rank, Dr rope.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/attention/attention.hpp"
#include "tests/testing.hpp"

using namespace lm;
using namespace lm::ops;
using lm::testing::randn;
using lm::testing::rel_rms_vec;

namespace {

struct Case {
  const char* name;
  int64_t B, T, H, Hkv, Dk, Dv, bq, bk;
  std::vector<int64_t> lens;  // non-empty: varlen (B == 1, T = sum)
};

struct Problem {
  AttnDims d;
  std::vector<int64_t> cu;
  std::vector<double> q, k, v, dout;
  double scale;
};

Problem make(const Case& c, uint64_t seed) {
  Problem p;
  p.d = AttnDims{c.B, c.T, c.H, c.Hkv, c.Dk, c.Dv};
  if (!c.lens.empty()) {
    p.cu.push_back(0);
    for (int64_t L : c.lens) p.cu.push_back(p.cu.back() + L);
    p.d.B = 1;
    p.d.T = p.cu.back();
    p.d.cu_seqlens = p.cu.data();
    p.d.N = static_cast<int64_t>(c.lens.size());
  }
  const auto rows = static_cast<size_t>(p.d.rows());
  const auto H = static_cast<size_t>(p.d.H), Hkv = static_cast<size_t>(p.d.kv_heads());
  p.q = randn(rows * H * static_cast<size_t>(c.Dk), seed);
  p.k = randn(rows * Hkv * static_cast<size_t>(c.Dk), seed + 1);
  p.v = randn(rows * Hkv * static_cast<size_t>(c.Dv), seed + 2);
  p.dout = randn(rows * H * static_cast<size_t>(c.Dv), seed + 3);
  p.scale = 1.0 / std::sqrt(double(c.Dk));
  return p;
}

template <class F>
std::vector<F> cast(const std::vector<double>& x) {
  return std::vector<F>(x.begin(), x.end());
}

const std::vector<Case>& cases() {
  static const std::vector<Case> cs = {
      {"T1", 1, 1, 1, 0, 48, 32, 0, 0, {}},
      {"T_lt_tile", 1, 5, 2, 0, 48, 32, 0, 0, {}},
      {"T_exact_tile", 1, 64, 2, 0, 48, 32, 64, 64, {}},
      {"T_not_multiple_bq_gt_bk", 1, 100, 3, 0, 48, 32, 32, 16, {}},
      {"bq_lt_bk", 1, 77, 2, 0, 48, 32, 16, 48, {}},
      {"batch2_k3_dims", 2, 130, 2, 0, 192, 128, 0, 0, {}},
      {"gqa", 1, 50, 4, 2, 48, 32, 16, 16, {}},
      {"odd_dims", 1, 37, 2, 0, 20, 24, 8, 16, {}},
      {"tiny_dims", 1, 19, 1, 0, 1, 1, 4, 16, {}},
      {"varlen", 1, 0, 2, 0, 48, 32, 16, 32, {5, 0, 64, 1, 40}},
      {"varlen_gqa", 1, 0, 4, 1, 32, 48, 24, 16, {33, 17, 2}},
  };
  return cs;
}

template <class F>
void run_forward(const Problem& p, const AttnConfig& cfg, std::vector<F>& o, std::vector<F>& lse) {
  const auto q = cast<F>(p.q), k = cast<F>(p.k), v = cast<F>(p.v);
  o.assign(static_cast<size_t>(p.d.rows() * p.d.H * p.d.Dv), F(0));
  lse.assign(static_cast<size_t>(p.d.rows() * p.d.H), F(0));
  attention_forward<F>(q.data(), k.data(), v.data(), o.data(), lse.data(), p.d, F(p.scale), cfg);
}

template <class F>
void run_backward(const Problem& p, const AttnConfig& cfg, std::vector<F>& dq, std::vector<F>& dk, std::vector<F>& dv) {
  std::vector<F> o, lse;
  run_forward<F>(p, cfg, o, lse);
  const auto q = cast<F>(p.q), k = cast<F>(p.k), v = cast<F>(p.v), dout = cast<F>(p.dout);
  dq.assign(q.size(), F(0));
  dk.assign(k.size(), F(0));
  dv.assign(v.size(), F(0));
  attention_backward<F>(q.data(), k.data(), v.data(), o.data(), lse.data(), dout.data(), dq.data(), dk.data(),
                        dv.data(), p.d, F(p.scale), cfg);
}

struct RefOut {
  std::vector<double> o, lse, dq, dk, dv;
};
RefOut reference(const Problem& p) {
  RefOut r;
  r.o.resize(static_cast<size_t>(p.d.rows() * p.d.H * p.d.Dv));
  r.lse.resize(static_cast<size_t>(p.d.rows() * p.d.H));
  attention_reference<double>(p.q.data(), p.k.data(), p.v.data(), r.o.data(), r.lse.data(), p.d, p.scale);
  r.dq.resize(p.q.size());
  r.dk.resize(p.k.size());
  r.dv.resize(p.v.size());
  attention_reference_backward<double>(p.q.data(), p.k.data(), p.v.data(), p.dout.data(), r.dq.data(), r.dk.data(),
                                       r.dv.data(), p.d, p.scale);
  return r;
}

template <class F>
std::vector<double> up(const std::vector<F>& x) {
  return std::vector<double>(x.begin(), x.end());
}

// Relative RMS error, or the absolute RMS where the reference is exactly zero (T = 1: dq = dk = 0).
template <class F>
double err(const std::vector<double>& ref, const std::vector<F>& x) {
  if (lm::testing::dot(ref, ref) > 0) return rel_rms_vec(ref, up(x));
  const auto u = up(x);
  return std::sqrt(lm::testing::dot(u, u) / double(std::max<size_t>(1, u.size())));
}

}  // namespace

TEST(Attention, ForwardMatchesReference) {
  for (const Case& c : cases()) {
    const Problem p = make(c, 100);
    const RefOut r = reference(p);
    for (int64_t group : {1, 3, 0}) {  // tiles per work item (0: default)
      SCOPED_TRACE(::testing::Message() << c.name << " group " << group);
      const AttnConfig cfg{c.bq, c.bk, AttnBwdSplit::Auto, group};
      std::vector<double> o64, lse64;
      run_forward<double>(p, cfg, o64, lse64);
      const double e64 = rel_rms_vec(r.o, o64), l64 = rel_rms_vec(r.lse, lse64);
      std::vector<float> o32, lse32;
      run_forward<float>(p, cfg, o32, lse32);
      const double e32 = rel_rms_vec(r.o, up(o32)), l32 = rel_rms_vec(r.lse, up(lse32));
      EXPECT_LT(e64, 1e-12);
      EXPECT_LT(l64, 1e-12);
      EXPECT_LT(e32, 1e-5);
      EXPECT_LT(l32, 1e-5);
      std::printf("  fwd %-24s g%ld o f64 %.1e f32 %.1e | lse f64 %.1e f32 %.1e\n", c.name, long(group), e64, e32, l64,
                  l32);
    }
  }
}

TEST(Attention, ReferenceBackwardMatchesFiniteDifferences) {
  const Problem p = make({"fd", 1, 0, 2, 1, 12, 10, 0, 0, {7, 9}}, 7);
  const RefOut r = reference(p);
  Problem w = p;
  std::vector<double> o(r.o.size());
  auto loss = [&]() {
    attention_reference<double>(w.q.data(), w.k.data(), w.v.data(), o.data(), nullptr, w.d, w.scale);
    return lm::testing::dot(o, w.dout);
  };
  const double eq = lm::testing::fd_check(w.q, r.dq, loss, 40);
  const double ek = lm::testing::fd_check(w.k, r.dk, loss, 40);
  const double ev = lm::testing::fd_check(w.v, r.dv, loss, 40);
  std::printf("  reference backward vs FD: dq %.1e dk %.1e dv %.1e\n", eq, ek, ev);
  EXPECT_LT(eq, 1e-8);
  EXPECT_LT(ek, 1e-8);
  EXPECT_LT(ev, 1e-8);
}

TEST(Attention, TiledBackwardMatchesFiniteDifferences) {
  for (AttnBwdSplit split : {AttnBwdSplit::PerHead, AttnBwdSplit::TwoPass}) {
    const Problem p = make({"fd", 1, 0, 4, 2, 24, 16, 8, 16, {21, 40}}, 11);
    AttnConfig cfg{8, 16, split};
    std::vector<double> dq, dk, dv;
    run_backward<double>(p, cfg, dq, dk, dv);
    Problem w = p;
    std::vector<double> o(static_cast<size_t>(p.d.rows() * p.d.H * p.d.Dv));
    auto loss = [&]() {
      attention_forward<double>(w.q.data(), w.k.data(), w.v.data(), o.data(), nullptr, w.d, w.scale, cfg);
      return lm::testing::dot(o, w.dout);
    };
    // h = 1e-5: truncation O(h²) ~ 1e-10 while the loss's rounding (~1e-14 over ~1e3 terms) / h stays small.
    const double eq = lm::testing::fd_check(w.q, dq, loss, 48, 1e-5);
    const double ek = lm::testing::fd_check(w.k, dk, loss, 48, 1e-5);
    const double ev = lm::testing::fd_check(w.v, dv, loss, 48, 1e-5);
    std::printf("  tiled backward (%s) vs FD: dq %.1e dk %.1e dv %.1e\n",
                split == AttnBwdSplit::PerHead ? "per-head" : "two-pass", eq, ek, ev);
    EXPECT_LT(eq, 1e-7);
    EXPECT_LT(ek, 1e-7);
    EXPECT_LT(ev, 1e-7);
  }
}

TEST(Attention, BackwardMatchesReference) {
  for (const Case& c : cases()) {
    const Problem p = make(c, 200);
    const RefOut r = reference(p);
    for (AttnBwdSplit split : {AttnBwdSplit::PerHead, AttnBwdSplit::TwoPass}) {
      const char* sname = split == AttnBwdSplit::PerHead ? "per-head" : "two-pass";
      const int64_t group = split == AttnBwdSplit::PerHead ? 3 : 1;  // 0 (default) is covered by the FD test
      SCOPED_TRACE(std::string(c.name) + " " + sname);
      const AttnConfig cfg{c.bq, c.bk, split, group};
      std::vector<double> dq, dk, dv;
      run_backward<double>(p, cfg, dq, dk, dv);
      std::vector<float> fq, fk, fv;
      run_backward<float>(p, cfg, fq, fk, fv);
      const double e[6] = {err(r.dq, dq), err(r.dk, dk), err(r.dv, dv), err(r.dq, fq), err(r.dk, fk), err(r.dv, fv)};
      for (int i = 0; i < 3; ++i) EXPECT_LT(e[i], 1e-12) << i;
      for (int i = 3; i < 6; ++i) EXPECT_LT(e[i], 1e-5) << i;
      std::printf("  bwd %-24s %-8s g%ld f64 dq %.1e dk %.1e dv %.1e | f32 dq %.1e dk %.1e dv %.1e\n", c.name, sname, long(group), e[0],
                  e[1], e[2], e[3], e[4], e[5]);
    }
  }
}

// Packed sequences give exactly what separate runs give (the tiles restart at each sequence).
TEST(Attention, VarlenEqualsSeparateRuns) {
  const std::vector<int64_t> lens = {70, 1, 0, 33, 128};
  const Problem p = make({"varlen", 1, 0, 3, 0, 48, 32, 32, 32, lens}, 300);
  const AttnConfig cfg{32, 32};
  std::vector<float> o, lse, dq, dk, dv;
  run_forward<float>(p, cfg, o, lse);
  run_backward<float>(p, cfg, dq, dk, dv);
  const int64_t H = p.d.H, Dk = p.d.Dk, Dv = p.d.Dv;
  for (size_t n = 0; n < lens.size(); ++n) {
    if (lens[n] == 0) continue;
    const int64_t s0 = p.cu[n], L = lens[n];
    Problem s;
    s.d = AttnDims{1, L, H, 0, Dk, Dv};
    s.scale = p.scale;
    auto sub = [&](const std::vector<double>& x, int64_t width) {
      return std::vector<double>(x.begin() + s0 * width, x.begin() + (s0 + L) * width);
    };
    s.q = sub(p.q, H * Dk);
    s.k = sub(p.k, H * Dk);
    s.v = sub(p.v, H * Dv);
    s.dout = sub(p.dout, H * Dv);
    std::vector<float> so, slse, sdq, sdk, sdv;
    run_forward<float>(s, cfg, so, slse);
    run_backward<float>(s, cfg, sdq, sdk, sdv);
    auto same = [&](const std::vector<float>& packed, const std::vector<float>& single, int64_t width) {
      return std::equal(single.begin(), single.end(), packed.begin() + s0 * width);
    };
    EXPECT_TRUE(same(o, so, H * Dv)) << n;
    EXPECT_TRUE(same(lse, slse, H)) << n;
    EXPECT_TRUE(same(dq, sdq, H * Dk)) << n;
    EXPECT_TRUE(same(dk, sdk, H * Dk)) << n;
    EXPECT_TRUE(same(dv, sdv, H * Dv)) << n;
  }
  // B × T layout equals the same sequences packed.
  const Problem b = make({"batch", 3, 45, 2, 0, 16, 16, 16, 16, {}}, 400);
  Problem v = b;
  v.cu = {0, 45, 90, 135};
  v.d = AttnDims{1, 135, 2, 0, 16, 16, v.cu.data(), 3};
  std::vector<float> ob, lb, ov, lv;
  run_forward<float>(b, {16, 16}, ob, lb);
  run_forward<float>(v, {16, 16}, ov, lv);
  EXPECT_EQ(ob, ov);
  EXPECT_EQ(lb, lv);
}

// Work is split by items that own their outputs: the thread count does not change a single bit.
TEST(Attention, DeterministicAcrossThreadCounts) {
  const Problem p = make({"det", 1, 0, 4, 2, 48, 32, 32, 32, {150, 37, 90}}, 500);
  const int saved = num_threads();
  for (AttnBwdSplit split : {AttnBwdSplit::PerHead, AttnBwdSplit::TwoPass}) {
    const AttnConfig cfg{32, 32, split};
    std::vector<float> o[2], lse[2], dq[2], dk[2], dv[2];
    for (int t = 0; t < 2; ++t) {
      set_num_threads(t == 0 ? 1 : std::max(2, saved));
      run_forward<float>(p, cfg, o[t], lse[t]);
      run_backward<float>(p, cfg, dq[t], dk[t], dv[t]);
    }
    EXPECT_EQ(o[0], o[1]);
    EXPECT_EQ(lse[0], lse[1]);
    EXPECT_EQ(dq[0], dq[1]);
    EXPECT_EQ(dk[0], dk[1]);
    EXPECT_EQ(dv[0], dv[1]);
  }
  set_num_threads(saved);
}

// Large logits: the online softmax must not overflow where exp(scale·q·k) would.
TEST(Attention, LargeScoresStayFinite) {
  Problem p = make({"big", 1, 90, 2, 0, 32, 16, 16, 16, {}}, 600);
  for (double& x : p.q) x *= 30;
  const RefOut r = reference(p);
  std::vector<float> o, lse;
  run_forward<float>(p, {16, 16}, o, lse);
  EXPECT_LT(rel_rms_vec(r.o, up(o)), 1e-5);
  EXPECT_LT(rel_rms_vec(r.lse, up(lse)), 1e-5);
  std::vector<double> dq, dk, dv;
  run_backward<double>(p, {16, 16}, dq, dk, dv);
  EXPECT_LT(rel_rms_vec(r.dq, dq), 1e-11);
  EXPECT_LT(rel_rms_vec(r.dk, dk), 1e-11);
  EXPECT_LT(rel_rms_vec(r.dv, dv), 1e-11);
}

TEST(Attention, EmptyInputIsANoOp) {
  float x = 0;
  EXPECT_NO_THROW(attention_forward<float>(&x, &x, &x, &x, &x, AttnDims{1, 0, 2, 0, 8, 8}, 1.f));
  EXPECT_NO_THROW(attention_backward<float>(&x, &x, &x, &x, &x, &x, &x, &x, &x, AttnDims{1, 0, 2, 0, 8, 8}, 1.f));
}

TEST(Attention, RejectsBadShapes) {
  std::vector<float> x(1024);
  float* f = x.data();
  EXPECT_THROW(attention_forward<float>(f, f, f, f, f, AttnDims{1, 4, 3, 2, 8, 8}, 1.f), Error);  // H % Hkv
  std::vector<int64_t> cu = {0, 3, 5};
  EXPECT_THROW(attention_forward<float>(f, f, f, f, f, AttnDims{1, 6, 1, 0, 8, 8, cu.data(), 2}, 1.f), Error);
  EXPECT_THROW(attention_forward<float>(f, f, f, f, f, AttnDims{2, 5, 1, 0, 8, 8, cu.data(), 2}, 1.f), Error);
  EXPECT_THROW(attention_forward<float>(f, f, f, f, f, AttnDims{1, 4, 1, 0, 8, 8}, 1.f, {16, 24}), Error);  // bk % 16
  EXPECT_THROW(attention_backward<float>(f, f, f, f, nullptr, f, f, f, f, AttnDims{1, 4, 1, 0, 8, 8}, 1.f), Error);
  EXPECT_THROW(mla_decode_absorbed<float>(f, f, f, f, f, f, DecodeDims{2, 4, 8, 4, 6, 0, 256}, 1.f), Error);  // ldc < R
}

// ---- absorbed decode --------------------------------------------------------------------------------
namespace {

struct DecodeCase {
  int64_t H, Tc, R, Dn, Dr, Dv, chunk;
};

// Expanded MLA for the last query row vs the absorbed form over a latent cache [Tc, R + Dr] (c and k_r
// interleaved, as the decode cache stores them). Returns the rel RMS errors of o and lse.
template <class F>
std::pair<double, double> decode_vs_expanded(const DecodeCase& c, uint64_t seed) {
  const int64_t H = c.H, Tc = c.Tc, R = c.R, Dn = c.Dn, Dr = c.Dr, Dv = c.Dv, Dk = Dn + Dr, W = R + Dr;
  const auto cache = randn(static_cast<size_t>(Tc * W), seed);
  const auto W_UK = randn(static_cast<size_t>(H * Dn * R), seed + 1, 1.0 / std::sqrt(double(R)));
  const auto W_UV = randn(static_cast<size_t>(H * Dv * R), seed + 2, 1.0 / std::sqrt(double(R)));
  const auto q_last = randn(static_cast<size_t>(H * Dk), seed + 3);  // [q_nope ; q_rope] per head
  const double scale = 1.0 / std::sqrt(double(Dk));

  // Expanded: k_h[t] = [W_UK,h c_t ; k_r,t], v_h[t] = W_UV,h c_t; only the last query row is compared.
  std::vector<double> q(static_cast<size_t>(Tc * H * Dk), 0.0), k(q.size()), v(static_cast<size_t>(Tc * H * Dv));
  for (int64_t t = 0; t < Tc; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const double* ct = cache.data() + t * W;
      for (int64_t e = 0; e < Dn; ++e) {
        double s = 0;
        for (int64_t a = 0; a < R; ++a) s += W_UK[static_cast<size_t>((h * Dn + e) * R + a)] * ct[a];
        k[static_cast<size_t>((t * H + h) * Dk + e)] = s;
      }
      for (int64_t e = 0; e < Dr; ++e) k[static_cast<size_t>((t * H + h) * Dk + Dn + e)] = ct[R + e];
      for (int64_t e = 0; e < Dv; ++e) {
        double s = 0;
        for (int64_t a = 0; a < R; ++a) s += W_UV[static_cast<size_t>((h * Dv + e) * R + a)] * ct[a];
        v[static_cast<size_t>((t * H + h) * Dv + e)] = s;
      }
    }
  std::copy(q_last.begin(), q_last.end(), q.begin() + (Tc - 1) * H * Dk);
  std::vector<double> o(v.size()), lse(static_cast<size_t>(Tc * H));
  attention_reference<double>(q.data(), k.data(), v.data(), o.data(), lse.data(), AttnDims{1, Tc, H, 0, Dk, Dv}, scale);
  const std::vector<double> o_ref(o.begin() + (Tc - 1) * H * Dv, o.end()), lse_ref(lse.end() - H, lse.end());

  // Absorbed: q̃_h = W_UK,hᵀ q_nope,h, attention over the latent, o_h = W_UV,h ō_h.
  std::vector<F> q_lat(static_cast<size_t>(H * R)), q_rope(static_cast<size_t>(H * Dr));
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t a = 0; a < R; ++a) {
      double s = 0;
      for (int64_t e = 0; e < Dn; ++e) s += W_UK[static_cast<size_t>((h * Dn + e) * R + a)] * q_last[static_cast<size_t>(h * Dk + e)];
      q_lat[static_cast<size_t>(h * R + a)] = F(s);
    }
    for (int64_t e = 0; e < Dr; ++e) q_rope[static_cast<size_t>(h * Dr + e)] = F(q_last[static_cast<size_t>(h * Dk + Dn + e)]);
  }
  const auto cacheF = cast<F>(cache);
  std::vector<F> o_lat(static_cast<size_t>(H * R)), lse_d(static_cast<size_t>(H));
  mla_decode_absorbed<F>(q_lat.data(), q_rope.data(), cacheF.data(), cacheF.data() + R, o_lat.data(), lse_d.data(),
                         DecodeDims{H, Tc, R, Dr, W, W, c.chunk}, F(scale));
  std::vector<double> o_abs(static_cast<size_t>(H * Dv));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t e = 0; e < Dv; ++e) {
      double s = 0;
      for (int64_t a = 0; a < R; ++a) s += W_UV[static_cast<size_t>((h * Dv + e) * R + a)] * double(o_lat[static_cast<size_t>(h * R + a)]);
      o_abs[static_cast<size_t>(h * Dv + e)] = s;
    }
  return {rel_rms_vec(o_ref, o_abs), rel_rms_vec(lse_ref, up(lse_d))};
}

}  // namespace

TEST(Attention, AbsorbedDecodeEqualsExpanded) {
  const std::vector<DecodeCase> cs = {
      {4, 37, 32, 32, 16, 32, 8},      // tiny goldens' MLA dims, several chunks + a partial one
      {4, 37, 32, 32, 16, 32, 256},    // one chunk
      {2, 1, 32, 32, 16, 32, 8},       // a single cached position
      {3, 50, 24, 16, 0, 8, 7},        // no rope part
      {4, 300, 512, 128, 64, 128, 64},  // K3 dims
  };
  for (const auto& c : cs) {
    SCOPED_TRACE(::testing::Message() << "H" << c.H << " Tc" << c.Tc << " R" << c.R << " chunk" << c.chunk);
    const auto [o64, l64] = decode_vs_expanded<double>(c, 900);
    const auto [o32, l32] = decode_vs_expanded<float>(c, 900);
    EXPECT_LT(o64, 1e-12);
    EXPECT_LT(l64, 1e-12);
    EXPECT_LT(o32, 1e-5);
    EXPECT_LT(l32, 1e-5);
    std::printf("  decode H%ld Tc%ld R%ld Dr%ld chunk%ld: o f64 %.1e f32 %.1e | lse f64 %.1e f32 %.1e\n", long(c.H),
                long(c.Tc), long(c.R), long(c.Dr), long(c.chunk), o64, o32, l64, l32);
  }
}

// ---- absorbed prefill ---------------------------------------------------------------------------------
// A chunk of n queries at positions p .. p+n-1 over a latent cache [p + n, R + Dr] against the softmax written out in
// float64: a long chunk (its query tiles run in parallel) and short chunks far into the context (few tiles: the keys
// are split into segments whose softmax states are merged), in float64 and float; the result does not depend on the
// thread count.
TEST(Attention, AbsorbedPrefillEqualsTheDefinition) {
  const int64_t H = 4, R = 16, Dr = 8, RD = R + Dr;
  for (const auto& [p, n] : std::vector<std::pair<int64_t, int64_t>>{{300, 200}, {5000, 8}, {4100, 40}, {0, 3}}) {
    const std::vector<double> q = randn<double>(n * H * RD, 11), c = randn<double>((p + n) * RD, 12);
    const double scale = 0.3;
    std::vector<double> want(static_cast<size_t>(n * H * R), 0.0);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const double* qr = q.data() + (t * H + h) * RD;
        std::vector<double> s(static_cast<size_t>(p + t + 1));
        double mx = -1e300, sum = 0;
        for (int64_t k = 0; k <= p + t; ++k) {
          double d = 0;
          for (int64_t e = 0; e < RD; ++e) d += qr[e] * c[k * RD + e];
          s[k] = d * scale, mx = std::max(mx, s[k]);
        }
        for (auto& x : s) sum += (x = std::exp(x - mx));
        for (int64_t k = 0; k <= p + t; ++k)
          for (int64_t e = 0; e < R; ++e) want[(t * H + h) * R + e] += s[k] / sum * c[k * RD + e];
      }
    std::vector<double> got(want.size());
    mla_prefill_absorbed<double>(q.data(), c.data(), p, n, H, R, Dr, scale, got.data());
    EXPECT_LT(rel_rms_vec(got, want), 1e-12) << "p " << p << " n " << n;
    const std::vector<float> qf(q.begin(), q.end()), cf(c.begin(), c.end());
    std::vector<float> gf(want.size()), g1(want.size());
    mla_prefill_absorbed<float>(qf.data(), cf.data(), p, n, H, R, Dr, float(scale), gf.data());
    EXPECT_LT(rel_rms_vec(std::vector<double>(gf.begin(), gf.end()), want), 1e-5) << "p " << p << " n " << n;
    const int threads = num_threads();
    set_num_threads(1);
    mla_prefill_absorbed<float>(qf.data(), cf.data(), p, n, H, R, Dr, float(scale), g1.data());
    set_num_threads(threads);
    EXPECT_EQ(gf, g1) << "p " << p << " n " << n;
  }
}
