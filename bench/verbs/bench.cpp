// `longmoe bench <what> [flags]`: nested verbs registered by each benchmark file.
#include "bench/verbs/bench.hpp"

#include <map>
#include <memory>
#include <vector>

#include "core/rng.hpp"
#include "ops/gemm/gemm.hpp"

namespace lm::app {

std::vector<Command>& bench_registry() {
  static std::vector<Command> r;
  return r;
}

double measure_sgemm_gflops(int n, int reps) {
  std::vector<float> a(static_cast<size_t>(n) * n), b(a.size()), c(a.size());
  Rng r{1, 2};
  for (size_t i = 0; i < a.size(); ++i) a[i] = r.normal(i), b[i] = r.normal(i + a.size());
  const double s = time_median([&] { ops::matmul(a.data(), false, b.data(), false, c.data(), n, n, n); }, reps);
  return 2.0 * n * n * static_cast<double>(n) / s / 1e9;
}

namespace {
Register reg({"bench", "Benchmarks that print their figures and the comparison they are about", [](CLI::App& sub) {
                sub.require_subcommand(1);
                auto actions = std::make_shared<std::map<CLI::App*, std::function<int()>>>();
                for (auto& c : bench_registry()) {
                  CLI::App* s = sub.add_subcommand(c.name, c.help);
                  (*actions)[s] = c.setup(*s);
                }
                return [actions] {
                  for (auto& [s, act] : *actions)
                    if (s->parsed()) return act();
                  return 1;
                };
              }});
}  // namespace

}  // namespace lm::app
