#include "model/config.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <set>

#include "io/file.hpp"

namespace lm::model {

namespace {

using io::json;

// Bounds that keep every later product (tensor sizes, parameter sums) far from int64 overflow while
// admitting any plausible model. Larger values are configuration errors, not models.
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxVocab = (int64_t{1} << 31) - 1;  // token ids are int32
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = 65536;

// Fields the model reads (canonical names).
const std::vector<std::string> kModelFields = {
    "vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps",
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate", "linear_attn_config",
    "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "intermediate_size",
    "first_k_dense_replace", "moe_layer_freq", "num_experts", "num_experts_per_token", "num_shared_experts",
    "moe_intermediate_size", "routed_expert_hidden_size", "latent_moe_use_norm", "moe_renormalize",
    "routed_scaling_factor", "attn_res_block_size", "vision_config",
    // carried through
    "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id", "torch_dtype", "dtype"};

// HF attribute-map aliases: alias -> canonical (HF config.json may use either).
const std::vector<std::pair<std::string, std::string>> kAliases = {
    {"num_local_experts", "num_experts"},
    {"num_experts_per_tok", "num_experts_per_token"},
    {"n_shared_experts", "num_shared_experts"},
    {"norm_topk_prob", "moe_renormalize"},
    {"n_group", "num_expert_group"},
};
// HF 5 derives these from linear_attn_config; accepted when they agree with it.
const std::vector<std::pair<std::string, std::string>> kLinearAliases = {
    {"linear_num_heads", "num_heads"},
    {"linear_head_dim", "head_dim"},
    {"linear_conv_kernel_dim", "short_conv_kernel_size"},
};

// Fields with one permitted value (checked), and fields that do not affect the model (ignored).
const std::vector<std::string> kCheckedFields = {
    "model_type", "architectures", "tie_word_embeddings", "num_nextn_predict_layers", "use_grouped_topk",
    "topk_group", "num_expert_group", "moe_router_activation_func"};
const std::vector<std::string> kIgnoredFields = {
    "attention_dropout", "use_cache", "transformers_version", "initializer_range", "rope_theta", "rope_scaling",
    "rope_parameters", "head_dim", "auto_map", "model_max_length", "layer_types", "mlp_layer_types",
    "_name_or_path", "return_dict", "output_attentions", "output_hidden_states", "output_router_logits",
    "use_bfloat16", "is_encoder_decoder", "id2label", "label2id", "sep_token_id", "tokenizer_class",
    "keys_to_ignore_at_inference"};

// Top level of a multimodal HF config whose language model sits under "text_config".
const std::vector<std::string> kOuterFields = {
    "text_config", "vision_config", "model_type", "architectures", "auto_map", "torch_dtype", "dtype",
    "transformers_version", "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
    "media_placeholder_token_id", "ignore_index", "use_cache", "_name_or_path", "quantization_config"};

const std::vector<std::string> kLinearFields = {"num_heads",          "head_dim",        "short_conv_kernel_size",
                                                "use_full_rank_gate", "gate_lower_bound", "full_attn_layers",
                                                "kda_layers"};

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string suggestion(const std::string& key, const std::vector<std::vector<std::string>>& lists) {
  if (key.size() > 64) return "";
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& l : lists)
    for (const auto& k : l) {
      const size_t d = edit_distance(key, k);
      if (d < best_d) best_d = d, best = k;
    }
  if (best.empty() || best_d > std::max<size_t>(2, key.size() / 4)) return "";
  return " (did you mean '" + best + "'?)";
}

// A short, never-throwing rendering of a value for error messages (no recursion into containers,
// invalid UTF-8 replaced, long strings cut).
std::string brief(const json& v) {
  if (v.is_array()) return fmt::format("a list of {}", v.size());
  if (v.is_object()) return fmt::format("an object of {} fields", v.size());
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 64) s = s.substr(0, 61) + "...";
  return s;
}

bool is_primitive(const json& v) { return !v.is_array() && !v.is_object(); }

// Typed, strict access to one JSON object. `where` is the dotted prefix of the object's fields
// ("" at top level, "linear_attn_config." inside it) so errors name the field as the file spells it.
struct Fields {
  const json& j;
  const std::string& ctx;
  std::string where;

  bool has(const std::string& k) const { return j.contains(k) && !j.at(k).is_null(); }
  std::string name(const std::string& k) const { return where + k; }

  [[noreturn]] void wrong_type(const std::string& k, const char* want) const {
    fail("{}: field '{}' must be {}, got {} ({})", ctx, name(k), want, j.at(k).type_name(), brief(j.at(k)));
  }
  void require(const std::string& k) const {
    LM_CHECK(has(k), "{}: missing required field '{}'", ctx, name(k));
  }

