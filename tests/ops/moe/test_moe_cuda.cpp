// MoE on the GPU (src/ops/moe/cuda): grouped expert GEMMs (plain and with SiTU/SwiGLU fused), the expert FFN,
// router, permutation, gather and combine against the CPU definitions. Skips without a CUDA device.
//
// Legend: m tokens, n = E experts, k experts per token, M = m·k permuted rows, K reduction dim, N output dim,
//         I intermediate width, d row width.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "cuda_testing.hpp"
#include "ops/glu/glu.hpp"
#include "ops/moe/cuda/moe_cuda.hpp"
#include "ops/moe/permute.hpp"
#include "ops/moe/router.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

namespace {

std::vector<int32_t> offsets_of(const std::vector<int>& counts) {
  std::vector<int32_t> off(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  return off;
}
// y [M, N] = x_r · W_eᵀ per expert, in double.
Vec ref_grouped(const Vec& x, const Vec& w, const std::vector<int32_t>& off, int64_t N, int64_t K) {
  const int64_t M = off.back(), E = int64_t(off.size()) - 1;
  Vec y(size_t(M * N));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = off[size_t(e)]; r < off[size_t(e + 1)]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        const float* xr = &x[size_t(r * K)];
        const float* wr = &w[size_t((e * N + n) * K)];
        for (int64_t c = 0; c < K; ++c) s += double(xr[c]) * wr[c];
        y[size_t(r * N + n)] = float(s);
      }
  return y;
}
// dw [E, N, K] = dy_eᵀ · x_e per expert (zeros for an expert without rows), in double.
std::vector<double> ref_wgrad(const Vec& dy, const Vec& x, const std::vector<int32_t>& off, int64_t N, int64_t K) {
  const int64_t E = int64_t(off.size()) - 1;
  std::vector<double> dw(size_t(E * N * K), 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = off[size_t(e)]; r < off[size_t(e + 1)]; ++r)
      for (int64_t n = 0; n < N; ++n) {
        const double g = dy[size_t(r * N + n)];
        const float* xr = &x[size_t(r * K)];
        double* a = &dw[size_t((e * N + n) * K)];
        for (int64_t c = 0; c < K; ++c) a[c] += g * xr[c];
      }
  return dw;
}

}  // namespace

TEST(MoeCuda, GroupedGemm) {
  REQUIRE_GPU();
  // Empty experts, single rows, counts across tile edges; N and K off the tile sizes. N = 384 (the dh product)
  // and 264 take 192-row weight tiles, 512 256-row ones; LONGMOE_GG_BN=256 forces 256 rows everywhere.
  struct GC {
    std::vector<int> counts;
    int64_t N, K;
  };
  for (const GC& gc : {GC{{0, 1, 130, 257, 40}, 264, 200}, GC{{128, 128, 0, 3}, 512, 64}, GC{{300}, 8, 1032},
                       GC{{200, 0, 77, 513}, 384, 768}}) {
    const auto off = offsets_of(gc.counts);
    const int64_t M = off.back(), E = int64_t(gc.counts.size());
    const Vec x = round_bf16(lm::testing::randn<float>(size_t(M * gc.K), uint64_t(M + gc.N), 1.0));
    const Vec w = round_bf16(lm::testing::randn<float>(size_t(E * gc.N * gc.K), uint64_t(M + gc.K), 0.05));
    const Vec ref = ref_grouped(x, w, off, gc.N, gc.K);
    Dev gx(x.size() * 2), gw(w.size() * 2), go(off.size() * 4);
    up_bf16(gx, x), up_bf16(gw, w), up(go, off);
    // Every tile order and epilogue variant (benchmark overrides) must give the same result.
    for (const char* variant : {"0 1 0", "1 1 0", "0 0 0", "1 0 0", "0 1 1", "1 0 1"}) {
      Dev gy(ref.size() * 2);  // poisoned
      const std::string order(1, variant[0]), epi(1, variant[2]);
      const bool bn256 = variant[4] == '1';
      setenv(env::kGgOrder, order.c_str(), 1);
      setenv(env::kGgEpi, epi.c_str(), 1);
      if (bn256) setenv(env::kGgBn, "256", 1);
      oc::grouped_gemm(gx.p, gw.p, gy.p, go.i(), M, gc.N, gc.K, E);
      kc::synchronize();
      unsetenv(env::kGgBn);
      const double e = err(ref, down_bf16(gy, ref.size()));
      std::printf("grouped gemm M%lld N%lld K%lld E%lld order %s epilogue %s%s: %.2e\n", (long long)M,
                  (long long)gc.N, (long long)gc.K, (long long)E, order.c_str(), epi.c_str(),
                  bn256 ? " (256-row tiles)" : "", e);
      EXPECT_LE(e, 5e-3) << "order " << order << " epilogue " << epi << (bn256 ? " 256-row tiles" : "");
    }
    unsetenv(env::kGgOrder);
    unsetenv(env::kGgEpi);
  }
}

