// SiTU/SwiGLU forward and backward on the GPU against the CPU fp32 definition. Inputs the GPU reads in bf16 are
// rounded to bf16 on the host before the CPU reference. Skips without a CUDA device.
//
// Legend: rows, I GLU width.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/glu/cuda/glu_cuda.hpp"
#include "ops/glu/glu.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

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