  int64_t as_int(const std::string& k, int64_t lo, int64_t hi) const {
    const json& v = j.at(k);
    if (!v.is_number_integer()) wrong_type(k, "an integer");
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail("{}: field '{}' = {} is out of range [{}, {}]", ctx, name(k), brief(v), lo, hi);
    const int64_t x = v.get<int64_t>();
    LM_CHECK(x >= lo && x <= hi, "{}: field '{}' = {} is out of range [{}, {}]", ctx, name(k), x, lo, hi);
    return x;
  }
  int64_t req_int(const std::string& k, int64_t lo, int64_t hi) const {
    require(k);
    return as_int(k, lo, hi);
  }
  std::optional<int64_t> opt_int(const std::string& k, int64_t lo, int64_t hi) const {
    if (!has(k)) return std::nullopt;
    return as_int(k, lo, hi);
  }
  double as_double(const std::string& k) const {
    const json& v = j.at(k);
    if (!v.is_number()) wrong_type(k, "a number");
    const double x = v.get<double>();
    LM_CHECK(std::isfinite(x), "{}: field '{}' is not finite", ctx, name(k));
    return x;
  }
  std::optional<double> opt_double(const std::string& k) const {
    if (!has(k)) return std::nullopt;
    return as_double(k);
  }
  std::optional<bool> opt_bool(const std::string& k) const {
    if (!has(k)) return std::nullopt;
    if (!j.at(k).is_boolean()) wrong_type(k, "true or false");
    return j.at(k).get<bool>();
  }
  std::optional<std::string> opt_string(const std::string& k) const {
    if (!has(k)) return std::nullopt;
    if (!j.at(k).is_string()) wrong_type(k, "a string");
    return j.at(k).get<std::string>();
  }
  std::vector<int64_t> req_int_list(const std::string& k, int64_t lo, int64_t hi) const {
    require(k);
    const json& v = j.at(k);
    if (!v.is_array()) wrong_type(k, "a list of integers");
    std::vector<int64_t> r;
    r.reserve(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const json& e = v.at(i);
      LM_CHECK(e.is_number_integer(), "{}: field '{}' must be a list of integers; entry {} is {} ({})", ctx, name(k),
               i, e.type_name(), brief(e));
      LM_CHECK(!e.is_number_unsigned() || e.get<uint64_t>() <= static_cast<uint64_t>(hi),
               "{}: field '{}' entry {} = {} is out of range [{}, {}]", ctx, name(k), i, brief(e), lo, hi);
      const int64_t x = e.get<int64_t>();
      LM_CHECK(x >= lo && x <= hi, "{}: field '{}' entry {} = {} is out of range [{}, {}]", ctx, name(k), i, x, lo,
               hi);
      r.push_back(x);
    }
    return r;
  }

  // Canonical field or its alias; both present must agree. Returns the key that holds the value ("" if none).
  std::string resolve(const std::string& canonical, const std::string& alias) const {
    const bool c = has(canonical), a = has(alias);
    if (c && a) {
      if (!is_primitive(j.at(canonical))) wrong_type(canonical, "a number or a boolean");
      if (!is_primitive(j.at(alias))) wrong_type(alias, "a number or a boolean");
      LM_CHECK(j.at(canonical) == j.at(alias), "{}: fields '{}' ({}) and its alias '{}' ({}) disagree", ctx,
               name(canonical), brief(j.at(canonical)), name(alias), brief(j.at(alias)));
    }
    return c ? canonical : (a ? alias : std::string());
  }

  void reject_unknown(const std::vector<std::vector<std::string>>& lists) const {
    for (auto it = j.begin(); it != j.end(); ++it) {
      bool known = false;
      for (const auto& l : lists) known = known || std::find(l.begin(), l.end(), it.key()) != l.end();
      if (!known) {
        LM_CHECK(it.key() != "quantization_config",
                 "{}: field '{}': quantized checkpoints are not supported (longmoe reads bf16/f32 weights)", ctx,
                 name(it.key()));
        fail("{}: unknown field '{}'{}", ctx, name(it.key()), suggestion(it.key(), lists));
      }
    }
  }
};

std::vector<std::string> alias_names(const std::vector<std::pair<std::string, std::string>>& a) {
  std::vector<std::string> r;
  for (const auto& [alias, canon] : a) r.push_back(alias);
  return r;
}

void check_token_id(const Fields& f, const std::string& k, bool allow_list) {
  if (!f.has(k)) return;
  const json& v = f.j.at(k);
  if (v.is_number_integer()) return;
  if (allow_list && v.is_array()) {
    for (const auto& e : v)
      LM_CHECK(e.is_number_integer(), "{}: field '{}' must be an integer or a list of integers", f.ctx, f.name(k));
    return;
  }
  f.wrong_type(k, allow_list ? "an integer or a list of integers" : "an integer");
}

void check_ignored_types(const Fields& f, int64_t num_layers) {
  // Ignored fields still must not be nonsense of the wrong kind.
  for (const char* k : {"attention_dropout", "initializer_range", "rope_theta"})
    if (f.has(k)) (void)f.as_double(k);
  for (const char* k : {"use_cache", "return_dict", "output_attentions", "output_hidden_states", "use_bfloat16",
                        "is_encoder_decoder", "output_router_logits"})
    (void)f.opt_bool(k);
  for (const char* k : {"transformers_version", "_name_or_path", "tokenizer_class"}) (void)f.opt_string(k);
  if (f.has("attention_dropout"))
    LM_CHECK(f.as_double("attention_dropout") == 0.0,
             "{}: field 'attention_dropout' must be 0 (longmoe has no attention dropout)", f.ctx);
  for (const char* k : {"layer_types", "mlp_layer_types"}) {
    if (!f.has(k)) continue;
    const json& v = f.j.at(k);
    if (!v.is_array()) f.wrong_type(k, "a list of strings");
    for (const auto& e : v)
      LM_CHECK(e.is_string(), "{}: field '{}' must be a list of strings", f.ctx, f.name(k));
    LM_CHECK(static_cast<int64_t>(v.size()) == num_layers, "{}: field '{}' has {} entries for {} layers", f.ctx,
             f.name(k), v.size(), num_layers);
  }
}

// Checks the fields that have exactly one admissible value.
// ---- vision_config (SPEC §9) ---------------------------------------------------------------------

// Fields the tower reads, fields with one permitted value (the variant longmoe implements), ignored ones.
const std::vector<std::string> kVisionFields = {
    "patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time", "vt_num_attention_heads",
    "vt_num_hidden_layers", "vt_hidden_size", "vt_intermediate_size", "qkv_hidden_size", "merge_kernel_size",
    "mm_hidden_size", "projector_ln_eps", "text_hidden_size", "media_placeholder_token_id"};
const std::vector<std::pair<std::string, std::string>> kVisionFixedStrings = {
    {"pos_emb_type", "divided_fixed"},     {"merge_type", "sd2_tpool"},
    {"mm_projector_type", "patchmergerv2"}, {"projector_hidden_act", "gelu"},
    {"norm_type", "rmsnorm"},              {"mlp_type", "mlp2"},
    {"activation_func", "gelu_pytorch_tanh"}, {"pos_emb_interpolation_mode", "bilinear"},
    {"video_attn_type", "spatial_temporal"}};