TEST(MoeCuda, GroupedGemmWgrad) {
  REQUIRE_GPU();
  // Empty experts (first, middle, last), single rows, counts across 64-row steps; N and K off the tile sizes
  // (not multiples of 128 or 192); the k3-1b dW2 shape with thousands of rows per expert.
  struct WC {
    std::vector<int> counts;
    int64_t N, K;
  };
  for (const WC& wc : {WC{{0, 1, 130, 257, 40}, 264, 200}, WC{{0, 300, 1}, 8, 1032}, WC{{64, 127, 1, 65, 0}, 1032, 8},
                       WC{{2048, 1900, 0, 2200}, 768, 384}}) {
    const auto off = offsets_of(wc.counts);
    const int64_t M = off.back(), E = int64_t(wc.counts.size()), N = wc.N, K = wc.K, NK = N * K;
    const Vec dy = round_bf16(lm::testing::randn<float>(size_t(M * N), uint64_t(M + N + 7), 1.0));
    const Vec x = round_bf16(lm::testing::randn<float>(size_t(M * K), uint64_t(M + K + 8), 1.0));
    const Vec dw0 = lm::testing::randn<float>(size_t(E * NK), uint64_t(M + 9), 1.0);
    const std::vector<double> prod = ref_wgrad(dy, x, off, N, K);
    Vec ref(prod.size()), ref_acc(prod.size());
    for (size_t i = 0; i < prod.size(); ++i) ref[i] = float(prod[i]), ref_acc[i] = float(dw0[i] + prod[i]);
    Dev gdy(dy.size() * 2), gx(x.size() * 2), go(off.size() * 4);
    up_bf16(gdy, dy), up_bf16(gx, x), up(go, off);
    // Worst error over the experts with rows, so a small expert is not hidden behind the large ones.
    auto worst = [&](const Vec& r, const Vec& got) {
      double w = 0;
      for (int64_t e = 0; e < E; ++e)
        if (wc.counts[size_t(e)] > 0) {
          const auto b = r.begin() + e * NK, g = got.begin() + e * NK;
          w = std::max(w, err(Vec(b, b + NK), Vec(g, g + NK)));
        }
      return w;
    };
    // accumulate=false must overwrite, never read dw: poisoned with a huge value, then with NaN (0xff bytes; the
    // memory a training step hands it may hold anything, and 0·NaN is NaN).
    for (const bool nan_poison : {false, true}) {
      Dev gdw(ref.size() * 4);  // 0xff: NaN
      if (!nan_poison) up(gdw, Vec(ref.size(), 1e30f));
      oc::grouped_gemm_wgrad(gdy.p, gx.p, gdw.f(), go.i(), M, N, K, E, false);
      kc::synchronize();
      const Vec got = down<float>(gdw, ref.size());
      const double e = err(ref, got), ew = worst(ref, got);
      std::printf("grouped wgrad M%lld N%lld K%lld E%lld =, poison %s: %.2e (worst expert %.2e)\n", (long long)M,
                  (long long)N, (long long)K, (long long)E, nan_poison ? "NaN" : "1e30", e, ew);
      EXPECT_LE(e, 1e-4);
      EXPECT_LE(ew, 1e-4);
      for (int64_t j = 0; j < E; ++j) {
        if (wc.counts[size_t(j)] > 0) continue;
        EXPECT_TRUE(std::all_of(got.begin() + j * NK, got.begin() + (j + 1) * NK, [](float v) { return v == 0.f; }))
            << "empty expert " << j << " not zeroed";
      }
    }
    // accumulate=true: dw0 + product; an expert without rows keeps dw0 bit for bit.
    {
      Dev gdw(ref.size() * 4);
      up(gdw, dw0);
      oc::grouped_gemm_wgrad(gdy.p, gx.p, gdw.f(), go.i(), M, N, K, E, true);
      kc::synchronize();
      const Vec got = down<float>(gdw, ref.size());
      const double e = err(ref_acc, got), ew = worst(ref_acc, got);
      std::printf("grouped wgrad M%lld N%lld K%lld E%lld +=: %.2e (worst expert %.2e)\n", (long long)M, (long long)N,
                  (long long)K, (long long)E, e, ew);
      EXPECT_LE(e, 1e-4);
      EXPECT_LE(ew, 1e-4);
      for (int64_t j = 0; j < E; ++j) {
        if (wc.counts[size_t(j)] > 0) continue;
        EXPECT_EQ(std::memcmp(got.data() + j * NK, dw0.data() + j * NK, size_t(NK) * sizeof(float)), 0)
            << "empty expert " << j << " changed";
      }
    }
  }
}

