// RMSNorm (plain and gated) on the GPU against the CPU fp32 op. Skips without a CUDA device. Inputs the GPU
// reads as bf16 are rounded to bf16 on the host first, so the CPU reference sees the same values; bf16 outputs
// are compared with bf16 tolerances, fp32 ones tightly.
//
// Legend: rows independent vectors, D normalised width, ld* row strides (0: D).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "core/error.hpp"
#include "cuda_testing.hpp"
#include "ops/rmsnorm/cuda/rmsnorm_cuda.hpp"
#include "ops/rmsnorm/rmsnorm.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

TEST(NormsCuda, RmsnormForward) {
  REQUIRE_GPU();
  struct FC {
    int64_t rows, D, ldx, ldy;
    DType xt;
    bool want_rstd;
  };
  const float eps = 1e-6f;
  for (const FC fc : {FC{37, 128, 0, 0, DType::F32, true}, FC{300, 512, 576, 0, DType::BF16, true},  // MLA kv_a
                      FC{65, 2048, 0, 0, DType::BF16, true}, FC{19, 100, 103, 101, DType::F32, true},  // scalar path
                      FC{9, 1536, 1536, 1600, DType::F32, false}, FC{1000, 64, 0, 0, DType::BF16, true}}) {
    const int64_t ldx = fc.ldx ? fc.ldx : fc.D, ldy = fc.ldy ? fc.ldy : fc.D;
    const Vec x = maybe_round(randn(size_t(fc.rows * ldx), uint64_t(fc.D + 1), 1.5), fc.xt);
    const Vec w = gain(size_t(fc.D), uint64_t(fc.D + 2), 0.1);
    Vec y_ref(size_t(fc.rows * ldy)), rstd_ref(size_t(fc.rows));
    ops::rmsnorm_forward<float>(x.data(), w.data(), y_ref.data(), rstd_ref.data(), fc.rows, fc.D, eps, ldx, ldy);

    Dev gx(x.size() * dtype_size(fc.xt)), gw(w.size() * 4), gy(y_ref.size() * 2), gr(rstd_ref.size() * 4);
    up_as(gx, x, fc.xt), up(gw, w);
    const auto y0 = bytes_of(gy, y_ref.size() * 2);
    oc::rmsnorm_forward(gx.p, fc.xt, gw.f(), gy.p, fc.want_rstd ? gr.f() : nullptr, fc.rows, fc.D, eps, fc.ldx,
                        fc.ldy);
    kc::synchronize();
    const double ey = err(cols(y_ref, fc.rows, ldy, fc.D), cols(down_bf16(gy, y_ref.size()), fc.rows, ldy, fc.D));
    std::printf("rmsnorm fwd rows%lld D%lld ldx%lld ldy%lld x %s: y %.2e", (long long)fc.rows, (long long)fc.D,
                (long long)ldx, (long long)ldy, name(fc.xt), ey);
    EXPECT_LE(ey, kTolBf16);
    EXPECT_EQ(pad_changes(y0, bytes_of(gy, y_ref.size() * 2), fc.rows, ldy, fc.D, 2), 0u) << "wrote past D";
    if (fc.want_rstd) {
      const double er = err(rstd_ref, down<float>(gr, rstd_ref.size()));
      std::printf(" rstd %.2e", er);
      EXPECT_LE(er, kTolF32);
    }
    std::printf("\n");
  }
}

