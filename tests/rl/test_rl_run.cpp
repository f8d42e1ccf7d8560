// The RL loop (rl/rl_run.hpp) on configs/k3-rl-tiny.json from a random tiny checkpoint: it logs iteration and
// held-out rows and sample trajectories, pauses trajectories at the token deadline, trains (the weights move), and a
// run stopped after 2 iterations and resumed equals the uninterrupted one (metrics and weights, bit for bit).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "core/error.hpp"
#include "io/checkpoint.hpp"
#include "io/file.hpp"
#include "io/tokenizer.hpp"
#include "model/model.hpp"
#include "rl/demos.hpp"
#include "rl/rl_run.hpp"
#include "train/tiny_run.hpp"
#include "testing.hpp"

namespace fs = std::filesystem;
using namespace lm;
using namespace lm::rl;

namespace {

fs::path root() {
  static const fs::path p = [] {
    const fs::path d = fs::temp_directory_path() / ("lm_rlrun_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  return p;
}

// A random tiny model with a tokenizer trained on demonstrations: the checkpoint the runs start from.
std::string init_checkpoint() {
  static const std::string dir = [] {
    const fs::path d = root() / "init";
    fs::create_directories(d);
    std::vector<std::string> texts;
    io::write_file_atomic((root() / "demos.jsonl").string(),
                          demos_jsonl({TaskKind::Arithmetic, TaskKind::Lookup}, 16, 1, 3));
    for (const auto& c : io::read_demos((root() / "demos.jsonl").string()))
      for (const auto& m : c) texts.push_back(m.content);
    io::Tokenizer::TrainOptions o;
    o.vocab_size = 400;
    io::Tokenizer::train(texts, (d / "tokenizer.model").string(), o);
    model::ModelConfig c = model::ModelConfig::from_json(io::json::parse(train::tiny::kTinyModel), "tiny");
    c.vocab_size = io::Tokenizer::load((d / "tokenizer.model").string()).vocab_size();
    model::Model<float> m(c);
    m.params().init(4);
    c.save((d / "config.json").string());
    io::save_checkpoint(d.string(), m.params().named(DType::F32), uint64_t{1} << 30);
    return d.string();
  }();
  return dir;
}

RlConfig tiny(const std::string& out) {
  io::json j = io::load_json_file(std::string(LONGMOE_SOURCE_DIR) + "/configs/k3-rl-tiny.json");
  j["init"] = init_checkpoint();
  j["out"] = (root() / out).string();
  return RlConfig::from_json(j, "k3-rl-tiny");
}

std::vector<io::json> lines(const fs::path& p) {
  std::vector<io::json> r;
  std::ifstream f(p);
  for (std::string l; std::getline(f, l);) r.push_back(io::json::parse(l));
  return r;
}

// The metrics rows without their wall times.
std::vector<io::json> timeless(std::vector<io::json> rows) {
  for (auto& r : rows)
    for (const char* k : {"seconds", "rollout_seconds", "eval_seconds"}) r.erase(k);
  return rows;
}

std::vector<float> weights(const std::string& ckpt) {
  const io::Checkpoint c = io::Checkpoint::open(ckpt);
  std::vector<float> w;
  for (const auto& n : c.names()) {
    const Tensor t = c.get_as(n, DType::F32);
    w.insert(w.end(), t.data<float>(), t.data<float>() + t.numel());
  }
  return w;
}

}  // namespace

TEST(RlRun, LogsTrainsAndResumesExactly) {
  const RlConfig a = tiny("whole");
  const RlResult ra = run_rl(a, {false, false, true});
  EXPECT_EQ(ra.iterations, 4);
  const auto ma = lines(fs::path(a.out) / "metrics.jsonl");
  // Held-out rows at 0, 2, 4; iteration rows 1-4 with the metrics plot reads.
  int evals = 0, iters = 0, paused = 0, trained = 0;
  for (const auto& r : ma) {
    if (r.contains("eval_success")) {
      ++evals;
      continue;
    }
    ++iters;
    paused += r["paused"].get<int>();
    if (r["groups_trained"].get<int>() > 0) {
      ++trained;
      for (const char* k : {"reward", "success", "turns", "traj_tokens", "kl", "entropy", "clip_frac", "loss"})
        EXPECT_TRUE(r.contains(k)) << k;
      EXPECT_GT(r["entropy"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(evals, 3);
  EXPECT_EQ(iters, 4);
  EXPECT_GT(paused, 0);   // the deadline paused trajectories
  EXPECT_GE(trained, 2);
  EXPECT_FALSE(lines(fs::path(a.out) / "samples.jsonl").empty());
  EXPECT_NE(weights(ra.checkpoint), weights((fs::path(init_checkpoint()) / "model.safetensors").string()));
  EXPECT_TRUE(fs::exists(fs::path(a.out) / "summary.json"));

  RlConfig b = tiny("pieces");
  b.max_iterations = 2;
  const RlResult rb1 = run_rl(b, {false, false, true});
  EXPECT_EQ(rb1.iterations, 2);
  EXPECT_FALSE(fs::exists(fs::path(b.out) / "summary.json"));
  b.max_iterations = 0;
  const RlResult rb2 = run_rl(b, {true, false, true});
  EXPECT_EQ(rb2.iterations, 4);
  EXPECT_EQ(timeless(lines(fs::path(b.out) / "metrics.jsonl")), timeless(ma));
  EXPECT_EQ(weights(rb2.checkpoint), weights(ra.checkpoint));
  EXPECT_EQ(lines(fs::path(b.out) / "samples.jsonl"), lines(fs::path(a.out) / "samples.jsonl"));
  // A new run into a folder that holds one is refused, and nothing there changes.
  EXPECT_THROW(run_rl(b, {false, false, true}), Error);
  EXPECT_EQ(weights(io::resolve_checkpoint(b.out) + "/model.safetensors"), weights(ra.checkpoint));
}

// A second optimiser step on the same rollouts sees ratios away from 1 (the first is on-policy: exactly 1 up to the
// rollout's and the training forward's rounding, except for tokens sampled before a pause), and the run ends on other
// weights than the single-epoch one.
TEST(RlRun, SecondEpochRatiosLeaveOne) {
  RlConfig one = tiny("epochs1"), two = tiny("epochs2");
  two.epochs = 2;
  const RlResult r1 = run_rl(one, {false, false, true}), r2 = run_rl(two, {false, false, true});
  const auto most = [](const RlResult& r) {
    double m = 0;
    for (const auto& row : r.metrics) m = std::max(m, row.value("ratio_dev", 0.0));
    return m;
  };
  EXPECT_LT(most(r1), 1e-2);
  EXPECT_GT(most(r2), 3 * most(r1));
  EXPECT_NE(weights(r1.checkpoint), weights(r2.checkpoint));
  std::printf("mean |ratio - 1|, largest over the iterations: 1 epoch %.2e, 2 epochs %.2e\n", most(r1), most(r2));
}

TEST(RlRun, ConfigErrorsNameTheField) {
  io::json j = io::load_json_file(std::string(LONGMOE_SOURCE_DIR) + "/configs/k3-rl-tiny.json");
  j["init"] = "x";
  j["grpo"]["group_size"] = 1;
  try {
    RlConfig::from_json(j, "cfg");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("group_size"), std::string::npos) << e.what();
  }
  j["grpo"]["group_size"] = 2;
  j["rollout"]["max_turns"] = "three";
  EXPECT_THROW(RlConfig::from_json(j, "cfg"), Error);
  j["rollout"].erase("max_turns");
  j["iteratons"] = 3;
  try {
    RlConfig::from_json(j, "cfg");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("iteratons"), std::string::npos) << e.what();
  }
}

// The verb: a run stopped by --max-iterations and continued with --resume --out finishes; a finished run says so;
// flags that contradict a resumed run are refused and change nothing.
TEST(RlCli, RunsResumesAndRefusesContradictions) {
  const auto longmoe = [](const std::string& args, int* rc) {
    const lm::testing::CliRun r = lm::testing::run_longmoe("rl " + args);
    *rc = r.rc;
    return r.out;
  };
  const RlConfig c = tiny("cli");
  const fs::path cfg = root() / "cli.json";
  io::write_file_atomic(cfg.string(), c.to_json().dump());
  int rc = 0;
  std::string out = longmoe("--quiet --config '" + cfg.string() + "' --max-iterations 2", &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_FALSE(fs::exists(fs::path(c.out) / "summary.json"));
  out = longmoe("--quiet --resume --out '" + c.out + "'", &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("rl: 4 iterations"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(fs::path(c.out) / "summary.json"));
  const auto rows = lines(fs::path(c.out) / "metrics.jsonl");
  EXPECT_EQ(rows.size(), 7u);  // 4 iterations and held-out rows at 0, 2, 4
  out = longmoe("--quiet --resume --out '" + c.out + "'", &rc);
  EXPECT_EQ(rc, 0);
  EXPECT_NE(out.find("has finished (4 of 4 iterations)"), std::string::npos) << out;
  out = longmoe("--quiet --resume --out '" + c.out + "' --iterations 9", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("drop --init and --iterations"), std::string::npos) << out;
  EXPECT_EQ(lines(fs::path(c.out) / "metrics.jsonl"), rows);
  out = longmoe("--quiet", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("give --config"), std::string::npos) << out;
}
