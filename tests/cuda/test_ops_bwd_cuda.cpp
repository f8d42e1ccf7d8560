// GPU training-step operators against the CPU fp32 definitions: LM head + cross-entropy, SiTU/SwiGLU
// forward and backward, the KDA short convolution (B×T and varlen), and the MoE backward pieces (combine,
// gather, router). Inputs the GPU reads in bf16 are rounded to bf16 on the host before the CPU reference.
// Skips without a CUDA device.
//
// Legend: T tokens, d hidden, V vocabulary, Bt token block; rows, I GLU width; B, T, C, W, N conv batch,
//         tokens, channels, taps, sequences; m tokens, n experts, k experts per token, M = m·k, d row width.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/half.hpp"
#include "ops/cross_entropy/cross_entropy.hpp"
#include "ops/cross_entropy/cuda/cross_entropy_cuda.hpp"
#include "ops/glu/cuda/glu_cuda.hpp"
#include "ops/glu/glu.hpp"
#include "ops/kda/cuda/kda_cuda.hpp"  // device helpers (alloc, copies)
#include "ops/kda/cuda/short_conv_cuda.hpp"
#include "ops/kda/kda.hpp"
#include "ops/moe/cuda/moe_cuda.hpp"
#include "ops/moe/permute.hpp"
#include "ops/moe/router.hpp"
#include "cuda_testing.hpp"
#include "testing.hpp"

using namespace lm;
namespace kc = lm::kda::cuda;
namespace oc = lm::ops::cuda;
using namespace lm::cuda_testing;  // Dev, Vec, copies, err

