#pragma once
// Every parameter tensor of a model, by its checkpoint key (Moonshot / K3 names, golden/README.md),
// with its shape and the component it belongs to. This list is the contract between the model code,
// the checkpoint loader/saver and the parameter accounting: all three walk it.
//
// Shapes follow nn.Linear ([out, in]); d = hidden_size, H/K = KDA heads/head dim, Hm = MLA heads,
// E = num_experts, I = moe_intermediate_size, l = routed expert width (latent or d).
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.hpp"
#include "model/config.hpp"

namespace lm::model {

enum class Component : uint8_t {
  Embedding,     // model.embed_tokens
  LmHead,        // lm_head
  Kda,           // KDA mixer (projections, convs, A_log, dt_bias, o_norm)
  Mla,           // gated MLA mixer (incl. its LoRA norms)
  DenseFfn,      // model.layers.{i}.mlp (dense layers)
  Router,        // block_sparse_moe.gate (weight + e_score_correction_bias)
  RoutedExpert,  // block_sparse_moe.experts.{e}
  SharedExpert,  // block_sparse_moe.shared_experts
  LatentProj,    // routed_expert_{down_proj,norm,up_proj}
  Norm,          // input/post_attention layernorms, model.norm
  AttnRes,       // *_res_proj / *_res_norm (per layer and output read)
};
inline constexpr int kNumComponents = 11;
std::string_view component_name(Component c);  // "embedding", "lm_head", "kda", ...

struct ParamSpec {
  std::string name;  // e.g. "model.layers.3.self_attn.kv_b_proj.weight"
  Shape shape;
  Component component = Component::Norm;
  int layer = -1;          // 0-based decoder layer, -1 for model-level tensors
  int expert = -1;         // routed expert index, -1 otherwise
  bool trainable = true;   // false for e_score_correction_bias (updated by Quantile Balancing, no gradient)
  bool matmul = false;     // a weight used as a GEMM operand per token (for FLOP counts)
  int64_t numel() const { return shape_numel(shape); }
};

// Visits the tensors of the whole model in checkpoint order: embedding, layers 0..L-1 (mixer, ffn,
// norms, AttnRes), model-level norms, lm_head.
void for_each_param(const ModelConfig& c, const std::function<void(const ParamSpec&)>& f);
// Only the tensors of decoder layer `layer` (0-based).
void for_each_layer_param(const ModelConfig& c, int layer, const std::function<void(const ParamSpec&)>& f);
std::vector<ParamSpec> param_specs(const ModelConfig& c);

}  // namespace lm::model
