// `longmoe bench model --config F`: whole-model forward and forward+backward tokens/s on the CPU
// with a per-layer-type time breakdown (randomly initialised weights, random tokens).
#include <cstdio>
#include <memory>
#include <vector>

#include "apps/longmoe/bench.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/rng.hpp"
#include "model/accounting.hpp"
#include "model/model.hpp"

namespace {

using namespace lm;

struct Args {
  std::string config;
  int64_t batch = 1, seq = 1024;
  int reps = 3;
};

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

int run(const Args& a) {
  LM_CHECK(a.batch > 0 && a.seq > 0 && a.reps > 0, "bench model: --batch, --seq and --reps must be positive");
  const auto cfg = model::ModelConfig::load(a.config);
  const auto counts = model::count_params(cfg);
  model::Model<float> m(cfg);
  m.params().init(1);
  m.params().enable_grads();
  const int64_t rows = a.batch * a.seq;
  std::vector<int32_t> ids(rows), targets(rows);
  Rng r{7, 0};
  for (int64_t i = 0; i < rows; ++i) {
    ids[i] = static_cast<int32_t>(r.bits(i).v[0] % cfg.vocab_size);
    targets[i] = static_cast<int32_t>(r.bits(i).v[1] % cfg.vocab_size);
  }
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
                          return [a] { return run(*a); };
                        }});

}  // namespace