const std::vector<std::string> kVisionFalseFlags = {"attn_bias", "patch_embed_proj_bias", "linear_bias"};
const std::vector<std::string> kVisionIgnored = {"model_type", "_name_or_path", "transformers_version",
                                                 "torch_dtype", "dtype", "initializer_range"};

// True when `j[key]` holds a tower: absent, null and {} all mean "no vision tower".
bool has_vision(const json& j, const std::string& key) {
  return j.contains(key) && !j.at(key).is_null() && !(j.at(key).is_object() && j.at(key).empty());
}

}  // namespace

VisionConfig VisionConfig::from_json(const io::json& vc, const std::string& ctx, const std::string& where) {
  try {
    const std::string obj = where.empty() ? std::string("vision_config") : where.substr(0, where.size() - 1);
    LM_CHECK(vc.is_object(), "{}: field '{}' must be an object, got {}", ctx, obj, vc.type_name());
    Fields f{vc, ctx, where};
    std::vector<std::string> fixed;
    for (const auto& [k, v] : kVisionFixedStrings) fixed.push_back(k);
    f.reject_unknown({kVisionFields, fixed, kVisionFalseFlags, kVisionIgnored});
    for (const auto& [k, want] : kVisionFixedStrings)
      if (auto v = f.opt_string(k))
        LM_CHECK(*v == want, "{}: field '{}' is '{}'; longmoe implements '{}' (SPEC §9)", ctx, f.name(k), *v, want);
    for (const auto& k : kVisionFalseFlags)
      if (auto v = f.opt_bool(k))
        LM_CHECK(!*v, "{}: field '{}' must be false: every linear of the tower is bias-free (SPEC §9)", ctx, f.name(k));

    VisionConfig c;
    c.patch_size = f.req_int("patch_size", 1, 1024);
    c.init_pos_emb_height = f.req_int("init_pos_emb_height", 1, 65536);
    c.init_pos_emb_width = f.req_int("init_pos_emb_width", 1, 65536);
    c.init_pos_emb_time = f.req_int("init_pos_emb_time", 1, 65536);
    c.num_heads = f.req_int("vt_num_attention_heads", 1, kMaxDim);
    c.num_layers = f.req_int("vt_num_hidden_layers", 1, kMaxLayers);
    c.hidden_size = f.req_int("vt_hidden_size", 1, kMaxDim);
    c.intermediate_size = f.req_int("vt_intermediate_size", 1, kMaxDim);
    c.qkv_hidden_size = f.opt_int("qkv_hidden_size", 1, kMaxDim).value_or(c.hidden_size);
    if (f.has("merge_kernel_size")) {
      const auto mk = f.req_int_list("merge_kernel_size", 1, 64);
      LM_CHECK(mk.size() == 2, "{}: field '{}' must be [rows, columns], got a list of {}", ctx,
               f.name("merge_kernel_size"), mk.size());
      c.merge_h = mk[0], c.merge_w = mk[1];
    }
    if (auto m = f.opt_int("mm_hidden_size", 1, kMaxDim))
      LM_CHECK(*m == c.hidden_size,
               "{}: field '{}' = {} must equal '{}vt_hidden_size' = {} (the projector reads the tower's patches)", ctx,
               f.name("mm_hidden_size"), *m, where, c.hidden_size);
    if (auto e = f.opt_double("projector_ln_eps")) c.projector_ln_eps = *e;
    c.text_hidden_size = f.req_int("text_hidden_size", 1, kMaxDim);
    c.media_placeholder_token_id = f.opt_int("media_placeholder_token_id", 0, kMaxVocab);
    c.validate(ctx);
    return c;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("{}: invalid vision_config: {}", ctx, e.what());
  }
}

VisionConfig VisionConfig::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string file = fs::is_directory(path, ec) ? (fs::path(path) / "config.json").string() : path;
  const json j = io::load_json_file(file);
  LM_CHECK(j.is_object() && has_vision(j, "vision_config"), "{}: no 'vision_config' object (a vision tower config)",
           file);
  return from_json(j.at("vision_config"), file);
}

void VisionConfig::validate(const std::string& ctx) const {
  auto in = [&](int64_t v, int64_t lo, int64_t hi, const char* n) {
    LM_CHECK(v >= lo && v <= hi, "{}: field 'vision_config.{}' = {} is out of range [{}, {}]", ctx, n, v, lo, hi);
  };
  in(patch_size, 1, 1024, "patch_size");
  in(init_pos_emb_height, 1, 65536, "init_pos_emb_height");
  in(init_pos_emb_width, 1, 65536, "init_pos_emb_width");
  in(init_pos_emb_time, 1, 65536, "init_pos_emb_time");
  in(num_heads, 1, kMaxDim, "vt_num_attention_heads");
  in(num_layers, 1, kMaxLayers, "vt_num_hidden_layers");
  in(hidden_size, 1, kMaxDim, "vt_hidden_size");
  in(intermediate_size, 1, kMaxDim, "vt_intermediate_size");
  in(qkv_hidden_size, 1, kMaxDim, "qkv_hidden_size");
  in(text_hidden_size, 1, kMaxDim, "text_hidden_size");
  LM_CHECK(merge_h >= 1 && merge_h <= 64 && merge_w >= 1 && merge_w <= 64,
           "{}: field 'vision_config.merge_kernel_size' = [{}, {}] is out of range [1, 64]", ctx, merge_h, merge_w);
  LM_CHECK(qkv_hidden_size % num_heads == 0,
           "{}: field 'vision_config.qkv_hidden_size' = {} is not a multiple of 'vt_num_attention_heads' = {}", ctx,
           qkv_hidden_size, num_heads);
  LM_CHECK(head_dim() % 4 == 0,
           "{}: head_dim = qkv_hidden_size / vt_num_attention_heads = {} must be a multiple of 4 (2-D RoPE turns "
           "channel pairs by column and by row in turn)",
           ctx, head_dim());
  LM_CHECK(hidden_size % 2 == 0, "{}: field 'vision_config.vt_hidden_size' = {} must be even (sin/cos time table)",
           ctx, hidden_size);
  LM_CHECK(std::isfinite(projector_ln_eps) && projector_ln_eps > 0 && projector_ln_eps < 1,
           "{}: field 'vision_config.projector_ln_eps' = {} must be in (0, 1)", ctx, projector_ln_eps);
  LM_CHECK(!media_placeholder_token_id || (*media_placeholder_token_id >= 0 && *media_placeholder_token_id <= kMaxVocab),
           "{}: field 'vision_config.media_placeholder_token_id' is out of range", ctx);
  LM_CHECK(merged_dim() <= kMaxDim, "{}: merged width {} x vt_hidden_size {} is too large", ctx, merge_size(),
           hidden_size);
}

