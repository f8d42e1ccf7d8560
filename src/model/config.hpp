#pragma once
// ModelConfig: the HF `config.json` of a K3-class hybrid model (`model_type: kimi_linear`), SPEC.md.
//
// Parsing is strict: every field is type-checked, unknown fields are errors (a typo must not silently
// turn into a default), and the fields must describe one consistent model. Every error is an
// lm::Error that names the file (ctx) and the field. Accepted inputs:
//   * the flat layout of configs/*.json and golden/model/*/config.json;
//   * the HF multimodal layout where the language model's fields sit under "text_config";
//   * HF attribute-map aliases (num_local_experts, num_experts_per_tok, n_shared_experts,
//     norm_topk_prob, n_group) and HF's derived linear_* fields; an alias and its canonical name must
//     agree when both are given;
//   * a `vision_config` object (top level in either layout) parsed into `vision` (VisionConfig);
//     null or {} means no tower.
// Layer lists in the file are 1-based (kda_layers, full_attn_layers); the helpers below take 0-based
// layer indices, as tensor names do.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/json.hpp"

namespace lm::model {

// `vision_config` (K3's field names, SPEC §9): the MoonViT-V2 tower and the patchmergerv2 projector.
// Parsed as strictly as the text model: unknown fields are errors, and the fields that name a variant
// (pos_emb_type, merge_type, mm_projector_type, activations, norm_type, biases, ...) must name the one
// longmoe implements. Legend: D vt_hidden_size, Q qkv_hidden_size, I vt_intermediate_size, d text width.
struct VisionConfig {
  int64_t patch_size = 14;           // square RGB patches, Conv2d stride = kernel = patch_size
  int64_t init_pos_emb_height = 0;   // P0 rows of the learned position table (K3: 64)
  int64_t init_pos_emb_width = 0;    // P0 columns
  int64_t init_pos_emb_time = 0;     // frames of the fixed sin/cos time table: the longest clip
  int64_t num_heads = 0;             // vt_num_attention_heads
  int64_t num_layers = 0;            // vt_num_hidden_layers
  int64_t hidden_size = 0;           // vt_hidden_size, D
  int64_t intermediate_size = 0;     // vt_intermediate_size, I
  int64_t qkv_hidden_size = 0;       // Q (absent: D); head_dim = Q / heads, a multiple of 4 (2-D RoPE)
  int64_t merge_h = 2, merge_w = 2;  // merge_kernel_size
  double projector_ln_eps = 1e-5;    // the projector's post_norm eps
  int64_t text_hidden_size = 0;      // d: the projector's output width (the text model's hidden_size)
  std::optional<int64_t> media_placeholder_token_id;  // the prompt token whose rows the splice replaces (SPEC §9)

  // The tower's RMSNorms: nn.RMSNorm without eps in the reference, i.e. bf16's finfo eps, fixed here
  // in every dtype so the fp32 and bf16 paths agree (SPEC §9).
  static constexpr double kNormEps = 1.0 / 128.0;
  static constexpr double kRopeTheta = 10000.0;

  int64_t head_dim() const { return qkv_hidden_size / num_heads; }
  int64_t patch_dim() const { return 3 * patch_size * patch_size; }     // flattened [3, p, p]
  int64_t merge_size() const { return merge_h * merge_w; }
  int64_t merged_dim() const { return merge_size() * hidden_size; }     // projector input width (4D)

  // `vc` is the vision_config object; `where` prefixes field names in errors ("vision_config.").
  static VisionConfig from_json(const io::json& vc, const std::string& ctx, const std::string& where = "vision_config.");
  // The "vision_config" object of a config.json (or a directory holding one).
  static VisionConfig load(const std::string& path);
  io::json to_json() const;
  void validate(const std::string& ctx = "VisionConfig") const;
  bool operator==(const VisionConfig&) const = default;
};

// The top-level names of a multimodal config.json that to_json writes (from_json accepts any wrapper name).
inline constexpr const char* kMultimodalArchitecture = "KimiK3ForConditionalGeneration";
inline constexpr const char* kMultimodalModelType = "kimi_k3";

struct ModelConfig {
  // ---- stack -------------------------------------------------------------------------------
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;         // d
  int64_t num_hidden_layers = 0;   // L
  double rms_norm_eps = 1e-6;      // HF default when absent; both published configs say 1e-5

  // ---- gated NoPE MLA (SPEC §3) ----------------------------------------------------------------
  int64_t num_attention_heads = 0;  // H_mla
  int64_t num_key_value_heads = 0;  // must equal num_attention_heads (MLA: one K/V per head)
  std::optional<int64_t> q_lora_rank;  // null/absent: plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;  // the "rope" slice, not rotated (NoPE)
  int64_t v_head_dim = 0;
  bool mla_use_nope = true;          // must be true: longmoe implements NoPE MLA only
  bool mla_use_output_gate = false;  // K3: sigmoid(g_proj(x)) before o_proj

