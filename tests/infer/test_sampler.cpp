// Sampler properties: greedy, top-k / top-p masks, temperature, seed reproducibility, repetition penalty,
// stop handling in the text stream, UTF-8 hold-back.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/error.hpp"
#include "infer/sampler.hpp"

using namespace lm;
using namespace lm::infer;

namespace {
std::vector<float> logits_of(std::vector<double> p) {
  std::vector<float> l;
  for (double x : p) l.push_back(static_cast<float>(std::log(x)));
  return l;
}
SamplingParams params(float t, int64_t k = 0, float p = 1.0f, float r = 1.0f, uint64_t seed = 1) {
  SamplingParams s;
  s.temperature = t, s.top_k = k, s.top_p = p, s.repetition_penalty = r, s.seed = seed;
  return s;
}
}  // namespace

TEST(Sampler, GreedyIsArgmaxLowestIdOnTies) {
  Sampler s(params(0));
  std::vector<float> l = {0.1f, 2.0f, 2.0f, -1.0f};
  EXPECT_EQ(s.sample(l.data(), 4, {}), 1);
  const auto d = s.distribution(l.data(), 4, {});
  EXPECT_EQ(d, (std::vector<float>{0, 1, 0, 0}));
}

TEST(Sampler, TopKKeepsTheKMostLikely) {
  const auto l = logits_of({0.05, 0.4, 0.1, 0.3, 0.15});
  Sampler s(params(1.0f, 2));
  const auto d = s.distribution(l.data(), 5, {});
  EXPECT_EQ(d[0], 0.0f);
  EXPECT_EQ(d[2], 0.0f);
  EXPECT_EQ(d[4], 0.0f);
  EXPECT_NEAR(d[1], 0.4 / 0.7, 1e-6);
  EXPECT_NEAR(d[3], 0.3 / 0.7, 1e-6);
  for (int i = 0; i < 200; ++i) {
    const int32_t t = s.sample(l.data(), 5, {});
    EXPECT_TRUE(t == 1 || t == 3);
  }
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  const auto l = logits_of({0.05, 0.4, 0.1, 0.3, 0.15});
  // 0.4 + 0.3 = 0.7 < 0.75 -> add 0.15: {1, 3, 4}.
  Sampler s(params(1.0f, 0, 0.75f));
  const auto d = s.distribution(l.data(), 5, {});
  EXPECT_EQ(d[0], 0.0f);
  EXPECT_EQ(d[2], 0.0f);
  EXPECT_NEAR(d[1] + d[3] + d[4], 1.0, 1e-6);
  EXPECT_NEAR(d[4], 0.15 / 0.85, 1e-6);
  // top-p below the first probability keeps one token.
  Sampler s1(params(1.0f, 0, 0.39f));
  const auto d1 = s1.distribution(l.data(), 5, {});
  EXPECT_EQ(d1[1], 1.0f);
}

TEST(Sampler, FrequenciesFollowTheDistribution) {
  const auto l = logits_of({0.5, 0.3, 0.2});
  Sampler s(params(1.0f, 0, 1.0f, 1.0f, 42));
  std::map<int32_t, int> n;
  const int N = 20000;
  for (int i = 0; i < N; ++i) ++n[s.sample(l.data(), 3, {})];
  EXPECT_NEAR(n[0] / double(N), 0.5, 0.015);
  EXPECT_NEAR(n[1] / double(N), 0.3, 0.015);
  EXPECT_NEAR(n[2] / double(N), 0.2, 0.015);
}

TEST(Sampler, TemperatureSharpensAndFlattens) {
  const auto l = logits_of({0.6, 0.3, 0.1});
  const auto cold = Sampler(params(0.5f)).distribution(l.data(), 3, {});
  const auto hot = Sampler(params(2.0f)).distribution(l.data(), 3, {});
  EXPECT_GT(cold[0], 0.6f);
  EXPECT_LT(hot[0], 0.6f);
  EXPECT_NEAR(cold[0], 0.36 / (0.36 + 0.09 + 0.01), 1e-5);
}

