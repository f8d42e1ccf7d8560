#pragma once
// Each verb of the CLI lives in its own file and registers itself here, so verbs can be added
// without touching main.cpp.
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace lm::app {

struct Command {
  std::string name;
  std::string help;
  // Adds options to `sub` and returns the action run when the verb is chosen (returns exit code).
  std::function<std::function<int()>(CLI::App& sub)> setup;
};

std::vector<Command>& registry();

struct Register {
  explicit Register(Command c) { registry().push_back(std::move(c)); }
};

}  // namespace lm::app
