// The KDA short convolution (B×T and varlen, forward and backward) on the GPU against the CPU fp32 definition.
// Inputs the GPU reads in bf16 are rounded to bf16 on the host before the CPU reference. Skips without a CUDA
// device.
//
// Legend: B, T, C, W, N conv batch, tokens, channels, taps, sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/kda/cuda/short_conv_cuda.hpp"
#include "ops/kda/kda.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

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

// Inference: the cache of the first T0 tokens (short_conv_cache), then one short_conv_step per token for S
// sequences at once (x a column block of a wider matrix, the cache of model::KdaMixer::cache_spec) gives the
// outputs of the whole-sequence forward bit for bit (the same taps in the same order).
TEST(OpsBwdCuda, ShortConvStepContinuesTheForward) {
  REQUIRE_GPU();
  for (const int64_t W : {4, 3, 1}) {
    const int64_t S = 3, T = 20, C = 40, ld = 3 * C, cache_ld = 3 * C * (W - 1) + 5;  // per-slot stride, padded
    const Vec w = lm::testing::randn<float>(size_t(C * W), 91 + W, 0.5);
    Dev gw(w.size() * 4);
    up(gw, w);
    std::vector<Vec> x(S), y_ref(S);
    std::vector<std::unique_ptr<Dev>> gx, gy;
    kc::ConvShape s;
    s.B = 1, s.T = T, s.C = C, s.W = W, s.ldx = ld;
    for (int64_t q = 0; q < S; ++q) {  // each sequence's [T, ld] input, its columns C..2C the conv input
      x[q] = round_bf16(lm::testing::randn<float>(size_t(T * ld), 100 + q, 1.0));
      gx.push_back(std::make_unique<Dev>(x[q].size() * 2));
      gy.push_back(std::make_unique<Dev>(size_t(T * C) * 2));
      up_bf16(*gx[q], x[q]);
      kc::short_conv_forward(static_cast<uint16_t*>(gx[q]->p) + C, gw.f(), gy[q]->p, s);
      y_ref[q] = down_bf16(*gy[q], size_t(T * C));
    }
    const int64_t T0[S] = {1, 7, 2};  // the prefill lengths, then steps up to a common position
    Dev gcache(size_t(S * cache_ld) * 4 + 16);
    kc::device_fill(gcache.p, 0xff, size_t(S * cache_ld) * 4);
    for (int64_t q = 0; q < S; ++q)
      kc::short_conv_cache(static_cast<uint16_t*>(gx[q]->p) + C, ld, T0[q], gcache.f() + q * cache_ld + C * (W - 1), C,
                           W);
    size_t bad = 0;
    Dev gxs(size_t(S * ld) * 2), gys(size_t(S * C) * 2);
    for (int64_t t = 0; t < T - 7; ++t) {  // S rows, row q = sequence q's token T0[q] + t
      std::vector<uint16_t> rows(size_t(S * ld));
      for (int64_t q = 0; q < S; ++q)
        for (int64_t c = 0; c < ld; ++c) rows[size_t(q * ld + c)] = f32_to_bf16(x[q][size_t((T0[q] + t) * ld + c)]);
      kc::copy_to_device(gxs.p, rows.data(), rows.size() * 2);
      kc::short_conv_step(static_cast<uint16_t*>(gxs.p) + C, ld, gw.f(), gcache.f() + C * (W - 1), cache_ld, gys.p, S,
                          C, W);
      const Vec y = down_bf16(gys, size_t(S * C));
      for (int64_t q = 0; q < S; ++q)
        for (int64_t c = 0; c < C; ++c) bad += y[size_t(q * C + c)] != y_ref[q][size_t((T0[q] + t) * C + c)];
    }
    EXPECT_EQ(bad, 0u) << "W " << W;
  }
}

