#pragma once
// The whole K3 / Kimi Linear decoder on one NVIDIA GPU (SPEC §1–§6): the same wiring as model::Model
// (model.cpp), with bf16 GEMM operands and activations, fp32 accumulation, an fp32 residual stream and AttnRes
// block sums, fp32 master weights and gradients. Plain C++ (no CUDA types), so the CLI includes it on machines
// without CUDA; every entry point then throws lm::Error ("built without CUDA"). The optimiser runs over flat()
// and owns its state (train/cuda/adamw.hpp: AdamW's moments).
//
// Legend: rows tokens of the batch (the layout of `Seqs`), d hidden, V vocabulary, P parameters.
// Device memory: flat fp32 arrays [P] (master, grad) and their bf16 copy [P]; the expert weights
// of each MoE layer lie as W13 [E, 2I, l] = per expert [w1; w3] and W2 [E, l, I] (the grouped-GEMM layouts),
// a dense FFN's gate_proj/up_proj as one [2I, d]. Activations kept for the backward are reused between steps.
// Kernels: cuBLAS for dense GEMMs (ops/gemm/cuda), the KDA, attention and MoE kernels of ops/*/cuda, and the
// elementwise ops (RMSNorm, AttnRes, embedding, cross-entropy, GLU, short conv) of ops/*/cuda.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "model/accounting.hpp"
#include "model/config.hpp"
#include "model/model.hpp"
#include "model/param_names.hpp"
#include "model/params.hpp"
#include "model/seqs.hpp"

namespace lm::model::cuda {

// True when longmoe was built with CUDA and a device is usable.
bool available();
// True when longmoe was built with CUDA (nvcc found at build time).
bool built_with_cuda();
// Device memory in use now (total − free, as cudaMemGetInfo reports: this process's allocations, the CUDA context).
size_t device_memory_used();
size_t device_memory_total();
// Device-to-device copy bandwidth in bytes/s (bytes read + written, 1 GiB copies timed with events): the physical
// limit a bandwidth-bound kernel is measured against in the same run.
double device_copy_bandwidth();
// The profiler's collection range (cudaProfilerStart / Stop): `ncu --profile-from-start off` (or nsys
// --capture-range=cudaProfilerApi) then sees only the kernels launched inside it (bench decode's timed steps).
void profiler_range(bool on);

// Where a parameter lies in the flat arrays.
struct ParamSlot {
  size_t off = 0;  // elements into the flat arrays
  int64_t numel = 0;
};

class GpuModel {
 public:
  static constexpr int64_t kCacheBlock = 64;  // tokens per block of the MLA latent pool (the decode kernel's tile)
  // `decays` says which trainable parameters get weight decay (null: every tensor with ndim >= 2).
  explicit GpuModel(const ModelConfig& c, std::function<bool(const ParamSpec&)> decays = nullptr);
  // Inference only: the bf16 weights (and an fp32 copy of the small tensors the forward reads in fp32: norms, convs,
  // A_log, dt_bias, biases), no master weights, gradients, optimiser view or backward operands: 2 bytes per
  // parameter, so a 48B model fits one H200. Training calls are errors.
  struct Inference {};
  GpuModel(const ModelConfig& c, Inference);
  bool inference_only() const;
  // Random weights made on the device, for shapes whose weights cannot be fetched (inference-only models): the
  // distributions of ParamStore::init (model/params.hpp: init_normal_sd, init_fixed), not its values.
  void init_random(uint64_t seed, double init_scale = 1.0);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const ModelConfig& config() const;
  int64_t num_params() const;
  size_t device_bytes() const;  // parameters and kept activations now allocated (not the optimiser's state)

  void upload(const ParamStore<float>& ps);           // master weights (and their bf16 copy) from the host
  void download(ParamStore<float>& ps) const;         // master weights to the host
  void download_grads(ParamStore<float>& ps) const;   // gradients to the host (ps.enable_grads() first)
  void zero_grads();

  // The memory plan of a training step (model/accounting.hpp: gpu_training_plan): keep[i] says whether layer i keeps
  // its internals from the forward to the backward; the others run their forward again just before their backward,
  // into one set of buffers they share (the same loss and gradients: the second forward repeats the first). Empty:
  // every layer keeps. lm::Error for a size other than the layer count.
  void set_keep_layers(std::vector<bool> keep);
  std::vector<bool> keep_layers() const;
  // The plan's offload: the transient input states (model::gpu_transient_states) wait in pinned host memory from
  // the forward to the backward (copied out and back beside the layers; the same loss and gradients).
  void set_offload_states(bool on);
  bool offload_states() const;
  // Chooses and sets the plan for steps of `rows` tokens (gpu_training_plan against this device's memory, less a
  // 3% margin for the allocator, and half this host's memory); lm::Error, before anything is allocated, when no plan
  // fits.
  GpuTrainingMemory plan_memory(int64_t rows);

