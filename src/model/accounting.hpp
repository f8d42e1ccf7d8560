#pragma once
// Parameter, FLOP and memory accounting for a ModelConfig (SPEC §8). Everything is derived from
// the tensor list of param_names.hpp, so the counts are exactly the tensors a checkpoint holds.
//
// Definitions
//   total      every tensor in the checkpoint (incl. e_score_correction_bias, norms, AttnRes).
//   activated  what one token touches: everything except the input embedding, with k of the E routed
//              experts of each MoE layer (shared experts, router, latent projections, lm_head included).
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.hpp"
#include "model/param_names.hpp"

namespace lm::model {

struct ComponentCount {
  int64_t total = 0;
  int64_t activated = 0;
};

struct ParamCounts {
  int64_t total = 0;
  int64_t activated = 0;
  int64_t activated_matmul = 0;  // activated GEMM weights (lm_head, projections, experts): the 6N of FLOPs
  int64_t trainable = 0;         // total minus the QB biases
  std::array<ComponentCount, kNumComponents> by_component{};
  // For pipeline/expert splits: per decoder layer, all params and the routed-expert part of them.
  std::vector<int64_t> layer_total, layer_routed;
  int64_t embedding = 0;  // model.embed_tokens (pipeline stage 0)
  int64_t head = 0;       // model.norm + output AttnRes read + lm_head (last stage)