TEST(MoeCuda, GroupedGemmGluFused) {
  REQUIRE_GPU();
  const std::vector<int> counts{100, 0, 300, 1};
  const auto off = offsets_of(counts);
  const int64_t M = off.back(), E = int64_t(counts.size()), I = 136, K = 256;
  const Vec x = round_bf16(lm::testing::randn<float>(size_t(M * K), 71, 1.0));
  const Vec w = round_bf16(lm::testing::randn<float>(size_t(E * 2 * I * K), 72, 0.15));
  const Vec ab = ref_grouped(x, w, off, 2 * I, K);
  for (const bool swiglu : {false, true})
    for (const char* epi : {"1", "0"}) {
    setenv(env::kGgEpi, epi, 1);
    const ops::GluParams gp = swiglu ? ops::GluParams::swiglu() : ops::GluParams::situ(4.0, 25.0);
    Vec h_ref(size_t(M * I));
    ops::glu_forward(ab.data(), h_ref.data(), M, I, gp);
    Dev gx(x.size() * 2), gw(w.size() * 2), gh(h_ref.size() * 2), gab(ab.size() * 2), go(off.size() * 4);
    up_bf16(gx, x), up_bf16(gw, w), up(go, off);
    oc::GluArgs ga;
    ga.swiglu = swiglu;
    oc::grouped_gemm_glu(gx.p, gw.p, gh.p, gab.p, go.i(), M, I, K, E, ga);
    kc::synchronize();
    const double eh = err(h_ref, down_bf16(gh, h_ref.size())), eab = err(ab, down_bf16(gab, ab.size()));
    std::printf("grouped gemm %s epilogue %s: h %.2e ab %.2e\n", swiglu ? "SwiGLU" : "SiTU", epi, eh, eab);
    EXPECT_LE(eh, 8e-3);
    EXPECT_LE(eab, 5e-3);
  }
  unsetenv(env::kGgEpi);
}

