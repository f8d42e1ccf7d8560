// The CPU engine (infer/engine.hpp: CpuEngine over a Session): sequences by id decoded in any subset and order give
// the Session's own results bit for bit, EngineSequence drives generate() as a Session's Sequence does, the prefix
// cache resumes through open(), and unknown ids are clear errors.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "infer/engine.hpp"
#include "infer/generate.hpp"
#include "model/model.hpp"
#include "tests/serve/harness.hpp"

using namespace lm;

namespace {

model::ModelConfig config() { return serve_test::small_config(97); }

std::vector<int32_t> tokens(int64_t n, uint64_t seed) {
  Rng r{seed, 5};
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>(r.bits(i).v[0] % 97));
  return t;
}

}  // namespace

// Three sequences through the engine, decoded in changing subsets and orders, against the same sequences run
// through the Session directly one at a time: identical logits at every step.
TEST(CpuEngine, SubsetsInAnyOrderEqualTheSessionAlone) {
  model::Model<float> m(config());
  m.params().init(3);
  infer::Session s(m, infer::SessionOptions{16, 256, 0});
  infer::CpuEngine e(s);
  const int64_t V = 97, G = 6;
  std::vector<infer::Engine::Id> ids;
  std::vector<infer::Sequence> alone;
  for (int i = 0; i < 3; ++i) {
    const auto p = tokens(10 + 13 * i, uint64_t(i));
    ids.push_back(e.open());
    EXPECT_EQ(e.prefill(ids.back(), p), s.prefill(alone.emplace_back(s.new_sequence()), p));
  }
  const std::vector<std::vector<int>> rounds = {{2, 0, 1}, {1}, {0, 2}, {2, 1, 0}, {0}, {1, 2}};
  for (int64_t g = 0; g < G; ++g) {
    const auto& order = rounds[size_t(g)];
    std::vector<infer::Engine::Id> sel;
    std::vector<int32_t> t;
    for (int i : order) sel.push_back(ids[size_t(i)]), t.push_back(static_cast<int32_t>((g * 7 + i) % V));
    const std::vector<float> lg = e.decode(sel, t);
    for (size_t j = 0; j < order.size(); ++j) {
      const std::vector<float> ref = s.decode({&alone[size_t(order[j])]}, std::span(&t[j], 1));
      EXPECT_EQ(std::vector<float>(lg.begin() + int64_t(j) * V, lg.begin() + int64_t(j + 1) * V), ref) << g << " " << j;
    }
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(e.tokens(ids[size_t(i)]), alone[size_t(i)].tokens);
  EXPECT_GT(e.cache_bytes(), 0);
  e.close(ids[0]);
  EXPECT_THROW(e.tokens(ids[0]), Error);
  const int32_t one = 1;
  EXPECT_THROW(e.decode(std::span(&ids[0], 1), std::span(&one, 1)), Error);
  EXPECT_THROW(e.open({}, 257), Error);  // a reservation past the context
}

// A prompt that shares a stored prefix opens resumed from it (pos() > 0) and continues to the same logits; an
// EngineSequence gives what a Session's own Sequence does.
TEST(CpuEngine, EngineSequenceAndPrefixResume) {
  model::Model<float> m(config());
  m.params().init(4);
  infer::Session s(m, infer::SessionOptions{16, 256, int64_t(8) << 20});
  infer::CpuEngine e(s);
  const auto p = tokens(40, 9);
  infer::Sequence direct = s.new_sequence();
  const std::vector<float> want = s.prefill(direct, p);
  // (the Session stored the snapshot at 32 tokens, the prompt's last grid point)
  const infer::Engine::Id id = e.open(p);
  EXPECT_EQ(e.pos(id), 32);
  EXPECT_EQ(e.prefill(id, std::span(p).subspan(32)), want);
  e.close(id);
  // An EngineSequence: the same logits as the Session's own Sequence (prefix cache and all); reset() starts over.
  infer::EngineSequence es(e);
  infer::Sequence q = s.new_sequence();
  infer::SessionSequence qs(s, q);
  EXPECT_EQ(es.prefill(p), qs.prefill(p));
  EXPECT_EQ(es.decode(5), qs.decode(5));
  EXPECT_EQ(es.tokens(), q.tokens);
  es.reset();
  EXPECT_EQ(es.pos(), 0);
}
