// longmoe: train, generate, chat, serve, eval, bench, params, verify. One verb per file.
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>

#include "apps/longmoe/commands.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "dist/comm.hpp"
#include "dist/nccl.hpp"

namespace lm::app {
std::vector<Command>& registry() {
  static std::vector<Command> r;
  return r;
}
}  // namespace lm::app

namespace {

// Runtime settings that OpenBLAS and the OpenMP runtime read from the environment when they load,
// before main() runs: the only way to change them is a fresh process image with a new environment.
//  * Debian's OpenBLAS files recent AVX-512 CPUs (AMD Zen 4/5) under "Haswell" (AVX2); its SkylakeX
//    kernels run sgemm about twice as fast there.
//  * OMP_WAIT_POLICY=passive: idle OpenMP threads sleep instead of spinning. Decode alternates tiny
//    parallel regions with serial work, and spinning threads took the cores from it: k3-small decode
//    on 2 cores went from 79 to 241 tokens/s, for ~1% of training throughput.
// A variable the user has set is left alone; LONGMOE_NO_REEXEC=1 turns this off.
void reexec_with_runtime_env(char** argv) {
  if (lm::env::no_reexec()) return;
  bool changed = false;
  if (!std::getenv("OMP_WAIT_POLICY")) {
    setenv("OMP_WAIT_POLICY", "passive", 1);
    changed = true;
  }
  __builtin_cpu_init();
  if (!std::getenv("OPENBLAS_CORETYPE") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
    changed = true;
  }
  if (changed) execv("/proc/self/exe", argv);  // returns only on failure: then carry on as we are
}

}  // namespace

int main(int argc, char** argv) {
  reexec_with_runtime_env(argv);
  // Activations are allocated per step; keep freed blocks in the heap instead of returning them to
  // the kernel, so later steps reuse warm pages instead of faulting fresh zeroed ones in.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  CLI::App app{"longmoe: a native engine for K3-class hybrid MoE models (KDA + gated MLA + LatentMoE)"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Expand all help");
  int threads = 0;
  // OpenMP (libgomp) crashes when asked for tens of thousands of threads: bound it.
  app.add_option("--threads", threads, "CPU threads in [1, 1024] (default: all cores)")->check(CLI::Range(1, 1024));

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
    lm::dist::abort_job_and_devices(2);  // under mpirun: no other rank may wait for this one in a collective
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "longmoe: internal error: %s\n", e.what());
    lm::dist::abort_job_and_devices(3);
    return 3;
  }
  return 1;
}
