// AdamW + Muon (optim.hpp has the update rules, the group rules and the determinism argument).
#include "train/optim.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/gemm/gemm.hpp"

namespace lm::train {

namespace {

using model::Component;
using model::Param;
using model::ParamStore;

constexpr int64_t kChunk = 32768;  // elements per reduction / update piece (fixed: determinism)

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A fixed partition of a set of float arrays into pieces of at most kChunk elements.
struct Piece {
  int32_t param;
  int64_t begin, end;
};

std::vector<Piece> make_pieces(const std::vector<int64_t>& sizes, const std::vector<int32_t>& ids) {
  std::vector<Piece> r;
  for (size_t i = 0; i < sizes.size(); ++i)
    for (int64_t b = 0; b < sizes[i]; b += kChunk) r.push_back({ids[i], b, std::min(sizes[i], b + kChunk)});
  return r;
}

// Sum of squares in double with 8 fixed lanes (vectorisable, and the same order on every run).
double sum_squares(const float* x, int64_t n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) lane[k] += static_cast<double>(x[i + k]) * static_cast<double>(x[i + k]);
  for (; i < n; ++i) lane[i & 7] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

struct NormResult {
  double norm = 0;
  int first_bad = -1;  // index into ps.all() of the first parameter with a non-finite element
};

// Squared norms per piece (parallel), summed in piece order (serial): deterministic. `experts`: only the routed
// experts' arrays (1), only the others' (0), or all (-1).
NormResult array_norm(const ParamStore<float>& ps, bool grads, int experts = -1) {
  std::vector<int64_t> sizes;
  std::vector<int32_t> ids;
  const auto& all = ps.all();
  for (size_t i = 0; i < all.size(); ++i) {
    const Tensor& t = grads ? all[i].grad : all[i].value;
    if (!t.defined()) continue;
    if (experts >= 0 && (all[i].spec.component == Component::RoutedExpert) != (experts == 1)) continue;
    sizes.push_back(t.numel());
    ids.push_back(static_cast<int32_t>(i));
  }
  const std::vector<Piece> pieces = make_pieces(sizes, ids);
  std::vector<double> part(pieces.size());
  parallel_for(static_cast<int64_t>(pieces.size()), [&](int64_t k) {
    const Piece& pc = pieces[static_cast<size_t>(k)];
    const Tensor& t = grads ? all[static_cast<size_t>(pc.param)].grad : all[static_cast<size_t>(pc.param)].value;
    part[static_cast<size_t>(k)] = sum_squares(t.data<float>() + pc.begin, pc.end - pc.begin);
  });
  NormResult r;
  double s = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    // A NaN or Inf element makes its piece's sum non-finite (float² cannot overflow a double).
    if (!std::isfinite(part[k]) && r.first_bad < 0) r.first_bad = pieces[k].param;
    s += part[k];
  }
  r.norm = s;  // (squared here; the square root below)
  return r;
}
NormResult array_norm_sqrt(const ParamStore<float>& ps, bool grads) {
  NormResult r = array_norm(ps, grads);
  r.norm = std::sqrt(r.norm);
  return r;
}

[[noreturn]] void fail_nonfinite(const Param<float>& p, int64_t step) {
  fail("non-finite gradient (NaN or Inf) in '{}' ({}{}){}; the update was not applied", p.spec.name,
       model::component_name(p.spec.component),
       p.spec.layer >= 0 ? fmt::format(", layer {}", p.spec.layer) : std::string(),
       step >= 0 ? fmt::format(" at optimiser step {}", step) : std::string());
}

// f(i) for i in [0, n) on the OpenMP threads (parallel_for_dynamic, which keeps each call's GEMMs on
// OpenBLAS's single-threaded path), and single-threaded BLAS also when n == 1 or with one thread, so
// the results do not depend on the thread count.
template <class F>
void for_each_task(int64_t n, F&& f) {
  const BlasSerialScope serial;
  parallel_for_dynamic(n, f);
}

// Rows per attention head for the projections Muon orthogonalises per head, else 0.
int64_t head_count(const model::ParamSpec& p, const model::ModelConfig& mc) {
  if (p.component == Component::Mla) {
    for (const char* s : {".q_proj.weight", ".q_b_proj.weight", ".kv_b_proj.weight"})
      if (ends_with(p.name, s)) return mc.num_attention_heads;  // q: [nope|rope] per head; kv_b: [k_nope|v]
  } else if (p.component == Component::Kda) {
    for (const char* s : {".q_proj.weight", ".k_proj.weight"})
      if (ends_with(p.name, s)) return mc.kda_num_heads;
  }
  return 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// config

const char* group_name(Group g) {
  switch (g) {
    case Group::None: return "none";
    case Group::AdamW: return "adamw";
    case Group::Muon: return "muon";
  }
  return "?";
}

OptimConfig OptimConfig::from_json(const io::json& j, const std::string& ctx) {
  io::check_known_fields(j, {"kind", "lr", "lr_adamw", "lr_muon", "beta1", "beta2", "eps", "weight_decay",
                             "decay_embeddings", "clip", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_rms",
                             "muon_per_head"},
                         ctx);
  OptimConfig c;
  c.kind = io::get_or<std::string>(j, "kind", c.kind, ctx);
  if (auto lr = io::get_optional<double>(j, "lr", ctx)) c.lr_adamw = c.lr_muon = *lr;
  c.lr_adamw = io::get_or(j, "lr_adamw", c.lr_adamw, ctx);
  c.lr_muon = io::get_or(j, "lr_muon", c.lr_muon, ctx);
  c.beta1 = io::get_or(j, "beta1", c.beta1, ctx);
  c.beta2 = io::get_or(j, "beta2", c.beta2, ctx);
  c.eps = io::get_or(j, "eps", c.eps, ctx);
  c.weight_decay = io::get_or(j, "weight_decay", c.weight_decay, ctx);
  c.decay_embeddings = io::get_or(j, "decay_embeddings", c.decay_embeddings, ctx);
  c.clip = io::get_or(j, "clip", c.clip, ctx);
  c.muon_momentum = io::get_or(j, "muon_momentum", c.muon_momentum, ctx);
  c.muon_nesterov = io::get_or(j, "muon_nesterov", c.muon_nesterov, ctx);
  c.muon_ns_steps = io::get_or(j, "muon_ns_steps", c.muon_ns_steps, ctx);
  c.muon_rms = io::get_or(j, "muon_rms", c.muon_rms, ctx);
  c.muon_per_head = io::get_or(j, "muon_per_head", c.muon_per_head, ctx);
  c.validate(ctx);
  return c;
}

io::json OptimConfig::to_json() const {
  return io::json{{"kind", kind},
                  {"lr_adamw", lr_adamw},
                  {"lr_muon", lr_muon},
                  {"beta1", beta1},
                  {"beta2", beta2},
                  {"eps", eps},
                  {"weight_decay", weight_decay},
                  {"decay_embeddings", decay_embeddings},
                  {"clip", clip},
                  {"muon_momentum", muon_momentum},
                  {"muon_nesterov", muon_nesterov},
                  {"muon_ns_steps", muon_ns_steps},
                  {"muon_rms", muon_rms},
                  {"muon_per_head", muon_per_head}};
}

void OptimConfig::validate(const std::string& ctx) const {
  LM_CHECK(kind == "muon" || kind == "adamw", "{}: kind must be \"muon\" or \"adamw\", got \"{}\"", ctx, kind);
  LM_CHECK(std::isfinite(lr_adamw) && lr_adamw >= 0, "{}: lr_adamw must be a finite number >= 0, got {}", ctx,
           lr_adamw);
  LM_CHECK(std::isfinite(lr_muon) && lr_muon >= 0, "{}: lr_muon must be a finite number >= 0, got {}", ctx, lr_muon);
  LM_CHECK(beta1 >= 0 && beta1 < 1, "{}: beta1 must be in [0, 1), got {}", ctx, beta1);
  LM_CHECK(beta2 >= 0 && beta2 < 1, "{}: beta2 must be in [0, 1), got {}", ctx, beta2);
  LM_CHECK(eps > 0 && std::isfinite(eps), "{}: eps must be > 0, got {}", ctx, eps);
  LM_CHECK(weight_decay >= 0 && std::isfinite(weight_decay), "{}: weight_decay must be >= 0, got {}", ctx,
           weight_decay);
  LM_CHECK(!std::isnan(clip), "{}: clip must be a number (<= 0 disables clipping)", ctx);
  LM_CHECK(muon_momentum >= 0 && muon_momentum < 1, "{}: muon_momentum must be in [0, 1), got {}", ctx,
           muon_momentum);
  LM_CHECK(muon_ns_steps >= 1 && muon_ns_steps <= 100, "{}: muon_ns_steps must be in [1, 100], got {}", ctx,
           muon_ns_steps);
  LM_CHECK(muon_rms > 0 && std::isfinite(muon_rms), "{}: muon_rms must be > 0, got {}", ctx, muon_rms);
}

ParamRule param_rule(const model::ParamSpec& p, const model::ModelConfig& mc, const OptimConfig& oc) {
  ParamRule r;
  if (!p.trainable) return r;
  r.decay = p.shape.size() >= 2 && p.component != Component::AttnRes &&
            (p.component != Component::Embedding || oc.decay_embeddings);
  const bool matrix = p.matmul && p.shape.size() == 2 && p.layer >= 0 && p.component != Component::Embedding &&
                      p.component != Component::LmHead && p.component != Component::Router;
  if (oc.kind == "muon" && matrix) {
    r.group = Group::Muon;
    if (oc.muon_per_head) {
      const int64_t h = head_count(p, mc);
      if (h > 1) {
        LM_CHECK(p.shape[0] % h == 0, "'{}' has {} rows, not a multiple of its {} attention heads", p.name,
                 p.shape[0], h);
        r.blocks = h;
      }
    }
  } else {
    r.group = Group::AdamW;
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Newton–Schulz

void newton_schulz(float* x, int64_t r, int64_t c, int steps) {
  LM_CHECK(r > 0 && c > 0 && steps >= 0, "newton_schulz: bad shape {}x{} or steps {}", r, c, steps);
  constexpr float a = 3.4445f, b = -4.7750f, cc = 2.0315f;
  const bool tr = r > c;  // work on the wide orientation so the Gram matrix XXᵀ is the small one
  const int64_t m = tr ? c : r, n = tr ? r : c;
  std::vector<float> X(static_cast<size_t>(m * n)), Y(X.size()), A(static_cast<size_t>(m * m)), B(A.size());
  if (tr) {
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) X[static_cast<size_t>(j * n + i)] = x[i * c + j];
  } else {
    std::copy(x, x + m * n, X.begin());
  }
  const float inv = static_cast<float>(1.0 / (std::sqrt(sum_squares(X.data(), m * n)) + 1e-7));
  for (float& v : X) v *= inv;
  for (int s = 0; s < steps; ++s) {
    ops::gemm(false, true, m, m, n, 1.0f, X.data(), n, X.data(), n, 0.0f, A.data(), m);  // A = X Xᵀ
    B = A;
    ops::gemm(false, false, m, m, m, cc, A.data(), m, A.data(), m, b, B.data(), m);  // B = bA + cA²
    Y = X;
    ops::gemm(false, false, m, n, m, 1.0f, B.data(), m, X.data(), n, a, Y.data(), n);  // Y = aX + BX
    std::swap(X, Y);
  }
  if (tr) {
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) x[i * c + j] = X[static_cast<size_t>(j * n + i)];
  } else {
    std::copy(X.begin(), X.end(), x);
  }
}

// ---------------------------------------------------------------------------------------------
// gradient norm, clipping, finiteness

double grad_norm(const ParamStore<float>& ps) { return array_norm_sqrt(ps, true).norm; }

std::optional<std::string> nonfinite_grad(const ParamStore<float>& ps) {
  const NormResult r = array_norm_sqrt(ps, true);
  if (r.first_bad < 0) return std::nullopt;
  return ps.all()[static_cast<size_t>(r.first_bad)].spec.name;
}

std::optional<std::string> nonfinite_value(const ParamStore<float>& ps) {
  const NormResult r = array_norm_sqrt(ps, false);
  if (r.first_bad < 0) return std::nullopt;
  return ps.all()[static_cast<size_t>(r.first_bad)].spec.name;
}

double clip_grad_norm(ParamStore<float>& ps, double max_norm) {
  const NormResult r = array_norm_sqrt(ps, true);
  if (r.first_bad >= 0) fail_nonfinite(ps.all()[static_cast<size_t>(r.first_bad)], -1);
  if (max_norm > 0 && r.norm > max_norm) {
    const float coef = static_cast<float>(max_norm / (r.norm + 1e-6));
    for (auto& p : ps.all()) {
      if (!p.grad.defined()) continue;
      float* g = p.g();
      parallel_for(p.grad.numel(), [&](int64_t i) { g[i] *= coef; }, kChunk);
    }
  }
  return r.norm;
}

// ---------------------------------------------------------------------------------------------
// Optimizer

Optimizer::Optimizer(ParamStore<float>& ps, const model::ModelConfig& mc, const OptimConfig& oc)
    : ps_(ps), oc_(oc) {
  oc_.validate();
  auto& all = ps_.all();
  slots_.reserve(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    Param<float>& p = all[i];
    LM_CHECK(p.value.shape() == p.spec.shape && p.value.is_contiguous(),
             "optimizer: parameter '{}' is not a contiguous {} tensor", p.spec.name, shape_str(p.spec.shape));
    Slot s;
    s.p = &p;
    s.rule = param_rule(p.spec, mc, oc_);
    const auto id = static_cast<int32_t>(i);
    if (s.rule.group == Group::AdamW) {
      s.m = Tensor::zeros(p.spec.shape);
      s.v = Tensor::zeros(p.spec.shape);
      for (int64_t b = 0; b < p.spec.numel(); b += kChunk)
        adam_chunks_.push_back({id, b, std::min(p.spec.numel(), b + kChunk)});
    } else if (s.rule.group == Group::Muon) {
      s.m = Tensor::zeros(p.spec.shape);
      const int64_t rows = p.spec.shape[0] / s.rule.blocks;
      for (int64_t h = 0; h < s.rule.blocks; ++h) muon_blocks_.push_back({id, h * rows, rows});
    }
    index_[p.spec.name] = i;
    slots_.push_back(std::move(s));
  }
  for (const model::ParamSpec& p : ps_.elsewhere())
    for (auto& n : state_names(p.name, param_rule(p, mc, oc_).group)) elsewhere_names_.insert(std::move(n));
  // Largest blocks first so the dynamic schedule ends with small ones (does not affect results).
  auto cost = [&](const Block& b) {
    const int64_t c = slots_[static_cast<size_t>(b.slot)].p->spec.shape[1];
    return b.rows * c * std::min(b.rows, c);
  };
  std::stable_sort(muon_blocks_.begin(), muon_blocks_.end(),
                   [&](const Block& x, const Block& y) { return cost(x) > cost(y); });
}

const ParamRule& Optimizer::rule(const std::string& param) const {
  auto it = index_.find(param);
  LM_CHECK(it != index_.end(), "optimizer: the model has no parameter named '{}'", param);
  return slots_[it->second].rule;
}

std::vector<std::string> Optimizer::group_params(Group g) const {
  std::vector<std::string> r;
  for (const auto& s : slots_)
    if (s.rule.group == g) r.push_back(s.p->spec.name);
  return r;
}

StepInfo Optimizer::step(double lr_factor) {
  LM_CHECK(ps_.has_grads(), "optimizer: gradients are not enabled on the parameter store");
  LM_CHECK(std::isfinite(lr_factor) && lr_factor >= 0, "optimizer: learning-rate factor must be >= 0, got {}",
           lr_factor);
  StepInfo info;
  info.grad_norm = global_grad_norm(t_ + 1);
  if (oc_.clip > 0 && info.grad_norm > oc_.clip) info.clip_coef = oc_.clip / (info.grad_norm + 1e-6);
  info.lr_adamw = oc_.lr_adamw * lr_factor;
  info.lr_muon = oc_.lr_muon * lr_factor;
  ++t_;
  const float coef = static_cast<float>(info.clip_coef);

  // ---- AdamW: elementwise over fixed chunks ----
  {
    const double lr = info.lr_adamw;
    const float b1 = static_cast<float>(oc_.beta1), b2 = static_cast<float>(oc_.beta2);
    const float omb1 = static_cast<float>(1.0 - oc_.beta1), omb2 = static_cast<float>(1.0 - oc_.beta2);
    const double bc1 = 1.0 - std::pow(oc_.beta1, static_cast<double>(t_));
    const double bc2 = 1.0 - std::pow(oc_.beta2, static_cast<double>(t_));
    const float step_size = static_cast<float>(lr / bc1);
    const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
    const float eps = static_cast<float>(oc_.eps);
    const float keep_decay = static_cast<float>(1.0 - lr * oc_.weight_decay);
    parallel_for(static_cast<int64_t>(adam_chunks_.size()), [&](int64_t k) {
      const Chunk& ch = adam_chunks_[static_cast<size_t>(k)];
      const Slot& s = slots_[static_cast<size_t>(ch.slot)];
      float* w = s.p->w();
      const float* g = s.p->g();
      float* m = s.m.data<float>();
      float* v = s.v.data<float>();
      const float keep = s.rule.decay ? keep_decay : 1.0f;
      for (int64_t i = ch.begin; i < ch.end; ++i) {
        const float gi = g[i] * coef;
        m[i] = b1 * m[i] + omb1 * gi;
        v[i] = b2 * v[i] + omb2 * gi * gi;
        w[i] = w[i] * keep - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
      }
    });
  }

  // ---- Muon: one task per block (momentum, Newton–Schulz, update of its rows) ----
  {
    const double lr = info.lr_muon;
    const float mu = static_cast<float>(oc_.muon_momentum);
    const float keep_decay = static_cast<float>(1.0 - lr * oc_.weight_decay);
    for_each_task(static_cast<int64_t>(muon_blocks_.size()), [&](int64_t k) {
      const Block& bl = muon_blocks_[static_cast<size_t>(k)];
      const Slot& s = slots_[static_cast<size_t>(bl.slot)];
      const int64_t cols = s.p->spec.shape[1], off = bl.row0 * cols, n = bl.rows * cols;
      float* w = s.p->w() + off;
      const float* g = s.p->g() + off;
      float* buf = s.m.data<float>() + off;
      std::vector<float> u(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const float gi = g[i] * coef;
        buf[i] = mu * buf[i] + gi;
        u[static_cast<size_t>(i)] = oc_.muon_nesterov ? gi + mu * buf[i] : buf[i];
      }
      newton_schulz(u.data(), bl.rows, cols, oc_.muon_ns_steps);
      const float scale =
          static_cast<float>(lr * oc_.muon_rms * std::sqrt(static_cast<double>(std::max(bl.rows, cols))));
      const float keep = s.rule.decay ? keep_decay : 1.0f;
      for (int64_t i = 0; i < n; ++i) w[i] = w[i] * keep - scale * u[static_cast<size_t>(i)];
    });
  }
  if (comm_) gather_weights(false);
  if (edp_ && edp_->size() > 1 && comm_) gather_weights(true);
  return info;
}

// The norm of every gradient of the model; under expert parallel the routed experts' part is summed over the ranks
// that hold them between them. Throws, on every rank, when a gradient is not finite (naming it where it lives).
double Optimizer::global_grad_norm(int64_t step) const {
  if (!ep_) {
    const NormResult nr = array_norm_sqrt(ps_, true);
    if (nr.first_bad >= 0) fail_nonfinite(ps_.all()[static_cast<size_t>(nr.first_bad)], step);
    return nr.norm;
  }
  const NormResult rep = array_norm(ps_, true, 0), exp = array_norm(ps_, true, 1);
  double sq = exp.norm;
  ep_->all_reduce_sum(&sq, 1);  // (a NaN or Inf on any rank reaches every rank)
  if (rep.first_bad >= 0) fail_nonfinite(ps_.all()[static_cast<size_t>(rep.first_bad)], step);
  if (exp.first_bad >= 0) fail_nonfinite(ps_.all()[static_cast<size_t>(exp.first_bad)], step);
  LM_CHECK(std::isfinite(sq), "non-finite gradient (NaN or Inf) in a routed expert of another rank at optimiser step "
           "{}; the update was not applied", step);
  return std::sqrt(rep.norm + sq);
}

// ---------------------------------------------------------------------------------------------
// state

std::vector<std::string> Optimizer::state_names(const std::string& param, Group g) const {
  if (g == Group::AdamW) return {"optim.adamw.m." + param, "optim.adamw.v." + param};
  if (g == Group::Muon) return {"optim.muon.momentum." + param};
  return {};
}
std::set<std::string> Optimizer::all_state_names() const {
  std::set<std::string> r = elsewhere_names_;
  r.insert("optim.step");
  for (const auto& s : slots_)
    for (auto& n : state_names(s)) r.insert(std::move(n));
  return r;
}

io::NamedTensors Optimizer::state() const {
  io::NamedTensors r;
  r.emplace_back("optim.step", Tensor::from_vector<int64_t>({t_}, {1}));
  for (const auto& s : slots_) {
    if (!owned(s)) continue;
    const std::vector<std::string> n = state_names(s);
    if (n.size() >= 1) r.emplace_back(n[0], s.m);
    if (n.size() == 2) r.emplace_back(n[1], s.v);
  }
  return r;
}

void Optimizer::set_expert_parallel(dist::Comm& ep, dist::Comm& edp) {
  LM_CHECK(t_ == 0 && !comm_ && !ep_, "optimizer: set_expert_parallel() before shard, any step or load_state, once");
  ep_ = &ep, edp_ = &edp;
  for (auto& s : slots_) s.expert = s.p->spec.component == Component::RoutedExpert;
}

void Optimizer::shard(dist::Comm& comm) {
  if (comm.size() <= 1 && !(edp_ && edp_->size() > 1)) return;
  LM_CHECK(t_ == 0 && !comm_, "optimizer: shard() before any step or load_state, once");
  comm_ = &comm;
  // Per group (the replicated parameters over comm, the experts over edp), contiguous runs of parameters by element
  // count: slot i goes to the rank whose share its first element is in.
  for (const bool experts : {false, true}) {
    int64_t total = 0, before = 0;
    for (const auto& s : slots_)
      if (s.expert == experts) total += s.p->spec.numel();
    for (auto& s : slots_) {
      if (s.expert != experts) continue;
      const int R = group(s)->size();
      s.owner = static_cast<int>(std::min<int64_t>(R - 1, total ? before * R / total : 0));
      before += s.p->spec.numel();
      if (!owned(s)) s.m = Tensor(), s.v = Tensor();
    }
  }
  auto mine = [&](int32_t slot) { return owned(slots_[static_cast<size_t>(slot)]); };
  std::erase_if(adam_chunks_, [&](const Chunk& c) { return !mine(c.slot); });
  std::erase_if(muon_blocks_, [&](const Block& b) { return !mine(b.slot); });
}

int Optimizer::owner(const std::string& param) const {
  auto it = index_.find(param);
  LM_CHECK(it != index_.end(), "optimizer: the model has no parameter named '{}'", param);
  return slots_[it->second].owner;
}

size_t Optimizer::state_bytes() const {
  size_t b = 0;
  for (const auto& s : slots_) b += (s.m.defined() ? s.m.nbytes() : 0) + (s.v.defined() ? s.v.nbytes() : 0);
  return b;
}

// ZeRO-1: each rank's updated parameters of one group (the replicated ones, or the routed experts), concatenated in
// slot order, to every rank of the group.
void Optimizer::gather_weights(bool experts) {
  dist::Comm& g = experts ? *edp_ : *comm_;
  auto in = [&](const Slot& s) { return s.expert == experts && s.rule.group != Group::None; };
  std::vector<float> mine;
  for (const auto& s : slots_)
    if (in(s) && owned(s)) mine.insert(mine.end(), s.p->w(), s.p->w() + s.p->spec.numel());
  const std::vector<char> all = g.all_gather_v(mine.data(), mine.size() * sizeof(float));
  // Every rank's part lies in rank order, and within it in slot order: the owners are non-decreasing in slot order.
  size_t off = 0;
  for (int r = 0; r < g.size(); ++r)
    for (auto& s : slots_)
      if (in(s) && s.owner == r) {
        const size_t n = static_cast<size_t>(s.p->spec.numel()) * sizeof(float);
        LM_CHECK(off + n <= all.size(), "optimizer: the gathered weights are short ({} bytes)", all.size());
        if (r != g.rank()) std::memcpy(s.p->w(), all.data() + off, n);
        off += n;
      }
  LM_CHECK(off == all.size(), "optimizer: gathered {} bytes of weights, expected {}", all.size(), off);
}

void Optimizer::load_state(const std::map<std::string, Tensor>& tensors, const std::string& ctx) {
  io::NamedTensors mine = state();
  std::set<std::string> expected;
  for (const auto& [name, t] : mine) {
    expected.insert(name);
    auto it = tensors.find(name);
    LM_CHECK(it != tensors.end(), "{}: missing tensor '{}' (was the state saved with other optimizer groups?)", ctx,
             name);
    LM_CHECK(it->second.dtype() == t.dtype(), "{}: tensor '{}' is {}, expected {}", ctx, name,
             dtype_name(it->second.dtype()), dtype_name(t.dtype()));
    LM_CHECK(it->second.shape() == t.shape(), "{}: tensor '{}' has shape {}, expected {}", ctx, name,
             shape_str(it->second.shape()), shape_str(t.shape()));
  }
  const std::set<std::string> known = all_state_names();
  for (const auto& [name, t] : tensors) {
    (void)t;
    LM_CHECK(name.rfind("optim.", 0) != 0 || known.count(name),
             "{}: tensor '{}' does not belong to this optimizer's groups (config kind '{}')", ctx, name, oc_.kind);
  }
  const int64_t step = static_cast<int64_t>(tensors.at("optim.step").item(0));
  LM_CHECK(step >= 0, "{}: optim.step is negative ({})", ctx, step);
  for (auto& [name, t] : mine)
    if (name != "optim.step") t.copy_from(tensors.at(name));  // shares storage with the slot
  t_ = step;
}

void Optimizer::load_state(const io::SafeTensorsFile& f) {
  load_state(std::vector<std::string>{}, &f);
}

void Optimizer::load_state(const std::vector<std::string>& files) { load_state(files, nullptr); }

// The optim.* tensors of `files` (or of `one`): those this rank's state needs are read, the others only listed
// (so an unknown one is still an error).
void Optimizer::load_state(const std::vector<std::string>& files, const io::SafeTensorsFile* one) {
  std::set<std::string> need;
  for (const auto& [name, t] : state()) need.insert(name);
  std::map<std::string, Tensor> m;
  std::string ctx = one ? (one->path().empty() ? std::string("optimizer state") : one->path()) : std::string();
  auto take = [&](const io::SafeTensorsFile& f) {
    for (const auto& info : f.tensors()) {
      if (info.name.rfind("optim.", 0) != 0) continue;
      LM_CHECK(!m.count(info.name) || info.name == "optim.step", "{}: tensor '{}' appears in more than one shard",
               f.path(), info.name);
      m[info.name] = need.count(info.name) ? f.get(info.name) : Tensor::zeros({});  // (listed, not read)
    }
  };
  if (one) {
    take(*one);
  } else {
    LM_CHECK(!files.empty(), "optimizer state: no files");
    for (const std::string& p : files) take(io::SafeTensorsFile::open(p));
    ctx = files.size() == 1 ? files[0] : fmt::format("{} and {} more optimizer shard(s)", files[0], files.size() - 1);
  }
  load_state(m, ctx);
}

}  // namespace lm::train