// The few-row kernels (decode steps): plain and GLU products against the double reference and against the wgmma
// kernels; an expert with more rows than one register pass (11 > 4), 300 experts (the slot search crosses 256), K not
// a multiple of 256, N off the block width, 511 rows over 64 experts (a batch-64 step); the GLU product reading its
// rows through the permutation (the gather fused); every row equal bit for bit when the same rows arrive one per
// expert (what a token decoded alone or in a batch sees).
TEST(MoeCuda, FewRowsKernels) {
  REQUIRE_GPU();
  struct FC {
    int E;
    std::vector<std::pair<int, int>> rows;  // (expert, rows) with rows; the others empty
    int64_t N, K;
  };
  std::vector<std::pair<int, int>> busy;
  for (int e = 0; e < 64; ++e) busy.push_back({e, 1 + (e * 7) % 15});  // 511 rows, 1 to 15 per expert
  for (const FC& fc : {FC{4, {{1, 1}}, 272, 200}, FC{300, {{0, 2}, {7, 11}, {255, 1}, {256, 3}, {299, 5}}, 80, 1032},
                       FC{64, {{3, 8}, {4, 8}, {9, 8}, {10, 8}, {20, 8}, {33, 8}, {40, 8}, {63, 8}}, 768, 384},
                       FC{64, busy, 144, 264}}) {
    std::vector<int> counts(size_t(fc.E), 0);
    for (const auto& [e, n] : fc.rows) counts[size_t(e)] = n;
    const auto off = offsets_of(counts);
    const int64_t M = off.back(), E = fc.E, N = fc.N, K = fc.K, I = N / 2;
    const Vec x = round_bf16(lm::testing::randn<float>(size_t(M * K), uint64_t(M + K), 1.0));
    const Vec w = round_bf16(lm::testing::randn<float>(size_t(E * N * K), uint64_t(E + N), 0.05));
    Dev gx(x.size() * 2), gw(w.size() * 2), go(off.size() * 4);
    up_bf16(gx, x), up_bf16(gw, w), up(go, off);
    // One row per expert (each expert's first row), as a batch of its own.
    std::vector<int> one(size_t(E), 0);
    Vec x1;
    std::vector<int64_t> first;
    for (int64_t e = 0; e < E; ++e)
      if (counts[size_t(e)] > 0) {
        one[size_t(e)] = 1, first.push_back(off[size_t(e)]);
        x1.insert(x1.end(), x.begin() + off[size_t(e)] * K, x.begin() + (off[size_t(e)] + 1) * K);
      }
    const auto off1 = offsets_of(one);
    const int64_t M1 = off1.back();
    Dev gx1(x1.size() * 2), go1(off1.size() * 4);
    up_bf16(gx1, x1), up(go1, off1);
    auto same_rows = [&](const Dev& all, const Dev& ones, int64_t cols) {
      const std::vector<uint16_t> a = down<uint16_t>(all, size_t(M * cols));
      const std::vector<uint16_t> b = down<uint16_t>(ones, size_t(M1 * cols));
      for (size_t j = 0; j < first.size(); ++j)
        if (std::memcmp(&a[size_t(first[j] * cols)], &b[j * size_t(cols)], size_t(cols) * 2) != 0) return false;
      return true;
    };
    // The gather fused: row r is token M−1−r of a wider matrix (row stride K + 16), rows[r] = 3·(M−1−r) + r mod 3
    // with k = 3 (an assignment index: token · k + slot).
    const int64_t ldx = K + 16;
    Vec xw(size_t(M * ldx), 0.f);
    std::vector<int32_t> rows(static_cast<size_t>(M));
    for (int64_t r = 0; r < M; ++r) {
      rows[size_t(r)] = int32_t(3 * (M - 1 - r) + r % 3);
      std::copy(x.begin() + r * K, x.begin() + (r + 1) * K, xw.begin() + (M - 1 - r) * ldx);
    }
    Dev gxw(xw.size() * 2), grows(rows.size() * 4);
    up_bf16(gxw, xw), up(grows, rows);
    // Plain product.
    const Vec ref = ref_grouped(x, w, off, N, K);
    Dev gy(ref.size() * 2), gy_mma(ref.size() * 2), gy1(size_t(M1 * N) * 2);
    oc::grouped_gemm_few_rows(gx.p, gw.p, gy.p, go.i(), M, N, K, E);
    oc::grouped_gemm_few_rows(gx1.p, gw.p, gy1.p, go1.i(), M1, N, K, E);
    oc::grouped_gemm(gx.p, gw.p, gy_mma.p, go.i(), M, N, K, E);
    kc::synchronize();
    const Vec y = down_bf16(gy, ref.size());
    const double e_ref = err(ref, y), e_mma = err(down_bf16(gy_mma, ref.size()), y);
    std::printf("few-row gemm M%lld N%lld K%lld E%lld: vs double %.2e, vs wgmma %.2e\n", (long long)M, (long long)N,
                (long long)K, (long long)E, e_ref, e_mma);
    EXPECT_LE(e_ref, 5e-3);
    EXPECT_LE(e_mma, 5e-3);
    EXPECT_TRUE(same_rows(gy, gy1, N)) << "a row differs when its expert has other rows";
    {  // A decode step's chain: the GLU product, then the plain one on its output launched early (offsets_ready,
       // programmatic dependent launch), bit-equal to the plain one launched after a synchronisation.
      const int64_t N2 = 2 * K;  // the weights read as [E, 2K, I]
      Dev gh2(size_t(M * I) * 2), gz_early(size_t(M * N2) * 2), gz_plain(size_t(M * N2) * 2);
      oc::grouped_gemm_glu_few_rows(gx.p, gw.p, gh2.p, nullptr, go.i(), M, I, K, E, oc::GluArgs{});
      oc::grouped_gemm_few_rows(gh2.p, gw.p, gz_early.p, go.i(), M, N2, I, E, nullptr, true);
      kc::synchronize();
      oc::grouped_gemm_few_rows(gh2.p, gw.p, gz_plain.p, go.i(), M, N2, I, E);
      kc::synchronize();
      EXPECT_EQ(down<uint16_t>(gz_early, size_t(M * N2)), down<uint16_t>(gz_plain, size_t(M * N2)))
          << "the early-launched product differs";
    }
    // GLU product (W13 = the same weights read as [E, 2I, K]) with the pre-activations kept.
    for (const bool swiglu : {false, true}) {
      const ops::GluParams gp = swiglu ? ops::GluParams::swiglu() : ops::GluParams::situ(4.0, 25.0);
      Vec h_ref(size_t(M * I));
      ops::glu_forward(ref.data(), h_ref.data(), M, I, gp);
      oc::GluArgs ga;
      ga.swiglu = swiglu;
      Dev gh(h_ref.size() * 2), gab(ref.size() * 2), gh_mma(h_ref.size() * 2), gh1(size_t(M1 * I) * 2),
          ghw(h_ref.size() * 2);
      oc::grouped_gemm_glu_few_rows(gx.p, gw.p, gh.p, gab.p, go.i(), M, I, K, E, ga);
      oc::grouped_gemm_glu_few_rows(gx1.p, gw.p, gh1.p, nullptr, go1.i(), M1, I, K, E, ga);
      oc::grouped_gemm_glu_few_rows(gxw.p, gw.p, ghw.p, nullptr, go.i(), M, I, K, E, ga, nullptr, grows.i(), 3, ldx);
      oc::grouped_gemm_glu(gx.p, gw.p, gh_mma.p, nullptr, go.i(), M, I, K, E, ga);
      kc::synchronize();
      const Vec h = down_bf16(gh, h_ref.size());
      const double eh = err(h_ref, h), eab = err(ref, down_bf16(gab, ref.size())),
                   eh_mma = err(down_bf16(gh_mma, h_ref.size()), h);
      std::printf("few-row %s M%lld I%lld K%lld: h %.2e, ab %.2e, h vs wgmma %.2e\n", swiglu ? "SwiGLU" : "SiTU",
                  (long long)M, (long long)I, (long long)K, eh, eab, eh_mma);
      EXPECT_LE(eh, 8e-3);
      EXPECT_LE(eab, 5e-3);
      EXPECT_LE(eh_mma, 8e-3);
      EXPECT_TRUE(same_rows(gh, gh1, I)) << "a GLU row differs when its expert has other rows";
      EXPECT_EQ(down<uint16_t>(ghw, h_ref.size()), down<uint16_t>(gh, h_ref.size())) << "the fused gather differs";
    }
  }
}