io::json VisionConfig::to_json() const {
  json j = json::object();
  j["patch_size"] = patch_size;
  j["init_pos_emb_height"] = init_pos_emb_height;
  j["init_pos_emb_width"] = init_pos_emb_width;
  j["init_pos_emb_time"] = init_pos_emb_time;
  j["pos_emb_type"] = "divided_fixed";
  j["vt_num_attention_heads"] = num_heads;
  j["vt_num_hidden_layers"] = num_layers;
  j["vt_hidden_size"] = hidden_size;
  j["vt_intermediate_size"] = intermediate_size;
  j["qkv_hidden_size"] = qkv_hidden_size;
  j["merge_kernel_size"] = json::array({merge_h, merge_w});
  j["merge_type"] = "sd2_tpool";
  j["mm_projector_type"] = "patchmergerv2";
  j["mm_hidden_size"] = hidden_size;
  j["projector_hidden_act"] = "gelu";
  j["projector_ln_eps"] = projector_ln_eps;
  j["norm_type"] = "rmsnorm";
  j["attn_bias"] = false;
  j["patch_embed_proj_bias"] = false;
  j["mlp_type"] = "mlp2";
  j["linear_bias"] = false;
  j["activation_func"] = "gelu_pytorch_tanh";
  j["pos_emb_interpolation_mode"] = "bilinear";
  j["text_hidden_size"] = text_hidden_size;
  if (media_placeholder_token_id) j["media_placeholder_token_id"] = *media_placeholder_token_id;
  return j;
}