  struct LossStats {
    double loss_sum = 0;
    int64_t n_valid = 0;
  };
  // Forward, mean cross-entropy over targets >= 0, backward into the gradients (accumulated, scaled by
  // 1 / n_valid, or 1 / n_valid_total when > 0). Host ids / targets [rows]; lm::Error for ids or targets
  // out of range (nothing on the device changes then). With `media` (a model with a vision tower, SPEC §9) the
  // tower's features replace the embedding rows of the media placeholders in ids, in order, and the backward
  // continues into the tower; a target naming the placeholder carries no loss (as model::Model).
  // With `weights` (host [rows], e.g. data.answer_weight's), row t's loss counts weights[t] times in the gradient
  // (still divided by n_valid); the returned loss_sum stays the unweighted sum. One pass of the LM head either way.
  LossStats forward_backward(const int32_t* ids, const int32_t* targets, const Seqs& s, int64_t n_valid_total = 0,
                             const Media<float>* media = nullptr, std::span<const float> weights = {});
  // Loss only.
  LossStats loss(const int32_t* ids, const int32_t* targets, const Seqs& s, const Media<float>* media = nullptr);
  // RL (rl/grpo.hpp), as Model::target_logprobs and Model::forward_backward_logp: log p(target_t | tokens <= t) per
  // row [rows] (0 where the target is < 0) without a backward; or one forward, `dloss` turning the log-probs into
  // dL/dlogp_t [rows], and the backward accumulating dL/dparams = Σ_t dL/dlogp_t dlogp_t/dparams into the
  // gradients (the cross-entropy backward with per-row scales −dL/dlogp_t). Returns the log-probs.
  std::vector<float> target_logprobs(const int32_t* ids, const int32_t* targets, const Seqs& s);
  using LogpGrad = std::function<std::vector<float>(const std::vector<float>& logp)>;
  std::vector<float> forward_backward_logp(const int32_t* ids, const int32_t* targets, const Seqs& s,
                                           const LogpGrad& dloss);
  // The tower and projector over `media` (inference): features [rows, d] (bf16 values as fp32), the rows its
  // placeholders take, in order (M in *rows). lm::Error without a tower or for grids the config refuses.
  std::vector<float> media_features(const Media<float>& media, int64_t* rows = nullptr);
  int32_t media_placeholder() const;  // the placeholder token id, -1 without a tower

  // The flat device arrays of every parameter, for an optimiser that updates them in place: the tensors that
  // decay [0, decay_end), the other trainable ones [decay_end, train_end), then the untrained QB biases (P in all,
  // with alignment gaps).
  struct Flat {
    float* master = nullptr;  // fp32 [P]
    float* grad = nullptr;    // fp32 [P]
    void* bf16 = nullptr;     // bf16 [P], the copy the GEMMs read
    size_t P = 0, decay_end = 0, train_end = 0;
  };
  Flat flat() const;
  // Where parameter `name` lies in flat(); lm::Error for an unknown name.
  ParamSlot slot(const std::string& name) const;
  // After an optimiser wrote master and the bf16 copy: refreshes what derives from the bf16 copy (the transposed
  // expert weights of the MoE backward).
  void weights_updated();
  // Quantile Balancing: each MoE layer's e_score_correction_bias from the last forward's routing.
  void balance();
  // The same over several data-parallel replicas: per MoE layer, `gather` receives this model's router statistics of
  // the last forward (device scores [rows, E] fp32, alpha [rows] fp32) and returns every replica's, concatenated
  // (device buffers valid until its next call, ready on the null stream); every replica then installs the same bias.
  struct RouterRows {
    const float* scores = nullptr;
    const float* alpha = nullptr;
    int64_t rows = 0;
  };
  void balance(const std::function<RouterRows(const RouterRows& mine)>& gather);
  // The backward's progress, for a reducer that sends gradients while the backward goes on (data parallel): during
  // every backward, hook(stage) once the gradient writes of that stage's parameters are all queued on the walk's
  // stream (the null stream, core/cuda/stream.hpp), in the order L (lm_head, the final norm and AttnRes read),
  // L − 1, ..., 0 (decoder layer i), −1 (the embedding and the vision tower: the end). Null: none.
  void set_grad_ready(std::function<void(int64_t stage)> hook);
  // The stage (above) after which parameter `s`'s gradient is final, in a model of `layers` decoder layers.
  static int64_t grad_stage(const ParamSpec& s, int64_t layers);
  // Global L2 norm of the trainable parameters' gradients (double, deterministic).
  double grad_norm() const;
  // Tokens routed to each expert of MoE layer `layer` in the last forward [E].
  std::vector<int64_t> expert_loads(int64_t layer) const;
  // Final hidden after the norm [rows, d] (bf16 rounded) of the last forward, for tests.
  std::vector<float> final_hidden() const;

