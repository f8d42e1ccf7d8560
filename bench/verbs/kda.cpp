// `longmoe bench kda`: chunked KDA on the CPU, bounded vs exact diagonal tiles, forward and
// forward+backward, against this machine's sgemm rate measured in the same run. With --device cuda: the CUDA
// kernels on the shapes beside fla's figures (bench/cuda/kda.cu, run_cuda_bench).
//
// FLOPs (SPEC §2.1) per head, forward: 6·T·K·V + 3·T·C·K + T·C² (K = V there); forward+backward is
// counted as 3x forward (the usual convention: the backward does about twice the forward's work).
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "bench/verbs/bench.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/rng.hpp"
#include "ops/kda/kda.hpp"

namespace {

using namespace lm;
using namespace lm::kda;

struct Args {
  std::vector<int64_t> T{4096, 16384, 65536};
  int64_t B = 1, H = 4, K = 128, V = 128;
  int reps = 3;
  bool fused = false;
  bool no_backward = false;
  double lower_bound = -5.0;
  std::string device = "cpu";
  bool prof = false;
};

double flops_forward(const Args& a, int64_t T) {
  const double C = 64, K = static_cast<double>(a.K), V = static_cast<double>(a.V);
  return static_cast<double>(a.B * a.H) * (6.0 * T * K * V + 3.0 * T * C * K + T * C * C);
}

struct Data {
  std::vector<float> q, k, v, g, beta, A_log, dt_bias, h0, dO, dht;
  std::vector<float> o, ht, dq, dk, dv, dg, dbeta, dA, ddt, dh0;
};

Data make(const Args& a, int64_t T) {
  const int64_t rows = a.B * T, nqk = rows * a.H * a.K, nv = rows * a.H * a.V, ns = a.B * a.H * a.K * a.V;
  Data d;
  auto fill = [](std::vector<float>& x, int64_t n, uint64_t s, float sd) {
    x.resize(n);
    Rng r{s, 0};
    parallel_for(n, [&](int64_t i) { x[i] = sd * r.normal(i); }, 4096);
  };
  fill(d.q, nqk, 1, 1), fill(d.k, nqk, 2, 1), fill(d.v, nv, 3, 1), fill(d.g, nqk, 4, 1), fill(d.beta, rows * a.H, 5, 1);
  fill(d.dt_bias, a.H * a.K, 6, 0.5f), fill(d.h0, ns, 7, 0.1f), fill(d.dO, nv, 8, 1), fill(d.dht, ns, 9, 1);
  d.A_log.resize(a.H);
  for (int64_t h = 0; h < a.H; ++h) d.A_log[h] = std::log(1.0f + 15.0f * (h + 0.5f) / a.H);
  d.o.resize(nv), d.ht.resize(ns), d.dq.resize(nqk), d.dk.resize(nqk), d.dv.resize(nv), d.dg.resize(nqk);
  d.dbeta.resize(rows * a.H), d.dA.resize(a.H), d.ddt.resize(a.H * a.K), d.dh0.resize(ns);
  return d;
}

int run(const Args& a) {
  LM_CHECK(a.device == "cpu" || a.device == "cuda", "bench kda: --device must be cpu or cuda, not '{}'", a.device);
  if (a.device == "cuda") return lm::app::run_cuda_bench("kda", std::max(a.reps, 10), a.prof, false);
  LM_CHECK(a.B > 0 && a.H > 0 && a.K > 0 && a.V > 0 && a.reps > 0, "bench kda: sizes and --reps must be positive");
  const double sgemm = lm::app::measure_sgemm_gflops();
  std::printf("KDA chunked (CPU fp32, C=64, 16-row sub-tiles), B=%ld H=%ld K=%ld V=%ld, %d threads, %s\n",
              static_cast<long>(a.B), static_cast<long>(a.H), static_cast<long>(a.K), static_cast<long>(a.V),
              num_threads(), a.fused ? "fused (L2 norm, gate, beta sigmoid included)" : "core recurrence");
  std::printf("sgemm 2048^3 on this machine, same run: %.1f GFLOP/s\n", sgemm);
  std::printf("%-7s %-8s %-8s %10s %12s %10s %8s\n", "T", "pass", "path", "ms", "tokens/s", "GFLOP/s", "%sgemm");
  GateParams gate{GateForm::LowerBound, a.lower_bound};
  for (int64_t T : a.T) {
    LM_CHECK(T > 0, "bench kda: T must be positive");
    Data d = make(a, T);
    Dims dims{a.B, T, a.H, a.K, a.V};
    const float scale = 1.0f / std::sqrt(static_cast<float>(a.K));
    // Processed inputs for the core benchmark (what the fused path computes first).
    std::vector<float> qn(d.q.size()), kn(d.k.size()), gg(d.g.size()), bb(d.beta.size());
    const int64_t rows = a.B * T;
    l2norm_forward(d.q.data(), qn.data(), rows * a.H, a.K);
    l2norm_forward(d.k.data(), kn.data(), rows * a.H, a.K);
    sigmoid_forward(d.beta.data(), bb.data(), rows * a.H);
    gate_forward(d.g.data(), d.A_log.data(), d.dt_bias.data(), gg.data(), rows, a.H, a.K, gate);
    CoreInputs<float> ci{qn.data(), kn.data(), d.v.data(), gg.data(), bb.data(), d.h0.data(), scale};
    CoreGrads<float> cg{d.dq.data(), d.dk.data(), d.dv.data(), d.dg.data(), d.dbeta.data(), d.dh0.data()};
    FusedInputs<float> fi;
    fi.q = d.q.data(), fi.k = d.k.data(), fi.v = d.v.data(), fi.g_raw = d.g.data(), fi.beta_raw = d.beta.data();
    fi.A_log = d.A_log.data(), fi.dt_bias = d.dt_bias.data(), fi.h0 = d.h0.data(), fi.scale = scale, fi.gate = gate;
    FusedGrads<float> fg{d.dq.data(), d.dk.data(), d.dv.data(), d.dg.data(), d.dbeta.data(), d.dA.data(),
                         d.ddt.data(), d.dh0.data()};

    // Training keeps forward's chunk-start states for backward; so does this benchmark.
    std::vector<float> states(chunk_state_count(dims) * a.K * a.V);
    double t_fwd[2] = {0, 0}, t_all[2] = {0, 0};
    const DiagPath paths[2] = {DiagPath::Bounded, DiagPath::Exact};
    for (int p = 0; p < 2; ++p) {
      auto fwd = [&] {
        if (a.fused) fused_forward(fi, dims, d.o.data(), d.ht.data(), CorePath::Chunked, paths[p], states.data());
        else chunk_forward(ci, dims, d.o.data(), d.ht.data(), paths[p], gate, states.data());
      };
      auto bwd = [&] {
        const float* st = states.data();
        if (a.fused) fused_backward(fi, dims, d.dO.data(), d.dht.data(), fg, CorePath::Chunked, paths[p], st);
        else chunk_backward(ci, dims, d.dO.data(), d.dht.data(), cg, paths[p], gate, st);
      };
      t_fwd[p] = lm::app::time_median(fwd, a.reps);
      if (!a.no_backward) t_all[p] = lm::app::time_median([&] { fwd(); bwd(); }, a.reps);
      const double fl = flops_forward(a, T);
      auto row = [&](const char* pass, double t, double mult) {
        const double gf = mult * fl / t / 1e9;
        std::printf("%-7ld %-8s %-8s %10.2f %12.0f %10.1f %7.1f%%\n", static_cast<long>(T), pass,
                    diag_path_name(paths[p]), t * 1e3, static_cast<double>(a.B * T) / t, gf, 100.0 * gf / sgemm);
      };
      row("fwd", t_fwd[p], 1.0);
      if (!a.no_backward) row("fwd+bwd", t_all[p], 3.0);
    }
    std::printf("%-7ld bounded/exact speed-up: forward %.2fx", static_cast<long>(T), t_fwd[1] / t_fwd[0]);
    if (!a.no_backward) std::printf(", forward+backward %.2fx", t_all[1] / t_all[0]);
    std::printf("\n");
    std::fflush(stdout);
  }
  return 0;
}

lm::app::RegisterBench reg({"kda", "Chunked KDA: bounded vs exact diagonal tiles, forward and forward+backward",
                            [](CLI::App& sub) {
                              auto a = std::make_shared<Args>();
                              sub.add_option("--T", a->T, "Sequence lengths")->delimiter(',');
                              sub.add_option("--B", a->B, "Batch size");
                              sub.add_option("--H", a->H, "Heads");
                              sub.add_option("--K", a->K, "Key head dim");
                              sub.add_option("--V", a->V, "Value head dim");
                              sub.add_option("--reps", a->reps, "Timed repetitions (median reported)");
                              sub.add_option("--lower-bound", a->lower_bound, "Gate lower bound");
                              sub.add_flag("--fused", a->fused, "Include L2 norm, gate and beta sigmoid");
                              sub.add_flag("--no-backward", a->no_backward, "Forward only");
                              sub.add_option("--device", a->device,
                                             "cpu, or cuda (the CUDA kernels on fixed shapes beside fla's figures)");
                              sub.add_flag("--prof", a->prof, "cuda: one forward + backward only (for a profiler)");
                              return [a] { return run(*a); };
                            }});

}  // namespace