TEST(NormsCuda, RmsnormBackward) {
  REQUIRE_GPU();
  struct BC {
    int64_t rows, D, ldx, ldy, lddx;
    DType xt, dyt, dxt;
    bool acc, with_rstd, with_dw;
  };
  const float eps = 1e-6f;
  const DType F = DType::F32, B = DType::BF16;
  for (const BC bc : {BC{300, 512, 576, 0, 576, B, B, F, true, true, true},  // MLA kv_a: dx += into the 576-wide grad
                      BC{37, 128, 0, 0, 0, F, F, F, false, true, true}, BC{65, 2048, 0, 0, 0, B, B, B, false, true, true},
                      BC{19, 100, 103, 101, 102, F, B, F, false, false, true},  // scalar path, rstd recomputed
                      BC{1000, 64, 0, 0, 0, B, F, B, false, true, false},     // no dw
                      BC{20000, 64, 0, 0, 0, F, F, F, true, false, true},     // several row groups per block
                      BC{7, 1536, 0, 0, 0, B, B, F, false, true, true},
                      BC{3000, 1536, 0, 0, 0, F, F, F, false, true, true},  // the model's shape, 2 rows a block
                      BC{5, 9000, 0, 0, 0, F, F, F, false, false, true}}) {  // too wide for the register path
    const int64_t ldx = bc.ldx ? bc.ldx : bc.D, ldy = bc.ldy ? bc.ldy : bc.D, lddx = bc.lddx ? bc.lddx : bc.D;
    const Vec x = maybe_round(randn(size_t(bc.rows * ldx), uint64_t(bc.D + 11), 1.5), bc.xt);
    const Vec dy = maybe_round(randn(size_t(bc.rows * ldy), uint64_t(bc.D + 12), 1.0), bc.dyt);
    const Vec w = gain(size_t(bc.D), uint64_t(bc.D + 13), 0.1);
    const Vec dx0 = maybe_round(randn(size_t(bc.rows * lddx), uint64_t(bc.D + 14), 0.1), bc.dxt);
    const Vec dw0 = randn(size_t(bc.D), uint64_t(bc.D + 15), 0.1);
    Vec rstd(size_t(bc.rows)), y(size_t(bc.rows * bc.D));
    ops::rmsnorm_forward<float>(x.data(), w.data(), y.data(), rstd.data(), bc.rows, bc.D, eps, ldx, bc.D);
    Vec dx_cpu(size_t(bc.rows * ldx)), dw_ref = dw0;
    ops::rmsnorm_backward<float>(x.data(), w.data(), bc.with_rstd ? rstd.data() : nullptr, dy.data(), dx_cpu.data(),
                                 bc.with_dw ? dw_ref.data() : nullptr, bc.rows, bc.D, eps, ldx, ldy);
    Vec dx_ref = cols(dx_cpu, bc.rows, ldx, bc.D);
    if (bc.acc) {
      const Vec base = cols(dx0, bc.rows, lddx, bc.D);
      for (size_t i = 0; i < dx_ref.size(); ++i) dx_ref[i] += base[i];
    }

    Dev gx(x.size() * dtype_size(bc.xt)), gdy(dy.size() * dtype_size(bc.dyt)), gw(w.size() * 4),
        gr(rstd.size() * 4), gdx(dx0.size() * dtype_size(bc.dxt)), gdw(dw0.size() * 4);
    up_as(gx, x, bc.xt), up_as(gdy, dy, bc.dyt), up(gw, w), up(gr, rstd), up(gdw, dw0);
    // Run twice from the same state: the results must be bitwise equal (deterministic dw reduction).
    std::vector<uint8_t> dx_bits[2];
    std::vector<float> dw_out[2];
    for (int rep = 0; rep < 2; ++rep) {
      up_as(gdx, dx0, bc.dxt), up(gdw, dw0);
      oc::rmsnorm_backward(gx.p, bc.xt, gw.f(), bc.with_rstd ? gr.f() : nullptr, gdy.p, bc.dyt, gdx.p, bc.dxt,
                           bc.with_dw ? gdw.f() : nullptr, bc.rows, bc.D, eps, bc.ldx, bc.ldy, bc.acc, bc.lddx);
      kc::synchronize();
      dx_bits[rep] = bytes_of(gdx, dx0.size() * dtype_size(bc.dxt));
      dw_out[rep] = down<float>(gdw, dw0.size());
    }
    EXPECT_EQ(dx_bits[0], dx_bits[1]) << "dx not reproducible";
    EXPECT_EQ(dw_out[0], dw_out[1]) << "dw not reproducible";
    const double edx = err(dx_ref, cols(down_as(gdx, dx0.size(), bc.dxt), bc.rows, lddx, bc.D));
    const double edw = err(dw_ref, dw_out[0]);
    std::printf("rmsnorm bwd rows%lld D%lld ld %lld/%lld/%lld x %s dy %s dx %s%s%s: dx %.2e dw %.2e\n",
                (long long)bc.rows, (long long)bc.D, (long long)ldx, (long long)ldy, (long long)lddx, name(bc.xt),
                name(bc.dyt), name(bc.dxt), bc.acc ? " acc" : "", bc.with_rstd ? "" : " (rstd recomputed)", edx, edw);
    EXPECT_LE(edx, tol(bc.dxt));
    EXPECT_LE(edw, kTolF32);
    if (!bc.with_dw) {
      EXPECT_EQ(dw_out[0], dw0) << "dw touched although null was passed";
    }
    // Columns past D of dx keep their values (dx0 was uploaded there).
    std::vector<uint8_t> dx0_bits(dx0.size() * dtype_size(bc.dxt));
    {
      Dev tmp(dx0_bits.size());
      up_as(tmp, dx0, bc.dxt);
      dx0_bits = bytes_of(tmp, dx0_bits.size());
    }
    EXPECT_EQ(pad_changes(dx0_bits, dx_bits[0], bc.rows, lddx, bc.D, dtype_size(bc.dxt)), 0u) << "wrote past D";
  }
}

