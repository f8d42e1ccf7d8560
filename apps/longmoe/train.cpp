// `longmoe train --config RUN.json [--resume] [overrides]`: the trainer (src/train/trainer.hpp).
#include <memory>
#include <string>

#include "apps/longmoe/commands.hpp"
#include "apps/longmoe/train_common.hpp"
#include "io/json.hpp"

namespace {

struct Args {
  std::string config, model, balance, estimator;
  lm::app::RunFlags run;
  int64_t seed = -1;
};

int run(const Args& a) {
  return lm::app::run_training(lm::io::load_json_file(a.config), a.config + " (with command-line overrides)",
                               [&a](lm::io::json& j) {
                                 if (!a.model.empty()) j["model"] = a.model;
                                 if (a.seed >= 0) j["seed"] = a.seed;
                                 if (!a.balance.empty()) j["balance"]["kind"] = a.balance;
                                 if (!a.estimator.empty()) j["balance"]["estimator"] = a.estimator;
                               },
                               a.run, "train");
}

lm::app::Register reg({"train", "Train a model: tokenizer, data, curriculum stages, checkpoints", [](CLI::App& sub) {
                         auto a = std::make_shared<Args>();
                         sub.add_option("--config", a->config, "Run config (JSON; see configs/train-*.json)")
                             ->required()
                             ->check(CLI::ExistingFile);
                         a->run.add(sub);
                         sub.add_option("--model", a->model, "Model config.json (overrides the config's 'model')");
                         sub.add_option("--balance", a->balance, "MoE balancing: qb, sign, aux or none")
                             ->check(CLI::IsMember({"qb", "sign", "aux", "none"}));
                         sub.add_option("--qb-estimator", a->estimator, "Quantile Balancing estimator")
                             ->check(CLI::IsMember({"exact", "hist"}));
                         sub.add_option("--seed", a->seed, "Seed for initialisation, split and shuffling");
                         return [a] { return run(*a); };
                       }});

}  // namespace
