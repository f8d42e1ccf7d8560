// run_training (train_common.hpp): the part of `train` and `sft` after their flags.
#include "apps/longmoe/train_common.hpp"

#include <cmath>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "apps/longmoe/infer_common.hpp"
#include "core/error.hpp"
#include "dist/comm.hpp"
#include "infer/retrieval_eval.hpp"
#include "io/file.hpp"
#include "train/trainer.hpp"

namespace lm::app {
namespace {

// RunConfig::eval_retrieval: every stage-<i> of the run without a retrieval.jsonl yet is loaded and measured on
// `device` (so a resumed run measures only what is missing), one JSON line per task and length.
void eval_stage_retrieval(const train::RunConfig& cfg, const std::string& device) {
  for (size_t i = 0; i < cfg.stages.size(); ++i) {
    const std::filesystem::path dir = std::filesystem::path(cfg.out) / fmt::format("stage-{}", i);
    const std::filesystem::path file = dir / "retrieval.jsonl";
    if (!std::filesystem::exists(dir / "config.json") || std::filesystem::exists(file)) continue;
    InferArgs a;
    a.model = dir.string();
    a.device = device;
    a.context = cfg.eval_retrieval.longest();
    a.prefix_cache_mb = 0;  // (every prompt is new)
    infer::LoadedModel m = a.load();
    cfg.eval_retrieval.validate(*m.tokenizer, "eval_retrieval");
    infer::OwnedEngine engine = a.engine(m);
    std::string lines;
    infer::eval_retrieval(*engine, *m.tokenizer, cfg.eval_retrieval, [&](const infer::RetrievalPoint& p) {
      std::printf("stage %zu: %s\n", i, infer::describe(p, cfg.eval_retrieval.needles).c_str());
      std::fflush(stdout);
      io::json row = p.to_json();
      row["stage"] = i;
      lines += row.dump() + "\n";
    });
    io::write_file_atomic(file.string(), lines);
  }
}

}  // namespace

void RunFlags::add(CLI::App& sub) {
  sub.add_flag("--resume", resume, "Continue the run in --out from its latest checkpoint");
  sub.add_flag("--overwrite", overwrite, "Start over in an --out that holds another run (removes its checkpoints)");
  sub.add_option("--out", out, "Run folder (overrides the config's 'out')");
  sub.add_option("--max-steps", max_steps, "Stop after this many optimiser steps");
  sub.add_flag("--quiet", quiet, "No progress output");
  sub.add_option("--device", device, "cpu, or cuda (AdamW + QB on the GPU; same checkpoints, see docs/gpu.md)");
}

int run_training(const io::json& base, const std::string& ctx, const Overrides& overrides, const RunFlags& f,
                 const std::string& verb) {
  LM_CHECK(!(f.resume && f.overwrite), "{}: --resume continues the run in --out, --overwrite replaces it; give one",
           verb);
  io::json j = base;
  overrides(j);
  if (!f.out.empty()) j["out"] = f.out;
  const std::string out = j.value("out", std::string("runs/default"));
  const std::filesystem::path saved = std::filesystem::path(out) / "run.json";
  train::RunConfig cfg;
  if (f.resume && std::filesystem::exists(saved)) {
    train::RunConfig s = train::RunConfig::load(saved.string());
    io::json want = s.to_json();
    overrides(want);
    LM_CHECK(train::RunConfig::from_json(want, saved.string()).to_json() == s.to_json(),
             "--resume: the command-line overrides contradict the run being resumed ({}); drop them to continue it "
             "as it was started",
             saved.string());
    s.out = out;
    s.max_steps = f.max_steps >= 0 ? f.max_steps : j.value("max_steps", int64_t{0});
    if (j.contains("parallel")) {  // a checkpoint is the same for any layout: a run may resume on another world size
      io::json p = s.to_json();
      p["parallel"] = j["parallel"];
      s.parallel = train::RunConfig::from_json(p, ctx).parallel;
    }
    s.validate(saved.string() + " (with --config's parallel layout)");
    cfg = s;
  } else {
    if (f.max_steps >= 0) j["max_steps"] = f.max_steps;
    cfg = train::RunConfig::from_json(j, ctx);
  }
  train::TrainOptions opt;
  opt.resume = f.resume;
  opt.overwrite = f.overwrite;
  opt.quiet = f.quiet;
  opt.device = f.device;
  const auto r = train::train(cfg, opt);
  if (dist::world().rank() != 0) return r.interrupted ? 130 : 0;  // (data parallel: rank 0 reports)
  if (r.interrupted) {
    std::printf("interrupted after %ld steps; checkpoint %s (continue with --resume)\n", static_cast<long>(r.steps),
                r.checkpoint.c_str());
    return 130;
  }
  // Held-out perplexity is measured at stage ends; a run stopped by --max-steps inside its first
  // stage has none.
  const std::string ppl = r.stage_heldout_ppl.empty() ? std::string("n/a (no stage finished)")
                                                      : fmt::format("{:.2f}", r.heldout_ppl);
  std::printf("final: held-out ppl %s (unigram ppl %.2f), train loss %.4f, %.0f tokens/s, checkpoint %s\n",
              ppl.c_str(), r.unigram_ppl, r.final_train_loss, r.tokens_per_s, r.checkpoint.c_str());
  if (!r.maxvio_worst.empty()) {
    const auto b = train::summarize_balance(r, 0.3, 50);
    std::string line = b.first_step_below > 0 ? fmt::format("first below 0.3 at step {}", b.first_step_below)
                                              : std::string("never below 0.3");
    if (!std::isnan(b.median_after))
      line += fmt::format("; after step 50: median {:.3f}, max {:.3f}", b.median_after, b.max_after);
    std::printf("balance: worst-layer MaxVio %s\n", line.c_str());
  }
  if (!cfg.eval_retrieval.empty()) eval_stage_retrieval(cfg, f.device);
  return 0;
}

}  // namespace lm::app