  // ---- KDA (SPEC §2), `linear_attn_config` -----------------------------------------------------
  int64_t kda_num_heads = 0;     // linear_attn_config.num_heads
  int64_t kda_head_dim = 0;      // linear_attn_config.head_dim (K = V)
  int64_t kda_conv_kernel = 4;   // linear_attn_config.short_conv_kernel_size
  bool kda_full_rank_gate = false;             // use_full_rank_gate: g_proj (K3) vs g_a/g_b (Kimi Linear)
  std::optional<double> kda_gate_lower_bound;  // gate_lower_bound (K3: -5); absent: softplus gate
  std::vector<int64_t> kda_layers;        // 1-based, as in the file
  std::vector<int64_t> full_attn_layers;  // 1-based, as in the file

  // ---- FFNs (SPEC §4) ------------------------------------------------------------------------
  std::string hidden_act = "silu";                 // "silu" (SwiGLU) or "situ" (SiTU-GLU)
  std::optional<double> activation_situ_beta;      // beta1; required for situ
  std::optional<double> activation_situ_linear_beta;  // beta2; absent: no cap on the up branch
  int64_t intermediate_size = 0;                   // dense FFN width (required when a dense layer exists)
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;

  // ---- MoE (SPEC §5) -------------------------------------------------------------------------
  int64_t num_experts = 0;            // 0 / absent: no MoE layers (every FFN dense)
  int64_t num_experts_per_token = 0;  // top-k
  int64_t num_shared_experts = 0;
  int64_t moe_intermediate_size = 0;
  std::optional<int64_t> routed_expert_hidden_size;  // latent width; absent: full-width experts
  bool latent_moe_use_norm = true;  // routed_expert_norm between the expert sum and the up-projection
  bool moe_renormalize = true;
  double routed_scaling_factor = 1.0;

  // ---- Block AttnRes (SPEC §6) ---------------------------------------------------------------
  std::optional<int64_t> attn_res_block_size;  // absent: plain pre-norm residual

  // ---- vision (SPEC §9): `vision_config`, absent (or null / {}) for a text-only model -----------
  std::optional<VisionConfig> vision;

  // ---- carried through unchanged (no effect on the computation) -------------------------------
  std::optional<int64_t> max_position_embeddings;
  io::json pad_token_id, bos_token_id, eos_token_id;  // null, an integer, or (eos) a list of integers
  std::optional<std::string> torch_dtype;             // "torch_dtype" or HF 5's "dtype"

  // ---- parsing / writing ---------------------------------------------------------------------
  // `ctx` names the source (file path) in error messages. Throws only lm::Error.
  static ModelConfig from_json(const io::json& j, const std::string& ctx);
  // `path`: a config.json, or a directory containing one.
  static ModelConfig load(const std::string& path);
  // HF config.json that from_json (and the HF reference) reads back to an equal ModelConfig: flat for a text-only
  // model; with a tower, K3's multimodal layout ({architectures, model_type, text_config: <the flat text config>,
  // vision_config, media_placeholder_token_id, ...}).
  io::json to_json() const;
  // to_json() written atomically (pretty-printed).
  void save(const std::string& path) const;
  // Re-checks every consistency rule (from_json calls it; call it after editing fields by hand).
  void validate(const std::string& ctx = "ModelConfig") const;

  bool operator==(const ModelConfig&) const = default;

  // ---- derived facts; `i` is a 0-based layer index ---------------------------------------------
  bool is_kda(int64_t i) const;  // i+1 in kda_layers
  bool is_mla(int64_t i) const { return !is_kda(i); }
  bool is_moe(int64_t i) const {
    return num_experts > 0 && i >= first_k_dense_replace && i % moe_layer_freq == 0;
  }
  bool is_dense_ffn(int64_t i) const { return !is_moe(i); }
  int64_t num_kda_layers() const { return static_cast<int64_t>(kda_layers.size()); }
  int64_t num_mla_layers() const { return num_hidden_layers - num_kda_layers(); }
  int64_t num_moe_layers() const;
  int64_t num_dense_ffn_layers() const { return num_hidden_layers - num_moe_layers(); }

  bool is_situ() const { return hidden_act == "situ"; }
  bool has_q_lora() const { return q_lora_rank.has_value(); }
  bool has_latent_moe() const { return routed_expert_hidden_size.has_value(); }
  bool has_attn_res() const { return attn_res_block_size.has_value(); }
  bool kda_bounded_gate() const { return kda_gate_lower_bound.has_value(); }

  int64_t mla_qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }  // 192 in K3
  int64_t mla_cache_dim() const { return kv_lora_rank + qk_rope_head_dim; }        // 576 in K3
  int64_t expert_width() const { return routed_expert_hidden_size.value_or(hidden_size); }
  int64_t shared_intermediate_size() const { return moe_intermediate_size * num_shared_experts; }
  int64_t kda_key_dim() const { return kda_num_heads * kda_head_dim; }  // H*K (= H*V)
  // Depth sources an AttnRes read sees at most: embedding + closed blocks + partial block.
  int64_t attn_res_max_sources() const;
};

// The field names from_json accepts (top level, then linear_attn_config), for tools and tests.
const std::vector<std::string>& known_config_fields();
const std::vector<std::string>& known_linear_attn_fields();

}  // namespace lm::model
