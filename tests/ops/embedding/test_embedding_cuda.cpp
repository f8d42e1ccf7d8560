// The token embedding (forward gather and backward scatter-add) on the GPU against the CPU fp32 op. Skips
// without a CUDA device.
//
// Legend: T tokens, d hidden, vocab table rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/embedding/cuda/embedding_cuda.hpp"
#include "ops/embedding/embedding.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

TEST(NormsCuda, Embedding) {
  REQUIRE_GPU();
  const int64_t vocab = 50, T = 300;
  // Ids drawn from the first 40 rows only (many repeats, and unused rows that must stay as they were).
  const Vec u = lm::testing::randu<float>(size_t(T), 41, 0.0, 1.0);
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[size_t(t)] = std::min<int32_t>(39, int32_t(u[size_t(t)] * 40.f));
  ids[5] = ids[6] = ids[7] = 3;  // adjacent repeats
  for (const int64_t d : {256, 100, 30}) {  // vector paths, partly scalar (d % 8 != 0), scalar
    const Vec table = round_bf16(randn(size_t(vocab * d), uint64_t(d + 42), 1.0));
    const Vec dout = randn(size_t(T * d), uint64_t(d + 43), 1.0);
    const Vec dt0 = randn(size_t(vocab * d), uint64_t(d + 44), 1.0);
    Vec out_ref(size_t(T * d)), dt_ref = dt0;
    ops::embedding_forward<float>(ids.data(), T, table.data(), vocab, d, out_ref.data());
    ops::embedding_backward<float>(ids.data(), T, dout.data(), vocab, d, dt_ref.data());

    Dev gi(ids.size() * 4), gt(table.size() * 2), go(out_ref.size() * 4), gdo(dout.size() * 4), gdt(dt0.size() * 4);
    up(gi, ids), up_bf16(gt, table), up(gdo, dout), up(gdt, dt0);
    oc::embedding_forward(gi.i(), T, gt.p, d, go.f());
    oc::embedding_backward(ids.data(), T, gdo.f(), vocab, d, gdt.f());
    kc::synchronize();
    const Vec out = down<float>(go, out_ref.size()), dt = down<float>(gdt, dt0.size());
    const double edt = err(dt_ref, dt);
    std::printf("embedding T%lld vocab%lld d%lld: out %.2e dtable %.2e\n", (long long)T, (long long)vocab,
                (long long)d, err(out_ref, out), edt);
    EXPECT_EQ(out, out_ref);  // a bf16 -> fp32 copy is exact
    EXPECT_LE(edt, kTolF32);
    for (int64_t r = 40; r < vocab; ++r)
      for (int64_t c = 0; c < d; ++c)
        ASSERT_EQ(dt[size_t(r * d + c)], dt0[size_t(r * d + c)]) << "unused row " << r << " changed";
    // A second run adds the same sums again: bitwise reproducible.
    up(gdt, dt0);
    oc::embedding_backward(ids.data(), T, gdo.f(), vocab, d, gdt.f());
    kc::synchronize();
    EXPECT_EQ(down<float>(gdt, dt0.size()), dt) << "embedding backward not reproducible";
  }
  // T = 0 is a no-op; an out-of-range id throws before anything is written.
  Dev gdt(size_t(vocab) * 4 * 4);
  EXPECT_NO_THROW(oc::embedding_backward(ids.data(), 0, nullptr, vocab, 4, gdt.f()));
  const std::vector<int32_t> bad{1, 2, int32_t(vocab)};
  Dev gdo(bad.size() * 4 * 4);
  EXPECT_THROW(oc::embedding_backward(bad.data(), 3, gdo.f(), vocab, 4, gdt.f()), lm::Error);
}
