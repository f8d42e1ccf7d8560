// Rollouts (rl/rollout.hpp) on a tiny random model: a trajectory paused at the iteration's token deadline and
// continued later (in several pieces, through its saved JSON) ends with the same tokens, masks and episode as one
// that ran unpaused; the masks hold exactly the sampled tokens; a model that never calls a tool properly or never
// answers ends at the turn or token budget with that reason and reward 0.
#include <gtest/gtest.h>

#include <filesystem>
#include <numeric>
#include <unistd.h>

#include "infer/engine.hpp"
#include "infer/session.hpp"
#include "io/chat.hpp"
#include "io/file.hpp"
#include "io/tokenizer.hpp"
#include "model/model.hpp"
#include "rl/demos.hpp"
#include "rl/rollout.hpp"
#include "train/tiny_run.hpp"

namespace fs = std::filesystem;
using namespace lm;
using namespace lm::rl;

namespace {

const io::Tokenizer& tok() {
  static const io::Tokenizer t = [] {
    const fs::path d = fs::temp_directory_path() / ("lm_rollout_" + std::to_string(::getpid()));
    fs::create_directories(d);
    std::vector<std::string> texts;
    for (const auto& c : io::read_demos([&] {
           const std::string p = (d / "demos.jsonl").string();
           io::write_file_atomic(p, demos_jsonl({TaskKind::Arithmetic, TaskKind::Lookup}, 16, 1, 3));
           return p;
         }()))
      for (const auto& m : c) texts.push_back(m.content);
    io::Tokenizer::TrainOptions o;
    o.vocab_size = 400;
    io::Tokenizer::train(texts, (d / "tokenizer.model").string(), o);
    io::Tokenizer r = io::Tokenizer::load((d / "tokenizer.model").string());
    fs::remove_all(d);
    return r;
  }();
  return t;
}

model::Model<float>& policy() {
  static model::Model<float> m([] {
    model::ModelConfig c = model::ModelConfig::from_json(io::json::parse(train::tiny::kTinyModel), "tiny");
    c.vocab_size = tok().vocab_size();
    return c;
  }());
  static const bool init = (m.params().init(7), true);
  (void)init;
  return m;
}

RolloutConfig config() {
  RolloutConfig c;
  c.budget = {3, 2, 40};
  c.max_turn_tokens = 12;
  c.seed = 5;
  return c;
}

std::vector<Trajectory> start(int n) {
  std::vector<Trajectory> ts;
  for (int i = 0; i < n; ++i)
    ts.push_back(start_trajectory(tok(), config(), 100 + i, {i % 2 ? TaskKind::Lookup : TaskKind::Arithmetic,
                                                             uint64_t(1000 + i), i % 2 ? int64_t{3} : int64_t{2}}));
  return ts;
}

std::vector<Trajectory*> ptrs(std::vector<Trajectory>& ts) {
  std::vector<Trajectory*> p;
  for (auto& t : ts) p.push_back(&t);
  return p;
}

}  // namespace

TEST(RlRollout, APausedTrajectoryResumesExactly) {
  infer::SessionOptions so;
  so.prefix_cache_bytes = 0;
  std::vector<Trajectory> whole = start(4), parts = start(4);
  {
    infer::Session ss(policy(), so);
    infer::CpuEngine s(ss);
    const RolloutStats st = rollout(s, tok(), config(), ptrs(whole));
    EXPECT_EQ(st.paused, 0);
    EXPECT_GT(st.generated, 40);
  }
  int pauses = 0, calls = 0;
  for (const int64_t deadline : {9, 23, 5, 0}) {
    infer::Session ss(policy(), so);  // a fresh session each "iteration", as the RL loop makes one
    infer::CpuEngine s(ss);
    const RolloutStats st = rollout(s, tok(), config(), ptrs(parts), deadline);
    ++calls;
    if (deadline > 0) {
      EXPECT_GE(st.generated, deadline);
    }
    pauses += static_cast<int>(st.paused);
    for (auto& t : parts) t = Trajectory::from_json(io::json::parse(t.to_json().dump(-1, ' ', false, io::json::error_handler_t::replace)), "saved");  // as a resume
  }
  EXPECT_GT(pauses, 4);
  for (size_t i = 0; i < whole.size(); ++i) {
    const Trajectory &a = whole[i], &b = parts[i];
    ASSERT_TRUE(a.done() && b.done());
    EXPECT_EQ(a.tokens, b.tokens) << "trajectory " << i;
    EXPECT_EQ(a.mask, b.mask);
    EXPECT_EQ(a.episode.end, b.episode.end);
    EXPECT_EQ(a.episode.tokens, b.episode.tokens);
    EXPECT_EQ(a.drawn, b.drawn);
    ASSERT_EQ(a.logp.size(), b.logp.size());
    for (size_t j = 0; j < a.logp.size(); ++j) EXPECT_NEAR(a.logp[j], b.logp[j], 1e-4);
    EXPECT_GT(b.iterations, 1);
  }
}