namespace {

Vec minus(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

// k distinct experts of n per token, each row sorted ascending (as the router emits them).
std::vector<int32_t> random_topk(int64_t m, int64_t n, int64_t k, uint64_t seed) {
  std::vector<int32_t> idx(size_t(m * k));
  const Vec u = lm::testing::randu<float>(size_t(m * n), seed, 0.0, 1.0);
  for (int64_t i = 0; i < m; ++i) {
    std::vector<int32_t> e(static_cast<size_t>(n));
    std::iota(e.begin(), e.end(), 0);
    std::stable_sort(e.begin(), e.end(),
                     [&](int32_t a, int32_t b) { return u[size_t(i * n + a)] < u[size_t(i * n + b)]; });
    std::sort(e.begin(), e.begin() + k);
    std::copy(e.begin(), e.begin() + k, idx.begin() + i * k);
  }
  return idx;
}

}  // namespace

// ---- LM head + cross-entropy ----------------------------------------------------------------------

TEST(OpsBwdCuda, CrossEntropy) {
  REQUIRE_GPU();
  struct CC {
    int64_t T, d, V, Bt;
    int ignore_every;  // every n-th target ignored (0: none)
  };
  // V = 1003: not a multiple of the row kernel's vector width nor of 8 (padded scratch rows); T not a multiple
  // of Bt; Bt 0 (auto: one block here); a block of one token.
  for (const CC cc : {CC{300, 64, 1003, 128, 7}, CC{257, 128, 4096, 0, 0}, CC{40, 32, 515, 1, 3}}) {
    const Vec h = round_bf16(lm::testing::randn<float>(size_t(cc.T * cc.d), uint64_t(cc.V + 1), 1.0));
    const Vec W = round_bf16(lm::testing::randn<float>(size_t(cc.V * cc.d), uint64_t(cc.V + 2), 0.15));
    const Vec u = lm::testing::randu<float>(size_t(cc.T), uint64_t(cc.V + 3), 0.0, 1.0);
    std::vector<int32_t> tg(size_t(cc.T));
    for (int64_t t = 0; t < cc.T; ++t)
      tg[size_t(t)] = (cc.ignore_every && t % cc.ignore_every == 1)
                          ? -100
                          : std::min<int32_t>(int32_t(u[size_t(t)] * float(cc.V)), int32_t(cc.V - 1));
    const int64_t n_valid = ops::cross_entropy_count_valid(tg.data(), cc.T, cc.V);
    const float scale = 1.f / float(n_valid);
    const Vec dW0 = lm::testing::randn<float>(size_t(cc.V * cc.d), uint64_t(cc.V + 4), 1e-3);  // dW accumulates
    Vec dh_ref(size_t(cc.T * cc.d)), dW_ref = dW0;
    const ops::CeStats st = ops::cross_entropy_forward_backward<float>(h.data(), W.data(), tg.data(), cc.T, cc.d, cc.V,
                                                                       scale, dh_ref.data(), dW_ref.data());

    Dev gh(h.size() * 2), gW(W.size() * 2), gt(tg.size() * 4), gdh(dh_ref.size() * 4), gdW(dW0.size() * 4);
    up_bf16(gh, h), up_bf16(gW, W), up(gt, tg), up(gdW, dW0);
    const oc::CeResult r = oc::cross_entropy_forward_backward(gh.p, gW.p, gt.i(), cc.T, cc.d, cc.V, scale, gdh.f(),
                                                              gdW.f(), cc.Bt);
    const Vec dh = down<float>(gdh, dh_ref.size()), dW = down<float>(gdW, dW0.size());
    const oc::CeResult rf = oc::cross_entropy_forward(gh.p, gW.p, gt.i(), cc.T, cc.d, cc.V, cc.Bt);
    kc::synchronize();

    EXPECT_EQ(r.n_valid, st.n_valid);
    EXPECT_EQ(rf.n_valid, st.n_valid);
    const double mean_ref = st.mean(), mean = r.loss_sum / double(r.n_valid);
    const double e_loss = std::fabs(mean - mean_ref) / std::fabs(mean_ref);
    const double e_lossf = std::fabs(rf.loss_sum / double(rf.n_valid) - mean_ref) / std::fabs(mean_ref);
    const double e_dh = err(dh_ref, dh), e_dW = err(minus(dW_ref, dW0), minus(dW, dW0));
    std::printf("CE T%lld d%lld V%lld Bt%lld: loss %.6f (ref %.6f) rel %.1e fwd-only %.1e, dh %.2e, dW %.2e\n",
                (long long)cc.T, (long long)cc.d, (long long)cc.V, (long long)cc.Bt, mean, mean_ref, e_loss, e_lossf,
                e_dh, e_dW);
    EXPECT_LE(e_loss, 1e-3);
    EXPECT_LE(e_lossf, 1e-3);
    EXPECT_EQ(r.loss_sum, rf.loss_sum);  // same logits, same row kernel, fixed summation order
    EXPECT_LE(e_dh, 1e-2);
    EXPECT_LE(e_dW, 1e-2);
    for (int64_t t = 0; t < cc.T; ++t) {
      if (tg[size_t(t)] >= 0) continue;
      for (int64_t c = 0; c < cc.d; ++c) ASSERT_EQ(dh[size_t(t * cc.d + c)], 0.f) << "ignored token " << t;
    }
  }
}

TEST(OpsBwdCuda, CrossEntropyAllIgnored) {
  REQUIRE_GPU();
  const int64_t T = 9, d = 16, V = 40;
  const Vec h = round_bf16(lm::testing::randn<float>(size_t(T * d), 5, 1.0));
  const Vec W = round_bf16(lm::testing::randn<float>(size_t(V * d), 6, 0.1));
  const std::vector<int32_t> tg(size_t(T), -100);
  Dev gh(h.size() * 2), gW(W.size() * 2), gt(tg.size() * 4), gdh(size_t(T * d) * 4), gdW(size_t(V * d) * 4);
  up_bf16(gh, h), up_bf16(gW, W), up(gt, tg);
  kc::device_fill(gdW.p, 0, size_t(V * d) * 4);
  const oc::CeResult r = oc::cross_entropy_forward_backward(gh.p, gW.p, gt.i(), T, d, V, 1.f, gdh.f(), gdW.f(), 4);
  EXPECT_EQ(r.n_valid, 0);
  EXPECT_EQ(r.loss_sum, 0.0);
  for (float v : down<float>(gdh, size_t(T * d))) ASSERT_EQ(v, 0.f);
  for (float v : down<float>(gdW, size_t(V * d))) ASSERT_EQ(v, 0.f);
}

// ---- SiTU-GLU / SwiGLU ----------------------------------------------------------------------------

TEST(OpsBwdCuda, Glu) {
  REQUIRE_GPU();
  struct GC {
    const char* name;
    ops::GluParams p;
  };
  const GC kinds[] = {{"SiTU(4,25)", ops::GluParams::situ(4.0, 25.0)},
                      {"SiTU(4,nocap)", ops::GluParams::situ(4.0, 0.0)},
                      {"SwiGLU", ops::GluParams::swiglu()}};
  // I = 136: 8 columns per thread; I = 37: the scalar path.
  for (const int64_t I : {int64_t(136), int64_t(37)})
    for (const GC& gc : kinds) {
      const int64_t rows = 333;
      // Wide enough to reach both tanh caps (|b| ~ 25 needs a few large values).
      const Vec ab = round_bf16(lm::testing::randn<float>(size_t(rows * 2 * I), uint64_t(I + 11), 6.0));
      const Vec dh = round_bf16(lm::testing::randn<float>(size_t(rows * I), uint64_t(I + 12), 1.0));
      Vec h_ref(size_t(rows * I)), dab_ref(ab.size());
      ops::glu_forward<float>(ab.data(), h_ref.data(), rows, I, gc.p);
      ops::glu_backward<float>(ab.data(), dh.data(), dab_ref.data(), rows, I, gc.p);

      Dev gab(ab.size() * 2), gh(h_ref.size() * 2), gdh32(dh.size() * 4), gdh16(dh.size() * 2), gdab(ab.size() * 2);
      up_bf16(gab, ab), up(gdh32, dh), up_bf16(gdh16, dh);
      oc::glu_forward(gab.p, gh.p, rows, I, gc.p);
      const double eh = err(h_ref, down_bf16(gh, h_ref.size()));
      oc::glu_backward(gab.p, gdh32.p, DType::F32, gdab.p, rows, I, gc.p);
      const double e32 = err(dab_ref, down_bf16(gdab, ab.size()));
      oc::glu_backward(gab.p, gdh16.p, DType::BF16, gdab.p, rows, I, gc.p);
      const double e16 = err(dab_ref, down_bf16(gdab, ab.size()));
      oc::glu_backward(gab.p, gdh16.p, DType::BF16, gab.p, rows, I, gc.p);  // in place: dab == ab
      const double eip = err(dab_ref, down_bf16(gab, ab.size()));
      kc::synchronize();
      std::printf("GLU %s I%lld: h %.2e, dab (dh f32) %.2e, (dh bf16) %.2e, in place %.2e\n", gc.name, (long long)I,
                  eh, e32, e16, eip);
      EXPECT_LE(eh, 1e-2);
      EXPECT_LE(e32, 1e-2);
      EXPECT_LE(e16, 1e-2);
      EXPECT_LE(eip, 1e-2);
    }
}

// ---- KDA short convolution ------------------------------------------------------------------------

TEST(OpsBwdCuda, ShortConv) {
  REQUIRE_GPU();
  struct SC {
    int64_t B, T, C, W;
    std::vector<int64_t> cu;  // empty: B×T
    bool silu;
  };
  const std::vector<SC> cases = {
      {3, 50, 96, 4, {}, true},                         // 4 channels per thread
      {2, 700, 64, 4, {}, true},                        // sequences across thread and block chunks (256 rows)
      {2, 41, 45, 3, {}, true},                         // odd C: one channel per thread
      {1, 333, 64, 4, {0, 1, 2, 40, 40, 300, 333}, true},  // varlen: length 1, empty, across chunks
      {1, 600, 20, 8, {0, 5, 263, 264, 600}, false},    // varlen, 8 taps, no SiLU
      {1, 77, 32, 1, {0, 30, 77}, true},                // a single tap
  };
  for (const SC& sc : cases) {
    const int64_t rows = sc.B * sc.T, N = sc.cu.empty() ? 0 : int64_t(sc.cu.size()) - 1;
    const uint64_t seed = uint64_t(sc.T * 16 + sc.C + sc.W);
    const Vec x = round_bf16(lm::testing::randn<float>(size_t(rows * sc.C), seed + 1, 1.0));
    const Vec w = lm::testing::randn<float>(size_t(sc.C * sc.W), seed + 2, 0.5);
    const Vec dy = round_bf16(lm::testing::randn<float>(size_t(rows * sc.C), seed + 3, 1.0));
    const Vec dw0 = lm::testing::randn<float>(size_t(sc.C * sc.W), seed + 4, 1.0);  // dw accumulates
    kda::ConvDims cd;
    cd.B = sc.B, cd.T = sc.T, cd.C = sc.C, cd.W = sc.W, cd.cu_seqlens = sc.cu.empty() ? nullptr : sc.cu.data(), cd.N = N;
    Vec y_ref(x.size()), dx_ref(x.size()), dw_ref = dw0;
    kda::short_conv_forward<float>(x.data(), w.data(), nullptr, y_ref.data(), cd, sc.silu);
    kda::short_conv_backward<float>(x.data(), w.data(), nullptr, dy.data(), dx_ref.data(), dw_ref.data(), nullptr, cd,
                                    sc.silu);

    kc::ConvShape s;
    s.B = sc.B, s.T = sc.T, s.C = sc.C, s.W = sc.W, s.cu_seqlens = cd.cu_seqlens, s.N = N;
    Dev gx(x.size() * 2), gw(w.size() * 4), gy(x.size() * 2), gdy(x.size() * 2), gdx(x.size() * 2),
        gdw(w.size() * 4), gdw2(w.size() * 4);
    up_bf16(gx, x), up(gw, w), up_bf16(gdy, dy), up(gdw, dw0);
    kc::short_conv_forward(gx.p, gw.f(), gy.p, s, sc.silu);
    kc::short_conv_backward(gx.p, gw.f(), gdy.p, gdx.p, gdw.f(), s, sc.silu);
    // Determinism: a second backward from zero twice must give bit-identical dw.
    kc::device_fill(gdw2.p, 0, w.size() * 4);
    kc::short_conv_backward(gx.p, gw.f(), gdy.p, gdx.p, gdw2.f(), s, sc.silu);
    const auto dw_a = down<float>(gdw2, w.size());
    kc::device_fill(gdw2.p, 0, w.size() * 4);
    kc::short_conv_backward(gx.p, gw.f(), gdy.p, gdx.p, gdw2.f(), s, sc.silu);
    const auto dw_b = down<float>(gdw2, w.size());
    kc::synchronize();
    const double ey = err(y_ref, down_bf16(gy, y_ref.size())), edx = err(dx_ref, down_bf16(gdx, dx_ref.size()));
    const double edw = err(minus(dw_ref, dw0), minus(down<float>(gdw, w.size()), dw0));
    std::printf("short conv B%lld T%lld C%lld W%lld N%lld silu %d: y %.2e dx %.2e dw %.2e\n", (long long)sc.B,
                (long long)sc.T, (long long)sc.C, (long long)sc.W, (long long)N, int(sc.silu), ey, edx, edw);
    EXPECT_LE(ey, 1e-2);
    EXPECT_LE(edx, 1e-2);
    EXPECT_LE(edw, 1e-3);
    EXPECT_EQ(0, std::memcmp(dw_a.data(), dw_b.data(), dw_a.size() * 4)) << "dw not deterministic";

    // x and dx as the middle column block of a [rows, 3C] matrix (ldx = 3C, as the model's fused q/k/v
    // projection feeds it): the same results bit for bit, and the other columns untouched.
    kc::ConvShape s3 = s;
    s3.ldx = 3 * sc.C;
    Vec x3(size_t(rows * 3 * sc.C), 0.f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < sc.C; ++c) x3[size_t(r * 3 * sc.C + sc.C + c)] = x[size_t(r * sc.C + c)];
    Dev gx3(x3.size() * 2), gy3(x.size() * 2), gdx3(x3.size() * 2), gdw3(w.size() * 4);
    up_bf16(gx3, x3);
    kc::device_fill(gdx3.p, 0, x3.size() * 2);
    kc::device_fill(gdw3.p, 0, w.size() * 4);
    kc::short_conv_forward(static_cast<uint16_t*>(gx3.p) + sc.C, gw.f(), gy3.p, s3, sc.silu);
    kc::short_conv_backward(static_cast<uint16_t*>(gx3.p) + sc.C, gw.f(), gdy.p, static_cast<uint16_t*>(gdx3.p) + sc.C,
                            gdw3.f(), s3, sc.silu);
    const auto y1 = down<uint16_t>(gy, x.size()), y3 = down<uint16_t>(gy3, x.size());
    const auto dx1 = down<uint16_t>(gdx, x.size()), dx3 = down<uint16_t>(gdx3, x3.size());
    const auto dw3 = down<float>(gdw3, w.size());
    kc::synchronize();
    EXPECT_EQ(y1, y3) << "strided input changed y";
    size_t bad = 0, stray = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < 3 * sc.C; ++c) {
        const uint16_t got = dx3[size_t(r * 3 * sc.C + c)];
        if (c >= sc.C && c < 2 * sc.C) bad += got != dx1[size_t(r * sc.C + c - sc.C)];
        else stray += got != 0;
      }
    EXPECT_EQ(bad, 0u) << "strided dx differs";
    EXPECT_EQ(stray, 0u) << "strided dx wrote outside its column block";
    EXPECT_EQ(0, std::memcmp(dw3.data(), dw_a.data(), dw_a.size() * 4)) << "strided dw differs";
  }
}

