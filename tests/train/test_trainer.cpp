// The trainer end to end on a tiny model and a synthetic corpus: the loss falls, a resumed run
// reproduces the uninterrupted run's losses exactly (also with synthetic passkey documents mixed in),
// a kill during a save loses only that save, bad run configs stop with a clear message.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "core/error.hpp"
#include "io/file.hpp"
#include "io/json.hpp"
#include "model/cuda/gpu_model.hpp"
#include "train/run_dir.hpp"
#include "train/trainer.hpp"
#include "testing.hpp"
#include "train/tiny_run.hpp"

namespace fs = std::filesystem;
using namespace lm;
using namespace lm::train;
using namespace lm::train::tiny;

namespace {

// Like make_corpus, with the words of the passkey template (io/retrieval.hpp) among the toy words, so
// that a 512-piece tokenizer fits passkey documents into short stages.
void make_passkey_corpus(const fs::path& dir) {
  fs::create_directories(dir);
  const char* words[] = {"the", "grass", "is", "green", "sky", "blue", "sun", "yellow", "here", "we", "go",
                         "there", "and", "back", "again", "pass", "key", "remember", "it", "what", "find",
                         "important", "information", "hidden", "inside", "a", "lot", "of", "irrelevant", "text"};
  Rng r{98, 0};
  uint64_t n = 0;
  for (int d = 0; d < 24; ++d) {
    std::ofstream f(dir / ("doc" + std::to_string(100 + d) + ".txt"));
    for (int s = 0; s < 30; ++s) {
      const int len = 4 + static_cast<int>(r.bits(n++).v[0] % 6);
      for (int w = 0; w < len; ++w) f << (w ? " " : "The ") << words[(r.bits(n++).v[0] % 30 + w * 7) % 30];
      f << ". " << (s % 10 == 9 ? "\n" : "");
    }
  }
}

// Two stages (128 then 256 tokens) with a share `fraction` of synthetic passkey documents.
RunConfig tiny_passkey_run(const fs::path& root, const std::string& out, double fraction) {
  RunConfig c = tiny_config(root, make_passkey_corpus, R"({
    "model": "", "data": {"path": "", "format": "folder", "heldout_fraction": 0.1},
    "tokenizer": {"vocab_size": 512}, "seed": 5,
    "optimizer": {"kind": "muon", "lr_adamw": 3e-3, "lr_muon": 3e-3},
    "balance": {"kind": "qb"},
    "stages": [{"seq_len": 128, "tokens": 2048, "batch_seqs": 4, "micro_seqs": 2},
               {"seq_len": 256, "tokens": 2048, "batch_seqs": 2}],
    "eval_every": 0, "eval_batches": 1, "save_every": 2 })", out, "tiny passkey run");
  c.passkey_fraction = fraction;
  c.validate("tiny passkey run");
  return c;
}

}  // namespace

// --device is checked before anything is written: an unknown device, Muon on the GPU (AdamW only there), and,
// on a machine without a GPU, cuda itself.
TEST(Trainer, DeviceChecksComeFirst) {
  const lm::testing::ScratchDir scratch("lm_trainer_device");
  const fs::path& root = scratch.path;
  TrainOptions o;
  o.quiet = true;
  o.device = "tpu";
  EXPECT_THROW(lm::train::train(tiny_run(root, (root / "tpu").string()), o), Error);
  o.device = "cuda";
  RunConfig muon = tiny_run(root, (root / "muon").string());  // the tiny run uses Muon
  EXPECT_THROW(lm::train::train(muon, o), Error);
  if (!lm::model::cuda::available()) {
    RunConfig adamw = tiny_run(root, (root / "adamw").string());
    adamw.optim.kind = "adamw";
    EXPECT_THROW(lm::train::train(adamw, o), Error);
    EXPECT_FALSE(fs::exists(root / "adamw"));
  }
  EXPECT_FALSE(fs::exists(root / "tpu"));
  EXPECT_FALSE(fs::exists(root / "muon"));
}