namespace {

void check_fixed_fields(const Fields& f, bool nested) {
  if (auto mt = f.opt_string("model_type"))
    LM_CHECK(*mt == "kimi_linear", "{}: field '{}' is '{}'; longmoe reads model_type 'kimi_linear'", f.ctx,
             f.name("model_type"), *mt);
  else
    LM_CHECK(nested, "{}: missing required field 'model_type' (expected 'kimi_linear')", f.ctx);
  if (f.has("architectures")) {
    const json& a = f.j.at("architectures");
    if (!a.is_array()) f.wrong_type("architectures", "a list of strings");
    for (const auto& e : a) LM_CHECK(e.is_string(), "{}: field '{}' must be a list of strings", f.ctx, f.name("architectures"));
  }
  if (auto t = f.opt_bool("tie_word_embeddings"))
    LM_CHECK(!*t, "{}: field '{}' must be false: the K3 family has an untied lm_head", f.ctx,
             f.name("tie_word_embeddings"));
  if (auto n = f.opt_int("num_nextn_predict_layers", 0, kMaxLayers))
    LM_CHECK(*n == 0, "{}: field '{}' = {}: multi-token-prediction layers are not supported (must be 0)", f.ctx,
             f.name("num_nextn_predict_layers"), *n);
  (void)f.opt_bool("use_grouped_topk");  // with one expert group, grouped top-k is plain top-k
  const std::string group_key = f.resolve("num_expert_group", "n_group");
  if (!group_key.empty()) {
    const int64_t g = f.as_int(group_key, 1, kMaxExperts);
    LM_CHECK(g == 1, "{}: field '{}' = {}: only one expert group is supported (must be 1)", f.ctx, f.name(group_key), g);
  }
  if (auto tg = f.opt_int("topk_group", 1, kMaxExperts))
    LM_CHECK(*tg == 1, "{}: field '{}' = {}: with one expert group topk_group must be 1", f.ctx, f.name("topk_group"),
             *tg);
  if (auto act = f.opt_string("moe_router_activation_func"))
    LM_CHECK(*act == "sigmoid", "{}: field '{}' is '{}'; the router of this family is 'sigmoid'", f.ctx,
             f.name("moe_router_activation_func"), *act);
}

ModelConfig parse_model(const Fields& f, bool nested) {
  f.reject_unknown({kModelFields, kCheckedFields, kIgnoredFields, alias_names(kAliases), alias_names(kLinearAliases)});
  check_fixed_fields(f, nested);

  ModelConfig c;
  c.vocab_size = f.req_int("vocab_size", 1, kMaxVocab);
  c.hidden_size = f.req_int("hidden_size", 1, kMaxDim);
  c.num_hidden_layers = f.req_int("num_hidden_layers", 1, kMaxLayers);
  check_ignored_types(f, c.num_hidden_layers);
  if (auto e = f.opt_double("rms_norm_eps")) c.rms_norm_eps = *e;

  // MLA
  c.num_attention_heads = f.req_int("num_attention_heads", 1, kMaxDim);
  c.num_key_value_heads = f.opt_int("num_key_value_heads", 1, kMaxDim).value_or(c.num_attention_heads);
  c.q_lora_rank = f.opt_int("q_lora_rank", 1, kMaxDim);
  c.kv_lora_rank = f.req_int("kv_lora_rank", 1, kMaxDim);
  c.qk_nope_head_dim = f.req_int("qk_nope_head_dim", 1, kMaxDim);
  c.qk_rope_head_dim = f.req_int("qk_rope_head_dim", 0, kMaxDim);
  c.v_head_dim = f.req_int("v_head_dim", 1, kMaxDim);
  {
    auto nope = f.opt_bool("mla_use_nope");
    LM_CHECK(nope.has_value(),
             "{}: missing required field '{}': the reference reads an absent value as false (rotary MLA), "
             "which longmoe does not implement; K3-class models set it to true",
             f.ctx, f.name("mla_use_nope"));
    c.mla_use_nope = *nope;
  }
  c.mla_use_output_gate = f.opt_bool("mla_use_output_gate").value_or(false);

  // KDA
  f.require("linear_attn_config");
  {
    const json& la = f.j.at("linear_attn_config");
    if (!la.is_object()) f.wrong_type("linear_attn_config", "an object");
    Fields g{la, f.ctx, f.where + "linear_attn_config."};
    g.reject_unknown({kLinearFields});
    c.kda_num_heads = g.req_int("num_heads", 1, kMaxDim);
    c.kda_head_dim = g.req_int("head_dim", 1, kMaxDim);
    c.kda_conv_kernel = g.opt_int("short_conv_kernel_size", 1, 64).value_or(4);
    c.kda_full_rank_gate = g.opt_bool("use_full_rank_gate").value_or(false);
    c.kda_gate_lower_bound = g.opt_double("gate_lower_bound");
    c.kda_layers = g.req_int_list("kda_layers", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
    c.full_attn_layers =
        g.req_int_list("full_attn_layers", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
    // HF's derived top-level copies must agree.
    for (const auto& [alias, canon] : kLinearAliases) {
      if (!f.has(alias)) continue;
      const int64_t top = f.as_int(alias, 0, kMaxDim);
      const int64_t inner = canon == "num_heads" ? c.kda_num_heads
                            : canon == "head_dim" ? c.kda_head_dim
                                                  : c.kda_conv_kernel;
      LM_CHECK(top == inner, "{}: field '{}' = {} disagrees with '{}linear_attn_config.{}' = {}", f.ctx, f.name(alias),
               top, f.where, canon, inner);
    }
  }

  // FFN
  if (auto act = f.opt_string("hidden_act")) c.hidden_act = *act;
  c.activation_situ_beta = f.opt_double("activation_situ_beta");
  c.activation_situ_linear_beta = f.opt_double("activation_situ_linear_beta");
  c.intermediate_size = f.opt_int("intermediate_size", 1, kMaxDim).value_or(0);
  c.first_k_dense_replace = f.opt_int("first_k_dense_replace", 0, kMaxLayers).value_or(0);
  c.moe_layer_freq = f.opt_int("moe_layer_freq", 1, kMaxLayers).value_or(1);

  // MoE
  auto key = [&](const std::string& canon) {
    for (const auto& [alias, cn] : kAliases)
      if (cn == canon) return f.resolve(canon, alias);
    return f.has(canon) ? canon : std::string();
  };
  if (auto k = key("num_experts"); !k.empty()) c.num_experts = f.as_int(k, 0, kMaxExperts);
  if (auto k = key("num_experts_per_token"); !k.empty()) c.num_experts_per_token = f.as_int(k, 1, kMaxExperts);
  if (auto k = key("num_shared_experts"); !k.empty()) c.num_shared_experts = f.as_int(k, 0, kMaxExperts);
  c.moe_intermediate_size = f.opt_int("moe_intermediate_size", 1, kMaxDim).value_or(0);
  c.routed_expert_hidden_size = f.opt_int("routed_expert_hidden_size", 1, kMaxDim);
  c.latent_moe_use_norm = f.opt_bool("latent_moe_use_norm").value_or(true);
  if (auto k = key("moe_renormalize"); !k.empty()) c.moe_renormalize = *f.opt_bool(k);
  if (auto s = f.opt_double("routed_scaling_factor")) c.routed_scaling_factor = *s;
  if (c.num_experts > 0) {
    LM_CHECK(!key("num_experts_per_token").empty(), "{}: missing required field '{}' (num_experts = {})", f.ctx,
             f.name("num_experts_per_token"), c.num_experts);
    LM_CHECK(c.moe_intermediate_size > 0, "{}: missing required field '{}' (num_experts = {})", f.ctx,
             f.name("moe_intermediate_size"), c.num_experts);
  }

  c.attn_res_block_size = f.opt_int("attn_res_block_size", 1, kMaxLayers);

  if (has_vision(f.j, "vision_config"))
    c.vision = VisionConfig::from_json(f.j.at("vision_config"), f.ctx, f.where + "vision_config.");

  // Carried through.
  c.max_position_embeddings = f.opt_int("max_position_embeddings", 1, std::numeric_limits<int64_t>::max());
  check_token_id(f, "pad_token_id", false);
  check_token_id(f, "bos_token_id", false);
  check_token_id(f, "eos_token_id", true);
  if (f.has("pad_token_id")) c.pad_token_id = f.j.at("pad_token_id");
  if (f.has("bos_token_id")) c.bos_token_id = f.j.at("bos_token_id");
  if (f.has("eos_token_id")) c.eos_token_id = f.j.at("eos_token_id");
  {
    auto td = f.opt_string("torch_dtype");
    auto d = f.opt_string("dtype");
    LM_CHECK(!td || !d || *td == *d, "{}: fields '{}' ({}) and '{}' ({}) disagree", f.ctx, f.name("torch_dtype"), *td,
             f.name("dtype"), *d);
    c.torch_dtype = td ? td : d;
  }
  return c;
}

}  // namespace

const std::vector<std::string>& known_config_fields() {
  static const std::vector<std::string> all = [] {
    std::vector<std::string> r = kModelFields;
    for (const auto* l : {&kCheckedFields, &kIgnoredFields}) r.insert(r.end(), l->begin(), l->end());
    for (const auto& [a, c] : kAliases) r.push_back(a);
    for (const auto& [a, c] : kLinearAliases) r.push_back(a);
    return r;
  }();
  return all;
}

const std::vector<std::string>& known_linear_attn_fields() { return kLinearFields; }

ModelConfig ModelConfig::from_json(const io::json& j, const std::string& ctx) {
  try {
    LM_CHECK(j.is_object(), "{}: a model config must be a JSON object, got {}", ctx, j.type_name());
    ModelConfig c;
    if (j.contains("text_config") && !j.at("text_config").is_null()) {
      Fields outer{j, ctx, ""};
      outer.reject_unknown({kOuterFields});
      (void)outer.opt_string("model_type");  // the wrapper's own type (any)
      if (auto t = outer.opt_bool("tie_word_embeddings"))
        LM_CHECK(!*t, "{}: field 'tie_word_embeddings' must be false: the K3 family has an untied lm_head", ctx);
      const json& tc = j.at("text_config");
      if (!tc.is_object()) outer.wrong_type("text_config", "an object");
      c = parse_model(Fields{tc, ctx, "text_config."}, /*nested=*/true);
      if (has_vision(j, "vision_config")) {
        LM_CHECK(!c.vision, "{}: both 'vision_config' and 'text_config.vision_config' are given", ctx);
        c.vision = VisionConfig::from_json(j.at("vision_config"), ctx);
      }
      // K3 repeats the placeholder id at the top level; either place names it, and both must agree.
      if (c.vision && outer.has("media_placeholder_token_id")) {
        const int64_t id = outer.as_int("media_placeholder_token_id", 0, kMaxVocab);
        LM_CHECK(!c.vision->media_placeholder_token_id || *c.vision->media_placeholder_token_id == id,
                 "{}: fields 'media_placeholder_token_id' and 'vision_config.media_placeholder_token_id' disagree",
                 ctx);
        c.vision->media_placeholder_token_id = id;
      }
      if (!c.torch_dtype) {
        auto td = outer.opt_string("torch_dtype");
        c.torch_dtype = td ? td : outer.opt_string("dtype");
      }
      for (auto [field, name] : {std::pair{&c.pad_token_id, "pad_token_id"}, std::pair{&c.bos_token_id, "bos_token_id"},
                                 std::pair{&c.eos_token_id, "eos_token_id"}}) {
        check_token_id(outer, name, std::string(name) == "eos_token_id");
        if (field->is_null() && outer.has(name)) *field = j.at(name);
      }
    } else {
      c = parse_model(Fields{j, ctx, ""}, /*nested=*/false);
    }
    c.validate(ctx);
    return c;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("{}: invalid model config: {}", ctx, e.what());
  }
}

ModelConfig ModelConfig::load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string file = fs::is_directory(path, ec) ? (fs::path(path) / "config.json").string() : path;
  return from_json(io::load_json_file(file), file);
}

void ModelConfig::validate(const std::string& ctx) const {
  const int64_t L = num_hidden_layers;
  LM_CHECK(vocab_size >= 1 && vocab_size <= kMaxVocab, "{}: field 'vocab_size' = {} is out of range", ctx, vocab_size);
  LM_CHECK(hidden_size >= 1 && hidden_size <= kMaxDim, "{}: field 'hidden_size' = {} is out of range", ctx,
           hidden_size);
  LM_CHECK(L >= 1 && L <= kMaxLayers, "{}: field 'num_hidden_layers' = {} is out of range [1, {}]", ctx, L, kMaxLayers);
  LM_CHECK(rms_norm_eps > 0 && rms_norm_eps < 1, "{}: field 'rms_norm_eps' = {} must be in (0, 1)", ctx, rms_norm_eps);

  // MLA
  LM_CHECK(num_attention_heads >= 1 && num_attention_heads <= kMaxDim,
           "{}: field 'num_attention_heads' = {} must be positive", ctx, num_attention_heads);
  LM_CHECK(num_key_value_heads == num_attention_heads,
           "{}: field 'num_key_value_heads' = {} must equal 'num_attention_heads' = {} (MLA expands one latent into "
           "per-head keys and values)",
           ctx, num_key_value_heads, num_attention_heads);
  LM_CHECK(!q_lora_rank || (*q_lora_rank >= 1 && *q_lora_rank <= kMaxDim), "{}: field 'q_lora_rank' must be positive",
           ctx);
  for (auto [v, n, lo] : {std::tuple{kv_lora_rank, "kv_lora_rank", 1}, std::tuple{qk_nope_head_dim, "qk_nope_head_dim", 1},
                          std::tuple{qk_rope_head_dim, "qk_rope_head_dim", 0}, std::tuple{v_head_dim, "v_head_dim", 1}})
    LM_CHECK(v >= lo && v <= kMaxDim, "{}: field '{}' = {} is out of range [{}, {}]", ctx, n, v, lo, kMaxDim);
  LM_CHECK(mla_use_nope || num_mla_layers() == 0,
           "{}: field 'mla_use_nope' is false: rotary MLA is not implemented (K3-class MLA is NoPE)", ctx);

  // KDA
  LM_CHECK(kda_num_heads >= 1 && kda_num_heads <= kMaxDim, "{}: field 'linear_attn_config.num_heads' = {} must be positive",
           ctx, kda_num_heads);
  LM_CHECK(kda_head_dim >= 1 && kda_head_dim <= kMaxDim, "{}: field 'linear_attn_config.head_dim' = {} must be positive",
           ctx, kda_head_dim);
  LM_CHECK(kda_num_heads * kda_head_dim <= kMaxDim, "{}: linear_attn_config num_heads x head_dim = {} is too large", ctx,
           kda_num_heads * kda_head_dim);
  LM_CHECK(kda_conv_kernel >= 1 && kda_conv_kernel <= 64,
           "{}: field 'linear_attn_config.short_conv_kernel_size' = {} is out of range [1, 64]", ctx, kda_conv_kernel);
  if (kda_gate_lower_bound)
    LM_CHECK(std::isfinite(*kda_gate_lower_bound) && *kda_gate_lower_bound < 0,
             "{}: field 'linear_attn_config.gate_lower_bound' = {} must be negative (the decay gate is g in (lb, 0))",
             ctx, *kda_gate_lower_bound);

  // Layer lists: kda_layers and full_attn_layers partition 1..L.
  std::vector<int> owner(static_cast<size_t>(L) + 1, 0);  // 0 none, 1 kda, 2 full
  for (auto [list, name, tag] : {std::tuple{&kda_layers, "kda_layers", 1}, std::tuple{&full_attn_layers, "full_attn_layers", 2}}) {
    for (int64_t l : *list) {
      LM_CHECK(l >= 1 && l <= L,
               "{}: field 'linear_attn_config.{}' has layer {}, outside 1..{} (layer lists are 1-based)", ctx, name, l,
               L);
      const int prev = owner[static_cast<size_t>(l)];
      LM_CHECK(prev != tag, "{}: field 'linear_attn_config.{}' lists layer {} twice", ctx, name, l);
      LM_CHECK(prev == 0, "{}: layer {} is in both 'linear_attn_config.kda_layers' and 'linear_attn_config.full_attn_layers'",
               ctx, l);
      owner[static_cast<size_t>(l)] = tag;
    }
  }
  for (int64_t l = 1; l <= L; ++l)
    LM_CHECK(owner[static_cast<size_t>(l)] != 0,
             "{}: layer {} (1-based) is in neither 'linear_attn_config.kda_layers' nor "
             "'linear_attn_config.full_attn_layers'; together they must cover 1..{}",
             ctx, l, L);

  // FFN
  LM_CHECK(hidden_act == "silu" || hidden_act == "situ", "{}: field 'hidden_act' is '{}'; expected 'silu' or 'situ'",
           ctx, hidden_act);
  if (hidden_act == "situ")
    LM_CHECK(activation_situ_beta.has_value(), "{}: missing required field 'activation_situ_beta' (hidden_act 'situ')",
             ctx);
  for (auto [v, n] : {std::pair{activation_situ_beta, "activation_situ_beta"},
                      std::pair{activation_situ_linear_beta, "activation_situ_linear_beta"}})
    LM_CHECK(!v || (std::isfinite(*v) && *v > 0), "{}: field '{}' = {} must be positive", ctx, n, v.value_or(0));
  LM_CHECK(first_k_dense_replace >= 0 && first_k_dense_replace <= L,
           "{}: field 'first_k_dense_replace' = {} is out of range [0, {}]", ctx, first_k_dense_replace, L);
  LM_CHECK(moe_layer_freq >= 1 && moe_layer_freq <= kMaxLayers, "{}: field 'moe_layer_freq' = {} must be >= 1", ctx,
           moe_layer_freq);
  LM_CHECK(intermediate_size >= 0 && intermediate_size <= kMaxDim, "{}: field 'intermediate_size' is out of range", ctx);
  if (num_dense_ffn_layers() > 0)
    LM_CHECK(intermediate_size >= 1,
             "{}: missing required field 'intermediate_size' ({} layer(s) have a dense FFN)", ctx,
             num_dense_ffn_layers());

  // MoE
  LM_CHECK(num_experts >= 0 && num_experts <= kMaxExperts, "{}: field 'num_experts' = {} is out of range [0, {}]", ctx,
           num_experts, kMaxExperts);
  LM_CHECK(num_shared_experts >= 0 && num_shared_experts <= kMaxExperts,
           "{}: field 'num_shared_experts' = {} is out of range", ctx, num_shared_experts);
  LM_CHECK(moe_intermediate_size >= 0 && moe_intermediate_size <= kMaxDim,
           "{}: field 'moe_intermediate_size' is out of range", ctx);
  LM_CHECK(!routed_expert_hidden_size || (*routed_expert_hidden_size >= 1 && *routed_expert_hidden_size <= kMaxDim),
           "{}: field 'routed_expert_hidden_size' must be positive", ctx);
  LM_CHECK(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0,
           "{}: field 'routed_scaling_factor' = {} must be positive", ctx, routed_scaling_factor);
  if (num_experts > 0) {
    LM_CHECK(num_experts_per_token >= 1 && num_experts_per_token <= num_experts,
             "{}: field 'num_experts_per_token' = {} must be in [1, num_experts = {}]", ctx, num_experts_per_token,
             num_experts);
    LM_CHECK(moe_intermediate_size >= 1, "{}: missing required field 'moe_intermediate_size' (num_experts = {})", ctx,
             num_experts);
    LM_CHECK(num_experts * num_hidden_layers <= (int64_t{1} << 22),
             "{}: num_experts x num_hidden_layers = {} expert instances is implausibly large", ctx,
             num_experts * num_hidden_layers);
  } else {
    LM_CHECK(num_experts_per_token >= 0, "{}: field 'num_experts_per_token' must not be negative", ctx);
  }
  LM_CHECK(!attn_res_block_size || (*attn_res_block_size >= 1 && *attn_res_block_size <= kMaxLayers),
           "{}: field 'attn_res_block_size' must be positive", ctx);
  LM_CHECK(!max_position_embeddings || *max_position_embeddings >= 1,
           "{}: field 'max_position_embeddings' must be positive", ctx);

  if (vision) {
    vision->validate(ctx);
    LM_CHECK(vision->text_hidden_size == hidden_size,
             "{}: field 'vision_config.text_hidden_size' = {} must equal 'hidden_size' = {} (the projector's features "
             "replace token embeddings)",
             ctx, vision->text_hidden_size, hidden_size);
    if (const auto id = vision->media_placeholder_token_id)
      LM_CHECK(*id < vocab_size,
               "{}: field 'media_placeholder_token_id' = {} is outside the vocabulary (vocab_size {}): the "
               "placeholder is a token of the prompt",
               ctx, *id, vocab_size);
  }

  // Keep every parameter sum far inside int64 (and exact in double): reject absurd totals.
  const double d = static_cast<double>(hidden_size);
  const double per_layer =
      4.0 * d * static_cast<double>(std::max({kda_key_dim(), num_attention_heads * (mla_qk_head_dim() + v_head_dim),
                                              kv_lora_rank, q_lora_rank.value_or(0)})) +
      3.0 * d * static_cast<double>(intermediate_size) +
      3.0 * static_cast<double>(num_experts) * static_cast<double>(expert_width()) *
          static_cast<double>(moe_intermediate_size) +
      3.0 * d * static_cast<double>(shared_intermediate_size()) + static_cast<double>(num_experts) * d;
  const double est = 2.0 * static_cast<double>(vocab_size) * d + static_cast<double>(L) * per_layer;
  LM_CHECK(est < 1e15, "{}: the configuration describes about {:.3g} parameters, which is implausibly large", ctx, est);
}

bool ModelConfig::is_kda(int64_t i) const {
  return std::find(kda_layers.begin(), kda_layers.end(), i + 1) != kda_layers.end();
}

int64_t ModelConfig::num_moe_layers() const {
  int64_t n = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i) n += is_moe(i) ? 1 : 0;
  return n;
}