TEST(MoeCuda, ExpertFfn) {
  REQUIRE_GPU();
  const std::vector<int> counts{37, 200, 0, 129};
  const auto off = offsets_of(counts);
  const int64_t M = off.back(), E = int64_t(counts.size()), d = 192, I = 128;
  const Vec x = round_bf16(lm::testing::randn<float>(size_t(M * d), 81, 1.0));
  const Vec w13 = round_bf16(lm::testing::randn<float>(size_t(E * 2 * I * d), 82, 0.12));
  const Vec w2 = round_bf16(lm::testing::randn<float>(size_t(E * d * I), 83, 0.1));
  const Vec ab = ref_grouped(x, w13, off, 2 * I, d);
  Vec h(size_t(M * I));
  ops::glu_forward(ab.data(), h.data(), M, I, ops::GluParams::situ());
  const Vec ref = ref_grouped(round_bf16(h), w2, off, d, I);  // the GPU keeps h in bf16
  Dev gx(x.size() * 2), g13(w13.size() * 2), g2(w2.size() * 2), geo(ref.size() * 2), go(off.size() * 4);
  up_bf16(gx, x), up_bf16(g13, w13), up_bf16(g2, w2), up(go, off);
  oc::moe_expert_ffn(gx.p, g13.p, g2.p, geo.p, go.i(), M, d, I, E);
  kc::synchronize();
  const double e = err(ref, down_bf16(geo, ref.size()));
  std::printf("expert ffn: %.2e\n", e);
  EXPECT_LE(e, 1e-2);
}