  // ---- inference (model/cuda/infer.cpp) ----
  // Caches for `slots` sequences of up to `max_tokens` tokens each, laid out as each mixer's cache_spec
  // (model/cache.hpp: KDA states and conv inputs fp32 per slot; MLA latent rows bf16 in a pool of 64-token blocks
  // shared by the slots, `pool_tokens` in all, 0 meaning slots × max_tokens); every slot starts empty. Replaces
  // earlier caches. The weights are the bf16 copy (upload first).
  void reserve_caches(int64_t slots, int64_t max_tokens, int64_t pool_tokens = 0);
  int64_t cache_slots() const;
  int64_t slot_tokens(int64_t slot) const;  // tokens cached in `slot`
  int64_t free_cache_tokens() const;        // latent pool tokens no slot or snapshot holds
  // The pool blocks that n more tokens in `slot` take: new ones, and copies of the shared ones they write into.
  int64_t blocks_needed(int64_t slot, int64_t n) const;
  size_t cache_bytes() const;               // the caches and the inference scratch now allocated
  // A fresh sequence in `slot` (what it held is dropped): runs the n prompt tokens and returns the logits after the
  // last one [V] (with all_logits, every token's [n, V]). lm::Error for a bad slot, ids outside the vocabulary,
  // n above max_tokens or a full latent pool (the slot is then empty). Prompts run prefill_chunk tokens at a time:
  // activations stay within a chunk's, whatever the context. `features` [k, d] (media_features) are the rows of the
  // k media placeholders among ids, in order; another count of placeholders is an error.
  std::vector<float> prefill(int64_t slot, const int32_t* ids, int64_t n, std::vector<float>* all_logits = nullptr,
                             std::span<const float> features = {});
  // The same n tokens after what `slot` holds (a continued conversation, a prompt that arrives in pieces): the
  // chunks attend to the cached latents and continue the cached states. Same checks; on an error the slot is empty.
  std::vector<float> extend(int64_t slot, const int32_t* ids, int64_t n, std::vector<float>* all_logits = nullptr,
                            std::span<const float> features = {});
  int64_t prefill_chunk = 16384;
  // Rows per piece of a training step's dense-FFN and shared-expert backward (their fp32 scratch stays that size).
  int64_t ffn_rows = kGpuFfnRows;
  // One token for each of the S slots [first, first + S), each after what it holds: logits [S, V]. Same checks
  // (and a slot that is full or empty); on an error no slot changes. The first step of a (first, S) runs eagerly and
  // is captured into a CUDA graph, replayed by the later ones (set_decode_graphs(false): every step eager).
  std::vector<float> decode(int64_t first, int64_t S, const int32_t* ids);
  void decode(int64_t first, int64_t S, const int32_t* ids, float* logits);  // the same into logits [S, V]
  void set_decode_graphs(bool on);
  bool decode_graphs() const;  // false also once a capture failed (steps then run eagerly)
  // Decode graphs captured so far. A graph is captured again when an activation buffer grew since its capture (a
  // larger prefill chunk or batch): GpuEngine sizes them all first (its warm-up) so that each batch size is captured
  // once.
  int64_t decode_captures() const;
  // The last captured decode graph's nodes by kind, e.g. "350 nodes: 331 kernel, 17 memcpy, 2 memset".
  std::string decode_graph_nodes() const;
  // Slot `to` continues exactly as `from` would: a copy of its states, its latent blocks shared (copied on write).
  void copy_slot(int64_t from, int64_t to);
  // Drops the sequence of `slot`: its latent blocks go back to the pool (those no other slot shares).
  void release_slot(int64_t slot);
  // Snapshots of slots (GpuEngine's prefix cache): `count` of them in pinned host memory, each holding a slot's KDA
  // states and conv inputs (snapshot_bytes() apiece) and keeping its latent blocks in the pool (shared with the slots
  // and copied on write, like copy_slot's) until it is dropped. reserve_caches drops them all and frees the memory.
  void reserve_snapshots(int64_t count);
  int64_t snapshot_count() const;
  size_t snapshot_bytes() const;  // (known once the caches are reserved)
  void save_snapshot(int64_t slot, int64_t snap);  // what `snap` held is dropped first
  // Slot `slot` continues exactly as the saved sequence would (what it held is dropped); lm::Error for an empty snap.
  void load_snapshot(int64_t snap, int64_t slot);
  void drop_snapshot(int64_t snap);  // its blocks go back to the pool (those no slot shares)
  int64_t snapshot_tokens(int64_t snap) const;  // 0: empty

  // Seconds per finer section ("kda.core.bwd", "moe.experts.fwd", ...) accumulated while profiling.
  std::vector<std::pair<std::string, double>> detail_profile() const;

  // When true, each part synchronises the device and adds its wall time to `profile`.
  bool profiling = false;
  Profile profile;

 private:
  struct Impl;
  std::unique_ptr<Impl> p_;
};

}  // namespace lm::model::cuda