TEST(Trainer, LossFallsAndResumeIsExact) {
  const lm::testing::ScratchDir scratch("lm_trainer");
  const fs::path& root = scratch.path;
  TrainOptions quiet;
  quiet.quiet = true;
  const RunConfig full_cfg = tiny_run(root, (root / "full").string());
  const TrainResult full = lm::train::train(full_cfg, quiet);
  ASSERT_EQ(full.steps, 12 + 8);
  EXPECT_LT(full.losses.back(), full.losses.front() - 1.0);  // it learns
  EXPECT_TRUE(std::isfinite(full.heldout_ppl));
  EXPECT_TRUE(fs::exists(root / "full" / "stage-0" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(root / "full" / "metrics.jsonl"));
  // HF interop: the checkpoint's config names the tokenizer's special ids (<s> 1, </s> 2, <pad> 3), inside the
  // vocabulary, so transformers does not fall back to Kimi's ids.
  for (const fs::path& dir : {root / "full", root / "full" / "stage-0"}) {
    const io::json cj = io::load_json_file((dir / "config.json").string());
    const int64_t V = cj.at("vocab_size").get<int64_t>();
    EXPECT_EQ(cj.at("bos_token_id").get<int64_t>(), 1) << dir;
    EXPECT_EQ(cj.at("eos_token_id").get<int64_t>(), 2) << dir;
    EXPECT_EQ(cj.at("pad_token_id").get<int64_t>(), 3) << dir;
    EXPECT_LT(cj.at("pad_token_id").get<int64_t>(), V);
  }

  // Interrupted after 7 steps (mid stage 0; the last checkpoint is step 4), then resumed.
  RunConfig part = tiny_run(root, (root / "part").string());
  part.max_steps = 7;
  const TrainResult first = lm::train::train(part, quiet);
  ASSERT_EQ(first.steps, 7);
  part.max_steps = 0;
  TrainOptions resume = quiet;
  resume.resume = true;
  const TrainResult rest = lm::train::train(part, resume);
  ASSERT_EQ(rest.steps, full.steps);
  std::vector<double> joined(first.losses.begin(), first.losses.end());
  joined.insert(joined.end(), rest.losses.begin(), rest.losses.end());
  ASSERT_EQ(joined.size(), full.losses.size());
  for (size_t i = 0; i < joined.size(); ++i) EXPECT_EQ(joined[i], full.losses[i]) << "step " << i + 1;
  EXPECT_EQ(rest.heldout_ppl, full.heldout_ppl);
}

// Passkey documents per stage: the run resumes exactly from inside a stage, from a stage-end checkpoint
// (whose position is still in the previous stage's stream) and across a stage switch; the synthetic
// share is as configured; the held-out side (unigram baseline) is the corpus' alone.
TEST(Trainer, PasskeyDocumentsResumeExactly) {
  const lm::testing::ScratchDir scratch("lm_trainer_passkey");
  const fs::path& root = scratch.path;
  TrainOptions quiet;
  quiet.quiet = true;
  const double f = 0.2;
  const TrainResult full = lm::train::train(tiny_passkey_run(root, (root / "full").string(), f), quiet);
  ASSERT_EQ(full.steps, 4 + 4);
  ASSERT_EQ(full.stage_passkey_token_fraction.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_NEAR(full.stage_passkey_token_fraction[s], f, 0.03) << "stage " << s;
    // The share is in tokens; in documents it depends on the lengths (here the corpus' are longer).
    EXPECT_GT(full.stage_passkey_doc_fraction[s], 0.0);
    EXPECT_LT(full.stage_passkey_doc_fraction[s], 1.0);
  }
  EXPECT_TRUE(std::isfinite(full.heldout_ppl));
  const io::json summary = io::load_json_file((root / "full" / "summary.json").string());
  EXPECT_EQ(summary.at("passkey_fraction").get<double>(), f);
  EXPECT_EQ(summary.at("stage_passkey_token_fraction").size(), 2u);
  EXPECT_EQ(io::load_json_file((root / "full" / "run.json").string())["data"]["passkey_fraction"].get<double>(), f);

  // Stopped after 3 steps (mid stage 0), 4 (the end of stage 0), 6 (mid stage 1), then to the end.
  RunConfig part = tiny_passkey_run(root, (root / "part").string(), f);
  std::vector<double> joined;
  TrainOptions resume = quiet;
  resume.resume = true;
  for (const int64_t stop : {3, 4, 6, 0}) {
    part.max_steps = stop;
    const TrainResult r = lm::train::train(part, stop == 3 ? quiet : resume);
    joined.insert(joined.end(), r.losses.begin(), r.losses.end());
    if (stop) {
      ASSERT_EQ(r.steps, stop);
    }
    if (stop == 3) {  // resuming with another passkey share is refused: the position is in another stream
      try {
        lm::train::train(tiny_passkey_run(root, (root / "part").string(), 0.3), resume);
        FAIL() << "resumed with another passkey_fraction";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("passkey"), std::string::npos) << e.what();
      }
    }
    if (stop == 4) {
      const io::json st = io::load_json_file((root / "part" / "stage-0" / "trainer_state.json").string());
      EXPECT_EQ(st["stage"], 1);
      EXPECT_EQ(st["data_stage"], 0);
    }
    if (stop == 0) {
      EXPECT_EQ(r.heldout_ppl, full.heldout_ppl);
    }
  }
  ASSERT_EQ(joined.size(), full.losses.size());
  for (size_t i = 0; i < joined.size(); ++i) EXPECT_EQ(joined[i], full.losses[i]) << "step " << i + 1;

  // The unigram baseline (and the held-out split) do not see the synthetic documents.
  RunConfig plain = tiny_passkey_run(root, (root / "plain").string(), 0);
  plain.max_steps = 1;
  const TrainResult p = lm::train::train(plain, quiet);
  EXPECT_TRUE(p.stage_passkey_token_fraction.empty());
  EXPECT_EQ(p.unigram_ppl, full.unigram_ppl);
  // A stage too short for the smallest passkey document is named before any training.
  RunConfig tiny = tiny_passkey_run(root, (root / "short").string(), f);
  tiny.stages[1].seq_len = 40;
  try {
    lm::train::train(tiny, quiet);
    FAIL() << "accepted a 40-token stage with passkey documents";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stages[1]"), std::string::npos) << e.what();
  }
}

