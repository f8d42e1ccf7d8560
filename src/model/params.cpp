#include "model/params.hpp"

#include <algorithm>
#include <cmath>
#include <set>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "core/rng.hpp"

namespace lm::model {

template <class F>
ParamStore<F>::ParamStore(const ModelConfig& c, ExpertShard shard) : shard_(shard), multimodal_(c.vision.has_value()) {
  LM_CHECK(shard.all() || (shard.first >= 0 && shard.count >= 1 && shard.first + shard.count <= c.num_experts),
           "expert shard [{}, {}) is not a range of the {} routed experts", shard.first, shard.first + shard.count,
           c.num_experts);
  add(model_param_specs(c), "this model configuration");
}

template <class F>
ParamStore<F>::ParamStore(const std::vector<ParamSpec>& specs) {
  add(specs, "this tensor list");
}

template <class F>
void ParamStore<F>::add(const std::vector<ParamSpec>& specs, const char* what) {
  auto here = [&](const ParamSpec& s) { return s.expert < 0 || shard_.holds(s.expert); };
  size_t bytes = 0;
  for (const ParamSpec& s : specs) bytes += here(s) ? static_cast<size_t>(s.numel()) * sizeof(F) : 0;
  check_host_memory(bytes, fmt::format("the {:.3f}B parameters of {}", bytes / sizeof(F) / 1e9, what));
  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& s = specs[i];
    LM_CHECK(!index_.count(s.name), "tensor '{}' is listed twice", s.name);
    if (!here(s)) {
      elsewhere_.push_back(s);
      continue;
    }
    Param<F> p;
    p.spec = s;
    p.value = Tensor::zeros(s.shape, dtype_of<F>);
    p.stream = i;
    index_[s.name] = params_.size();
    params_.push_back(std::move(p));
  }
}

template <class F>
Param<F>& ParamStore<F>::at(const std::string& name) {
  auto it = index_.find(name);
  LM_CHECK(it != index_.end(), "the model has no parameter named '{}'", name);
  return params_[it->second];
}

template <class F>
const Param<F>& ParamStore<F>::at(const std::string& name) const {
  auto it = index_.find(name);
  LM_CHECK(it != index_.end(), "the model has no parameter named '{}'", name);
  return params_[it->second];
}

template <class F>
int64_t ParamStore<F>::numel() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.value.numel();
  return n;
}

template <class F>
void ParamStore<F>::enable_grads() {
  if (grads_) return;
  check_host_memory(2 * static_cast<size_t>(numel()) * sizeof(F), "the parameters and their gradients");
  for (auto& p : params_)
    if (p.spec.trainable) p.grad = Tensor::zeros(p.spec.shape, dtype_of<F>);
  grads_ = true;
}

template <class F>
void ParamStore<F>::zero_grads() {
  for (auto& p : params_)
    if (p.grad.defined()) p.grad.zero();
}

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Output projections feed the residual stream; scaling them by 1/sqrt(2L) keeps the stream's
// variance from growing with depth (GPT-2 style).
bool is_output_projection(const std::string& n) {
  for (const char* s : {".o_proj.weight", ".down_proj.weight", ".w2.weight", ".routed_expert_up_proj.weight",
                        ".wo.weight", ".mlp.fc1.weight"})
    if (ends_with(n, s)) return true;
  return false;
}

}  // namespace

double init_normal_sd(const ParamSpec& s, int64_t L, double init_scale) {
  const std::string& n = s.name;
  if (ends_with(n, ".A_log") || ends_with(n, ".dt_bias") || ends_with(n, "_res_proj.weight") ||
      ends_with(n, "e_score_correction_bias"))
    return 0;
  if (ends_with(n, "conv1d.weight")) return 1.0 / std::sqrt(static_cast<double>(s.shape.back()));
  // Vision tower (SPEC §9): the patch conv is a GEMM over 3·p·p inputs; the position table starts small
  // beside the patch embedding it is added to.
  if (n == "vision_tower.patch_embed.proj.weight") return init_scale / std::sqrt(static_cast<double>(s.numel() / s.shape[0]));
  if (n == "vision_tower.patch_embed.pos_emb.weight") return 0.02 * init_scale;
  if (n == "model.embed_tokens.weight") return init_scale;
  if (s.shape.size() == 2 && s.matmul) {
    double sd = init_scale / std::sqrt(static_cast<double>(s.shape[1]));
    if (is_output_projection(n)) sd /= std::sqrt(2.0 * static_cast<double>(L));
    return sd;
  }
  return 0;
}

template <class F>
void init_fixed(const ParamSpec& s, const Rng& r, F* w) {
  const std::string& n = s.name;
  const int64_t N = s.numel();
  if (ends_with(n, ".A_log")) {
    for (int64_t i = 0; i < N; ++i) w[i] = static_cast<F>(std::log(1.0 + 15.0 * r.uniform_f64(i)));
  } else if (ends_with(n, ".dt_bias")) {
    for (int64_t i = 0; i < N; ++i) {
      const double dt = std::exp(std::log(1e-3) + (std::log(1e-1) - std::log(1e-3)) * r.uniform_f64(i));
      w[i] = static_cast<F>(dt + std::log(-std::expm1(-dt)));  // softplus^-1(dt)
    }
  } else if (ends_with(n, "_res_proj.weight") || ends_with(n, "e_score_correction_bias")) {
    std::fill(w, w + N, F(0));  // AttnRes pseudo-queries start at zero: uniform depth attention; router bias 0
  } else {
    std::fill(w, w + N, F(1));  // norm gains
  }
}
template void init_fixed<float>(const ParamSpec&, const Rng&, float*);
template void init_fixed<double>(const ParamSpec&, const Rng&, double*);

