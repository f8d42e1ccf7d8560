#pragma once
// Optimisers over a model::ParamStore<float>: AdamW and Muon, split into parameter groups by rule,
// with global gradient-norm clipping, NaN/Inf detection and resumable state.
//
// Legend: g gradient (after clipping), W weight, t = step count (1-based inside a step),
//         lr = group lr × schedule factor, wd = weight decay.
//   AdamW  m ← β1 m + (1−β1) g;  v ← β2 v + (1−β2) g²
//          W ← W (1 − lr·wd) − lr · (m / (1−β1ᵗ)) / (sqrt(v / (1−β2ᵗ)) + eps)
//   Muon   b ← μ b + g;  u = g + μ b (Nesterov) or b
//          O = NewtonSchulz5(u) per block (a whole matrix, or one attention head's row block)
//          W ← W (1 − lr·wd) − lr · 0.2·sqrt(max(rows_block, cols)) · O
//   The 0.2·sqrt(max(r, c)) factor (Moonlight's RMS matching): an r×c matrix with all singular values
//   1 has RMS 1/sqrt(max(r, c)), so the scaled update has RMS ≈ 0.2 — the typical RMS of an AdamW
//   update — and Muon groups can share AdamW's learning rate and weight decay. Applied per
//   orthogonalised block, so every head's block gets RMS 0.2 as well.
//
// Groups (group_rule):
//   none   non-trainable parameters (e_score_correction_bias, updated by Quantile Balancing)
//   muon   2-D matmul weights of the decoder layers (spec.matmul, ndim 2, not embedding / lm_head /
//          router); q/k projections (MLA q_proj, q_b_proj, kv_b_proj; KDA q_proj, k_proj) split into
//          one block per attention head
//   adamw  everything else: embeddings, lm_head, router, norms, KDA gates (A_log, dt_bias, convs),
//          AttnRes pseudo-queries and norms (and every trainable parameter when kind = "adamw")
// Weight decay applies iff ndim ≥ 2, except AttnRes parameters and (unless decay_embeddings) the
// embedding: norms, biases, A_log and dt_bias are 1-D and never decay.
//
// Determinism: the gradient norm sums fixed 32K-element chunks in double in a fixed order; the
// elementwise updates have no reductions; Newton–Schulz runs each block's GEMMs single-threaded
// (one block per OpenMP task, OpenBLAS pinned to one thread for the region), so results are
// bit-identical for any thread count.
// Cost: Newton–Schulz is 5·(4m²n + 2m³) FLOPs per m×n block (m ≤ n) — about 62 GFLOP per step for
// configs/k3-small.json, ~1 s on this 2-core machine; muon_ns_steps or kind "adamw" trade it away.
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "dist/comm.hpp"
#include "io/json.hpp"
#include "io/safetensors.hpp"
#include "model/config.hpp"
#include "model/params.hpp"

namespace lm::train {

struct OptimConfig {
  std::string kind = "muon";  // "muon" (Muon for matrices + AdamW for the rest) or "adamw" (AdamW for all)
  // AdamW groups (and every group when kind = "adamw").
  double lr_adamw = 3e-4;  // peak learning rate; the schedule multiplies it
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  // Muon groups.
  double lr_muon = 3e-4;  // peak; with the RMS-matching scale it can equal lr_adamw (Moonlight)
  double muon_momentum = 0.95;
  bool muon_nesterov = true;
  int muon_ns_steps = 5;
  double muon_rms = 0.2;       // target update RMS of an orthogonalised block
  bool muon_per_head = true;   // orthogonalise q/k projections per attention head
  // Both.
  double weight_decay = 0.1;   // K3 recipe
  bool decay_embeddings = false;
  double clip = 1.0;           // global gradient-norm clip; <= 0 disables

  // Strict JSON object with the field names above (unknown fields are errors); `ctx` names the
  // source in messages. "lr" sets both lr_adamw and lr_muon unless they are given.
  static OptimConfig from_json(const io::json& j, const std::string& ctx);
  io::json to_json() const;
  void validate(const std::string& ctx = "optimizer config") const;
};

enum class Group : uint8_t { None, AdamW, Muon };
const char* group_name(Group g);

struct ParamRule {
  Group group = Group::None;
  bool decay = false;
  int64_t blocks = 1;  // Muon: row blocks orthogonalised separately (attention heads), else 1
};

// The group, decay and per-head split of one parameter (pure: usable on any config's specs, e.g.
// the full K3 list without allocating it).
ParamRule param_rule(const model::ParamSpec& p, const model::ModelConfig& mc, const OptimConfig& oc);

// Newton–Schulz orthogonalisation of the r×c row-major matrix `x`, in place: `steps` iterations of
// X ← aX + (bA + cA²)X with A = XXᵀ, (a, b, c) = (3.4445, −4.7750, 2.0315), starting from
// X/‖X‖_F and working on the transpose when r > c. Its singular values end up in roughly [0.7, 1.2]
// (the quintic trades exactness for speed). Single-threaded inside an OpenMP region.
void newton_schulz(float* x, int64_t r, int64_t c, int steps = 5);

// Global L2 norm of all gradients, in double, deterministic; NaN/Inf if any gradient element is.
double grad_norm(const model::ParamStore<float>& ps);
// Name of the first parameter (checkpoint order) whose gradient holds a NaN or Inf.
std::optional<std::string> nonfinite_grad(const model::ParamStore<float>& ps);
// Name of the first parameter whose value holds a NaN or Inf.
std::optional<std::string> nonfinite_value(const model::ParamStore<float>& ps);
// Scales all gradients so their global norm is at most max_norm; returns the pre-clip norm. Throws
// (naming the parameter) when a gradient is not finite.
double clip_grad_norm(model::ParamStore<float>& ps, double max_norm);

struct StepInfo {
  double grad_norm = 0;  // before clipping
  double clip_coef = 1;  // factor the gradients were multiplied by
  double lr_adamw = 0, lr_muon = 0;  // effective learning rates of this step
  // Several ranks (the CPU engine): the step's gradient buckets, those started while the backward still had layers
  // to go, those already reduced when the backward ended, and the seconds the step then waited for the rest.
  int64_t buckets = 0, buckets_early = 0, buckets_hidden = 0;
  double reduce_wait_s = 0;
};

class Optimizer {
 public:
  // `ps` must outlive the optimiser; gradients must be enabled before step(). State starts at zero.
  Optimizer(model::ParamStore<float>& ps, const model::ModelConfig& mc, const OptimConfig& oc);

