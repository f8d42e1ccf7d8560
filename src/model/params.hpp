#pragma once
// The model's parameters: one tensor per HF name (model/param_names), its gradient, and loading /
// saving / initialisation. Layers hold raw pointers into these tensors.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/rng.hpp"
#include "core/tensor.hpp"
#include "io/checkpoint.hpp"
#include "model/config.hpp"
#include "model/param_names.hpp"

namespace lm::model {

template <class F>
struct Param {
  ParamSpec spec;
  Tensor value;  // dtype F, contiguous, shape spec.shape
  Tensor grad;   // same; allocated only when gradients are enabled (trainable params)
  size_t stream = 0;  // its place in the whole tensor list: init's random stream (the same in every expert shard)
  F* w() const { return value.data<F>(); }
  F* g() const { return grad.defined() ? grad.data<F>() : nullptr; }
};

// The checks of ParamStore::load from the checkpoint's headers alone, before anything is allocated: every tensor
// of `specs` present with its shape and a float dtype, and no tensor the specs do not name (param_specs(config)).
void check_checkpoint(const std::vector<ParamSpec>& specs, const io::Checkpoint& ckpt);

// ParamStore::init's rule for one tensor: the standard deviation of its normal draws, or 0 for a tensor it fills
// by init_fixed (A_log, dt_bias, zeros, norm gains). L layers.
double init_normal_sd(const ParamSpec& s, int64_t L, double init_scale = 1.0);
template <class F>
void init_fixed(const ParamSpec& s, const Rng& r, F* w);  // (float and double)

// The routed experts a store holds (expert parallel: the others live on other ranks): experts [first, first + count)
// of every MoE layer; count < 0: all of them.
struct ExpertShard {
  int64_t first = 0, count = -1;
  bool all() const { return count < 0; }
  bool holds(int64_t e) const { return all() || (e >= first && e < first + count); }
};

template <class F>
class ParamStore {
 public:
  // Allocates every tensor of model_param_specs(c) (the text model's, then the tower's and projector's when
  // c.vision) but the routed experts outside `shard`, zero-filled; lm::Error first when they need more than the
  // machine's memory, or for a shard outside the config's experts.
  explicit ParamStore(const ModelConfig& c, ExpertShard shard = {});
  // The same over any tensor list (the vision tower's, vision_param_specs).
  explicit ParamStore(const std::vector<ParamSpec>& specs);

  // Initialisation for from-scratch training (SPEC): linear weights N(0, 1/sqrt(fan_in)) scaled by
  // `init_scale`, output projections further by 1/sqrt(2L), norms 1, AttnRes pseudo-queries 0,
  // A_log = log U(1, 16), dt_bias = softplus^-1(exp U(log 1e-3, log 1e-1)), conv N(0, 1/sqrt(W)),
  // router bias 0, embedding N(0, 1). Deterministic in `seed` (Philox, one stream per tensor).
  void init(uint64_t seed, double init_scale = 1.0);

  // Loads every parameter from a checkpoint with HF names (checkpoint_name: K3's multimodal layout when the
  // config has a tower). Errors (naming the file and tensor) on a missing tensor, an unknown tensor, a shape
  // mismatch or a non-float dtype; nothing is modified unless everything checks out. An expert shard checks the
  // whole checkpoint (every expert's tensors too) and reads its own.
  void load(const io::Checkpoint& ckpt);
  // (checkpoint name, tensor) pairs in spec order, converted to `dt`, for io::save_checkpoint; only the tensors
  // `keep` accepts when given.
  io::NamedTensors named(DType dt = DType::F32, const std::function<bool(const ParamSpec&)>& keep = {}) const;
  // A store built from a config with vision_config: its text tensors are saved under `language_model.`.
  bool multimodal() const { return multimodal_; }
  std::string checkpoint_name(const Param<F>& p) const;

  void enable_grads();
  void zero_grads();
  bool has_grads() const { return grads_; }
  const ExpertShard& experts() const { return shard_; }
  const std::vector<ParamSpec>& elsewhere() const { return elsewhere_; }  // the routed experts other shards hold

  Param<F>& at(const std::string& name);
  const Param<F>& at(const std::string& name) const;
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  F* w(const std::string& name) { return at(name).w(); }
  F* g(const std::string& name) { return at(name).g(); }

  std::vector<Param<F>>& all() { return params_; }
  const std::vector<Param<F>>& all() const { return params_; }
  int64_t numel() const;

 private:
  void add(const std::vector<ParamSpec>& specs, const char* what);
  std::vector<Param<F>> params_;
  std::vector<ParamSpec> elsewhere_;  // the routed experts another shard holds
  ExpertShard shard_;
  std::map<std::string, size_t> index_;
  bool grads_ = false;
  bool multimodal_ = false;
};

}  // namespace lm::model