// The q, k and v steps of a decode step in one launch (short_conv_step3) equal three short_conv_step calls bit
// for bit: outputs and the caches they move on.
TEST(OpsBwdCuda, ShortConvStepOfThreeEqualsThreeSteps) {
  REQUIRE_GPU();
  const int64_t S = 5, C = 72, W = 4, ld = 3 * C + 8, cache_ld = 3 * C * (W - 1) + 3;
  const Vec x = round_bf16(lm::testing::randn<float>(size_t(S * ld), 7, 1.0));
  const Vec cache0 = round_bf16(lm::testing::randn<float>(size_t(S * cache_ld), 8, 1.0));
  Dev gx(x.size() * 2), ca(cache0.size() * 4), cb(cache0.size() * 4);
  up_bf16(gx, x), up(ca, cache0), up(cb, cache0);
  std::vector<std::unique_ptr<Dev>> gw, ya, yb;
  const float* w3[3];
  void* y3[3];
  for (int j = 0; j < 3; ++j) {
    gw.push_back(std::make_unique<Dev>(size_t(C * W) * 4));
    up(*gw.back(), lm::testing::randn<float>(size_t(C * W), 20 + j, 0.5));
    ya.push_back(std::make_unique<Dev>(size_t(S * C) * 2));
    yb.push_back(std::make_unique<Dev>(size_t(S * C) * 2));
    w3[j] = gw[size_t(j)]->f(), y3[j] = ya[size_t(j)]->p;
  }
  kc::short_conv_step3(gx.p, ld, w3, ca.f(), cache_ld, y3, S, C, W);
  for (int j = 0; j < 3; ++j)
    kc::short_conv_step(static_cast<uint16_t*>(gx.p) + j * C, ld, w3[j], cb.f() + j * C * (W - 1), cache_ld,
                        yb[size_t(j)]->p, S, C, W);
  for (int j = 0; j < 3; ++j)
    EXPECT_EQ(down<uint16_t>(*ya[size_t(j)], size_t(S * C)), down<uint16_t>(*yb[size_t(j)], size_t(S * C))) << j;
  EXPECT_EQ(down<float>(ca, cache0.size()), down<float>(cb, cache0.size()));
}

// Chunked prefill: one sequence of T tokens (x the middle column block of a [T, 3C] matrix, as the model's fused
// q/k/v projection feeds it) run in chunks through short_conv_forward_cached, each followed by
// short_conv_cache_append, gives the whole-sequence short_conv_forward's outputs bit for bit, the cache after
// every chunk holds the last W−1 inputs so far (zeros before the start; chunks shorter than W−1 and empty ones
// included), and the final cache equals short_conv_cache's after the whole sequence. Nothing is written past
// the cache.
TEST(OpsBwdCuda, ShortConvChunkedPrefillMatchesWhole) {
  REQUIRE_GPU();
  struct Case {
    int64_t T, C, W;
    std::vector<int64_t> chunks;  // the last one takes the rest
  };
  const std::vector<Case> cases = {
      {100, 256, 4, {1, 2, 37, 3, 1}},        // 4 channels per thread
      {100, 288, 4, {1, 2, 0, 37, 3, 1}},     // C = 96·3; an empty chunk
      {100, 45, 4, {1, 2, 37, 3, 1}},         // odd C: one channel per thread
      {100, 256, 2, {1, 2, 37, 3, 1}},
      {100, 288, 8, {1, 2, 3, 1, 37, 3, 1}},  // several chunks shorter than W − 1 in a row
      {100, 45, 8, {5, 1, 1, 60}},
      {100, 64, 3, {2, 1, 1, 33}},
      {100, 256, 1, {1, 2, 37, 3, 1}},        // a single tap: no cache
      {700, 256, 4, {5, 290, 1, 300}},        // chunks across thread (32) and block (256) rows
      {700, 45, 8, {255, 2, 258}},
  };
  for (const Case& cs : cases)
    for (const bool silu : {true, false}) {
      const int64_t T = cs.T, C = cs.C, W = cs.W, ld = 3 * C, CW = C * (W - 1);
      const uint64_t seed = uint64_t(T * 131 + C * 7 + W);
      const Vec x = round_bf16(lm::testing::randn<float>(size_t(T * ld), seed + 1, 1.0));
      const Vec w = lm::testing::randn<float>(size_t(C * W), seed + 2, 0.5);
      Dev gx(x.size() * 2), gw(w.size() * 4), gy_whole(size_t(T * C) * 2), gy(size_t(T * C) * 2);
      Dev gref(size_t(CW) * 4 + 16), gcache(size_t(CW + 8) * 4);  // 8 guard floats after the cache
      up_bf16(gx, x), up(gw, w);
      const uint16_t* xb = static_cast<const uint16_t*>(gx.p) + C;  // the conv input: columns C..2C
      kc::ConvShape s;
      s.B = 1, s.T = T, s.C = C, s.W = W, s.ldx = ld;
      kc::short_conv_forward(xb, gw.f(), gy_whole.p, s, silu);
      kc::short_conv_cache(xb, ld, T, gref.f(), C, W);
      if (CW) kc::device_fill(gcache.p, 0, size_t(CW) * 4);  // a fresh sequence; the guard stays 0xff
      // The cache expected after `end` tokens: slot j = input end − (W−1) + j, zero before the start.
      auto expect_cache = [&](int64_t end) {
        Vec e(size_t(CW), 0.f);
        for (int64_t c = 0; c < C; ++c)
          for (int64_t j = 0; j < W - 1; ++j) {
            const int64_t t = end - (W - 1) + j;
            if (t >= 0) e[size_t(c * (W - 1) + j)] = x[size_t(t * ld + C + c)];
          }
        return e;
      };
      // Bitwise equality of two fp32 vectors (empty ones included: W == 1).
      auto same = [](const Vec& a, const Vec& b) {
        return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
      };
      auto down_cache = [&](const Dev& d) { return CW ? down<float>(d, size_t(CW)) : Vec(); };  // W == 1: none
      std::vector<int64_t> chunks = cs.chunks;
      int64_t used = 0;
      for (const int64_t n : chunks) used += n;
      ASSERT_LT(used, T);
      chunks.push_back(T - used);
      int64_t off = 0;
      size_t bad_cache = 0;
      for (const int64_t n : chunks) {
        kc::short_conv_forward_cached(xb + off * ld, ld, gw.f(), gcache.f(), static_cast<uint16_t*>(gy.p) + off * C, n,
                                      C, W, silu);
        kc::short_conv_cache_append(xb + off * ld, ld, n, gcache.f(), C, W);  // after the forward: it read the old one
        off += n;
        const Vec got = down_cache(gcache), want = expect_cache(off);
        kc::synchronize();
        bad_cache += !same(got, want);
      }
      const auto y_whole = bytes_of(gy_whole, size_t(T * C) * 2), y = bytes_of(gy, size_t(T * C) * 2);
      const Vec c_ref = down_cache(gref), c_fin = down_cache(gcache);
      const auto c_all = bytes_of(gcache, size_t(CW + 8) * 4);
      kc::synchronize();
      const std::string what = "T " + std::to_string(T) + " C " + std::to_string(C) + " W " + std::to_string(W) +
                               " silu " + std::to_string(int(silu));
      size_t bad_y = 0;
      for (size_t i = 0; i < y.size(); i += 2) bad_y += std::memcmp(&y[i], &y_whole[i], 2) != 0;
      EXPECT_EQ(bad_y, 0u) << what << ": chunked outputs differ from the whole-sequence forward";
      EXPECT_EQ(bad_cache, 0u) << what << ": the cache after some chunk is not the last W-1 inputs";
      EXPECT_TRUE(same(c_fin, c_ref)) << what << ": final cache != short_conv_cache of the whole sequence";
      EXPECT_TRUE(same(c_ref, expect_cache(T))) << what << ": short_conv_cache is not the last W-1 inputs";
      size_t guard = 0;
      for (size_t i = size_t(CW) * 4; i < c_all.size(); ++i) guard += c_all[i] != 0xff;
      EXPECT_EQ(guard, 0u) << what << ": wrote past the cache";
    }
}