TEST(RlRollout, MasksHoldExactlyTheSampledTokens) {
  std::vector<Trajectory> ts = start(2);
  const size_t prompt = ts[0].tokens.size();
  infer::Session ss(policy());
  infer::CpuEngine s(ss);
  rollout(s, tok(), config(), ptrs(ts));
  const Trajectory& t = ts[0];
  EXPECT_EQ(std::accumulate(t.mask.begin(), t.mask.begin() + prompt, 0), 0);  // the prompt
  const int64_t sampled = std::accumulate(t.mask.begin(), t.mask.end(), int64_t{0});
  EXPECT_EQ(sampled, t.drawn);
  EXPECT_EQ(sampled, t.episode.tokens);
  // Every tool turn's tokens (the template's rendering of it) are unmasked.
  for (const Turn& turn : t.episode.turns) {
    if (turn.role != "tool") continue;
    const auto tt = io::chat_tokens(tok(), {{"tool", turn.text}}, true, false);
    const auto at = std::search(t.tokens.begin(), t.tokens.end(), tt.begin(), tt.end());
    ASSERT_NE(at, t.tokens.end()) << "tool turn not found: " << turn.text;
    const size_t k = static_cast<size_t>(at - t.tokens.begin());
    EXPECT_EQ(std::accumulate(t.mask.begin() + k, t.mask.begin() + k + tt.size(), 0), 0);
  }
  for (size_t j = 0; j < t.mask.size(); ++j)
    if (t.mask[j]) {
      EXPECT_LT(t.logp[j], 0.0);
    } else {
      EXPECT_EQ(t.logp[j], 0.0);
    }
}

TEST(RlRollout, EndlessOrMalformedTurnsEndAtTheBudgetWithAReason) {
  // The random model writes junk: no call parses and no answer comes, so every turn is answered "give a
  // <tool_call> or an <answer>" until the turn budget; with fewer tokens than the turns need, the token budget.
  std::vector<Trajectory> ts = start(3);
  infer::Session ss(policy());
  infer::CpuEngine s(ss);
  rollout(s, tok(), config(), ptrs(ts));
  for (const Trajectory& t : ts) {
    EXPECT_TRUE(t.episode.end == "turn_budget" || t.episode.end == "token_budget") << t.episode.end;
    EXPECT_EQ(t.episode.reward, 0.0);
    EXPECT_LE(t.episode.tokens, config().budget.max_tokens + 1);
  }
  RolloutConfig small = config();
  small.budget.max_tokens = 15;
  std::vector<Trajectory> tt = start(2);
  rollout(s, tok(), small, ptrs(tt));
  for (const Trajectory& t : tt) {
    EXPECT_EQ(t.episode.end, "token_budget");
    EXPECT_EQ(t.episode.tokens, 16);
    ASSERT_GE(t.episode.turns.size(), 2u);
    EXPECT_EQ(t.episode.turns[1].role, "tool");
    EXPECT_NE(t.episode.turns[1].text.find("give a <tool_call> or an <answer>"), std::string::npos);
  }
  RolloutConfig bad = config();
  bad.budget.max_turns = 0;
  EXPECT_THROW(rollout(s, tok(), bad, ptrs(tt)), Error);
}
