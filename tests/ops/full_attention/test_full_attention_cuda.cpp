// Full (non-causal) varlen attention on the GPU against the CPU fp32 path (ops/full_attention) on the same
// bf16-rounded inputs: q, k, v column slices of one [rows, 3Q] buffer, o and do strided wider than Q, media of
// very different lengths (an empty one too) in one call, forward o and lse, backward dq, dk, dv (the CPU
// backward reads the GPU's o and lse, so both differentiate the same function), and bitwise repeats; each case on
// the tensor-core kernels (the default for these aligned strides) and on the fp32 CUDA-core kernels
// (FullAttnShape::cuda_cores, or chosen by an unaligned stride). Skips without a CUDA device.
//
// Legend: rows packed tokens, N media, H heads, Dh head dim, Q = H·Dh, ld = 3Q, ldo = Q + pad.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/full_attention/cuda/full_attention_cuda.hpp"
#include "ops/full_attention/full_attention.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

namespace {

// Columns [c0, c0 + n) of every row of a [rows, ld] matrix.
Vec slice(const Vec& a, int64_t rows, int64_t ld, int64_t c0, int64_t n) {
  Vec r(size_t(rows * n));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < n; ++c) r[size_t(i * n + c)] = a[size_t(i * ld + c0 + c)];
  return r;
}

// One configuration: forward and backward vs the CPU, then a repeat with identical bits.
void run_case(const std::vector<int64_t>& lens, int64_t H, int64_t Dh, uint64_t seed, bool cuda_cores,
              float scale = 0.f, int64_t pad = 8) {
  std::vector<int64_t> cu{0};
  for (const int64_t T : lens) cu.push_back(cu.back() + T);
  const int64_t rows = cu.back(), N = int64_t(lens.size()), Q = H * Dh, ld = 3 * Q, ldo = Q + pad;
  const float sc = scale > 0.f ? scale : float(1.0 / std::sqrt(double(Dh)));
  // sd 1.5: scores of a few units, so the softmax is far from uniform.
  const Vec qkv = round_bf16(randn(size_t(rows * ld), seed, 1.5));
  const Vec dout = round_bf16(randn(size_t(rows * ldo), seed + 1, 1.0));

  ops::FullAttnDims d;
  d.H = H, d.D = Dh, d.cu_seqlens = cu.data(), d.N = N, d.ld_qkv = ld, d.ld_o = ldo;
  Vec o_ref(size_t(rows * ldo), 0.f), lse_ref(size_t(rows * H));
  ops::full_attention_forward<float>(qkv.data(), qkv.data() + Q, qkv.data() + 2 * Q, o_ref.data(), lse_ref.data(), d,
                                     sc);

  oc::FullAttnShape s;
  s.H = H, s.Dh = Dh, s.cu_seqlens = cu.data(), s.N = N, s.ld_qkv = ld, s.ld_o = ldo, s.scale = scale;
  s.cuda_cores = cuda_cores;
  Dev gqkv(qkv.size() * 2), go(size_t(rows * ldo) * 2), glse(size_t(rows * H) * 4), gdo(dout.size() * 2),
      gd(qkv.size() * 2);
  up_bf16(gqkv, qkv), up_bf16(gdo, dout);
  const auto* q = static_cast<const uint16_t*>(gqkv.p);
  auto* g = static_cast<uint16_t*>(gd.p);
  oc::full_attention_forward(s, q, q + Q, q + 2 * Q, go.p, glse.f());
  const Vec o = down_bf16(go, size_t(rows * ldo));
  const Vec lse = down<float>(glse, size_t(rows * H));
  const std::vector<uint8_t> o_bytes = bytes_of(go, size_t(rows * ldo) * 2), lse_bytes = bytes_of(glse, lse.size() * 4);
  oc::full_attention_backward(s, q, q + Q, q + 2 * Q, go.p, glse.f(), gdo.p, g, g + Q, g + 2 * Q);
  const Vec dqkv = down_bf16(gd, qkv.size());
  const std::vector<uint8_t> d_bytes = bytes_of(gd, qkv.size() * 2);

  // CPU backward from the GPU's o (bf16) and lse.
  Vec dqkv_ref(qkv.size(), 0.f);
  ops::full_attention_backward<float>(qkv.data(), qkv.data() + Q, qkv.data() + 2 * Q, o.data(), lse.data(), dout.data(),
                                      dqkv_ref.data(), dqkv_ref.data() + Q, dqkv_ref.data() + 2 * Q, d, sc);

  // Repeat both: identical bits.
  oc::full_attention_forward(s, q, q + Q, q + 2 * Q, go.p, glse.f());
  oc::full_attention_backward(s, q, q + Q, q + 2 * Q, go.p, glse.f(), gdo.p, g, g + Q, g + 2 * Q);
  const bool same = bytes_of(go, o_bytes.size()) == o_bytes && bytes_of(glse, lse_bytes.size()) == lse_bytes &&
                    bytes_of(gd, d_bytes.size()) == d_bytes;
  kc::synchronize();

  // o's columns past Q keep the poison (0xff bytes) of Dev: never written.
  size_t pad_written = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = Q; c < ldo; ++c) {
      const size_t b = size_t(r * ldo + c) * 2;
      pad_written += o_bytes[b] != 0xff || o_bytes[b + 1] != 0xff;
    }
  const double eo = err(slice(o_ref, rows, ldo, 0, Q), slice(o, rows, ldo, 0, Q));
  const double el = err(lse_ref, lse);
  const double edq = err(slice(dqkv_ref, rows, ld, 0, Q), slice(dqkv, rows, ld, 0, Q));
  const double edk = err(slice(dqkv_ref, rows, ld, Q, Q), slice(dqkv, rows, ld, Q, Q));
  const double edv = err(slice(dqkv_ref, rows, ld, 2 * Q, Q), slice(dqkv, rows, ld, 2 * Q, Q));
  std::printf("full attention %s N%lld rows%lld H%lld Dh%lld ldo%lld: o %.2e, lse %.2e, dq %.2e, dk %.2e, dv %.2e, "
              "repeat %s\n",
              cuda_cores || pad % 8 ? "fp32" : "tc", (long long)N, (long long)rows, (long long)H, (long long)Dh,
              (long long)ldo, eo, el, edq, edk, edv,
              same ? "identical" : "DIFFERS");
  EXPECT_LE(eo, kTolBf16);
  EXPECT_LE(el, 1e-5);  // fp32 output from fp32 math on the same inputs
  EXPECT_LE(edq, kTolBf16);
  EXPECT_LE(edk, kTolBf16);
  EXPECT_LE(edv, kTolBf16);
  EXPECT_TRUE(same);
  EXPECT_EQ(pad_written, 0u);
}

}  // namespace