// Multi-needle documents in concatenated stages (beside passkey ones), their answers weighted: the run resumes exactly
// from inside a stage and across the stage switch, its summary names the share, and resuming with another share is
// refused.
TEST(Trainer, MultiNeedleSequencesResumeExactly) {
  const lm::testing::ScratchDir scratch("lm_trainer_multi_needle");
  const fs::path& root = scratch.path;
  auto run = [&](const std::string& out, double multi, double passkey = 0.2, double answer_weight = 20) {
    RunConfig c = tiny_passkey_run(root, (root / out).string(), passkey);
    c.stages[0].seq_len = 512, c.stages[0].tokens = 4096, c.stages[0].batch_seqs = 4;
    c.stages[1].seq_len = 1024, c.stages[1].tokens = 2048, c.stages[1].batch_seqs = 1;
    for (auto& st : c.stages) st.concat_documents = true;
    c.multi_needle_fraction = multi;
    c.answer_weight = answer_weight;
    c.validate("multi-needle run");
    return c;
  };
  TrainOptions quiet;
  quiet.quiet = true;
  const TrainResult full = lm::train::train(run("full", 0.5), quiet);
  ASSERT_EQ(full.steps, 2 + 2);
  EXPECT_EQ(io::load_json_file((root / "full" / "summary.json").string()).at("multi_needle_fraction").get<double>(),
            0.5);
  // The same synthetic positions all passkey (the same share, the same draws): the first batch differs.
  RunConfig all_passkey = run("all_passkey", 0, 0.7);
  all_passkey.max_steps = 1;
  EXPECT_NE(lm::train::train(all_passkey, quiet).losses.at(0), full.losses.at(0));
  // The answers' weight (20 here) leaves the first step's reported (unweighted) loss and changes the update.
  RunConfig unweighted = run("unweighted", 0.5, 0.2, 1);
  unweighted.max_steps = 2;
  const TrainResult u = lm::train::train(unweighted, quiet);
  EXPECT_NEAR(u.losses.at(0), full.losses.at(0), 1e-5 * full.losses.at(0));
  EXPECT_NE(u.losses.at(1), full.losses.at(1));
  RunConfig part = run("part", 0.5);
  TrainOptions resume = quiet;
  resume.resume = true;
  std::vector<double> joined;
  for (const int64_t stop : {1, 3, 0}) {
    part.max_steps = stop;
    const TrainResult r = lm::train::train(part, stop == 1 ? quiet : resume);
    joined.insert(joined.end(), r.losses.begin(), r.losses.end());
    if (stop == 1) {  // another multi-needle share: another stream
      try {
        lm::train::train(run("part", 0.3), resume);
        FAIL() << "resumed with another multi_needle_fraction";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("multi-needle"), std::string::npos) << e.what();
      }
    }
  }
  ASSERT_EQ(joined.size(), full.losses.size());
  for (size_t i = 0; i < joined.size(); ++i) EXPECT_EQ(joined[i], full.losses[i]) << "step " << i + 1;
}

TEST(Trainer, KillDuringSaveKeepsThePreviousCheckpoint) {
  const lm::testing::ScratchDir scratch("lm_trainer_kill");
  const fs::path& root = scratch.path;
  RunConfig cfg = tiny_run(root, (root / "run").string());
  io::write_file_atomic((root / "run.json").string(), cfg.to_json().dump());
  // The child dies inside the save at step 8 (the save at step 4 completed).
  const std::string cmd = "LONGMOE_CRASH_IN_SAVE_AT_STEP=8 " + std::string(LONGMOE_BINARY) + " train --quiet --config " +
                          (root / "run.json").string() + " > /dev/null 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  EXPECT_EQ(resolve_checkpoint((root / "run").string()), (root / "run" / "ckpt" / "step-00000004").string());
  EXPECT_TRUE(fs::exists(root / "run" / "ckpt" / ".tmp-step-00000008"));  // the torn save, never referenced
  TrainOptions resume;
  resume.quiet = true;
  resume.resume = true;
  const TrainResult r = lm::train::train(cfg, resume);
  EXPECT_EQ(r.steps, 20);
  EXPECT_TRUE(std::isfinite(r.heldout_ppl));
  EXPECT_FALSE(fs::exists(root / "run" / "ckpt" / ".tmp-step-00000008"));  // the next save removed it
}