  const ComponentCount& operator[](Component c) const { return by_component[static_cast<size_t>(c)]; }
};
ParamCounts count_params(const ModelConfig& c);

// The vision tower and projector (SPEC §9), from vision_param_specs: a separate tensor list, not in count_params.
struct VisionParamCounts {
  int64_t tower = 0;      // vision_tower.*
  int64_t projector = 0;  // mm_projector.*
  int64_t total() const { return tower + projector; }
};
VisionParamCounts count_vision_params(const VisionConfig& v);

// FLOPs per token. Matmul FLOPs are 2 per activated GEMM weight forward, 6 for training (fwd + bwd).
// Attention adds, per MLA layer, 2*Hm*(qk+v) per attended key (forward, non-absorbed; causal training
// at sequence length S attends (S+1)/2 keys on average), and per KDA layer and head the chunked cost
// 6K^2 + 3CK + C^2 (C = 64, SPEC §2.1). Training multiplies the forward by 3. Decode at context N
// uses the absorbed MLA form: 2*Hm*(2*kv_lora_rank + qk_rope) per cached token, and the KDA
// recurrence 8*K*V per head.
struct FlopsPerToken {
  int64_t seq_len = 0, context = 0;
  double matmul_fwd = 0;        // 2 * activated_matmul
  double mla_attn_fwd_train = 0;  // at seq_len, causal average
  double kda_attn_fwd = 0;
  double train = 0;             // 3 * (matmul_fwd + mla_attn_fwd_train + kda_attn_fwd)
  double decode = 0;            // one new token at `context` cached tokens (forward only)
};
FlopsPerToken flops_per_token(const ModelConfig& c, int64_t seq_len, int64_t context);

// Decode-time state. MLA caches [RMSNorm_kv(c); k_r] = kv_lora_rank + qk_rope_head_dim values per token
// per MLA layer (576 in K3); KDA keeps S = H*K*V fp32 per layer per sequence plus the last W-1 inputs
// of the q, k and v short convolutions.
struct DecodeMemory {
  int64_t context = 0;
  int cache_bytes = 2;  // bytes per cached MLA / conv value (bf16)
  int64_t mla_bytes_per_token = 0;
  int64_t mla_bytes_per_seq = 0;   // * context
  int64_t kda_state_bytes_per_seq = 0;
  int64_t conv_state_bytes_per_seq = 0;
  int64_t total_bytes_per_seq = 0;
  int64_t weight_bytes = 0;  // all parameters at `weight_bytes_per_param`
};
DecodeMemory decode_memory(const ModelConfig& c, int64_t context, int cache_bytes = 2, int weight_bytes_per_param = 2);

// Bytes one decode step of `batch` sequences at `context` cached tokens must read from device memory with bf16
// weights: every weight but the embedding and the routed experts once, the embedding rows of the batch, in each
// MoE layer the experts the batch selects (expected distinct ones under uniform routing: E·(1 − (1 − k/E)^batch)),
// the KDA states read and written (fp32) and conv inputs, and the MLA latent rows (bf16) of each sequence.
struct DecodeTraffic {
  double weights = 0, experts = 0, kda_states = 0, mla_cache = 0;
  double total() const { return weights + experts + kda_states + mla_cache; }
};
DecodeTraffic decode_traffic(const ModelConfig& c, int64_t context, int64_t batch);

// Device memory of GPU inference (model/cuda/gpu_model.hpp, an inference-only model): the bf16 weights with the
// fp32 copy of the small tensors, the slot caches (KDA states and conv inputs fp32 per slot, MLA latent rows bf16
// in 64-token blocks), and the activations of a prefill chunk (one layer's, shared by the layers) and of a decode
// step; `workspace` covers what the kernels and libraries keep beside them (cuBLAS workspaces, the CUDA context).
struct InferenceMemory {
  double weights = 0, kda_caches = 0, mla_cache = 0, activations = 0, workspace = 0;
  double total() const { return weights + kda_caches + mla_cache + activations + workspace; }
};
// pool_tokens > 0: a latent pool of that many tokens instead of batch × context (slots sharing blocks).
InferenceMemory inference_memory(const ModelConfig& c, int64_t context, int64_t batch, int64_t prefill_chunk = 16384,
                                 int64_t pool_tokens = 0);

// Device memory of a training step of the GPU model (model/cuda/gpu_model.hpp) over `rows` tokens with AdamW, under
// a memory plan: keep[i] says whether layer i keeps its internals from the forward to the backward (otherwise the
// layer runs its forward again just before its backward, into buffers every such layer shares). Counted from the
// buffers the model allocates: parameters (fp32 master and gradients, the bf16 copy, the transposed experts, AdamW's
// two moments), the states every layer keeps (its input state; AttnRes block states), the kept layers' internals,
// the shared set of the recomputed ones, the backward's scratch, the largest transient workspace of a kernel (held
// in the stream-ordered pool), and `workspace` (the CUDA context, cuBLAS workspaces).
// Rows per piece of the GPU model's FFN backward (GpuModel::ffn_rows' default): its scratch is that many rows.
inline constexpr int64_t kGpuFfnRows = 16384;
struct GpuTrainingMemory {
  std::vector<bool> keep;  // [L]
  int64_t rows = 0, kept_layers = 0;
  // offload: the layers' transient input states (gpu_transient_states) wait in pinned host memory between the
  // forward and the backward; `host` is that memory (not part of total()).
  bool offload = false;
  double host = 0;
  double params = 0, states = 0, kept = 0, shared = 0, scratch = 0, transient = 0, workspace = 0;
  double total() const { return params + states + kept + shared + scratch + transient + workspace; }
};
// The layers whose input state only the layer itself reads in the forward, so that a training step can keep it in
// host memory until the backward: with AttnRes the ones that open no block (blocks are read by every later read),
// with plain residuals all (x_in, the copy of the stream before the mixer).
std::vector<bool> gpu_transient_states(const ModelConfig& c);
GpuTrainingMemory gpu_training_memory(const ModelConfig& c, int64_t rows, std::vector<bool> keep, bool offload = false);
// The plan for `device_bytes` of device memory and `host_bytes` of pinned host memory: every layer keeps when that
// fits; otherwise the transient input states move to host memory when they fit there, and the layers whose second
// forward would cost most keep first (MLA layers, whose attention grows with the context, then the KDA layers in
// order) as long as the total stays within the device. lm::Error naming the sizes when even recomputing every layer
// does not fit (before anything is allocated).
GpuTrainingMemory gpu_training_plan(const ModelConfig& c, int64_t rows, double device_bytes, double host_bytes = 0);
// One line: which layers keep, and the predicted memory by part.
std::string gpu_training_summary(const GpuTrainingMemory& m, const ModelConfig& c);

enum class Optimizer { AdamW, Muon };
enum class Recompute { None, Full };

struct ParallelPlan {
  int64_t dp = 1, ep = 1, pp = 1, tp = 1;
  int64_t cp = 1;  // context parallel: each sequence split over cp ranks (activations / cp)
  int64_t micro_batch = 1;  // sequences per micro-batch
  int64_t seq_len = 8192;
  Optimizer optimizer = Optimizer::AdamW;
  bool zero1 = true;  // fp32 master weights + optimizer state sharded over each parameter's data-parallel group
  Recompute recompute = Recompute::None;
  int64_t gpus() const { return dp * cp * pp * tp; }
  // Throws lm::Error when the plan does not fit the model (EP must divide num_experts and dp*tp, pp <= L ...).
  void validate(const ModelConfig& c) const;
};

struct TrainingMemory {
  ParallelPlan plan;
  int stage = 0;             // the pipeline stage with the largest footprint (reported)
  int64_t stage_layers = 0;  // decoder layers in that stage
  double dense_params = 0;   // non-routed parameters held by one device of that stage
  double expert_params = 0;  // routed-expert parameters held by one device of that stage
  double weight_bytes = 0, grad_bytes = 0, master_bytes = 0, optimizer_bytes = 0, activation_bytes = 0;
  double activation_bytes_per_token_layer = 0;  // average over the stage's layers, before TP split
  double total_bytes = 0;
  std::vector<std::string> assumptions;
};
TrainingMemory training_memory(const ModelConfig& c, const ParallelPlan& plan);

// Bytes one GPU sends per training step (one micro-batch per data-parallel replica) by parallel dimension, for ring
// collectives ((n−1)/n of the payload per rank) and pairwise all-to-alls: data parallel, the gradients reduce-
// scattered (fp32) and the updated weights all-gathered (bf16) over each parameter's replicas (dense: dp·cp, experts:
// dp·cp·tp/ep), or all-reduced without ZeRO-1; expert parallel, per MoE layer the routed rows dispatched and combined
// (l-wide bf16, forward and backward: 4 all-to-alls); context parallel, per KDA layer the all-gather of each rank's
// segment transition and zero-start state (fp32 [H, K, K] each, forward and backward) and the 3-token conv halo, per
// MLA layer the all-gather of the 576-wide latents (bf16 forward, fp32 gradients backward); pipeline, the boundary
// activations (bf16 [tokens, d] forward and backward); tensor parallel, Megatron's two all-reduces per sublayer of
// bf16 [tokens, d] forward and backward.
struct TrainingTraffic {
  double dp = 0, ep = 0, cp = 0, pp = 0, tp = 0;
  double total() const { return dp + ep + cp + pp + tp; }
};
TrainingTraffic training_traffic(const ModelConfig& c, const ParallelPlan& plan);

std::string_view optimizer_name(Optimizer o);
std::string_view recompute_name(Recompute r);

}  // namespace lm::model
