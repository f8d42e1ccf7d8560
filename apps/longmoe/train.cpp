// `longmoe train --config RUN.json [--resume] [overrides]`: the trainer (src/train/trainer.hpp).
#include <cstdio>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "apps/longmoe/commands.hpp"
#include "core/error.hpp"
#include "dist/comm.hpp"
#include "train/trainer.hpp"

namespace {

struct Args {
  std::string config, out, model, balance, estimator, device = "cpu";
  bool resume = false, overwrite = false, quiet = false;
  int64_t max_steps = -1;
  int64_t seed = -1;
};

int run(const Args& a) {
  lm::train::RunConfig cfg = lm::train::RunConfig::load(a.config);
  if (!a.out.empty()) cfg.out = a.out;
  if (!a.model.empty()) cfg.model = a.model;
  if (a.max_steps >= 0) cfg.max_steps = a.max_steps;
  if (a.seed >= 0) cfg.seed = static_cast<uint64_t>(a.seed);
  if (!a.balance.empty() || !a.estimator.empty()) {
    lm::io::json j = cfg.to_json();
    if (!a.balance.empty()) j["balance"]["kind"] = a.balance;
    if (!a.estimator.empty()) j["balance"]["estimator"] = a.estimator;
    cfg = lm::train::RunConfig::from_json(j, a.config + " (with command-line overrides)");
  }
  LM_CHECK(!(a.resume && a.overwrite), "train: --resume continues the run in --out, --overwrite replaces it; give one");
  if (a.resume) {
    // A resumed run continues with the configuration it was started with (run.json in its folder,
    // command-line overrides included), not with whatever --config says now; an explicit override
    // that contradicts it is an error rather than a silent change of the run.
    const std::filesystem::path saved = std::filesystem::path(cfg.out) / "run.json";
    if (std::filesystem::exists(saved)) {
      lm::train::RunConfig s = lm::train::RunConfig::load(saved.string());
      lm::io::json want = s.to_json();
      if (!a.model.empty()) want["model"] = a.model;
      if (a.seed >= 0) want["seed"] = a.seed;
      if (!a.balance.empty()) want["balance"]["kind"] = a.balance;
      if (!a.estimator.empty()) want["balance"]["estimator"] = a.estimator;
      LM_CHECK(want == s.to_json(), "--resume: the command-line overrides contradict the run being resumed ({}); "
               "drop them to continue it as it was started", saved.string());
      s.out = cfg.out;
      s.max_steps = cfg.max_steps;
      s.parallel = cfg.parallel;  // a checkpoint is the same for any layout: a run may resume on another world size
      s.validate(saved.string() + " (with --config's parallel layout)");
      cfg = s;
    }
  }
  lm::train::TrainOptions opt;
  opt.resume = a.resume;
  opt.overwrite = a.overwrite;
  opt.quiet = a.quiet;
  opt.device = a.device;
  const auto r = lm::train::train(cfg, opt);
  if (lm::dist::world().rank() != 0) return r.interrupted ? 130 : 0;  // (data parallel: rank 0 reports)
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
    const auto b = lm::train::summarize_balance(r, 0.3, 50);
    std::string line = b.first_step_below > 0 ? fmt::format("first below 0.3 at step {}", b.first_step_below)
                                              : std::string("never below 0.3");
    if (!std::isnan(b.median_after))
      line += fmt::format("; after step 50: median {:.3f}, max {:.3f}", b.median_after, b.max_after);
    std::printf("balance: worst-layer MaxVio %s\n", line.c_str());
  }
  return 0;
}

lm::app::Register reg({"train", "Train a model: tokenizer, data, curriculum stages, checkpoints", [](CLI::App& sub) {
                         auto a = std::make_shared<Args>();
                         sub.add_option("--config", a->config, "Run config (JSON; see configs/train-*.json)")
                             ->required()
                             ->check(CLI::ExistingFile);
                         sub.add_flag("--resume", a->resume, "Continue the run in --out from its latest checkpoint");
                         sub.add_flag("--overwrite", a->overwrite,
                                      "Start over in an --out that holds another run (removes its checkpoints)");
                         sub.add_option("--out", a->out, "Run folder (overrides the config's 'out')");
                         sub.add_option("--model", a->model, "Model config.json (overrides the config's 'model')");
                         sub.add_option("--balance", a->balance, "MoE balancing: qb, sign, aux or none")
                             ->check(CLI::IsMember({"qb", "sign", "aux", "none"}));
                         sub.add_option("--qb-estimator", a->estimator, "Quantile Balancing estimator")
                             ->check(CLI::IsMember({"exact", "hist"}));
                         sub.add_option("--max-steps", a->max_steps, "Stop after this many optimiser steps");
                         sub.add_option("--seed", a->seed, "Seed for initialisation, split and shuffling");
                         sub.add_flag("--quiet", a->quiet, "No progress output");
                         sub.add_option("--device", a->device,
                                        "cpu, or cuda (AdamW + QB on the GPU; same checkpoints, see docs/gpu.md)");
                         return [a] { return run(*a); };
                       }});

}  // namespace