TEST(Sampler, SeedReproducibility) {
  std::vector<float> l(50);
  for (int i = 0; i < 50; ++i) l[i] = std::sin(i * 0.7f);
  auto run = [&](uint64_t seed, uint64_t stream) {
    Sampler s(params(1.0f, 0, 0.95f, 1.0f, seed), stream);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(l.data(), 50, {}));
    return out;
  };
  EXPECT_EQ(run(7, 0), run(7, 0));
  EXPECT_NE(run(7, 0), run(8, 0));
  EXPECT_NE(run(7, 0), run(7, 1));
}

TEST(Sampler, RepetitionPenalty) {
  std::vector<float> l = {2.0f, 1.9f, -1.0f, -1.2f};
  Sampler s(params(0, 0, 1.0f, 1.5f));
  EXPECT_EQ(s.sample(l.data(), 4, {}), 0);
  EXPECT_EQ(s.sample(l.data(), 4, {0}), 1);  // 2.0 / 1.5 < 1.9
  const auto d = Sampler(params(1.0f, 0, 1.0f, 2.0f)).distribution(l.data(), 4, {2, 2, 2});
  const auto d0 = Sampler(params(1.0f)).distribution(l.data(), 4, {2});
  EXPECT_LT(d[2], d0[2]);  // negative logit multiplied by the penalty: less likely
}

TEST(Sampler, InvalidParamsAreRejected) {
  EXPECT_THROW(Sampler(params(-1.0f)), Error);
  EXPECT_THROW(Sampler(params(1.0f, -1)), Error);
  EXPECT_THROW(Sampler(params(1.0f, 0, 0.0f)), Error);
  EXPECT_THROW(Sampler(params(1.0f, 0, 1.5f)), Error);
  EXPECT_THROW(Sampler(params(1.0f, 0, 1.0f, 0.0f)), Error);
  SamplingParams p;
  p.max_tokens = 0;
  EXPECT_THROW(Sampler{p}, Error);
  EXPECT_THROW(Sampler(params(NAN)), Error);
}

TEST(TextStream, HoldsBackPartialUtf8AndStopStrings) {
  TextStream ts({"STOP"});
  EXPECT_EQ(ts.update("Hello"), "Hello");
  EXPECT_EQ(ts.update("Hello \xC3"), " ");  // half of 'é' held back
  EXPECT_EQ(ts.update("Hello \xC3\xA9 S"), "\xC3\xA9 ");  // "S" may start "STOP"
  EXPECT_EQ(ts.update("Hello \xC3\xA9 ST"), "");
  EXPECT_EQ(ts.update("Hello \xC3\xA9 STx"), "STx");
  EXPECT_FALSE(ts.stopped());
  EXPECT_EQ(ts.update("Hello \xC3\xA9 STx STOP and more"), " ");
  EXPECT_TRUE(ts.stopped());
  EXPECT_EQ(ts.text(), "Hello \xC3\xA9 STx ");
  EXPECT_EQ(ts.update("Hello \xC3\xA9 STx STOP and more, more"), "");
  TextStream t2;
  EXPECT_EQ(t2.update("ab\xE2\x82"), "ab");
  EXPECT_EQ(t2.finish("ab\xE2\x82\xAC"), "\xE2\x82\xAC");
  TextStream t3({"END"});
  EXPECT_EQ(t3.update("xE"), "x");
  EXPECT_EQ(t3.finish("xE"), "E");  // the end of generation releases a partial stop match
}

TEST(TextStream, Utf8Prefix) {
  EXPECT_EQ(utf8_complete_prefix("abc"), 3u);
  EXPECT_EQ(utf8_complete_prefix("a\xF0\x9F\x98"), 1u);
  EXPECT_EQ(utf8_complete_prefix("a\xF0\x9F\x98\x80"), 5u);
  EXPECT_EQ(utf8_complete_prefix(""), 0u);
}
