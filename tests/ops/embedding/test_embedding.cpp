// Embedding: gather, out-of-range ids (clear error, nothing written), scatter-add with repeated ids
// vs a naive loop, the adjoint identity, accumulation, thread-count independence.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/embedding/embedding.hpp"
#include "tests/testing.hpp"

using namespace lm;
using namespace lm::ops;
using lm::testing::randn;

namespace {

std::vector<int32_t> make_ids(int64_t T, int64_t vocab, uint64_t seed) {
  const auto u = lm::testing::randu(T, seed, 0.0, 1.0);
  std::vector<int32_t> ids(T);
  // Skewed towards small ids so rows repeat often (as frequent tokens do).
  for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>(std::min<double>(vocab - 1, u[t] * u[t] * vocab));
  return ids;
}

}  // namespace

TEST(Embedding, ForwardGathersRows) {
  const int64_t vocab = 50, d = 7, T = 30;
  const auto table = randn(vocab * d, 1);
  const auto ids = make_ids(T, vocab, 2);
  std::vector<double> out(T * d);
  embedding_forward(ids.data(), T, table.data(), vocab, d, out.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < d; ++c) EXPECT_EQ(out[t * d + c], table[ids[t] * d + c]);
}

TEST(Embedding, OutOfRangeIdsAreClearErrors) {
  const int64_t vocab = 10, d = 4;
  const auto table = randn(vocab * d, 3);
  for (const int32_t bad : {10, -1, -100, 1 << 30}) {
    const std::vector<int32_t> ids{1, 2, bad, 3};
    std::vector<double> out(4 * d, -5.0), dtable(vocab * d, 0.0);
    try {
      embedding_forward(ids.data(), 4, table.data(), vocab, d, out.data());
      FAIL() << "expected lm::Error for id " << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("position 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("[0, 10)"), std::string::npos) << msg;
    }
    for (double x : out) EXPECT_EQ(x, -5.0);  // nothing written
    EXPECT_THROW(embedding_backward(ids.data(), 4, out.data(), vocab, d, dtable.data()), Error);
    for (double x : dtable) EXPECT_EQ(x, 0.0);
  }
}

TEST(Embedding, BackwardScatterAddsRepeatedIds) {
  const int64_t vocab = 20, d = 130, T = 200;  // d > 64: several column work items
  const auto ids = make_ids(T, vocab, 4);
  const auto dout = randn(T * d, 5);
  std::vector<double> dtable(vocab * d, 1.0), naive(vocab * d, 1.0);
  embedding_backward(ids.data(), T, dout.data(), vocab, d, dtable.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < d; ++c) naive[ids[t] * d + c] += dout[t * d + c];
  EXPECT_EQ(dtable, naive);  // same summation order (token order): bitwise
  // Adjoint: <embed(table), dout> = <table, scatter(dout)>.
  const auto table = randn(vocab * d, 6);
  std::vector<double> out(T * d), g(vocab * d, 0.0);
  embedding_forward(ids.data(), T, table.data(), vocab, d, out.data());
  embedding_backward(ids.data(), T, dout.data(), vocab, d, g.data());
  EXPECT_NEAR(lm::testing::dot(out, dout), lm::testing::dot(table, g), 1e-10);
}

TEST(Embedding, BackwardIsThreadCountIndependent) {
  const int64_t vocab = 1000, d = 256, T = 5000;
  const auto ids = make_ids(T, vocab, 7);
  const auto dout = randn<float>(T * d, 8);
  std::vector<float> a(vocab * d, 0.0f), b(vocab * d, 0.0f);
  const int saved = num_threads();
  set_num_threads(1);
  embedding_backward(ids.data(), T, dout.data(), vocab, d, a.data());
  set_num_threads(2);
  embedding_backward(ids.data(), T, dout.data(), vocab, d, b.data());
  set_num_threads(saved);
  EXPECT_EQ(a, b);
}