template <class F>
void ParamStore<F>::init(uint64_t seed, double init_scale) {
  // The depth of the output-projection scaling: the decoder's layers for its tensors, the tower's blocks for its.
  int64_t L_text = 1, L_vision = 1;
  for (const auto& p : params_) {
    int64_t& L = is_vision_component(p.spec.component) ? L_vision : L_text;
    L = std::max<int64_t>(L, p.spec.layer + 1);
  }
  for (size_t ti = 0; ti < params_.size(); ++ti) {
    Param<F>& p = params_[ti];
    const Rng r = Rng{seed, 0}.fork(p.stream);
    F* w = p.w();
    const int64_t N = p.value.numel();
    const int64_t L = is_vision_component(p.spec.component) ? L_vision : L_text;
    if (const double sd = init_normal_sd(p.spec, L, init_scale); sd > 0) {
      // counter-based draws: the same values for any thread count
      parallel_for(N, [&](int64_t i) { w[i] = static_cast<F>(sd * r.normal_f64(static_cast<uint64_t>(i))); }, 4096);
    } else {
      init_fixed(p.spec, r, w);
    }
  }
}

namespace {
bool starts_with(const std::string& s, std::string_view p) { return s.compare(0, p.size(), p) == 0; }
}  // namespace

void check_checkpoint(const std::vector<ParamSpec>& specs, const io::Checkpoint& ckpt) {
  std::map<std::string, bool> used;
  for (const ParamSpec& s : specs) used[s.name] = true;
  for (const ParamSpec& s : specs) {
    if (!ckpt.contains(s.name)) {
      // The two layouts mixed up: say so rather than only naming the first missing tensor.
      const bool text_only_ckpt = starts_with(s.name, kLanguageModelPrefix) &&
                                  ckpt.contains(s.name.substr(kLanguageModelPrefix.size()));
      const bool multimodal_ckpt = !is_vision_component(s.component) && !starts_with(s.name, kLanguageModelPrefix) &&
                                   ckpt.contains(std::string(kLanguageModelPrefix) + s.name);
      fail("checkpoint '{}' lacks tensor '{}' (shape {}){}", ckpt.path(), s.name, shape_str(s.shape),
           text_only_ckpt    ? "; it holds the text-only layout (no 'language_model.' prefix), but the config has a "
                               "vision_config, whose checkpoints keep the text model under 'language_model.' (K3's "
                               "layout)"
           : multimodal_ckpt ? "; it holds K3's multimodal layout (the text model under 'language_model.'), but the "
                               "config has no vision_config"
                             : "");
    }
    const auto& info = ckpt.info(s.name);
    LM_CHECK(info.shape == s.shape, "checkpoint '{}': tensor '{}' has shape {}, the config needs {}", ckpt.path(),
             s.name, shape_str(info.shape), shape_str(s.shape));
    LM_CHECK(dtype_is_float(info.dtype), "checkpoint '{}': tensor '{}' has dtype {}, expected a float type",
             ckpt.path(), s.name, dtype_name(info.dtype));
  }
  for (const auto& name : ckpt.names()) {
    if (used.count(name)) continue;
    const bool multimodal_ckpt = starts_with(name, kLanguageModelPrefix) && used.count(name.substr(kLanguageModelPrefix.size()));
    fail("checkpoint '{}' has tensor '{}', which this model configuration does not use{}", ckpt.path(), name,
         multimodal_ckpt ? "; it is K3's multimodal layout (the text model under 'language_model.'), but the config "
                           "has no vision_config"
                         : "");
  }
}

template <class F>
std::string ParamStore<F>::checkpoint_name(const Param<F>& p) const {
  return model::checkpoint_name(p.spec, multimodal_);
}

template <class F>
void ParamStore<F>::load(const io::Checkpoint& ckpt) {
  std::vector<ParamSpec> specs;
  for (const auto& p : params_) {
    specs.push_back(p.spec);
    specs.back().name = checkpoint_name(p);
  }
  for (const ParamSpec& s : elsewhere_) {
    specs.push_back(s);
    specs.back().name = model::checkpoint_name(s, multimodal_);
  }
  check_checkpoint(specs, ckpt);  // everything first, so a bad checkpoint changes nothing
  for (auto& p : params_) p.value.copy_from(ckpt.get(checkpoint_name(p)));
}

template <class F>
io::NamedTensors ParamStore<F>::named(DType dt, const std::function<bool(const ParamSpec&)>& keep) const {
  io::NamedTensors r;
  for (const auto& p : params_)
    if (!keep || keep(p.spec)) r.emplace_back(checkpoint_name(p), p.value.to(dt));
  return r;
}

template class ParamStore<float>;
template class ParamStore<double>;

}  // namespace lm::model