TEST(MoeCuda, Router) {
  REQUIRE_GPU();
  struct RC {
    int64_t m, n, k;
    bool renorm;
  };
  for (const RC rc : {RC{300, 64, 6, true}, RC{100, 896, 16, true}, RC{50, 20, 3, false}, RC{33, 8, 8, true}}) {
    const Vec logits = lm::testing::randn<float>(size_t(rc.m * rc.n), uint64_t(rc.n + 1), 2.0);
    const Vec bias = lm::testing::randn<float>(size_t(rc.n), uint64_t(rc.n + 2), 0.1);
    ops::RouterConfig cfg;
    cfg.k = rc.k, cfg.renormalize = rc.renorm, cfg.routed_scaling_factor = 2.5;
    std::vector<int32_t> idx(size_t(rc.m * rc.k));
    Vec w(idx.size()), sc(size_t(rc.m * rc.n)), mg(size_t(rc.m)), al(size_t(rc.m));
    ops::RouterOutputs<float> ro{idx.data(), w.data(), sc.data(), mg.data(), al.data()};
    ops::router_forward(logits.data(), bias.data(), rc.m, rc.n, cfg, ro);
    Dev gl(logits.size() * 4), gb(bias.size() * 4), gi(idx.size() * 4), gw(w.size() * 4), gs(sc.size() * 4),
        gm(mg.size() * 4), ga(al.size() * 4);
    up(gl, logits), up(gb, bias);
    oc::RouterOut out{gi.i(), gw.f(), gs.f(), gm.f(), ga.f()};
    oc::router_forward(gl.f(), gb.f(), rc.m, rc.n, rc.k, rc.renorm, 2.5f, out);
    kc::synchronize();
    EXPECT_EQ(idx, down<int32_t>(gi, idx.size())) << "n " << rc.n << " k " << rc.k;
    const double ew = err(w, down<float>(gw, w.size())), es = err(sc, down<float>(gs, sc.size()));
    const double em = err(mg, down<float>(gm, mg.size())), ea = err(al, down<float>(ga, al.size()));
    std::printf("router m%lld n%lld k%lld: w %.1e scores %.1e margin %.1e alpha %.1e\n", (long long)rc.m,
                (long long)rc.n, (long long)rc.k, ew, es, em, ea);
    EXPECT_LE(ew, 1e-5);
    EXPECT_LE(es, 1e-6);
    if (rc.k < rc.n) {
      EXPECT_LE(em, 1e-4);
      EXPECT_LE(ea, 1e-5);
    }
  }
}

namespace {
// Random distinct experts per token, each token's sorted (as the router emits them).
std::vector<int32_t> random_routing(int64_t m, int64_t n, int64_t k, uint64_t seed) {
  std::vector<int32_t> idx(size_t(m * k));
  const Vec u = lm::testing::randu<float>(size_t(m * n), seed, 0.0, 1.0);
  for (int64_t i = 0; i < m; ++i) {
    std::vector<int32_t> e(static_cast<size_t>(n));
    std::iota(e.begin(), e.end(), 0);
    std::stable_sort(e.begin(), e.end(), [&](int32_t a, int32_t b) { return u[size_t(i * n + a)] < u[size_t(i * n + b)]; });
    std::sort(e.begin(), e.begin() + k);
    std::copy(e.begin(), e.begin() + k, idx.begin() + i * k);
  }
  return idx;
}
}  // namespace

