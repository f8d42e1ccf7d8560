// `longmoe rl --config X [--resume | --overwrite] [--out DIR] [--iterations N] [--device cuda]`: GRPO on the
// built-in agentic tasks from an sft checkpoint (rl/rl_run.hpp, docs/rl.md "longmoe rl"). --resume continues the run
// in --out as its run.json says.
#include <filesystem>
#include <memory>
#include <string>

#include "apps/longmoe/commands.hpp"
#include "core/error.hpp"
#include "io/json.hpp"
#include "rl/rl_run.hpp"

namespace {

struct Args {
  std::string config, out, init, device = "cpu";
  bool resume = false, overwrite = false, quiet = false;
  int64_t iterations = -1, max_iterations = -1;
};

int run(const Args& a) {
  namespace fs = std::filesystem;
  lm::io::json j;
  std::string ctx;
  if (a.resume && !a.out.empty() && fs::exists(fs::path(a.out) / "run.json")) {
    ctx = (fs::path(a.out) / "run.json").string();
    j = lm::io::load_json_file(ctx);
    LM_CHECK(a.init.empty() && a.iterations < 0, "rl --resume: the run continues as {} says; drop --init and "
             "--iterations (edit run.json to change it)", ctx);
  } else {
    LM_CHECK(!a.config.empty(), "rl: give --config RUN.json (or --resume --out DIR)");
    ctx = a.config;
    j = lm::io::load_json_file(a.config);
    if (!a.out.empty()) j["out"] = a.out;
    if (!a.init.empty()) j["init"] = a.init;
    if (a.iterations > 0) j["iterations"] = a.iterations;
  }
  if (a.max_iterations > 0) j["max_iterations"] = a.max_iterations;
  const lm::rl::RlConfig c = lm::rl::RlConfig::from_json(j, ctx);
  const lm::rl::RlResult r = lm::rl::run_rl(c, {a.resume, a.overwrite, a.quiet, a.device});
  if (r.metrics.empty() && r.iterations >= c.iterations) {
    std::printf("rl: the run in %s has finished (%ld of %ld iterations); nothing to do\n", c.out.c_str(),
                static_cast<long>(r.iterations), static_cast<long>(c.iterations));
    return 0;
  }
  if (r.interrupted)
    std::printf("interrupted after iteration %ld; checkpoint %s (continue with --resume --out %s)\n",
                static_cast<long>(r.iterations), r.checkpoint.c_str(), c.out.c_str());
  std::printf("rl: %ld iterations; held-out success %.3f at the start, %.3f now (%ld tasks); %.1f s; checkpoint %s\n",
              static_cast<long>(r.iterations), r.first_eval, r.last_eval, static_cast<long>(c.eval_tasks),
              r.seconds, r.checkpoint.c_str());
  return 0;
}

lm::app::Register reg({"rl", "Agentic RL (GRPO, multi-turn tool use, partial rollouts) from an sft checkpoint",
                       [](CLI::App& sub) {
                         auto a = std::make_shared<Args>();
                         sub.add_option("--config", a->config, "RL run config (JSON, docs/rl.md)")
                             ->check(CLI::ExistingFile);
                         sub.add_option("--out", a->out, "Run folder (overrides the config's 'out')");
                         sub.add_option("--init", a->init, "Checkpoint or run folder to start from (overrides)");
                         sub.add_option("--iterations", a->iterations, "Iterations (overrides)");
                         sub.add_option("--max-iterations", a->max_iterations,
                                        "Stop after this many iterations in this process (a checkpoint is saved)");
                         sub.add_flag("--resume", a->resume, "Continue the run in --out from its latest checkpoint");
                         sub.add_flag("--overwrite", a->overwrite, "Start over in an --out that holds another run");
                         sub.add_flag("--quiet", a->quiet, "No progress output");
                         sub.add_option("--device", a->device, "cpu, or cuda (training steps and rollouts on the GPU: "
                                        "AdamW; the KL reference stays on the CPU)")
                             ->check(CLI::IsMember({"cpu", "cuda"}));
                         return [a] { return run(*a); };
                       }});

}  // namespace
