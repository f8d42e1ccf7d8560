#pragma once
// What `train` and `sft` share: the flags of a run, resuming it with its own run.json, and the final report.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>

#include "io/json.hpp"

namespace lm::app {

struct RunFlags {
  std::string out, device = "cpu";
  bool resume = false, overwrite = false, quiet = false;
  int64_t max_steps = -1;
  void add(CLI::App& sub);  // --resume --overwrite --out --max-steps --quiet --device
};

// The command line's changes to a run config's JSON.
using Overrides = std::function<void(io::json&)>;

// A new run trains `base` (a --config file's JSON, or the verb's defaults; `ctx` names it) with the overrides. With
// --resume the run in --out continues as its run.json says (command-line overrides included), not as `base` says
// now; overrides that would change it are an error rather than a silent change of the run. Prints the result.
int run_training(const io::json& base, const std::string& ctx, const Overrides& overrides, const RunFlags& f,
                 const std::string& verb);

}  // namespace lm::app