// "eval_retrieval": when training ends, each stage's checkpoint is measured and its results written beside it
// (stage-<i>/retrieval.jsonl); a resumed run measures only the stages that have none yet.
TEST(Trainer, RetrievalOfEveryStageIsWrittenBesideIt) {
  const lm::testing::ScratchDir scratch("lm_trainer_retrieval");
  const fs::path& root = scratch.path;
  RunConfig cfg = tiny_run(root, (root / "run").string());
  io::json j = cfg.to_json();
  j["eval_retrieval"] = {{"passkey", {512}}, {"multi_needle", {512}}, {"trials", 2}, {"needles", 2}};
  io::write_file_atomic((root / "run.json").string(), j.dump());
  const std::string train = std::string(LONGMOE_BINARY) + " train --quiet --config " + (root / "run.json").string();
  const auto rows = [&](int stage) {
    std::vector<io::json> r;
    std::ifstream f(root / "run" / ("stage-" + std::to_string(stage)) / "retrieval.jsonl");
    for (std::string line; std::getline(f, line);) r.push_back(io::json::parse(line));
    return r;
  };
  const int64_t first_stage_steps = cfg.stage_steps()[0];
  ASSERT_EQ(std::system((train + " --max-steps " + std::to_string(first_stage_steps) + " > /dev/null 2>&1").c_str()), 0);
  ASSERT_EQ(rows(0).size(), 2u);
  EXPECT_FALSE(fs::exists(root / "run" / "stage-1"));
  const fs::path zero = root / "run" / "stage-0" / "retrieval.jsonl";
  const auto kept = fs::last_write_time(zero);
  ASSERT_EQ(std::system((train + " --resume > /dev/null 2>&1").c_str()), 0);
  EXPECT_EQ(fs::last_write_time(zero), kept);  // measured once
  for (int stage : {0, 1}) {
    const auto r = rows(stage);
    ASSERT_EQ(r.size(), 2u) << "stage " << stage;
    EXPECT_EQ(r[0]["stage"], stage);
    EXPECT_EQ(r[0]["length"], 512);
    EXPECT_EQ(r[0]["trials"], 2);
    EXPECT_TRUE(r[0].contains("passkey") && r[1].contains("multi_needle")) << r[0] << r[1];
    EXPECT_EQ(r[0]["passkey"].get<double>(), r[0]["passkey_correct"].get<double>() / 2);
    // A length with a wrong trial names the first one's number (digits) and answer; a perfect one names none.
    for (const auto& row : r) {
      const bool missed = row.value("passkey_correct", row.value("multi_needle_correct", 0)) < 2;
      ASSERT_EQ(row.contains("first_miss"), missed) << row;
      if (!missed) continue;
      const std::string want = row["first_miss"]["expected"];
      EXPECT_TRUE(!want.empty() && want.find_first_not_of("0123456789") == std::string::npos) << row;
      EXPECT_TRUE(row["first_miss"]["answer"].is_string()) << row;
    }
  }

  // A length no prompt fits is refused with the config, before the run starts.
  j["eval_retrieval"] = {{"passkey", {64}}};
  try {
    RunConfig::from_json(j, "bad run");
    ADD_FAILURE() << "passkey length 64 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("eval_retrieval"), std::string::npos) << e.what();
  }
}

