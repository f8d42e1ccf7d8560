// Block AttnRes (plain, with the fused RMSNorm, deferred) on the GPU against the CPU fp32 op. Skips without a
// CUDA device. Inputs the GPU reads as bf16 are rounded to bf16 on the host first, so the CPU reference sees the
// same values; bf16 outputs are compared with bf16 tolerances, fp32 ones tightly.
//
// Legend: N AttnRes sources, T tokens, d hidden.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

#include "core/error.hpp"
#include "cuda_testing.hpp"
#include "ops/attnres/attnres.hpp"
#include "ops/attnres/cuda/attnres_cuda.hpp"
#include "ops/rmsnorm/rmsnorm.hpp"  // the CPU reference of the fused norm

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

// N sources [T, d] of growing scale (as block sums grow with depth, so the norms r_j differ) and starting
// gradients, with host and device pointers; the gradient of source j is skipped (null) where skip(j).
struct Sources {
  std::vector<Vec> v, dv0, dv_ref;  // dv_ref: the CPU's gradients, starting at dv0
  std::vector<const float*> vp, gvp;
  std::vector<float*> dvp, gdvp;
  std::vector<std::unique_ptr<Dev>> gv, gdv;
  Sources(int64_t N, size_t n, uint64_t seed, const std::function<bool(int64_t)>& skip) {
    for (int64_t j = 0; j < N; ++j) {
      v.push_back(randn(n, seed + uint64_t(j), 1.0 + 0.5 * double(j)));
      dv0.push_back(randn(n, seed + 100 + uint64_t(j), 0.1));
    }
    dv_ref = dv0;
    for (int64_t j = 0; j < N; ++j) {
      vp.push_back(v[size_t(j)].data());
      dvp.push_back(skip(j) ? nullptr : dv_ref[size_t(j)].data());
      gv.push_back(std::make_unique<Dev>(n * 4));
      gdv.push_back(std::make_unique<Dev>(n * 4));
      up(*gv.back(), v[size_t(j)]), up(*gdv.back(), dv0[size_t(j)]);
      gvp.push_back(gv.back()->f());
      gdvp.push_back(skip(j) ? nullptr : gdv.back()->f());
    }
  }
  void reset_device_grads() {
    for (size_t j = 0; j < gdv.size(); ++j) up(*gdv[j], dv0[j]);
  }
};