  // One update with learning rates lr × lr_factor (the schedule's factor). Throws lm::Error naming
  // the parameter, and leaves weights and state untouched, when a gradient is NaN or Inf.
  StepInfo step(double lr_factor = 1.0);

  int64_t step_count() const { return t_; }
  const OptimConfig& config() const { return oc_; }
  const ParamRule& rule(const std::string& param) const;
  // Parameter names per group, in checkpoint order.
  std::vector<std::string> group_params(Group g) const;

  // ZeRO-1 over the job's data-parallel replicas (before load_state): each parameter's optimiser state lives on one
  // rank only, the owner of a contiguous run of parameters (checkpoint order, balanced by elements), so each
  // rank holds about 1/R of it. step() then updates the owned parameters (from the full, already reduced
  // gradients: the norm and the clip are the same on every rank) and all-gathers the new weights, so every
  // replica ends the step with the same weights. A comm of one process changes nothing.
  // With experts sharded (set_expert_parallel first), the routed experts' state is sharded over `edp` instead.
  void shard(dist::Comm& comm);
  int owner(const std::string& param) const;  // the rank holding its state (0 when not sharded; a routed expert's:
                                              // its rank among the replicas holding that expert)
  size_t state_bytes() const;                 // the optimiser state this rank holds
  // Expert parallel (before shard and load_state): the store holds only this rank's routed experts
  // (model::ExpertShard). `ep`: the ranks that hold every expert once between them (the global gradient norm adds
  // their experts' parts); `edp`: the ranks holding the same experts as this one (shard() shards their state there).
  void set_expert_parallel(dist::Comm& ep, dist::Comm& edp);

  // State as tensors: optim.step (I64 [1]), optim.adamw.m.<name>, optim.adamw.v.<name>,
  // optim.muon.momentum.<name> (F32, the parameter's shape) of the parameters this rank owns (all, unsharded).
  // Views of the live state.
  io::NamedTensors state() const;
  // Restores state(): every tensor it would write must be present with its shape; an optim.* tensor that no
  // parameter of these groups would have is an error (the groups differ); the tensors of parameters another
  // rank owns, and other names, are ignored, so the state can share a file with weights and one full state (or
  // every shard of a sharded one) serves any world size. Nothing changes unless everything checks out.
  void load_state(const std::map<std::string, Tensor>& tensors, const std::string& ctx = "optimizer state");
  // From one file or the shards of a sharded checkpoint (each read only for the tensors this rank owns).
  void load_state(const io::SafeTensorsFile& f);
  void load_state(const std::vector<std::string>& files);

 private:
  struct Slot {
    model::Param<float>* p = nullptr;
    ParamRule rule;
    Tensor m, v;  // AdamW moments, or m = Muon momentum (empty where another rank owns the parameter)
    int owner = 0;        // its rank in group(slot)
    bool expert = false;  // a routed expert's, under expert parallel: sharded over edp_
  };
  dist::Comm* group(const Slot& s) const { return s.expert ? edp_ : comm_; }
  bool owned(const Slot& s) const { return !group(s) || s.owner == group(s)->rank(); }
  void gather_weights(bool experts);
  double global_grad_norm(int64_t step) const;
  void load_state(const std::vector<std::string>& files, const io::SafeTensorsFile* one);
  std::vector<std::string> state_names(const std::string& param, Group g) const;
  std::vector<std::string> state_names(const Slot& s) const { return state_names(s.p->spec.name, s.rule.group); }
  std::set<std::string> all_state_names() const;
  struct Chunk {  // a fixed piece of an AdamW parameter, for the parallel elementwise update
    int32_t slot;
    int64_t begin, end;
  };
  struct Block {  // one Muon orthogonalisation unit: rows [row0, row0 + rows) of a parameter
    int32_t slot;
    int64_t row0, rows;
  };

  model::ParamStore<float>& ps_;
  OptimConfig oc_;
  std::vector<Slot> slots_;
  std::set<std::string> elsewhere_names_;  // the state of the routed experts other ranks hold (expert parallel)
  std::map<std::string, size_t> index_;
  std::vector<Chunk> adam_chunks_;
  std::vector<Block> muon_blocks_;
  int64_t t_ = 0;
  dist::Comm* comm_ = nullptr;  // sharded (ZeRO-1) over these ranks
  dist::Comm *ep_ = nullptr, *edp_ = nullptr;  // expert parallel
};

}  // namespace lm::train
