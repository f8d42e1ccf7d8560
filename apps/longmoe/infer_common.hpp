#pragma once
// Options shared by the inference verbs (generate, chat, serve, eval): the checkpoint, the device, the engine and
// the sampling flags, registered on a CLI11 subcommand.
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "infer/generate.hpp"

namespace lm::app {

struct InferArgs {
  std::string model;  // checkpoint directory
  std::string init_config, tokenizer;  // or: random weights for this config, with this tokenizer
  std::string device = "cpu";
  int64_t context = 0, prefill_chunk = 0, prefix_cache_mb = 256;
  // The prefill chunk when --prefill-chunk is not given: small on the CPU (the server interleaves chunks with
  // other requests' tokens), large on the GPU (a chunk's GEMMs fill the device only from a few thousand rows).
  int64_t cpu_chunk = 512, gpu_chunk = 16384;
  infer::SamplingParams sp;
  std::vector<std::string> stop;

  void add_model(CLI::App& sub) {
    sub.add_option("--model", model, "checkpoint directory (config.json, model.safetensors, tokenizer.model)");
    sub.add_option("--init-config", init_config, "instead of --model: random weights for this config.json (with "
                   "--device cuda drawn on the GPU, so any shape that fits the device runs)");
    sub.add_option("--tokenizer", tokenizer, "tokenizer.model (with --init-config)");
    // Ranges are checked on what the user gives (a bad value is an error, never silently replaced).
    sub.add_option("--context", context, "context limit in tokens (default: max_position_embeddings, else 131072)")
        ->check(CLI::Range(int64_t(1), int64_t(1) << 26));
    sub.add_option("--prefill-chunk", prefill_chunk, fmt::format("tokens per prefill step (also the prefix-cache grid; "
                   "default: cpu {}, cuda {})", cpu_chunk, gpu_chunk))
        ->check(CLI::Range(int64_t(1), int64_t(1) << 20));
    sub.add_option("--device", device, "cpu, or cuda (the GPU: bf16 weights, fp32 KDA states, bf16 latent cache)")
        ->check(CLI::IsMember({"cpu", "cuda"}));
    sub.add_option("--prefix-cache-mb", prefix_cache_mb, "prefix-cache budget in MiB (0: off; cuda: pinned host "
                   "memory for the snapshots' KDA states, their latent rows staying shared in the pool)")
        ->check(CLI::Range(int64_t(0), int64_t(1) << 24));
  }
  // The image flags of generate, chat and serve (a multimodal model), into `lim`.
  static void add_image_limits(CLI::App& sub, infer::ImageLimits& lim) {
    sub.add_option("--max-image-patches", lim.max_patches, "patch budget per image (larger images are shrunk to it)")
        ->check(CLI::Range(int64_t(4), int64_t(1) << 16));
    sub.add_option("--image-min-side", lim.min_side, "upscale smaller images to this many px on their shorter side "
                   "first (the size the model was trained on, e.g. 56)")
        ->check(CLI::Range(int64_t(0), int64_t(4096)));
    sub.add_option("--max-image-pixels", lim.max_pixels, "largest image accepted, in decoded pixels (default 4096 x "
                   "4096)")
        ->check(CLI::Range(int64_t(1), int64_t(1) << 28));
  }
  void add_sampling(CLI::App& sub) {
    sub.add_option("--max-tokens", sp.max_tokens, "tokens to generate at most");
    sub.add_option("--temperature", sp.temperature, "0: greedy");
    sub.add_option("--top-k", sp.top_k, "keep the k most likely tokens (0: all)");
    sub.add_option("--top-p", sp.top_p, "nucleus mass (1: all)");
    sub.add_option("--repetition-penalty", sp.repetition_penalty, "CTRL-style penalty on seen tokens (1: off)");
    sub.add_option("--seed", sp.seed, "sampling seed (reproducible)");
    sub.add_option("--stop", stop, "stop string (repeatable)");
  }
  infer::LoadedModel load() const {
    LM_CHECK(model.empty() != init_config.empty(), "give exactly one of --model and --init-config");
    infer::check_device(device);  // (before loading)
    if (!model.empty()) return infer::load_model_dir(model);
    LM_CHECK(!tokenizer.empty(), "--init-config needs --tokenizer");
    return infer::random_model(init_config, tokenizer, 1, device == "cpu");  // (on the GPU: drawn there)
  }
  infer::SessionOptions session_options() const {
    infer::SessionOptions o;
    o.max_context = context;
    o.prefill_chunk = prefill_chunk > 0 ? prefill_chunk : device == "cuda" ? gpu_chunk : cpu_chunk;
    o.prefix_cache_bytes = prefix_cache_mb << 20;
    return o;
  }
  // The engine of the loaded model on --device, holding up to `sequences` sequences at once (on the GPU: its slots).
  infer::OwnedEngine engine(infer::LoadedModel& m, int64_t sequences = 1) const {
    infer::EngineOptions o;
    o.device = device;
    o.session = session_options();
    o.max_sequences = sequences;
    return infer::make_engine(m.config, m.model.get(), o);
  }
  infer::SamplingParams sampling() const {
    infer::SamplingParams p = sp;
    p.stop = stop;
    p.validate();
    return p;
  }
};

}  // namespace lm::app
