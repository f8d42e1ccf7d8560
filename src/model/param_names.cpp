#include "model/param_names.hpp"

#include <fmt/format.h>

namespace lm::model {

std::string_view component_name(Component c) {
  switch (c) {
    case Component::Embedding: return "embedding";
    case Component::LmHead: return "lm_head";
    case Component::Kda: return "kda";
    case Component::Mla: return "mla";
    case Component::DenseFfn: return "dense_ffn";
    case Component::Router: return "router";
    case Component::RoutedExpert: return "routed_expert";
    case Component::SharedExpert: return "shared_expert";
    case Component::LatentProj: return "latent_proj";
    case Component::Norm: return "norm";
    case Component::AttnRes: return "attnres";
    case Component::VisionTower: return "vision_tower";
    case Component::Projector: return "mm_projector";
  }
  return "?";
}

namespace {

struct Emitter {
  explicit Emitter(const std::function<void(const ParamSpec&)>& fn) : f(fn) {}
  const std::function<void(const ParamSpec&)>& f;
  int layer = -1;
  ParamSpec p;  // reused to avoid reallocating the name buffer per tensor

  void operator()(std::string name, Shape shape, Component comp, bool matmul, int expert = -1,
                  bool trainable = true) {
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.component = comp;
    p.layer = layer;
    p.expert = expert;
    p.trainable = trainable;
    p.matmul = matmul;
    f(p);
  }
};

// GLU FFN: gate/up [I, in], down [in, I].
void glu(Emitter& emit, const std::string& pre, const char* gate, const char* up, const char* down, int64_t in,
         int64_t inter, Component comp, int expert = -1) {
  emit(fmt::format("{}.{}.weight", pre, gate), {inter, in}, comp, true, expert);
  emit(fmt::format("{}.{}.weight", pre, up), {inter, in}, comp, true, expert);
  emit(fmt::format("{}.{}.weight", pre, down), {in, inter}, comp, true, expert);
}

void layer_params(const ModelConfig& c, int i, Emitter& emit) {
  const int64_t d = c.hidden_size;
  const std::string L = fmt::format("model.layers.{}", i);
  emit.layer = i;

  // ---- mixer ----
  const std::string A = L + ".self_attn";
  if (c.is_kda(i)) {
    const int64_t H = c.kda_num_heads, K = c.kda_head_dim, HK = c.kda_key_dim(), W = c.kda_conv_kernel;
    const auto K3 = Component::Kda;
    emit(A + ".q_proj.weight", {HK, d}, K3, true);
    emit(A + ".k_proj.weight", {HK, d}, K3, true);
    emit(A + ".v_proj.weight", {HK, d}, K3, true);
    emit(A + ".q_conv1d.weight", {HK, 1, W}, K3, false);
    emit(A + ".k_conv1d.weight", {HK, 1, W}, K3, false);
    emit(A + ".v_conv1d.weight", {HK, 1, W}, K3, false);
    emit(A + ".A_log", {H}, K3, false);
    emit(A + ".dt_bias", {HK}, K3, false);
    emit(A + ".f_a_proj.weight", {K, d}, K3, true);
    emit(A + ".f_b_proj.weight", {HK, K}, K3, true);
    emit(A + ".b_proj.weight", {H, d}, K3, true);
    if (c.kda_full_rank_gate) {
      emit(A + ".g_proj.weight", {HK, d}, K3, true);
    } else {
      emit(A + ".g_a_proj.weight", {K, d}, K3, true);
      emit(A + ".g_b_proj.weight", {HK, K}, K3, true);
    }
    emit(A + ".o_norm.weight", {K}, K3, false);
    emit(A + ".o_proj.weight", {d, HK}, K3, true);
  } else {
    const int64_t Hm = c.num_attention_heads, qk = c.mla_qk_head_dim(), vh = c.v_head_dim;
    const auto M = Component::Mla;
    if (c.q_lora_rank) {
      emit(A + ".q_a_proj.weight", {*c.q_lora_rank, d}, M, true);
      emit(A + ".q_a_layernorm.weight", {*c.q_lora_rank}, M, false);
      emit(A + ".q_b_proj.weight", {Hm * qk, *c.q_lora_rank}, M, true);
    } else {
      emit(A + ".q_proj.weight", {Hm * qk, d}, M, true);
    }
    emit(A + ".kv_a_proj_with_mqa.weight", {c.mla_cache_dim(), d}, M, true);
    emit(A + ".kv_a_layernorm.weight", {c.kv_lora_rank}, M, false);
    emit(A + ".kv_b_proj.weight", {Hm * (c.qk_nope_head_dim + vh), c.kv_lora_rank}, M, true);
    emit(A + ".o_proj.weight", {d, Hm * vh}, M, true);
    if (c.mla_use_output_gate) emit(A + ".g_proj.weight", {Hm * vh, d}, M, true);
  }

  // ---- FFN ----
  if (c.is_moe(i)) {
    const std::string B = L + ".block_sparse_moe";
    const int64_t I = c.moe_intermediate_size, w = c.expert_width();
    emit(B + ".gate.weight", {c.num_experts, d}, Component::Router, true);
    emit(B + ".gate.e_score_correction_bias", {c.num_experts}, Component::Router, false, -1, /*trainable=*/false);
    for (int64_t e = 0; e < c.num_experts; ++e)
      glu(emit, fmt::format("{}.experts.{}", B, e), "w1", "w3", "w2", w, I, Component::RoutedExpert,
          static_cast<int>(e));
    if (c.num_shared_experts > 0)
      glu(emit, B + ".shared_experts", "gate_proj", "up_proj", "down_proj", d, c.shared_intermediate_size(),
          Component::SharedExpert);
    if (c.routed_expert_hidden_size) {
      emit(B + ".routed_expert_down_proj.weight", {w, d}, Component::LatentProj, true);
      if (c.latent_moe_use_norm) emit(B + ".routed_expert_norm.weight", {w}, Component::LatentProj, false);
      emit(B + ".routed_expert_up_proj.weight", {d, w}, Component::LatentProj, true);
    }
  } else {
    glu(emit, L + ".mlp", "gate_proj", "up_proj", "down_proj", d, c.intermediate_size, Component::DenseFfn);
  }

  // ---- norms and AttnRes ----
  emit(L + ".input_layernorm.weight", {d}, Component::Norm, false);
  emit(L + ".post_attention_layernorm.weight", {d}, Component::Norm, false);
  if (c.has_attn_res()) {
    emit(L + ".self_attention_res_proj.weight", {1, d}, Component::AttnRes, false);
    emit(L + ".self_attention_res_norm.weight", {d}, Component::AttnRes, false);
    emit(L + ".mlp_res_proj.weight", {1, d}, Component::AttnRes, false);
    emit(L + ".mlp_res_norm.weight", {d}, Component::AttnRes, false);
  }
}

}  // namespace

void for_each_layer_param(const ModelConfig& c, int layer, const std::function<void(const ParamSpec&)>& f) {
  LM_CHECK(layer >= 0 && layer < c.num_hidden_layers, "layer {} out of range [0, {})", layer, c.num_hidden_layers);
  Emitter emit(f);
  layer_params(c, layer, emit);
}

void for_each_param(const ModelConfig& c, const std::function<void(const ParamSpec&)>& f) {
  const int64_t d = c.hidden_size;
  Emitter emit(f);
  emit("model.embed_tokens.weight", {c.vocab_size, d}, Component::Embedding, false);
  for (int i = 0; i < c.num_hidden_layers; ++i) layer_params(c, i, emit);
  emit.layer = -1;
  if (c.has_attn_res()) {
    emit("model.output_attn_res_proj.weight", {1, d}, Component::AttnRes, false);
    emit("model.output_attn_res_norm.weight", {d}, Component::AttnRes, false);
  }
  emit("model.norm.weight", {d}, Component::Norm, false);
  emit("lm_head.weight", {c.vocab_size, d}, Component::LmHead, true);
}

void for_each_vision_param(const VisionConfig& v, const std::function<void(const ParamSpec&)>& f) {
  const int64_t D = v.hidden_size, Q = v.qkv_hidden_size, I = v.intermediate_size, p = v.patch_size;
  const int64_t m = v.merged_dim(), d = v.text_hidden_size;
  const auto VT = Component::VisionTower, PR = Component::Projector;
  Emitter emit(f);
  emit("vision_tower.patch_embed.proj.weight", {D, 3, p, p}, VT, true);
  emit("vision_tower.patch_embed.pos_emb.weight", {v.init_pos_emb_height, v.init_pos_emb_width, D}, VT, false);
  for (int i = 0; i < v.num_layers; ++i) {
    emit.layer = i;
    const std::string B = fmt::format("vision_tower.encoder.blocks.{}", i);
    emit(B + ".norm0.weight", {D}, VT, false);
    emit(B + ".wqkv.weight", {3 * Q, D}, VT, true);
    emit(B + ".wo.weight", {D, Q}, VT, true);
    emit(B + ".norm1.weight", {D}, VT, false);
    emit(B + ".mlp.fc0.weight", {I, D}, VT, true);
    emit(B + ".mlp.fc1.weight", {D, I}, VT, true);
  }
  emit.layer = -1;
  emit("vision_tower.encoder.final_layernorm.weight", {D}, VT, false);
  emit("mm_projector.proj.0.weight", {m, m}, PR, true);
  emit("mm_projector.proj.2.weight", {d, m}, PR, true);
  emit("mm_projector.post_norm.weight", {d}, PR, false);
}

std::vector<ParamSpec> vision_param_specs(const VisionConfig& v) {
  std::vector<ParamSpec> r;
  for_each_vision_param(v, [&](const ParamSpec& p) { r.push_back(p); });
  return r;
}

std::vector<ParamSpec> param_specs(const ModelConfig& c) {
  std::vector<ParamSpec> r;
  for_each_param(c, [&](const ParamSpec& p) { r.push_back(p); });
  return r;
}

std::string checkpoint_name(const ParamSpec& s, bool multimodal) {
  return multimodal && !is_vision_component(s.component) ? std::string(kLanguageModelPrefix) + s.name : s.name;
}

std::vector<ParamSpec> model_param_specs(const ModelConfig& c) {
  std::vector<ParamSpec> r = param_specs(c);
  if (c.vision) for_each_vision_param(*c.vision, [&](const ParamSpec& p) { r.push_back(p); });
  return r;
}

std::vector<ParamSpec> checkpoint_specs(const ModelConfig& c) {
  std::vector<ParamSpec> r = model_param_specs(c);
  for (ParamSpec& s : r) s.name = checkpoint_name(s, c.vision.has_value());
  return r;
}

}  // namespace lm::model