TEST(NormsCuda, AttnRes) {
  REQUIRE_GPU();
  struct AC {
    int64_t N, T, d;
  };
  const float eps = 1e-6f;
  // N <= 8 and d <= 2048 take the register path (d = 130: scalar accesses), N = 9 the loop path; T = 3000
  // gives several tokens per backward block.
  for (const AC ac : {AC{1, 50, 256}, AC{3, 77, 2048}, AC{9, 40, 100}, AC{9, 1500, 512}, AC{2, 33, 130},
                      AC{8, 70, 1024}, AC{5, 3000, 1536}}) {
    const size_t n = size_t(ac.T * ac.d);
    // Source 1's gradient is skipped (null) when there are several sources.
    auto skipped = [&](int64_t j) { return ac.N > 1 && j == 1; };
    Sources src(ac.N, n, uint64_t(100 * ac.N), skipped);
    const auto &vp = src.vp, &gvp = src.gvp;
    const auto &dvp = src.dvp, &gdvp = src.gdvp;
    const auto &dv0 = src.dv0, &dv_ref = src.dv_ref;
    const auto& gdv = src.gdv;
    const Vec w = randn(size_t(ac.d), uint64_t(ac.d + 31), 0.05);
    const Vec gamma = gain(size_t(ac.d), uint64_t(ac.d + 32), 0.2);
    const Vec dh = randn(n, uint64_t(ac.d + 33), 1.0);
    const Vec dw0 = randn(size_t(ac.d), uint64_t(ac.d + 34), 0.1), dg0 = randn(size_t(ac.d), uint64_t(ac.d + 35), 0.1);
    Vec h_ref(n), dw_ref = dw0, dg_ref = dg0;
    ops::attnres_forward<float>(vp.data(), ac.N, ac.T, ac.d, w.data(), gamma.data(), eps, h_ref.data());
    ops::attnres_backward<float>(vp.data(), ac.N, ac.T, ac.d, w.data(), gamma.data(), eps, dh.data(), dvp.data(),
                                 dw_ref.data(), dg_ref.data());

    Dev gw(w.size() * 4), gg(gamma.size() * 4), gh(n * 4), gdh(n * 4), gdw(w.size() * 4), gdg(gamma.size() * 4);
    up(gw, w), up(gg, gamma), up(gdh, dh), up(gdw, dw0), up(gdg, dg0);
    oc::attnres_forward(gvp.data(), ac.N, ac.T, ac.d, gw.f(), gg.f(), eps, gh.f());
    oc::attnres_backward(gvp.data(), ac.N, ac.T, ac.d, gw.f(), gg.f(), eps, gdh.f(), gdvp.data(), gdw.f(), gdg.f());
    kc::synchronize();
    // A second backward from the same state must give the same bits (deterministic dq reduction).
    {
      const Vec dw1 = down<float>(gdw, dw0.size()), dg1 = down<float>(gdg, dg0.size());
      std::vector<Vec> dv1;
      for (int64_t j = 0; j < ac.N; ++j) dv1.push_back(down<float>(*gdv[size_t(j)], n));
      up(gdw, dw0), up(gdg, dg0);
      src.reset_device_grads();
      oc::attnres_backward(gvp.data(), ac.N, ac.T, ac.d, gw.f(), gg.f(), eps, gdh.f(), gdvp.data(), gdw.f(),
                           gdg.f());
      kc::synchronize();
      EXPECT_EQ(down<float>(gdw, dw0.size()), dw1) << "dw not reproducible";
      EXPECT_EQ(down<float>(gdg, dg0.size()), dg1) << "dgamma not reproducible";
      for (int64_t j = 0; j < ac.N; ++j)
        EXPECT_EQ(down<float>(*gdv[size_t(j)], n), dv1[size_t(j)]) << "dv source " << j << " not reproducible";
    }
    const double eh = err(h_ref, down<float>(gh, n));
    double edv = 0;
    for (int64_t j = 0; j < ac.N; ++j) {
      const Vec got = down<float>(*gdv[size_t(j)], n);
      if (skipped(j)) {
        EXPECT_EQ(got, dv0[size_t(j)]) << "skipped source " << j << " was written";
        continue;
      }
      const double e = err(dv_ref[size_t(j)], got);
      edv = std::max(edv, e);
      EXPECT_LE(e, kTolF32) << "dv source " << j;
    }
    const double edw = err(dw_ref, down<float>(gdw, dw0.size())), edg = err(dg_ref, down<float>(gdg, dg0.size()));
    std::printf("attnres N%lld T%lld d%lld: h %.2e dv %.2e dw %.2e dgamma %.2e\n", (long long)ac.N, (long long)ac.T,
                (long long)ac.d, eh, edv, edw, edg);
    EXPECT_LE(eh, kTolF32);
    EXPECT_LE(edw, 2 * kTolF32);
    EXPECT_LE(edg, 2 * kTolF32);
  }
}