TEST(NormsCuda, RmsnormBadArgs) {
  REQUIRE_GPU();
  Dev g(1024);
  EXPECT_THROW(oc::rmsnorm_forward(g.p, DType::F16, g.f(), g.p, nullptr, 2, 8, 1e-6f), lm::Error);
  EXPECT_THROW(oc::rmsnorm_forward(g.p, DType::F32, g.f(), g.p, nullptr, 2, 8, 1e-6f, 4), lm::Error);  // ldx < D
  EXPECT_THROW(oc::rmsnorm_backward(g.p, DType::F32, g.f(), nullptr, g.p, DType::F32, g.p, DType::BF16, nullptr, 2, 8,
                                    1e-6f, 0, 0, /*accumulate_dx=*/true),
               lm::Error);
}

TEST(NormsCuda, RmsnormGated) {
  REQUIRE_GPU();
  struct GC {
    int64_t rows, D;
    bool with_rstd;
  };
  const float eps = 1e-5f;
  // D = 9000 takes the loop path, the others the register path (D = 100: scalar accesses).
  for (const GC gc : {GC{200, 128, true}, GC{33, 64, true}, GC{7, 100, false}, GC{3000, 128, false}, GC{5, 9000, true}}) {
    const size_t n = size_t(gc.rows * gc.D);
    const Vec x = round_bf16(randn(n, uint64_t(gc.D + 21), 1.0));
    const Vec gate = round_bf16(randn(n, uint64_t(gc.D + 22), 2.0));
    const Vec w = gain(size_t(gc.D), uint64_t(gc.D + 23), 0.1);
    const Vec dout = randn(n, uint64_t(gc.D + 24), 1.0);
    const Vec dw0 = randn(size_t(gc.D), uint64_t(gc.D + 25), 0.1);
    Vec out_ref(n), rstd_ref(size_t(gc.rows)), dx_ref(n), dg_ref(n), dw_ref = dw0;
    ops::rmsnorm_gated_forward<float>(x.data(), gate.data(), w.data(), out_ref.data(), rstd_ref.data(), gc.rows, gc.D,
                                      eps);
    ops::rmsnorm_gated_backward<float>(x.data(), gate.data(), w.data(), rstd_ref.data(), dout.data(), dx_ref.data(),
                                       dg_ref.data(), dw_ref.data(), gc.rows, gc.D, eps);

    Dev gx(n * 2), gg(n * 2), gw(w.size() * 4), go(n * 2), gr(rstd_ref.size() * 4), gdo(n * 4), gdx(n * 2), gdg(n * 2),
        gdw(dw0.size() * 4);
    up_bf16(gx, x), up_bf16(gg, gate), up(gw, w), up(gdo, dout), up(gdw, dw0);
    oc::rmsnorm_gated_forward(gx.p, gg.p, gw.f(), go.p, gr.f(), gc.rows, gc.D, eps);
    kc::synchronize();
    const double eo = err(out_ref, down_bf16(go, n)), er = err(rstd_ref, down<float>(gr, rstd_ref.size()));
    oc::rmsnorm_gated_backward(gx.p, gg.p, gw.f(), gc.with_rstd ? gr.f() : nullptr, gdo.f(), gdx.p, gdg.p, gdw.f(),
                               gc.rows, gc.D, eps);
    kc::synchronize();
    const double edx = err(dx_ref, down_bf16(gdx, n)), edg = err(dg_ref, down_bf16(gdg, n)),
                 edw = err(dw_ref, down<float>(gdw, dw0.size()));
    std::printf("rmsnorm gated rows%lld D%lld%s: out %.2e rstd %.2e dx %.2e dgate %.2e dw %.2e\n", (long long)gc.rows,
                (long long)gc.D, gc.with_rstd ? "" : " (rstd recomputed)", eo, er, edx, edg, edw);
    EXPECT_LE(eo, kTolBf16);
    EXPECT_LE(er, kTolF32);
    EXPECT_LE(edx, kTolBf16);
    EXPECT_LE(edg, kTolBf16);
    EXPECT_LE(edw, kTolF32);
  }
}