// ---- MoE backward pieces --------------------------------------------------------------------------

TEST(OpsBwdCuda, MoeCombineGatherBackward) {
  REQUIRE_GPU();
  const int64_t m = 300, n = 32, k = 4, d = 136, M = m * k;
  const auto idx = random_topk(m, n, k, 101);
  const auto perm = ops::moe_permutation(idx.data(), m, k, n);
  const std::vector<int32_t> pos32(perm.pos.begin(), perm.pos.end());
  const Vec eo = round_bf16(lm::testing::randn<float>(size_t(M * d), 102));
  const Vec w = lm::testing::randu<float>(size_t(M), 103, 0.0, 1.0);
  const Vec dy = round_bf16(lm::testing::randn<float>(size_t(m * d), 104));  // bf16-exact: both dy types agree
  const Vec dxs = round_bf16(lm::testing::randn<float>(size_t(M * d), 105));
  const Vec dx0 = lm::testing::randn<float>(size_t(m * d), 106);

  Vec deo_ref(eo.size()), dw_ref(static_cast<size_t>(M)), dx_ref(static_cast<size_t>(m * d)), dx_acc_ref = dx0;
  ops::moe_combine_backward<float>(eo.data(), w.data(), perm.pos.data(), dy.data(), deo_ref.data(), dw_ref.data(), m,
                                   k, d);
  ops::moe_gather_backward<float>(dxs.data(), perm.pos.data(), dx_ref.data(), m, k, d, false);
  ops::moe_gather_backward<float>(dxs.data(), perm.pos.data(), dx_acc_ref.data(), m, k, d, true);

  Dev gpos(pos32.size() * 4), geo(eo.size() * 2), gw(w.size() * 4), gdy32(dy.size() * 4), gdy16(dy.size() * 2),
      gdeo(eo.size() * 2), gdw(w.size() * 4), gdxs(dxs.size() * 2), gdx32(dx_ref.size() * 4),
      gdx16(dx_ref.size() * 2);
  up(gpos, pos32), up_bf16(geo, eo), up(gw, w), up(gdy32, dy), up_bf16(gdy16, dy), up_bf16(gdxs, dxs), up(gdx32, dx0);
  for (const bool dy_bf16 : {false, true}) {
    oc::moe_combine_backward(geo.p, gw.f(), gpos.i(), dy_bf16 ? gdy16.p : gdy32.p, dy_bf16, gdeo.p, gdw.f(), m, k, d);
    kc::synchronize();
    const double ede = err(deo_ref, down_bf16(gdeo, deo_ref.size())), edw = err(dw_ref, down<float>(gdw, dw_ref.size()));
    std::printf("combine backward (dy %s): d_eo %.2e d_topk_w %.2e\n", dy_bf16 ? "bf16" : "f32", ede, edw);
    EXPECT_LE(ede, 1e-2);
    EXPECT_LE(edw, 1e-5);
  }
  oc::moe_combine_backward(geo.p, gw.f(), gpos.i(), gdy32.p, false, gdeo.p, nullptr, m, k, d);  // d_topk_w optional
  oc::moe_gather_backward(gdxs.p, gpos.i(), gdx32.p, false, m, k, d, true);
  oc::moe_gather_backward(gdxs.p, gpos.i(), gdx16.p, true, m, k, d, false);
  kc::synchronize();
  const double ea = err(dx_acc_ref, down<float>(gdx32, dx_ref.size())), eb = err(dx_ref, down_bf16(gdx16, dx_ref.size()));
  std::printf("gather backward: f32 accumulate %.2e, bf16 %.2e\n", ea, eb);
  EXPECT_LE(ea, 1e-6);
  EXPECT_LE(eb, 1e-2);
  oc::moe_gather_backward(gdxs.p, gpos.i(), gdx32.p, false, m, k, d, false);
  kc::synchronize();
  EXPECT_LE(err(dx_ref, down<float>(gdx32, dx_ref.size())), 1e-6);
}