namespace {

// The files `f` of folder `dir` concatenated ("" when one is missing).
std::string contents(const fs::path& dir, std::initializer_list<const char*> f) {
  std::string r;
  for (const char* n : f) {
    if (!fs::is_regular_file(dir / n)) return "";
    r += io::read_file((dir / n).string());
  }
  return r;
}

// strace's fault injection SIGKILLs `cmd` at the Nth call of each file-changing syscall, for every N from the first
// call whose trace line contains `from` to the last call of the run. Before each run restore() puts the run folder
// back; after each kill recover() (its exit status) must bring the run to the end that an uninterrupted `cmd` gives:
// the same result(). Returns {kills, kills that ended the process, runs that did not recover}.
struct Kills {
  int64_t trials = 0, killed = 0, bad = 0;
};
Kills kill_at_every_syscall(const fs::path& root, const std::string& cmd, const std::string& from,
                            const std::function<void()>& restore, const std::function<int()>& recover,
                            const std::function<std::string()>& result) {
  const std::string syscalls =
      "openat,creat,write,pwrite64,writev,ftruncate,fsync,fdatasync,rename,renameat,renameat2,mkdir,mkdirat,unlink,"
      "unlinkat,rmdir,link,linkat,symlink,copy_file_range,sendfile";
  // The uninterrupted run, traced: which calls of each syscall come from `from` on.
  restore();
  const fs::path trace = root / "trace.txt";
  EXPECT_EQ(std::system(("OMP_NUM_THREADS=1 strace -f -qq -o " + trace.string() + " -e trace=" + syscalls + " " + cmd +
                         " > /dev/null 2>&1").c_str()), 0);
  const std::string ref = result();
  EXPECT_FALSE(ref.empty()) << "the uninterrupted run left no result";
  std::map<std::string, int64_t> before, total;
  bool in = false;
  std::istringstream lines(io::read_file(trace.string()));
  for (std::string line; std::getline(lines, line);) {
    // "<pid> name(args) = ret"; resumed halves of interrupted calls ("<... name resumed>") are not calls
    const size_t sp = line.find(' '), par = line.find('(');
    if (sp == std::string::npos || par == std::string::npos || par < sp || line.find("resumed>") != std::string::npos)
      continue;
    const std::string name = line.substr(sp + 1, par - sp - 1);
    in = in || line.find(from) != std::string::npos;
    ++total[name];
    if (!in) ++before[name];
  }
  EXPECT_TRUE(in) << "the trace never touched " << from;
  Kills k;
  for (const auto& [name, n] : total)
    for (int64_t i = before[name] + 1; i <= n; ++i) {
      restore();
      const int rc = std::system(("OMP_NUM_THREADS=1 strace -f -qq -o /dev/null -e trace=" + name + " -e inject=" + name +
                                  ":signal=SIGKILL:when=" + std::to_string(i) + " " + cmd + " > /dev/null 2>&1")
                                     .c_str());
      ++k.trials, k.killed += rc != 0;
      const int rc2 = recover();
      const bool ok = rc2 == 0 && result() == ref;
      if (!ok) ADD_FAILURE() << "a kill at " << name << " call " << i << " left a run that does not recover exactly";
      k.bad += !ok;
    }
  return k;
}

int run_quiet(const std::string& cmd) { return std::system(("OMP_NUM_THREADS=1 " + cmd + " > /dev/null 2>&1").c_str()); }

}  // namespace

// A kill at every file-changing syscall of a save never leaves a run that cannot resume: every call from the first
// inside the save of step 5 (a one-step continuation of a run saved at step 4) to the last of the run; each killed
// run is then resumed, and must finish with the weights and optimiser state of an uninterrupted one, bit for bit.
TEST(Trainer, AKillAtEverySyscallOfASaveResumes) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "too slow under the sanitizers (one process pair per syscall)";
#endif
  if (std::system("strace -V > /dev/null 2>&1") != 0) GTEST_SKIP() << "strace is not installed (scripts/deps.sh)";
  const lm::testing::ScratchDir scratch("lm_trainer_strace");
  const fs::path& root = scratch.path;
  RunConfig cfg = tiny_run(root, (root / "run").string());
  cfg.max_steps = 4;
  TrainOptions quiet;
  quiet.quiet = true;
  lm::train::train(cfg, quiet);  // saved at step 4
  fs::copy(root / "run", root / "base", fs::copy_options::recursive);
  cfg.max_steps = 5;
  io::write_file_atomic((root / "run.json").string(), cfg.to_json().dump());
  const std::string bin = std::string(LONGMOE_BINARY) + " train --quiet --resume --config " + (root / "run.json").string();
  const Kills k = kill_at_every_syscall(
      root, bin, ".tmp-step-00000005",
      [&] {
        fs::remove_all(root / "run");
        fs::copy(root / "base", root / "run", fs::copy_options::recursive);
      },
      [&] { return run_quiet(bin); },
      [&] { return contents(root / "run" / "ckpt" / "step-00000005", {"model.safetensors", "optimizer.safetensors"}); });
  std::printf("[ measure  ] %lld kills inside a save (%lld of them ended the process), %lld runs that did not resume "
              "exactly\n", static_cast<long long>(k.trials), static_cast<long long>(k.killed),
              static_cast<long long>(k.bad));
  EXPECT_GT(k.killed, 10);
}

