// `longmoe rl-demos --kind lookup_sum --n 1000 --out demos.jsonl`: demonstrations of the built-in RL tasks, solved
// by a scripted policy with the tools (rl/demos.hpp), as a dataset for `longmoe sft`.
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>

#include "apps/longmoe/commands.hpp"
#include "io/file.hpp"
#include "rl/demos.hpp"

namespace {

using namespace lm;

struct Args {
  std::string kinds = "lookup_sum", out;
  int64_t n = 1000, size = 0;
  uint64_t seed = 1;
};

int run(const Args& a) {
  std::vector<rl::TaskKind> kinds;
  std::stringstream ss(a.kinds);
  for (std::string k; std::getline(ss, k, ',');) kinds.push_back(rl::task_kind(k));
  io::write_file_atomic(a.out, rl::demos_jsonl(kinds, a.n, a.seed, a.size));
  std::printf("%ld demonstrations (%s, seeds %lu..%lu) in %s\n", static_cast<long>(a.n), a.kinds.c_str(),
              static_cast<unsigned long>(a.seed), static_cast<unsigned long>(a.seed + a.n - 1), a.out.c_str());
  return 0;
}

app::Register reg({"rl-demos", "Write demonstrations of the built-in RL tasks (scripted tool use) for sft",
                   [](CLI::App& sub) {
                     auto a = std::make_shared<Args>();
                     sub.add_option("--kind", a->kinds, "Task kinds, comma-separated, taken in turn: arithmetic, "
                                    "lookup, lookup_sum (default lookup_sum)");
                     sub.add_option("--n", a->n, "Number of demonstrations (default 1000)")->check(CLI::PositiveNumber);
                     sub.add_option("--size", a->size, "Operations (arithmetic) or document facts (lookup kinds); "
                                    "0: 4 and 20");
                     sub.add_option("--seed", a->seed, "Task seeds are seed .. seed + n - 1 (keep RL evaluation "
                                    "seeds outside them)");
                     sub.add_option("--out", a->out, "JSONL file to write (atomically)")->required();
                     return [a] { return run(*a); };
                   }});

}  // namespace
