// The MoE backward pieces (combine, gather, router) on the GPU against the CPU fp32 definitions. Inputs the GPU
// reads in bf16 are rounded to bf16 on the host before the CPU reference. Skips without a CUDA device.
//
// Legend: m tokens, n experts, k experts per token, M = m·k, d row width.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/moe/cuda/moe_cuda.hpp"
#include "ops/moe/permute.hpp"
#include "ops/moe/router.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

namespace {

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
