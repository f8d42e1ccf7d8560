// longmoe: train, generate, chat, serve, eval, bench, params, verify. One verb per file.
#include <cstdio>
#include <map>

#include "apps/longmoe/commands.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"

namespace lm::app {
std::vector<Command>& registry() {
  static std::vector<Command> r;
  return r;
}
}  // namespace lm::app

int main(int argc, char** argv) {
  CLI::App app{"longmoe: a native engine for K3-class hybrid MoE models (KDA + gated MLA + LatentMoE)"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Expand all help");
  int threads = 0;
  app.add_option("--threads", threads, "CPU threads (default: all cores)");

  std::map<CLI::App*, std::function<int()>> actions;
  for (auto& c : lm::app::registry()) {
    CLI::App* sub = app.add_subcommand(c.name, c.help);
    actions[sub] = c.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  lm::set_num_threads(threads);
  try {
    for (auto& [sub, act] : actions)
      if (sub->parsed()) return act();
  } catch (const lm::Error& e) {
    std::fprintf(stderr, "longmoe: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "longmoe: internal error: %s\n", e.what());
    return 3;
  }
  return 1;
}