// A read fused with the RMSNorm that consumes it, against the CPU ops in turn: forward y (bf16) and rstd; backward
// from the norm output's gradient: dv (one source skipped), dw, dgamma, the norm gain's dgn, and dlast (the last
// source's updated gradient as bf16). N = 9 and d = 9000 take the composed fallback.
TEST(NormsCuda, AttnResNorm) {
  REQUIRE_GPU();
  struct AC {
    int64_t N, T, d;
  };
  const float eps = 1e-6f, eps_n = 1e-5f;
  for (const AC ac : {AC{1, 50, 256}, AC{2, 3000, 1536}, AC{3, 77, 2048}, AC{5, 3000, 1536}, AC{4, 200, 1536},
                      AC{2, 33, 130}, AC{8, 70, 1024}, AC{9, 40, 100}, AC{3, 5, 9000}}) {
    const size_t n = size_t(ac.T * ac.d);
    auto skipped = [&](int64_t j) { return ac.N > 2 && j == 1; };
    Sources src(ac.N, n, uint64_t(300 * ac.N), skipped);
    const Vec w = randn(size_t(ac.d), uint64_t(ac.d + 41), 0.05);
    const Vec gamma = gain(size_t(ac.d), uint64_t(ac.d + 42), 0.2), gn = gain(size_t(ac.d), uint64_t(ac.d + 43), 0.2);
    const Vec dy = randn(n, uint64_t(ac.d + 44), 1.0);
    const Vec dw0 = randn(size_t(ac.d), uint64_t(ac.d + 45), 0.1), dg0 = randn(size_t(ac.d), uint64_t(ac.d + 46), 0.1),
              dgn0 = randn(size_t(ac.d), uint64_t(ac.d + 47), 0.1);

    // CPU: h = read(v); y = norm(h); dh = norm'(dy); dv, dw, dgamma = read'(dh).
    Vec h(n), y_ref(n), rstd_ref(size_t(ac.T)), dh(n), dw_ref = dw0, dg_ref = dg0, dgn_ref = dgn0;
    ops::attnres_forward<float>(src.vp.data(), ac.N, ac.T, ac.d, w.data(), gamma.data(), eps, h.data());
    ops::rmsnorm_forward<float>(h.data(), gn.data(), y_ref.data(), rstd_ref.data(), ac.T, ac.d, eps_n);
    ops::rmsnorm_backward<float>(h.data(), gn.data(), rstd_ref.data(), dy.data(), dh.data(), dgn_ref.data(), ac.T,
                                 ac.d, eps_n);
    ops::attnres_backward<float>(src.vp.data(), ac.N, ac.T, ac.d, w.data(), gamma.data(), eps, dh.data(),
                                 src.dvp.data(),
                                 dw_ref.data(), dg_ref.data());

    Dev gw(w.size() * 4), gg(gamma.size() * 4), ggn(gn.size() * 4), gy(n * 2), grs(rstd_ref.size() * 4), gdy(n * 4),
        gdw(w.size() * 4), gdg(gamma.size() * 4), gdgn(gn.size() * 4), glast(n * 2);
    up(gw, w), up(gg, gamma), up(ggn, gn), up(gdy, dy);
    oc::attnres_norm_forward(src.gvp.data(), ac.N, ac.T, ac.d, gw.f(), gg.f(), eps, ggn.f(), eps_n, gy.p, grs.f());
    kc::synchronize();
    const double ey = err(y_ref, down_bf16(gy, n)), er = err(rstd_ref, down<float>(grs, rstd_ref.size()));
    // Backward twice from the same state: bitwise equal results (fixed reduction orders).
    std::vector<std::vector<Vec>> dv_out(2);
    Vec dw_out[2], dg_out[2], dgn_out[2], last_out[2];
    for (int rep = 0; rep < 2; ++rep) {
      src.reset_device_grads();
      up(gdw, dw0), up(gdg, dg0), up(gdgn, dgn0);
      oc::attnres_norm_backward(src.gvp.data(), ac.N, ac.T, ac.d, gw.f(), gg.f(), eps, ggn.f(), eps_n, grs.f(), gdy.f(),
                                src.gdvp.data(), gdw.f(), gdg.f(), gdgn.f(), glast.p);
      kc::synchronize();
      for (int64_t j = 0; j < ac.N; ++j) dv_out[rep].push_back(down<float>(*src.gdv[size_t(j)], n));
      dw_out[rep] = down<float>(gdw, w.size()), dg_out[rep] = down<float>(gdg, gamma.size());
      dgn_out[rep] = down<float>(gdgn, gn.size()), last_out[rep] = down_bf16(glast, n);
    }
    EXPECT_EQ(dv_out[0], dv_out[1]) << "dv not reproducible";
    EXPECT_EQ(dw_out[0], dw_out[1]) << "dw not reproducible";
    EXPECT_EQ(dgn_out[0], dgn_out[1]) << "dgn not reproducible";
    double edv = 0;
    for (int64_t j = 0; j < ac.N; ++j) {
      if (skipped(j)) {
        EXPECT_EQ(dv_out[0][size_t(j)], src.dv0[size_t(j)]) << "skipped source " << j << " was written";
        continue;
      }
      edv = std::max(edv, err(src.dv_ref[size_t(j)], dv_out[0][size_t(j)]));
    }
    const double edw = err(dw_ref, dw_out[0]), edg = err(dg_ref, dg_out[0]), edgn = err(dgn_ref, dgn_out[0]);
    const double elast = err(src.dv_ref[size_t(ac.N - 1)], last_out[0]);
    std::printf("attnres+norm N%lld T%lld d%lld: y %.2e rstd %.2e dv %.2e dw %.2e dgamma %.2e dgn %.2e dlast %.2e\n",
                (long long)ac.N, (long long)ac.T, (long long)ac.d, ey, er, edv, edw, edg, edgn, elast);
    EXPECT_LE(ey, kTolBf16);
    EXPECT_LE(er, kTolF32);
    EXPECT_LE(edv, 1e-4);  // dh is rebuilt in registers in another order than the CPU's two passes
    EXPECT_LE(edw, 1e-4);
    EXPECT_LE(edg, 1e-4);
    EXPECT_LE(edgn, 1e-4);
    EXPECT_LE(elast, kTolBf16);
  }
  // Bad arguments: no gain, dlast without the last source's gradient.
  Dev a(64 * 4), y(64 * 2), r(4 * 4);
  const float* src[1] = {a.f()};
  float* none[1] = {nullptr};
  EXPECT_THROW(oc::attnres_norm_forward(src, 1, 4, 16, a.f(), a.f(), 1e-6f, nullptr, 1e-5f, y.p, r.f()), Error);
  EXPECT_THROW(oc::attnres_norm_backward(src, 1, 4, 16, a.f(), a.f(), 1e-6f, a.f(), 1e-5f, r.f(), a.f(), none,
                                         nullptr, nullptr, nullptr, y.p),
               Error);
}