TEST(OpsBwdCuda, RouterBackward) {
  REQUIRE_GPU();
  struct RC {
    int64_t m, n, k;
    bool renorm;
  };
  // k = 40: more slots than lanes.
  for (const RC rc : {RC{300, 64, 6, true}, RC{300, 64, 6, false}, RC{77, 20, 3, true}, RC{50, 64, 40, true},
                      RC{50, 64, 40, false}}) {
    const Vec logits = lm::testing::randn<float>(size_t(rc.m * rc.n), uint64_t(rc.n * 7 + rc.k), 2.0);
    const Vec bias = lm::testing::randn<float>(size_t(rc.n), uint64_t(rc.n * 7 + rc.k + 1), 0.1);
    ops::RouterConfig cfg;
    cfg.k = rc.k, cfg.renormalize = rc.renorm, cfg.routed_scaling_factor = 2.5;
    std::vector<int32_t> idx(size_t(rc.m * rc.k));
    Vec w(idx.size());
    ops::RouterOutputs<float> ro;
    ro.topk_idx = idx.data(), ro.topk_w = w.data();
    ops::router_forward<float>(logits.data(), bias.data(), rc.m, rc.n, cfg, ro);
    const Vec dp = lm::testing::randn<float>(idx.size(), uint64_t(rc.n * 7 + rc.k + 2));
    Vec dl_ref(logits.size());
    ops::router_backward<float>(logits.data(), idx.data(), dp.data(), dl_ref.data(), rc.m, rc.n, cfg);

    Dev gl(logits.size() * 4), gi(idx.size() * 4), gdp(dp.size() * 4), g32(logits.size() * 4), g16(logits.size() * 2);
    up(gl, logits), up(gi, idx), up(gdp, dp);
    oc::router_backward(gl.f(), gi.i(), gdp.f(), g32.p, false, rc.m, rc.n, rc.k, rc.renorm, 2.5f);
    oc::router_backward(gl.f(), gi.i(), gdp.f(), g16.p, true, rc.m, rc.n, rc.k, rc.renorm, 2.5f);
    kc::synchronize();
    const Vec d32 = down<float>(g32, logits.size());
    const double e32 = err(dl_ref, d32), e16 = err(dl_ref, down_bf16(g16, logits.size()));
    std::printf("router backward m%lld n%lld k%lld renorm %d: f32 %.2e bf16 %.2e\n", (long long)rc.m, (long long)rc.n,
                (long long)rc.k, int(rc.renorm), e32, e16);
    EXPECT_LE(e32, 1e-5);
    EXPECT_LE(e16, 1e-2);
    size_t nonzero = 0;  // exactly the selected entries carry gradient
    for (size_t j = 0; j < d32.size(); ++j) nonzero += d32[j] != 0.f;
    EXPECT_LE(nonzero, idx.size());
  }
}
