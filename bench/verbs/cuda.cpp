// `longmoe bench attention|moe --device cuda [--reps N] [--peer]`, and the GPU side of `longmoe bench kda --device
// cuda`: the CUDA benchmarks of bench/cuda, with the peer (PyTorch: SDPA for attention, torch._grouped_mm for the
// expert GEMMs) measured in the same run by bench/peer_attention_moe.py when python3 with torch is present. The
// KDA table prints the fla figures quoted in the CUDA issue beside ours (fla is not installed on the device).
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <unistd.h>

#include "bench/verbs/bench.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#ifdef LONGMOE_HAVE_CUDA_BENCH
#include "bench/cuda/benches.hpp"
#endif

namespace lm::app {

namespace {

#ifdef LONGMOE_HAVE_CUDA_BENCH
std::string peer_script() { return env::peer_script(LONGMOE_PEER_SCRIPT); }
#endif

}  // namespace

int run_cuda_bench(const std::string& what, int reps, bool prof, bool peer) {
#ifndef LONGMOE_HAVE_CUDA_BENCH
  (void)what, (void)reps, (void)prof, (void)peer;
  throw Error("bench --device cuda: longmoe was built without CUDA (nvcc was not found at build time)");
#else
  LM_CHECK(reps > 0, "bench: --reps must be positive");
  if (what == "kda") {
    const int rc = bench_cuda::kda(reps, prof);
    LM_CHECK(rc == 0, "bench kda --device cuda: no usable CUDA device");
    return 0;
  }
  LM_CHECK(what == "attention" || what == "moe", "bench: unknown CUDA benchmark '{}'", what);
  std::string path;
  FILE* f = nullptr;
  if (peer) {
    char tmpl[] = "/tmp/longmoe-bench-XXXXXX";
    const int fd = mkstemp(tmpl);
    LM_CHECK(fd >= 0, "bench: cannot create a temporary file for the peer results");
    path = tmpl;
    f = fdopen(fd, "w");
  }
  bench_cuda::set_results_file(f);
  const int rc = what == "attention" ? bench_cuda::attention(reps) : bench_cuda::moe(reps);
  bench_cuda::set_results_file(nullptr);
  if (f) std::fclose(f);
  if (rc != 0) {
    if (!path.empty()) std::remove(path.c_str());
    throw Error(fmt::format("bench {} --device cuda: no usable CUDA device", what));
  }
  if (peer) {
    std::fflush(stdout);
    if (std::system("python3 -c 'import torch' >/dev/null 2>&1") != 0) {
      std::printf("\npeer: not measured (python3 with torch is not available here)\n");
    } else {
      const std::string cmd =
          fmt::format("python3 '{}' --{} '{}' --reps {}", peer_script(), what, path, std::max(3, reps));
      std::printf("\npeer, same run: %s\n", cmd.c_str());
      std::fflush(stdout);
      const int prc = std::system(cmd.c_str());
      if (prc != 0) std::printf("peer: the driver failed (status %d)\n", prc);
    }
    std::remove(path.c_str());
  }
  return 0;
#endif
}

namespace {

struct Args {
  std::string device = "cuda";
  int reps = 20;
  bool peer = false;
};

Command cuda_verb(const char* name, const char* help) {
  return Command{name, help, [name](CLI::App& sub) {
                   auto a = std::make_shared<Args>();
                   sub.add_option("--device", a->device, "cuda (the CPU side of this op is in longmoe_gbench)");
                   sub.add_option("--reps", a->reps, "Timed repetitions (median reported)");
                   sub.add_flag("--peer", a->peer, "Measure the PyTorch peer in the same run (python3 + torch)");
                   return [a, name] {
                     LM_CHECK(a->device == "cuda", "bench {}: only --device cuda is available (CPU: longmoe_gbench)",
                              name);
                     return run_cuda_bench(name, a->reps, false, a->peer);
                   };
                 }};
}

RegisterBench reg_attention(cuda_verb("attention",
                                      "Causal MLA attention and the absorbed decode on the GPU (peer: SDPA / cuDNN)"));
RegisterBench reg_moe(cuda_verb("moe", "Grouped expert GEMMs and routing on the GPU (peer: torch._grouped_mm)"));

}  // namespace

}  // namespace lm::app
