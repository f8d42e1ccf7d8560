// `longmoe sft --init CKPT --data demos.jsonl --out DIR [--steps N --lr X ...]` or `longmoe sft --config RUN.json`:
// supervised fine-tuning on chat demonstrations, the loss on the assistant's tokens only (docs/rl.md). It is the
// trainer (train/trainer.hpp) with data.format "chat" and the weights of `init`; checkpoints, metrics.jsonl and
// --resume are train's.
#include <memory>
#include <string>

#include "apps/longmoe/commands.hpp"
#include "apps/longmoe/train_common.hpp"
#include "core/error.hpp"
#include "io/json.hpp"

namespace {

using lm::io::json;

struct Args {
  std::string config, init, data;
  lm::app::RunFlags run;
  int64_t steps = -1, seq_len = -1, batch = -1, seed = -1;
  double lr = -1;
};

// The defaults of a run without --config: one stage, AdamW with a short warm-up and a cosine decay.
json defaults() {
  return json::parse(R"({
    "data": {"format": "chat", "heldout_fraction": 0.05},
    "out": "runs/sft", "seed": 1,
    "optimizer": {"kind": "adamw", "lr": 1e-4, "weight_decay": 0.0, "clip": 1.0},
    "balance": {"kind": "qb"},
    "stages": [{"seq_len": 1024, "tokens": 1638400, "batch_seqs": 8,
                "schedule": {"kind": "cosine", "warmup": 0.05, "min_lr_ratio": 0.1}}],
    "eval_every": 50, "eval_batches": 8, "save_every": 100, "keep_checkpoints": 2 })");
}

int run(const Args& a) {
  LM_CHECK(!a.config.empty() || a.run.resume || (!a.init.empty() && !a.data.empty()),
           "sft: give --init (the checkpoint to fine-tune) and --data (demonstrations), or --config");
  json base = a.config.empty() ? defaults() : lm::io::load_json_file(a.config);
  const std::string ctx = (a.config.empty() ? std::string("sft") : a.config) + " (with command-line overrides)";
  return lm::app::run_training(base, ctx, [&a, ctx](json& j) {
    if (!a.init.empty()) j["init"] = a.init;
    if (!a.data.empty()) j["data"]["path"] = a.data;
    LM_CHECK(j["data"].value("format", std::string("chat")) == "chat",
             "{}: sft trains on demonstrations: data.format must be chat (got {})", ctx, j["data"]["format"].dump());
    j["data"]["format"] = "chat";
    if (a.seed >= 0) j["seed"] = a.seed;
    if (a.lr > 0) {
      j["optimizer"]["lr_adamw"] = j["optimizer"]["lr_muon"] = a.lr;
      j["optimizer"].erase("lr");
    }
    if (a.steps > 0 || a.seq_len > 0 || a.batch > 0) {
      LM_CHECK(j.contains("stages") && j["stages"].is_array() && j["stages"].size() == 1,
               "{}: --steps, --seq-len and --batch set the one stage of a run; this config has {}", ctx,
               j.contains("stages") ? j["stages"].size() : 0);
      json& s = j["stages"][0];
      if (a.seq_len > 0) s["seq_len"] = a.seq_len;
      if (a.batch > 0) s["batch_seqs"] = a.batch;
      const int64_t T = s.value("seq_len", int64_t{0}), B = s.value("batch_seqs", int64_t{8});
      // A stage is given in tokens; keep the steps it had when only the shape changes.
      const int64_t steps = a.steps > 0 ? a.steps : s.value("tokens", int64_t{0}) / std::max<int64_t>(1, T * B);
      s["tokens"] = steps * T * B;
    }
  }, a.run, "sft");
}

lm::app::Register reg({"sft", "Supervised fine-tuning on chat demonstrations (loss on the assistant's tokens)",
                       [](CLI::App& sub) {
                         auto a = std::make_shared<Args>();
                         sub.add_option("--config", a->config, "Run config (JSON, data.format chat); else defaults")
                             ->check(CLI::ExistingFile);
                         sub.add_option("--init", a->init, "Checkpoint or run folder to fine-tune (its weights, "
                                        "config and tokenizer)");
                         sub.add_option("--data", a->data, "Demonstrations: JSONL, {\"messages\": [{role, content}]} "
                                        "per line (docs/rl.md)");
                         a->run.add(sub);
                         sub.add_option("--steps", a->steps, "Optimiser steps (default 200)");
                         sub.add_option("--lr", a->lr, "Peak learning rate (default 1e-4, cosine to 10%)");
                         sub.add_option("--seq-len", a->seq_len, "Tokens per sequence (default 1024)");
                         sub.add_option("--batch", a->batch, "Sequences per step (default 8)");
                         sub.add_option("--seed", a->seed, "Seed for the held-out split and shuffling");
                         return [a] { return run(*a); };
                       }});

}  // namespace
