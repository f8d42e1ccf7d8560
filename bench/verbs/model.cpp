// `longmoe bench model --config F [--device cuda]`: whole-model forward and forward+backward tokens/s on the CPU
// with a per-layer-type time breakdown (randomly initialised weights, random tokens). On the GPU the timed step is
// a whole training step (forward, backward, Quantile Balancing, AdamW), reported as tokens/s and MFU: training
// FLOPs (6 × activated GEMM parameters + attention, model/accounting) against the bf16 GEMM rate measured in the
// same run.
#include <cstdio>
#include <memory>
#include <vector>

#include "bench/verbs/bench.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/rng.hpp"
#include "model/accounting.hpp"
#include "model/cuda/gpu_model.hpp"
#include "model/model.hpp"
#include "train/cuda/adamw.hpp"
#include "train/optim.hpp"
#ifdef LONGMOE_HAVE_CUDA
#include "ops/gemm/cuda/gemm_cuda.hpp"
#include "ops/kda/cuda/kda_cuda.hpp"
#endif

namespace {

using namespace lm;

struct Args {
  std::string config;
  int64_t batch = 1, seq = 1024;
  int reps = 3;
  std::string device = "cpu";
  int accum = 1;  // cuda: micro-batches per optimizer step
  std::string recompute = "auto";  // cuda: the memory plan (auto: chosen for the device), none, all
  bool offload = false;            // cuda, with --recompute none / all: the transient states wait on the host
};

// Uniform random token ids and targets (the same for the CPU and the GPU benchmark).
void random_tokens(const model::ModelConfig& cfg, int64_t rows, std::vector<int32_t>& ids,
                   std::vector<int32_t>& targets) {
  ids.resize(rows), targets.resize(rows);
  Rng r{7, 0};
  for (int64_t i = 0; i < rows; ++i) {
    ids[i] = static_cast<int32_t>(r.bits(i).v[0] % cfg.vocab_size);
    targets[i] = static_cast<int32_t>(r.bits(i).v[1] % cfg.vocab_size);
  }
}

void print_profile(const model::Profile& p, const char* what, bool bwd, int reps) {
  double total = 0;
  for (int k = 0; k < model::Profile::kNum; ++k) total += p.fwd[k] + (bwd ? p.bwd[k] : 0);
  std::printf("  %s breakdown (ms per step, share):", what);
  for (int k = 0; k < model::Profile::kNum; ++k) {
    const double t = p.fwd[k] + (bwd ? p.bwd[k] : 0);
    if (t > 0) std::printf("  %s %.1f (%.0f%%)", model::Profile::name(k), 1e3 * t / reps, 100 * t / total);
  }
  std::printf("\n");
}

#ifdef LONGMOE_HAVE_CUDA
// bf16 GEMM rate (TFLOP/s) at n³ through ops/gemm (cuBLASLt's fastest candidate, or cublasGemmEx with
// LONGMOE_GEMM_CUBLAS=1), median of reps: the ceiling MFU is measured against.
double measure_bf16_gemm_tflops(int64_t n, int reps) {
  namespace kc = lm::kda::cuda;
  void* A = kc::device_alloc(size_t(n) * n * 2);
  void* B = kc::device_alloc(size_t(n) * n * 2);
  void* C = kc::device_alloc(size_t(n) * n * 2);
  kc::device_fill(A, 0x3c, size_t(n) * n * 2), kc::device_fill(B, 0x3c, size_t(n) * n * 2);
  const double t = app::time_median(
      [&] {
        ops::cuda::gemm_bf16(false, true, n, n, n, 1.f, A, n, B, n, 0.f, C, n, DType::BF16);
        kc::synchronize();
      },
      reps, 2);
  kc::device_free(A), kc::device_free(B), kc::device_free(C);
  return 2.0 * n * n * n / t / 1e12;
}
#endif

int run_cuda(const Args& a, const model::ModelConfig& cfg, const model::ParamCounts& counts) {
#ifndef LONGMOE_HAVE_CUDA
  (void)a, (void)cfg, (void)counts;
  throw Error("bench model --device cuda: longmoe was built without CUDA");
#else
  namespace kc = lm::kda::cuda;
  LM_CHECK(model::cuda::available(), "bench model --device cuda: no usable CUDA device");
  const double ceiling = measure_bf16_gemm_tflops(8192, 5);
  model::ParamStore<float> ps(cfg);
  ps.init(1);
  const train::OptimConfig oc;
  model::cuda::GpuModel m(cfg, [&](const model::ParamSpec& p) { return train::param_rule(p, cfg, oc).decay; });
  train::cuda::AdamW opt(m);
  m.upload(ps);
  const int64_t rows = a.batch * a.seq;
  std::vector<int32_t> ids, targets;
  random_tokens(cfg, rows, ids, targets);
  const auto s = model::Seqs::batch(a.batch, a.seq);
  LM_CHECK(a.accum >= 1, "bench model: --accum must be at least 1");
  LM_CHECK(a.recompute == "auto" || a.recompute == "none" || a.recompute == "all",
           "bench model: --recompute must be auto, none or all (got '{}')", a.recompute);
  if (a.recompute == "auto") {
    std::printf("%s\n", model::gpu_training_summary(m.plan_memory(rows), cfg).c_str());
  } else {
    m.set_keep_layers(std::vector<bool>(size_t(cfg.num_hidden_layers), a.recompute == "none"));
    m.set_offload_states(a.offload);
  }
  const model::GpuTrainingMemory predicted =
      model::gpu_training_memory(cfg, rows, m.keep_layers(), m.offload_states());
  std::printf("model %s on the GPU: %.3fB params, %.3fB activated (%.3fB in GEMMs); micro-batch %ld x %ld tokens, "
              "%d per optimizer step\n",
              a.config.c_str(), counts.total / 1e9, counts.activated / 1e9, counts.activated_matmul / 1e9,
              static_cast<long>(a.batch), static_cast<long>(a.seq), a.accum);
  int64_t step = 0;
  // One optimizer step: accum forward+backward micro-batches (gradients accumulate, the loss is their mean), then
  // Quantile Balancing from the last micro-batch's routing and AdamW.
  auto train_step = [&] {
    m.zero_grads();
    for (int k = 0; k < a.accum; ++k) m.forward_backward(ids.data(), targets.data(), s, rows * a.accum);
    m.balance();
    train::cuda::AdamWStep as;
    as.lr = 1e-4, as.step = ++step;
    opt.step(as);
    kc::synchronize();
  };
  const double tf = app::time_median(
      [&] {
        m.loss(ids.data(), targets.data(), s);
        kc::synchronize();
      },
      a.reps, 1);
  const double tb = app::time_median(train_step, a.reps, 1) / a.accum;  // per micro-batch
  const auto fl = model::flops_per_token(cfg, a.seq, a.seq);
  const double tflops = fl.train * rows / tb / 1e12;
  std::printf("bf16 GEMM ceiling (8192^3 through ops/gemm, same run): %.1f TFLOP/s\n", ceiling);
  std::printf("forward (loss)   %9.2f ms  %9.0f tokens/s\n", tf * 1e3, rows / tf);
  std::printf("training, per micro-batch %9.2f ms  %9.0f tokens/s  %.1f TFLOP/s by %.3f GFLOP/token (6 x %.3fB + attention "
              "%.3f GFLOP)  MFU %.1f%%\n",
              tb * 1e3, rows / tb, tflops, fl.train / 1e9, counts.activated_matmul / 1e9,
              3 * (fl.mla_attn_fwd_train + fl.kda_attn_fwd) / 1e9, 100 * tflops / ceiling);
  // (the stream-ordered pool keeps what the kernels' transients freed: the use after the steps is their peak)
  std::printf("device memory held: %.2f GiB; in use after the steps %.2f GiB, predicted peak %.2f GiB (%.3f)\n",
              (m.device_bytes() + opt.device_bytes()) / 1073741824.0, model::cuda::device_memory_used() / 1073741824.0,
              predicted.total() / 1073741824.0, predicted.total() / double(model::cuda::device_memory_used()));
  m.profiling = true;
  m.profile.clear();
  m.zero_grads();
  m.forward_backward(ids.data(), targets.data(), s);
  kc::synchronize();
  m.profiling = false;
  model::Profile fwd = m.profile, bwd = m.profile;
  fwd.bwd.fill(0), bwd.fwd.fill(0);
  std::printf("training step, synchronised per part:\n");
  print_profile(fwd, "forward", false, 1);
  print_profile(bwd, "backward (lm_head = loss + its gradients)", true, 1);
  std::printf("  sections (ms):");
  for (const auto& [name, sec] : m.detail_profile()) std::printf("  %s %.2f", name.c_str(), sec * 1e3);
  std::printf("\n");
  const double tq = app::time_median([&] { m.balance(), kc::synchronize(); }, 3, 0);
  train::cuda::AdamWStep as;
  as.lr = 0;
  const double to = app::time_median([&] { opt.step(as), kc::synchronize(); }, 3, 0);
  std::printf("  quantile balancing %.2f ms, AdamW + bf16 copy %.2f ms\n", tq * 1e3, to * 1e3);
  return 0;
#endif
}

int run(const Args& a) {
  LM_CHECK(a.batch > 0 && a.seq > 0 && a.reps > 0, "bench model: --batch, --seq and --reps must be positive");
  LM_CHECK(a.device == "cpu" || a.device == "cuda", "bench model: --device must be cpu or cuda, not '{}'", a.device);
  const auto cfg = model::ModelConfig::load(a.config);
  if (a.device == "cuda") return run_cuda(a, cfg, model::count_params(cfg));
  const auto counts = model::count_params(cfg);
  model::Model<float> m(cfg);
  m.params().init(1);
  m.params().enable_grads();
  const int64_t rows = a.batch * a.seq;
  std::vector<int32_t> ids, targets;
  random_tokens(cfg, rows, ids, targets);
  const auto s = model::Seqs::batch(a.batch, a.seq);
  std::printf("model %s: %.2fM params, %.2fM activated, %ld layers; batch %ld x %ld tokens, %d threads\n",
              a.config.c_str(), counts.total / 1e6, counts.activated / 1e6, static_cast<long>(cfg.num_hidden_layers),
              static_cast<long>(a.batch), static_cast<long>(a.seq), num_threads());
  // Forward (loss only) and forward+backward, profiled separately.
  m.loss(ids.data(), targets.data(), s);  // warm-up
  m.profile.clear();
  const double tf = app::time_median([&] { m.loss(ids.data(), targets.data(), s); }, a.reps, 0);
  model::Profile pf = m.profile;
  m.forward_backward(ids.data(), targets.data(), s);  // warm-up
  m.profile.clear();
  const double tb = app::time_median([&] { m.forward_backward(ids.data(), targets.data(), s); }, a.reps, 0);
  model::Profile pb = m.profile;
  const auto fl = model::flops_per_token(cfg, a.seq, a.seq);
  std::printf("forward          %9.1f ms  %9.0f tokens/s\n", tf * 1e3, rows / tf);
  print_profile(pf, "forward", false, a.reps);
  std::printf("forward+backward %9.1f ms  %9.0f tokens/s  (%.2f GFLOP/s by %.1f MFLOP/token training FLOPs)\n",
              tb * 1e3, rows / tb, fl.train * rows / tb / 1e9, fl.train / 1e6);
  print_profile(pb, "forward+backward", true, a.reps);
  return 0;
}

app::RegisterBench reg({"model", "Whole-model forward and forward+backward tokens/s with a per-layer-type breakdown",
                        [](CLI::App& sub) {
                          auto a = std::make_shared<Args>();
                          sub.add_option("--config", a->config, "HF config.json (or a directory holding one)")
                              ->required();
                          sub.add_option("--batch", a->batch, "Sequences per step");
                          sub.add_option("--seq", a->seq, "Tokens per sequence");
                          sub.add_option("--reps", a->reps, "Timed repetitions (median reported)");
                          sub.add_option("--device", a->device, "cpu or cuda (a whole training step on the GPU)");
                          sub.add_option("--recompute", a->recompute,
                                         "cuda: auto (the memory plan for the device), none (every layer keeps) or "
                                         "all (every layer recomputes)");
                          sub.add_flag("--offload", a->offload,
                                       "cuda, with --recompute none or all: the layers' transient input states wait "
                                       "in pinned host memory");
                          sub.add_option("--accum", a->accum,
                                         "cuda: micro-batches per optimizer step (AdamW and balancing once per step)");
                          return [a] { return run(*a); };
                        }});

}  // namespace
