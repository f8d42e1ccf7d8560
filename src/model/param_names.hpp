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
  VisionTower,   // vision_tower.* (SPEC §9; a separate tensor list, for_each_vision_param)
  Projector,     // mm_projector.*
};
inline constexpr int kNumComponents = 13;
inline constexpr int kNumTextComponents = 11;  // the components for_each_param emits (Embedding .. AttnRes)
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

// The vision tower and projector (SPEC §9), in forward order: patch embed (proj, pos_emb), blocks 0..n-1
// (norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1; `layer` = block index), final_layernorm, mm_projector (proj.0,
// proj.2, post_norm). D vt_hidden_size, Q qkv_hidden_size, I vt_intermediate_size, p patch_size, P0h×P0w the
// position table, m = merge_h·merge_w, d text_hidden_size. These names are those of a multimodal checkpoint; the
// text model's tensors there carry the prefix `language_model.`.
void for_each_vision_param(const VisionConfig& v, const std::function<void(const ParamSpec&)>& f);
std::vector<ParamSpec> vision_param_specs(const VisionConfig& v);

// A multimodal model (a config with vision_config) is K3's layout: the text model's tensors under `language_model.`
// (language_model.model.layers.…, language_model.lm_head.weight), then vision_tower.* and mm_projector.*. A text-only
// model's checkpoint is the text list unprefixed. In memory every tensor keeps its own name (ParamSpec::name).
inline constexpr std::string_view kLanguageModelPrefix = "language_model.";
inline bool is_vision_component(Component c) { return c == Component::VisionTower || c == Component::Projector; }
// `s`'s name in the checkpoint of a model with (`multimodal`) or without a vision tower.
std::string checkpoint_name(const ParamSpec& s, bool multimodal);
// Every tensor of the model's parameter store, in checkpoint order: param_specs(c), then vision_param_specs when
// c.vision. In-memory names.
std::vector<ParamSpec> model_param_specs(const ModelConfig& c);
// model_param_specs(c) under their checkpoint names (for check_checkpoint before a model is allocated).
std::vector<ParamSpec> checkpoint_specs(const ModelConfig& c);

}  // namespace lm::model