TEST(OpsCuda, FullAttentionMediaOfMixedLengths) {
  REQUIRE_GPU();
  // 1 row, one tile exactly, an empty media, a partial tile, several tiles with a partial last one.
  const std::vector<int64_t> lens = {1, 16, 64, 0, 77, 300};
  uint64_t seed = 500;
  for (const bool cc : {false, true})
    for (const int64_t Dh : {int64_t(32), int64_t(64), int64_t(96), int64_t(128), int64_t(40), int64_t(8)})
      run_case(lens, 2, Dh, seed += 10, cc);
  run_case(lens, 2, 64, seed += 10, false, 0.f, 3);  // ld_o not a multiple of 8: the fp32 kernels
}

TEST(OpsCuda, FullAttentionExplicitScaleAndOneLongMedia) {
  REQUIRE_GPU();
  for (const bool cc : {false, true}) run_case({1000}, 3, 64, 777, cc, 0.05f);
}

TEST(OpsCuda, FullAttentionMoreMediaThanOneLaunchTable) {
  REQUIRE_GPU();
  // 1000 media of 0..6 rows (the kernels' table holds 480 per launch) and a longer one at the end.
  std::vector<int64_t> lens;
  for (int i = 0; i < 1000; ++i) lens.push_back((i * 7) % 7 == 0 ? i % 7 : 0);
  lens.push_back(130);
  for (const bool cc : {false, true}) run_case(lens, 1, 32, 4242, cc);
}

TEST(OpsCuda, FullAttentionRejectsBadShapes) {
  // Shape checks come before any CUDA call: no device needed.
  const int64_t cu[] = {0, 4};
  oc::FullAttnShape s;
  s.H = 1, s.cu_seqlens = cu, s.N = 1;
  s.Dh = 100;  // not a multiple of 8
  EXPECT_THROW(oc::full_attention_forward(s, nullptr, nullptr, nullptr, nullptr, nullptr), lm::Error);
  s.Dh = 136;  // above 128
  EXPECT_THROW(oc::full_attention_backward(s, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                           nullptr),
               lm::Error);
  s.Dh = 64, s.ld_qkv = 32;  // stride below H·Dh
  EXPECT_THROW(oc::full_attention_forward(s, nullptr, nullptr, nullptr, nullptr, nullptr), lm::Error);
  const int64_t bad[] = {0, 5, 3};
  s.ld_qkv = 0, s.cu_seqlens = bad, s.N = 2;  // decreasing offsets
  EXPECT_THROW(oc::full_attention_forward(s, nullptr, nullptr, nullptr, nullptr, nullptr), lm::Error);
}
