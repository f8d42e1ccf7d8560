// `longmoe bench decode --config F`: prefill tokens/s and decode tokens/s as the context grows (e.g. 1K ...
// 128K) on one sequence, with the decode time per token split by layer kind: KDA layers stay flat (a
// fixed-size state), MLA layers grow with the latent cache. Also the measured cache bytes against
// model::decode_memory's prediction for fp32 values. Random weights (or --model DIR).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>

#include "bench/verbs/bench.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/rng.hpp"
#include "infer/generate.hpp"
#include "model/accounting.hpp"
#include "model/cuda/gpu_model.hpp"

namespace {

using namespace lm;

struct Args {
  std::string config, model, device = "cpu";
  std::vector<int64_t> contexts = {1024, 4096, 16384, 65536, 131072};
  int64_t decode_tokens = 16, batch = 1, prefill_chunk = 0;  // 0: the engine's (cpu 1024, cuda 16384)
  int64_t profile_prefill = 0;  // cuda: a synchronised prefill of this many tokens, its time split by layer part
  bool profiler_range = false;  // cuda: the profiler collects the timed graph replays only
};

double rss_mib() {
  std::ifstream f("/proc/self/status");
  std::string k;
  while (f >> k)
    if (k == "VmRSS:") {
      double kb;
      f >> kb;
      return kb / 1024;
    }
  return 0;
}

// --device cuda: the GPU engine (GpuModel's slot caches). Slot 0 is prefilled to each context from empty, then
// copied to the `batch` decode slots.
// The model is inference-only (bf16 weights): random ones drawn on the device (--config), or m's (--model).
int run_cuda(const Args& a, const model::ModelConfig& cfg, const model::Model<float>* m) {
  LM_CHECK(model::cuda::available(), "bench decode --device cuda: no usable CUDA device");
  std::vector<int64_t> ctx = a.contexts;
  std::sort(ctx.begin(), ctx.end());
  model::cuda::GpuModel g(cfg, model::cuda::GpuModel::Inference{});
  if (m) g.upload(m->params());
  else g.init_random(1);
  const double weight_gib = g.device_bytes() / 1073741824.0;
  // The decode slots share slot 0's latent blocks (copy_slot): the pool holds one context plus what they append.
  const int64_t max_tokens = ctx.back() + 2 * a.decode_tokens + 4,
                pool_tokens = max_tokens + a.batch * (2 * a.decode_tokens + 4 + 128);
  g.reserve_caches(1 + a.batch, max_tokens, pool_tokens);
  if (a.prefill_chunk) g.prefill_chunk = a.prefill_chunk;
  const double bw = model::cuda::device_copy_bandwidth();
  const Rng rng{5, 0};
  auto tok = [&](uint64_t i) { return static_cast<int32_t>(rng.bits(i).v[0] % static_cast<uint32_t>(cfg.vocab_size)); };
  std::printf("bench decode on the GPU: %s, %ld layers (%ld KDA, %ld MLA), decode batch %ld; weights %.2f GiB, caches "
              "%.1f MiB for %ld slots of %ld tokens\n",
              a.model.empty() ? a.config.c_str() : a.model.c_str(), static_cast<long>(cfg.num_hidden_layers),
              static_cast<long>(cfg.num_kda_layers()), static_cast<long>(cfg.num_mla_layers()),
              static_cast<long>(a.batch), weight_gib, g.cache_bytes() / 1048576.0, static_cast<long>(1 + a.batch),
              static_cast<long>(max_tokens));
  std::printf("device copy bandwidth (read + write) %.2f TB/s, measured in this run\n", bw / 1e12);
  std::printf("dense products of up to %d row(s) on the few-row kernel (%s cores), programmatic dependent launch %s "
              "(LONGMOE_GEMM_FEW_ROWS, LONGMOE_GEMM_FEW_ROWS_MMA, LONGMOE_PDL)\n",
              env::gemm_few_rows(), env::gemm_few_rows_mma() ? "tensor" : "CUDA", env::pdl() ? "on" : "off");
  std::printf("%9s %11s %11s %8s %9s %9s %7s %10s %6s | %s\n", "context", "prefill t/s", "decode t/s", "ms/step",
              "GB/step", "TB/s", "of copy", "eager t/s", "ratio", "eager synchronised ms/step: kda mla ffn attnres");
  using Clock = std::chrono::steady_clock;
  auto secs = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  std::map<std::string, double> sections_before;
  for (int64_t c : ctx) {
    std::vector<int32_t> ids;
    for (int64_t i = 0; i < c; ++i) ids.push_back(tok(static_cast<uint64_t>(i)));
    for (int64_t b = 0; b < a.batch; ++b) g.release_slot(1 + b);  // (the last context's copies)
    auto t0 = Clock::now();
    g.prefill(0, ids.data(), c);  // (synchronous: it returns the logits)
    const double prefill_tps = static_cast<double>(c) / secs(t0);
    for (int64_t b = 0; b < a.batch; ++b) g.copy_slot(0, 1 + b);
    std::vector<int32_t> step_tok(static_cast<size_t>(a.batch));
    auto next = [&](int64_t k) {
      for (int64_t b = 0; b < a.batch; ++b) step_tok[size_t(b)] = tok(static_cast<uint64_t>(c + 100 + k * a.batch + b));
      g.decode(1, a.batch, step_tok.data());
    };
    // Graph replays, then the same steps eager (the second step of a shape is captured, so two warm-ups).
    g.set_decode_graphs(true);
    next(0), next(1);
    if (a.profiler_range) model::cuda::profiler_range(true);
    t0 = Clock::now();
    for (int64_t k = 2; k < a.decode_tokens + 2; ++k) next(k);
    const double t = secs(t0);
    if (a.profiler_range) model::cuda::profiler_range(false);
    g.set_decode_graphs(false);
    t0 = Clock::now();
    for (int64_t k = a.decode_tokens + 2; k < 2 * a.decode_tokens + 2; ++k) next(k);
    const double te = secs(t0);
    g.profiling = true;
    g.profile.clear();
    next(2 * a.decode_tokens + 2);
    g.profiling = false;
    const auto& f = g.profile.fwd;
    using P = model::Profile;
    const double n = static_cast<double>(a.decode_tokens * a.batch), step = t / static_cast<double>(a.decode_tokens);
    const double bytes = model::decode_traffic(cfg, c + a.decode_tokens, a.batch).total();  // (mid-run context)
    std::printf("%9ld %11.0f %11.1f %8.3f %9.3f %9.3f %6.1f%% %10.1f %6.2f | %.3f %.3f %.3f %.3f\n", static_cast<long>(c),
                prefill_tps, n / t, 1e3 * step, bytes / 1e9, bytes / step / 1e12, 100 * bytes / step / bw, n / te,
                te / t, 1e3 * f[P::Kda], 1e3 * f[P::Mla], 1e3 * (f[P::DenseFfn] + f[P::Moe]), 1e3 * f[P::AttnRes]);
    std::printf("  graph: %s; eager synchronised sections (ms):", g.decode_graph_nodes().c_str());
    for (const auto& [name, sec] : g.detail_profile()) {  // (the model's sections accumulate: this step's share)
      std::printf(" %s %.3f", name.c_str(), (sec - sections_before[name]) * 1e3);
      sections_before[name] = sec;
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  if (a.profile_prefill > 0) {  // (after the timed contexts: every part synchronises, so it is slower than above)
    const int64_t n = std::min(a.profile_prefill, max_tokens);
    std::vector<int32_t> ids;
    for (int64_t i = 0; i < n; ++i) ids.push_back(tok(static_cast<uint64_t>(7 * i + 3)));
    for (int64_t b = 0; b < a.batch; ++b) g.release_slot(1 + b);
    g.prefill(0, ids.data(), n);  // (unprofiled first: cuBLASLt times its algorithms for new GEMM shapes)
    g.profiling = true;
    g.profile.clear();
    auto t0 = Clock::now();
    g.prefill(0, ids.data(), n);
    const double t = secs(t0);
    g.profiling = false;
    std::printf("profiled prefill of %ld tokens: %.3f s (%.0f tokens/s); ms by part:", static_cast<long>(n), t,
                static_cast<double>(n) / t);
    for (int k = 0; k < model::Profile::kNum; ++k) std::printf(" %s %.1f", model::Profile::name(k), 1e3 * g.profile.fwd[k]);
    std::printf("\n  sections (ms):");
    for (const auto& [name, sec] : g.detail_profile())
      std::printf(" %s %.1f", name.c_str(), (sec - sections_before[name]) * 1e3);
    std::printf("\n");
  }
  const model::InferenceMemory pm = model::inference_memory(cfg, max_tokens, 1 + a.batch, g.prefill_chunk, pool_tokens);
  const double used = static_cast<double>(model::cuda::device_memory_used()), gib = 1073741824.0;
  std::printf("device memory: measured %.2f GiB in use, predicted %.2f GiB (weights %.2f, KDA caches %.3f, MLA latent "
              "pool %.3f, activations %.2f, workspace %.2f): measured / predicted = %.3f\n",
              used / gib, pm.total() / gib, pm.weights / gib, pm.kda_caches / gib, pm.mla_cache / gib,
              pm.activations / gib, pm.workspace / gib, used / pm.total());
  std::printf("(prefill t/s: one fresh sequence of that many tokens, %ld-token chunks; decode: %ld steps of %ld "
              "sequence(s) replayed from a CUDA graph, after two warm-up steps; GB/step: model::decode_traffic, the "
              "bytes a step must read (weights without the embedding, the selected experts, KDA states, latent rows); "
              "eager: %ld more steps without graphs, ratio = eager time / graph time)\n",
              static_cast<long>(g.prefill_chunk), static_cast<long>(a.decode_tokens), static_cast<long>(a.batch),
              static_cast<long>(a.decode_tokens));
  return 0;
}

int run(const Args& a) {
  LM_CHECK(a.config.empty() != a.model.empty(), "bench decode: give exactly one of --config and --model");
  LM_CHECK(a.decode_tokens >= 1 && a.batch >= 1 && !a.contexts.empty(), "bench decode: bad sizes");
  LM_CHECK(a.device == "cpu" || a.device == "cuda", "bench decode: --device must be cpu or cuda, not '{}'", a.device);
  std::unique_ptr<model::Model<float>> owned;
  infer::LoadedModel lm;
  model::Model<float>* m;
  if (!a.model.empty()) {
    lm = infer::load_model_dir(a.model, false);
    m = lm.model.get();
  } else if (a.device == "cuda") {  // (no host copy: a 48B shape's fp32 weights would not fit in host memory)
    return run_cuda(a, model::ModelConfig::load(a.config), nullptr);
  } else {
    owned = std::make_unique<model::Model<float>>(model::ModelConfig::load(a.config));
    owned->params().init(1);
    m = owned.get();
  }
  if (a.device == "cuda") return run_cuda(a, m->config(), m);
  const auto& cfg = m->config();
  std::vector<int64_t> ctx = a.contexts;
  std::sort(ctx.begin(), ctx.end());
  infer::SessionOptions so;
  so.prefill_chunk = a.prefill_chunk ? a.prefill_chunk : 1024;
  so.prefix_cache_bytes = 0;
  so.max_context = ctx.back() + a.decode_tokens + 1;
  infer::Session s(*m, so);
  const Rng rng{5, 0};
  auto tok = [&](uint64_t i) { return static_cast<int32_t>(rng.bits(i).v[0] % static_cast<uint32_t>(cfg.vocab_size)); };
  std::printf("bench decode: %s, %ld layers (%ld KDA, %ld MLA), %d threads, prefill chunk %ld, decode batch %ld\n",
              a.model.empty() ? a.config.c_str() : a.model.c_str(), static_cast<long>(cfg.num_hidden_layers),
              static_cast<long>(cfg.num_kda_layers()), static_cast<long>(cfg.num_mla_layers()), num_threads(),
              static_cast<long>(so.prefill_chunk), static_cast<long>(a.batch));
  std::printf("%9s %12s %11s | %-44s | %21s %8s\n", "context", "prefill t/s", "decode t/s",
              "decode ms/step: kda    mla    ffn  attnres  other", "cache MiB meas/pred", "RSS MiB");
  infer::Sequence seq = s.new_sequence();
  for (int64_t c : ctx) {
    std::vector<int32_t> ids;
    for (int64_t i = seq.pos(); i < c; ++i) ids.push_back(tok(static_cast<uint64_t>(i)));
    double prefill_tps = 0;
    if (!ids.empty()) {
      for (auto& l : seq.layers) l.rows.reserve(static_cast<size_t>(c * l.row_width));
      const auto t0 = std::chrono::steady_clock::now();
      s.prefill(seq, ids);
      prefill_tps = static_cast<double>(ids.size()) /
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const double meas = seq.cache_bytes() / 1048576.0;
    const double pred = model::decode_memory(cfg, c, 4).total_bytes_per_seq / 1048576.0;
    // Decode on copies, so the main sequence stays at the grid point for the next prefill.
    std::vector<infer::Sequence> copies(static_cast<size_t>(a.batch), seq);
    std::vector<infer::Sequence*> ptrs;
    for (auto& q : copies) ptrs.push_back(&q);
    std::vector<int32_t> step_tok(static_cast<size_t>(a.batch));
    for (int64_t b = 0; b < a.batch; ++b) step_tok[static_cast<size_t>(b)] = tok(static_cast<uint64_t>(c + b));
    s.decode(ptrs, step_tok);  // warm-up
    s.profile.clear();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t k = 0; k < a.decode_tokens; ++k) {
      for (int64_t b = 0; b < a.batch; ++b) step_tok[static_cast<size_t>(b)] = tok(static_cast<uint64_t>(c + 100 + k * a.batch + b));
      s.decode(ptrs, step_tok);
    }
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double per = 1e3 / static_cast<double>(a.decode_tokens);
    const auto& p = s.profile;
    std::printf("%9ld %12.0f %11.1f | %19.2f %6.2f %6.2f %6.2f %6.2f | %10.2f / %8.2f %8.0f\n", static_cast<long>(c),
                prefill_tps, static_cast<double>(a.decode_tokens * a.batch) / t, p.kda * per, p.mla * per, p.ffn * per,
                p.attnres * per, p.other * per, meas, pred, rss_mib());
    std::fflush(stdout);
  }
  std::printf("(prefill t/s: the tokens from the previous context to this one; decode: %ld steps of %ld sequence(s); "
              "cache: fp32 KDA states + conv inputs + MLA latent rows, predicted by decode_memory(cache_bytes = 4))\n",
              static_cast<long>(a.decode_tokens), static_cast<long>(a.batch));
  return 0;
}

app::RegisterBench reg({"decode", "Prefill and decode tokens/s as the context grows, KDA vs MLA time per step",
                        [](CLI::App& sub) {
                          auto a = std::make_shared<Args>();
                          sub.add_option("--config", a->config, "config.json (random weights)");
                          sub.add_option("--model", a->model, "checkpoint directory instead of --config");
                          sub.add_option("--contexts", a->contexts, "context lengths, e.g. 1024,4096,131072")
                              ->delimiter(',');
                          sub.add_option("--decode-tokens", a->decode_tokens, "decode steps timed per context");
                          sub.add_option("--batch", a->batch, "sequences decoded together");
                          sub.add_option("--prefill-chunk", a->prefill_chunk,
                                         "tokens per prefill chunk (default: cpu 1024, cuda 16384)");
                          sub.add_option("--device", a->device, "cpu or cuda");
                          sub.add_option("--profile-prefill", a->profile_prefill,
                                         "cuda: time a prefill of N tokens by layer part and section (synchronised)");
                          sub.add_flag("--profiler-range", a->profiler_range,
                                       "cuda: open the profiler's range around the timed graph replays only (e.g. "
                                       "ncu --profile-from-start off --graph-profiling node: one row per kernel of "
                                       "each replayed step)");
                          return [a] { return run(*a); };
                        }});

}  // namespace