// The two saves around the ends of a run: a kill anywhere in the first save of a new run (a folder with a complete
// step folder but no `latest`, or only a torn .tmp- one) is recovered by --resume when the folder holds a checkpoint,
// else by starting again, as scripts/run.sh does; a kill anywhere from the last stage's link (out/stage-1, hard links
// of the final checkpoint) to the end is recovered by --resume, which relinks the stage and writes the summary.
TEST(Trainer, AKillInTheFirstSaveOrInTheLastStagesLinksResumes) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "too slow under the sanitizers (one process pair per syscall)";
#endif
  if (std::system("strace -V > /dev/null 2>&1") != 0) GTEST_SKIP() << "strace is not installed (scripts/deps.sh)";
  const lm::testing::ScratchDir scratch("lm_trainer_strace_ends");
  const fs::path& root = scratch.path;
  const fs::path run = root / "run";
  RunConfig cfg = tiny_run(root, run.string());
  const std::string train = std::string(LONGMOE_BINARY) + " train --quiet --config " + (root / "run.json").string();
  // The first save: a new run of 4 steps, saved at step 4.
  cfg.max_steps = 4;
  io::write_file_atomic((root / "run.json").string(), cfg.to_json().dump());
  const Kills first = kill_at_every_syscall(
      root, train, ".tmp-step-00000004", [&] { fs::remove_all(run); },
      [&] { return run_quiet(train + (run_markers(run).empty() ? "" : " --resume")); },
      [&] { return contents(run / "ckpt" / "step-00000004", {"model.safetensors", "optimizer.safetensors"}); });
  // The last stage's link: from a run stopped at step 19 (by max_steps, so it has a summary of step 19), the last
  // step, the stage end, its checkpoint and link, pruning, the summary.
  cfg.max_steps = 19;
  io::write_file_atomic((root / "run.json").string(), cfg.to_json().dump());
  fs::remove_all(run);
  ASSERT_EQ(run_quiet(train), 0);
  fs::remove_all(root / "base");
  fs::copy(run, root / "base", fs::copy_options::recursive);
  cfg.max_steps = 0;
  io::write_file_atomic((root / "run.json").string(), cfg.to_json().dump());
  const Kills last = kill_at_every_syscall(
      root, train + " --resume", "stage-1",
      [&] {
        fs::remove_all(run);
        fs::copy(root / "base", run, fs::copy_options::recursive);
      },
      [&] { return summary_of_step(run, 20) ? 0 : run_quiet(train + " --resume"); },
      [&] {
        const std::string s = contents(run / "stage-1", {"model.safetensors", "optimizer.safetensors", "config.json"});
        return summary_of_step(run, 20) ? s : std::string();
      });
  std::printf("[ measure  ] first save: %lld kills (%lld ended the process), %lld not recovered; last stage's link: "
              "%lld kills (%lld ended the process), %lld not recovered\n",
              static_cast<long long>(first.trials), static_cast<long long>(first.killed),
              static_cast<long long>(first.bad), static_cast<long long>(last.trials),
              static_cast<long long>(last.killed), static_cast<long long>(last.bad));
  EXPECT_GT(first.killed, 10);
  EXPECT_GT(last.killed, 5);
}