// The permutation equals the CPU's (offsets, rows, pos) on both of its paths: one block up to 1,024 assignments
// and 8,192 experts, the radix sort beyond.
TEST(MoeCuda, PermuteSmallAndLarge) {
  REQUIRE_GPU();
  struct PC {
    int64_t m, n, k;
  };
  for (const PC& pc : {PC{1, 256, 8}, PC{64, 256, 8}, PC{256, 40, 4}, PC{257, 40, 4}, PC{3, 9000, 2}, PC{0, 16, 2},
                       PC{100, 896, 16}}) {
    const std::vector<int32_t> idx = random_routing(pc.m, pc.n, pc.k, uint64_t(pc.m + pc.n));
    const auto perm = ops::moe_permutation(idx.data(), pc.m, pc.k, pc.n);
    Dev gi(idx.size() * 4), goff(size_t(pc.n + 1) * 4), grows(idx.size() * 4), gpos(idx.size() * 4);
    up(gi, idx);
    oc::moe_permute(gi.i(), pc.m, pc.k, pc.n, goff.i(), grows.i(), gpos.i());
    kc::synchronize();
    auto got = [](const Dev& g, size_t n) {
      const std::vector<int32_t> v = down<int32_t>(g, n);
      return std::vector<int64_t>(v.begin(), v.end());
    };
    EXPECT_EQ(got(goff, size_t(pc.n + 1)), perm.offsets) << "m " << pc.m << " n " << pc.n;
    EXPECT_EQ(got(grows, idx.size()), perm.rows) << "m " << pc.m << " n " << pc.n;
    EXPECT_EQ(got(gpos, idx.size()), perm.pos) << "m " << pc.m << " n " << pc.n;
  }
}

TEST(MoeCuda, PermuteGatherCombine) {
  REQUIRE_GPU();
  const int64_t m = 500, n = 40, k = 4, d = 72;
  const std::vector<int32_t> idx = random_routing(m, n, k, 91);
  const auto perm = ops::moe_permutation(idx.data(), m, k, n);
  const Vec x = round_bf16(lm::testing::randn<float>(size_t(m * d), 92));
  const Vec w = lm::testing::randu<float>(size_t(m * k), 93, 0.0, 1.0);
  const Vec eo = round_bf16(lm::testing::randn<float>(size_t(m * k * d), 94));
  Vec xs_ref(size_t(m * k * d)), y_ref(size_t(m * d));
  ops::moe_gather(x.data(), perm.rows.data(), xs_ref.data(), m, k, d);
  ops::moe_combine(eo.data(), w.data(), perm.pos.data(), y_ref.data(), m, k, d);

  Dev gi(idx.size() * 4), goff(size_t(n + 1) * 4), grows(idx.size() * 4), gpos(idx.size() * 4), gx(x.size() * 2),
      gxs(xs_ref.size() * 2), gw(w.size() * 4), geo(eo.size() * 2), gy(y_ref.size() * 2);
  up(gi, idx), up_bf16(gx, x), up(gw, w), up_bf16(geo, eo);
  oc::moe_permute(gi.i(), m, k, n, goff.i(), grows.i(), gpos.i());
  kc::synchronize();
  const auto off = down<int32_t>(goff, size_t(n + 1)), rows = down<int32_t>(grows, idx.size()),
             pos = down<int32_t>(gpos, idx.size());
  for (int64_t j = 0; j <= n; ++j) EXPECT_EQ(off[size_t(j)], perm.offsets[size_t(j)]) << "offset " << j;
  for (size_t r = 0; r < idx.size(); ++r) {
    EXPECT_EQ(rows[r], perm.rows[r]) << "row " << r;
    EXPECT_EQ(pos[r], perm.pos[r]) << "pos " << r;
  }
  oc::moe_gather(gx.p, grows.i(), gxs.p, m, k, d);
  oc::moe_combine(geo.p, gw.f(), gpos.i(), gy.p, m, k, d);
  kc::synchronize();
  EXPECT_EQ(err(xs_ref, down_bf16(gxs, xs_ref.size())), 0.0);
  const double ey = err(y_ref, down_bf16(gy, y_ref.size()));
  std::printf("combine: %.2e\n", ey);
  EXPECT_LE(ey, 5e-3);
}