// Deferred closed-source gradients: R reads over the same C closed sources (each with its own last source, query,
// norm gain and output gradient), once with every read updating all gradients and once deferred and flushed. The
// last sources' gradients, dlast, dw, dgamma and dgn must be the same bits (the same arithmetic); the closed ones
// are untouched until the flush and then agree to bf16 rounding of δ. C = 5 takes two flush passes.
TEST(NormsCuda, AttnResDeferred) {
  REQUIRE_GPU();
  struct AC {
    int64_t C, R, T, d;
  };
  const float eps = 1e-6f, eps_n = 1e-5f;
  for (const AC ac : {AC{3, 3, 3000, 1536}, AC{5, 4, 200, 768}, AC{1, 2, 77, 512}}) {
    const int64_t N = ac.C + 1;
    ASSERT_TRUE(oc::attnres_can_defer(N, ac.d));
    const size_t n = size_t(ac.T * ac.d);
    Sources closed(ac.C, n, uint64_t(500 + ac.C), [](int64_t) { return false; });
    struct Read {
      Vec last, w, gamma, gn, dy;
      std::unique_ptr<Dev> glast, gw, gg, ggn, gdy, grs, gy;
    };
    std::vector<Read> reads(size_t(ac.R));
    for (int64_t r = 0; r < ac.R; ++r) {
      Read& rd = reads[size_t(r)];
      const uint64_t s0 = uint64_t(700 + 10 * r);
      rd.last = randn(n, s0, 1.0 + 0.3 * double(r)), rd.w = randn(size_t(ac.d), s0 + 1, 0.05);
      rd.gamma = gain(size_t(ac.d), s0 + 2, 0.2), rd.gn = gain(size_t(ac.d), s0 + 3, 0.2);
      rd.dy = randn(n, s0 + 4, 1.0);
      rd.glast = std::make_unique<Dev>(n * 4), rd.gw = std::make_unique<Dev>(size_t(ac.d) * 4);
      rd.gg = std::make_unique<Dev>(size_t(ac.d) * 4), rd.ggn = std::make_unique<Dev>(size_t(ac.d) * 4);
      rd.gdy = std::make_unique<Dev>(n * 4), rd.grs = std::make_unique<Dev>(size_t(ac.T) * 4);
      rd.gy = std::make_unique<Dev>(n * 2);
      up(*rd.glast, rd.last), up(*rd.gw, rd.w), up(*rd.gg, rd.gamma), up(*rd.ggn, rd.gn), up(*rd.gdy, rd.dy);
    }
    auto srcs = [&](const Read& rd) {
      std::vector<const float*> v = closed.gvp;
      v.push_back(rd.glast->f());
      return v;
    };
    for (const Read& rd : reads) {  // the forward's rstd of each read
      oc::attnres_norm_forward(srcs(rd).data(), N, ac.T, ac.d, rd.gw->f(), rd.gg->f(), eps, rd.ggn->f(), eps_n,
                               rd.gy->p, rd.grs->f());
    }
    const Vec dlast0 = randn(n, 901, 0.1), dp0 = randn(size_t(ac.d), 902, 0.1);
    Dev gdlast(n * 4), gdw(size_t(ac.d) * 4), gdg(size_t(ac.d) * 4), gdgn(size_t(ac.d) * 4), gb(n * 2);
    // Per mode: the closed gradients, and per read the last source's gradient, its bf16 copy, dw, dgamma, dgn.
    struct Out {
      std::vector<Vec> closed, last, lastb, dw, dg, dgn;
    };
    Out out[2];
    std::vector<std::unique_ptr<Dev>> delta, coef, q;
    std::vector<oc::AttnResDeferred> df(size_t(ac.R));
    for (int64_t r = 0; r < ac.R; ++r) {
      delta.push_back(std::make_unique<Dev>(n * 2)), coef.push_back(std::make_unique<Dev>(size_t(ac.T * ac.C) * 16));
      q.push_back(std::make_unique<Dev>(size_t(ac.d) * 4));
      df[size_t(r)].closed = ac.C, df[size_t(r)].delta = delta.back()->p, df[size_t(r)].coef = coef.back()->f();
      df[size_t(r)].q = q.back()->f();
    }
    for (int mode = 0; mode < 2; ++mode) {  // 0: every read updates every gradient, 1: deferred + flush
      closed.reset_device_grads();
      for (int64_t r = 0; r < ac.R; ++r) {
        const Read& rd = reads[size_t(r)];
        up(gdlast, dlast0), up(gdw, dp0), up(gdg, dp0), up(gdgn, dp0);
        std::vector<float*> dv = closed.gdvp;  // the closed pointers are passed either way (ignored when deferred)
        dv.push_back(gdlast.f());
        oc::attnres_norm_backward(srcs(rd).data(), N, ac.T, ac.d, rd.gw->f(), rd.gg->f(), eps, rd.ggn->f(), eps_n,
                                  rd.grs->f(), rd.gdy->f(), dv.data(), gdw.f(), gdg.f(), gdgn.f(), gb.p, nullptr,
                                  mode ? &df[size_t(r)] : nullptr);
        kc::synchronize();
        Out& o = out[mode];
        o.last.push_back(down<float>(gdlast, n)), o.lastb.push_back(down_bf16(gb, n));
        o.dw.push_back(down<float>(gdw, size_t(ac.d))), o.dg.push_back(down<float>(gdg, size_t(ac.d)));
        o.dgn.push_back(down<float>(gdgn, size_t(ac.d)));
        for (int64_t j = 0; mode && j < ac.C; ++j)
          EXPECT_EQ(down<float>(*closed.gdv[size_t(j)], n), closed.dv0[size_t(j)])
              << "deferred read " << r << " wrote closed source " << j;
      }
      if (mode) {
        oc::attnres_flush(closed.gvp.data(), ac.C, ac.T, ac.d, df.data(), ac.R, closed.gdvp.data());
        kc::synchronize();
      }
      for (int64_t j = 0; j < ac.C; ++j) out[mode].closed.push_back(down<float>(*closed.gdv[size_t(j)], n));
    }
    EXPECT_EQ(out[0].last, out[1].last) << "last-source gradients differ";
    EXPECT_EQ(out[0].lastb, out[1].lastb) << "dlast differs";
    EXPECT_EQ(out[0].dw, out[1].dw) << "dw differs";
    EXPECT_EQ(out[0].dg, out[1].dg) << "dgamma differs";
    EXPECT_EQ(out[0].dgn, out[1].dgn) << "dgn differs";
    double e = 0, moved = 0;  // moved: how far the reads took the closed gradients (so the check can fail)
    for (int64_t j = 0; j < ac.C; ++j) {
      e = std::max(e, err(out[0].closed[size_t(j)], out[1].closed[size_t(j)]));
      moved = std::max(moved, err(out[0].closed[size_t(j)], closed.dv0[size_t(j)]));
    }
    std::printf("attnres deferred C%lld R%lld T%lld d%lld: closed dv %.2e (reads moved them by %.2e)\n",
                (long long)ac.C, (long long)ac.R, (long long)ac.T, (long long)ac.d, e, moved);
    EXPECT_LE(e, 2e-3);  // δ stored as bf16
    EXPECT_GE(moved, 0.1);
  }
  // Bad arguments: nothing or everything deferred, a flush over reads with another closed count, too wide.
  Dev a(64 * 4), y(64 * 2), r(4 * 4), c(4 * 16 * 2);
  const float* src[2] = {a.f(), a.f()};
  float* dv[2] = {a.f(), a.f()};
  oc::AttnResDeferred bad;
  bad.delta = y.p, bad.coef = c.f(), bad.q = a.f();
  for (const int64_t cl : {0, 2}) {
    bad.closed = cl;
    EXPECT_THROW(oc::attnres_norm_backward(src, 2, 4, 16, a.f(), a.f(), 1e-6f, a.f(), 1e-5f, r.f(), a.f(), dv,
                                           nullptr, nullptr, nullptr, nullptr, nullptr, &bad),
                 Error);
  }
  bad.closed = 2;
  EXPECT_THROW(oc::attnres_flush(src, 1, 4, 16, &bad, 1, dv), Error);
  EXPECT_FALSE(oc::attnres_can_defer(9, 1536));
}