// n < W − 1 from a cache that is not zeros: the older inputs shift towards slot 0 and stay (a direct check of
// short_conv_cache_append against hand-built values), and forward_cached reads the cached history.
TEST(OpsBwdCuda, ShortConvCacheAppendShortChunk) {
  REQUIRE_GPU();
  const int64_t C = 6, W = 5, ld = C;  // cache [6, 4]
  Vec cache0(size_t(C * (W - 1))), xs(size_t(2 * C));
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < W - 1; ++j) cache0[size_t(c * (W - 1) + j)] = float(10 * c + j + 1);  // bf16-exact
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t c = 0; c < C; ++c) xs[size_t(t * C + c)] = float(-100 - 10 * c - t);
  Vec w(size_t(C * W));
  for (int64_t c = 0; c < C; ++c)
    for (int64_t k = 0; k < W; ++k) w[size_t(c * W + k)] = float(k == 0 ? 1 : 0);  // y = the oldest tap
  Dev gc(cache0.size() * 4), gx(xs.size() * 2), gw(w.size() * 4), gy(size_t(2 * C) * 2);
  up(gc, cache0), up_bf16(gx, xs), up(gw, w);
  kc::short_conv_forward_cached(gx.p, ld, gw.f(), gc.f(), gy.p, 2, C, W, /*silu=*/false);
  kc::short_conv_cache_append(gx.p, ld, 2, gc.f(), C, W);
  const Vec y = down_bf16(gy, size_t(2 * C)), got = down<float>(gc, cache0.size());
  kc::synchronize();
  size_t bad_y = 0, bad_c = 0;
  for (int64_t c = 0; c < C; ++c) {
    // Token t's oldest tap is position t − 4: cache slot t.
    for (int64_t t = 0; t < 2; ++t) bad_y += y[size_t(t * C + c)] != cache0[size_t(c * (W - 1) + t)];
    // New cache: old slots 2, 3, then x[0], x[1].
    const float want[4] = {cache0[size_t(c * (W - 1) + 2)], cache0[size_t(c * (W - 1) + 3)], xs[size_t(c)],
                           xs[size_t(C + c)]};
    for (int64_t j = 0; j < W - 1; ++j) bad_c += got[size_t(c * (W - 1) + j)] != want[j];
  }
  EXPECT_EQ(bad_y, 0u) << "forward_cached did not read the cached history";
  EXPECT_EQ(bad_c, 0u) << "short chunk: cache did not shift";
}