// A run folder belongs to one run (the older run's step numbers sorted after the new ones, so pruning by name once
// deleted each new checkpoint right after saving it).
TEST(Trainer, AnOlderRunsFolderIsRefusedOrOverwritten) {
  const lm::testing::ScratchDir scratch("lm_trainer_older");
  const fs::path& root = scratch.path;
  fs::create_directories(root / "run" / "ckpt" / "step-00000100");
  fs::create_directories(root / "run" / "ckpt" / "step-00000200");
  fs::create_directories(root / "run" / "stage-1");  // a stage the new run does not reach
  RunConfig cfg = tiny_run(root, (root / "run").string());
  cfg.max_steps = 9;  // saves at steps 4 and 8, and where it stops
  TrainOptions quiet;
  quiet.quiet = true;
  // A new run into the folder of another is refused, and the folder is left as it was.
  try {
    lm::train::train(cfg, quiet);
    ADD_FAILURE() << "a new run started in another run's folder";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--overwrite"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::exists(root / "run" / "ckpt" / "step-00000200"));
  EXPECT_FALSE(fs::exists(root / "run" / "metrics.jsonl"));
  // --overwrite starts over there: the old run's checkpoints go, the new ones stay.
  quiet.overwrite = true;
  lm::train::train(cfg, quiet);
  EXPECT_EQ(resolve_checkpoint((root / "run").string()), (root / "run" / "ckpt" / "step-00000009").string());
  EXPECT_TRUE(fs::exists(root / "run" / "ckpt" / "step-00000009" / "trainer_state.json"));
  EXPECT_FALSE(fs::exists(root / "run" / "ckpt" / "step-00000200"));
  EXPECT_FALSE(fs::exists(root / "run" / "stage-1"));
}

// Pruning keeps the newest keep_checkpoints step folders by name, and never the one just written, which `latest`
// names: step folders an older run left with later numbers (here beside a resumed run) once made every new
// checkpoint vanish right after its save, leaving `latest` dangling.
TEST(Trainer, PruningNeverRemovesTheCheckpointJustWritten) {
  const lm::testing::ScratchDir scratch("lm_trainer_prune");
  const fs::path& root = scratch.path;
  RunConfig cfg = tiny_run(root, (root / "run").string());
  cfg.max_steps = 4;
  TrainOptions o;
  o.quiet = true;
  lm::train::train(cfg, o);
  for (const char* older : {"step-00000100", "step-00000200"}) {
    fs::create_directories(root / "run" / "ckpt" / older);
    io::write_file_atomic((root / "run" / "ckpt" / older / "note").string(), "an older run's\n");
  }
  cfg.max_steps = 9;  // saves at steps 8 and 9
  o.resume = true;
  lm::train::train(cfg, o);
  const fs::path last = root / "run" / "ckpt" / "step-00000009";
  EXPECT_EQ(resolve_checkpoint((root / "run").string()), last.string());
  EXPECT_TRUE(fs::exists(last / "trainer_state.json"));
  EXPECT_TRUE(fs::exists(last / "model.safetensors"));
  EXPECT_EQ(io::read_file((root / "run" / "latest").string()), "ckpt/step-00000009\n");
  EXPECT_FALSE(fs::exists(root / "run" / "ckpt" / "step-00000004"));  // pruned: keep 2 = the newest other + step 9
  EXPECT_FALSE(fs::exists(root / "run" / "ckpt" / "step-00000008"));
  EXPECT_TRUE(fs::exists(root / "run" / "ckpt" / "step-00000200"));
}

TEST(Trainer, BadRunConfigsAreClearErrors) {
  const lm::testing::ScratchDir scratch("lm_trainer_bad");
  const fs::path& root = scratch.path;
  io::json j = tiny_run(root, (root / "x").string()).to_json();
  auto expect_error = [&](io::json bad, const std::string& needle) {
    try {
      RunConfig::from_json(bad, "bad.json");
      FAIL() << "accepted: " << bad.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  io::json b = j;
  b["stages"] = io::json::array();
  expect_error(b, "stages");
  b = j;
  b["stages"][0]["seq_len"] = "long";
  expect_error(b, "seq_len");
  b = j;
  b["balance"]["kind"] = "magic";
  expect_error(b, "balance.kind");
  b = j;
  b["learning_rate"] = 1;
  expect_error(b, "unknown field 'learning_rate'");
  b = j;
  b["stages"][0]["micro_seqs"] = 3;
  expect_error(b, "multiple of micro_seqs");
  b = j;
  b["data"]["passkey_fraction"] = 0.95;
  expect_error(b, "data.passkey_fraction must be in [0, 0.9]");
  b["data"]["passkey_fraction"] = -0.1;
  expect_error(b, "data.passkey_fraction must be in [0, 0.9]");
  b["data"]["passkey_fraction"] = "some";
  expect_error(b, "passkey_fraction");
  b["data"]["passkey_fraction"] = 0.9;
  EXPECT_EQ(RunConfig::from_json(b, "ok.json").passkey_fraction, 0.9);
  EXPECT_EQ(RunConfig::from_json(b, "ok.json").to_json()["data"]["passkey_fraction"], 0.9);
  EXPECT_EQ(RunConfig::from_json(j, "ok.json").passkey_fraction, 0.0);  // default: off
  // Multi-needle documents: a share of concat_documents stages' sequences, with the passkey ones at most 0.9.
  b = j;
  b["data"]["multi_needle_fraction"] = 0.2;
  expect_error(b, "needs concat_documents in every stage");
  for (auto& st : b["stages"]) st["concat_documents"] = true;
  EXPECT_EQ(RunConfig::from_json(b, "ok.json").multi_needle_fraction, 0.2);
  EXPECT_EQ(RunConfig::from_json(b, "ok.json").to_json()["data"]["multi_needle_fraction"], 0.2);
  b["data"]["passkey_fraction"] = 0.75;
  expect_error(b, "at most 0.9 with data.passkey_fraction");
  b["data"]["passkey_fraction"] = 0.7;
  EXPECT_DOUBLE_EQ(RunConfig::from_json(b, "ok.json").synthetic_fraction(), 0.9);
  b["data"]["multi_needle_fraction"] = -0.1;
  expect_error(b, "data.multi_needle_fraction must be in [0, 0.9]");
  EXPECT_FALSE(RunConfig::from_json(j, "ok.json").to_json()["data"].contains("multi_needle_fraction"));
  // The answers' loss weight: only where there are retrieval sequences in concat_documents stages.
  b = j;
  b["data"]["answer_weight"] = 20;
  expect_error(b, "data.answer_weight weighs the answers");
  b["data"]["passkey_fraction"] = 0.3;
  expect_error(b, "a concat_documents stage");
  b["stages"][0]["concat_documents"] = true;
  EXPECT_EQ(RunConfig::from_json(b, "ok.json").answer_weight, 20);
  EXPECT_EQ(RunConfig::from_json(b, "ok.json").to_json()["data"]["answer_weight"], 20);
  b["data"]["answer_weight"] = 0.5;
  expect_error(b, "data.answer_weight must be in [1, 1000]");
  b["data"]["answer_weight"] = "heavy";
  expect_error(b, "answer_weight");
  EXPECT_FALSE(RunConfig::from_json(j, "ok.json").to_json()["data"].contains("answer_weight"));
  // A corpus that does not exist: the error names it, and nothing is created under `out`.
  RunConfig c = RunConfig::from_json(j, "ok.json");
  c.data = (root / "missing").string();
  c.out = (root / "never").string();
  EXPECT_THROW(lm::train::train(c, TrainOptions{false, true}), Error);
}

// Every shipped run config parses (the README job, the experiments, the K3 recipe) and every model
// config it names (in this repository) builds.
TEST(Trainer, ShippedRunConfigsParse) {
  const fs::path src = fs::path(LONGMOE_SOURCE_DIR) / "configs";
  int n = 0;
  for (const auto& e : fs::directory_iterator(src)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("train-", 0) != 0) continue;
    const RunConfig c = RunConfig::load(e.path().string());
    EXPECT_FALSE(c.stages.empty()) << name;
    ++n;
  }
  EXPECT_GE(n, 3);
}

// trainer_state.json is range-checked: a step past its stage would skip the stage silently, a negative global
// step would name a checkpoint that never exists.
TEST(Trainer, TrainerStateFieldsAreRangeChecked) {
  const std::vector<int64_t> steps = {10, 20};
  auto fp = [](int64_t) { return uint64_t{7}; };
  auto state = [](int64_t stage, int64_t step, int64_t global, int64_t tokens) {
    io::json j;
    j["stage"] = stage, j["step_in_stage"] = step, j["global_step"] = global, j["tokens"] = tokens;
    j["position"] = train::Position{};
    j["data_fingerprint"] = 7;
    return j;
  };
  EXPECT_NO_THROW(train::read_trainer_state(state(1, 20, 30, 100), "ts", steps, fp));
  for (const auto& [j, what] : std::vector<std::pair<io::json, std::string>>{
           {state(1, 1000000000000, 30, 100), "step_in_stage"},
           {state(0, -1, 3, 100), "step_in_stage"},
           {state(0, 3, -5, 100), "global_step"},
           {state(-1, 0, 0, 0), "stage"},
           {state(0, 3, 3, -9), "tokens"},
           {state(2, 0, 30, 100), "nothing to resume"}}) {
    try {
      train::read_trainer_state(j, "ts", steps, fp);
      ADD_FAILURE() << j.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

// A run killed after its last stage's checkpoint but before summary.json: --resume writes the summary (the
// held-out figures of the finished weights) instead of saying there is nothing to resume; with the summary
// there, there is nothing to resume.
TEST(Trainer, ResumeFinishesARunWhoseSummaryIsMissing) {
  const lm::testing::ScratchDir scratch("lm_trainer_summary");
  const fs::path& root = scratch.path;
  RunConfig cfg = tiny_run(root, (root / "run").string());
  cfg.stages.resize(1);
  cfg.stages[0].tokens = 3 * 8 * 32;  // 3 steps
  TrainOptions o;
  o.quiet = true;
  const TrainResult full = lm::train::train(cfg, o);
  const fs::path summary = root / "run" / "summary.json";
  ASSERT_TRUE(fs::exists(summary));
  const io::json before = io::load_json_file(summary.string());
  fs::remove(summary);
  o.resume = true;
  const TrainResult again = lm::train::train(cfg, o);
  ASSERT_TRUE(fs::exists(summary));
  EXPECT_EQ(again.steps, full.steps);
  EXPECT_EQ(again.heldout_ppl, full.heldout_ppl);
  EXPECT_EQ(io::load_json_file(summary.string())["heldout_ppl"], before["heldout_ppl"]);
  try {
    lm::train::train(cfg, o);
    ADD_FAILURE() << "a finished run with its summary resumed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nothing to resume"), std::string::npos) << e.what();
  }
}