int64_t ModelConfig::attn_res_max_sources() const {
  if (!attn_res_block_size) return 0;
  const int64_t b = *attn_res_block_size;
  return (num_hidden_layers + b - 1) / b + 1;  // closed blocks (block 0 = embedding) + partial block
}

io::json ModelConfig::to_json() const {
  json j = json::object();
  j["architectures"] = json::array({"KimiLinearForCausalLM"});
  j["model_type"] = "kimi_linear";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["rms_norm_eps"] = rms_norm_eps;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["q_lora_rank"] = q_lora_rank ? json(*q_lora_rank) : json(nullptr);
  j["kv_lora_rank"] = kv_lora_rank;
  j["qk_nope_head_dim"] = qk_nope_head_dim;
  j["qk_rope_head_dim"] = qk_rope_head_dim;
  j["v_head_dim"] = v_head_dim;
  j["mla_use_nope"] = mla_use_nope;
  j["mla_use_output_gate"] = mla_use_output_gate;
  json la = json::object();
  la["num_heads"] = kda_num_heads;
  la["head_dim"] = kda_head_dim;
  la["short_conv_kernel_size"] = kda_conv_kernel;
  la["use_full_rank_gate"] = kda_full_rank_gate;
  if (kda_gate_lower_bound) la["gate_lower_bound"] = *kda_gate_lower_bound;
  la["kda_layers"] = kda_layers;
  la["full_attn_layers"] = full_attn_layers;
  j["linear_attn_config"] = la;
  j["hidden_act"] = hidden_act;
  if (activation_situ_beta) j["activation_situ_beta"] = *activation_situ_beta;
  if (activation_situ_linear_beta) j["activation_situ_linear_beta"] = *activation_situ_linear_beta;
  if (intermediate_size > 0) j["intermediate_size"] = intermediate_size;
  j["first_k_dense_replace"] = first_k_dense_replace;
  j["moe_layer_freq"] = moe_layer_freq;
  if (num_experts > 0) j["num_experts"] = num_experts;
  if (num_experts_per_token > 0) j["num_experts_per_token"] = num_experts_per_token;
  j["num_shared_experts"] = num_shared_experts;
  if (moe_intermediate_size > 0) j["moe_intermediate_size"] = moe_intermediate_size;
  if (routed_expert_hidden_size) j["routed_expert_hidden_size"] = *routed_expert_hidden_size;
  if (routed_expert_hidden_size || !latent_moe_use_norm) j["latent_moe_use_norm"] = latent_moe_use_norm;
  j["moe_router_activation_func"] = "sigmoid";
  j["moe_renormalize"] = moe_renormalize;
  j["routed_scaling_factor"] = routed_scaling_factor;
  j["use_grouped_topk"] = true;
  j["num_expert_group"] = 1;
  j["topk_group"] = 1;
  if (attn_res_block_size) j["attn_res_block_size"] = *attn_res_block_size;
  if (max_position_embeddings) j["max_position_embeddings"] = *max_position_embeddings;
  j["tie_word_embeddings"] = false;
  j["num_nextn_predict_layers"] = 0;
  if (!pad_token_id.is_null()) j["pad_token_id"] = pad_token_id;
  if (!bos_token_id.is_null()) j["bos_token_id"] = bos_token_id;
  if (!eos_token_id.is_null()) j["eos_token_id"] = eos_token_id;
  if (torch_dtype) j["torch_dtype"] = *torch_dtype;
  if (!vision) return j;
  // K3's multimodal layout: the language model under text_config, the tower beside it, the placeholder id and the
  // special ids repeated at the top level (where HF's generation code reads them).
  json mm = json::object();
  mm["architectures"] = json::array({kMultimodalArchitecture});
  mm["model_type"] = kMultimodalModelType;
  mm["text_config"] = std::move(j);
  mm["vision_config"] = vision->to_json();
  if (vision->media_placeholder_token_id) mm["media_placeholder_token_id"] = *vision->media_placeholder_token_id;
  for (const char* k : {"pad_token_id", "bos_token_id", "eos_token_id", "torch_dtype"})
    if (mm["text_config"].contains(k)) mm[k] = mm["text_config"][k];
  mm["tie_word_embeddings"] = false;
  return mm;
}

void ModelConfig::save(const std::string& path) const {
  validate(path);
  io::write_file_atomic(path, to_json().dump(2) + "\n");
}

}  // namespace lm::model
