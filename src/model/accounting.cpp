#include "model/accounting.hpp"

#include "model/stack.hpp"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>

namespace lm::model {

namespace {
constexpr int64_t kKdaChunk = 64;  // SPEC §2.1
}

VisionParamCounts count_vision_params(const VisionConfig& v) {
  VisionParamCounts r;
  for_each_vision_param(v, [&](const ParamSpec& p) {
    (p.component == Component::Projector ? r.projector : r.tower) += p.numel();
  });
  return r;
}

ParamCounts count_params(const ModelConfig& c) {
  ParamCounts r;
  r.layer_total.assign(static_cast<size_t>(c.num_hidden_layers), 0);
  r.layer_routed.assign(static_cast<size_t>(c.num_hidden_layers), 0);
  const int64_t k = c.num_experts_per_token;
  for_each_param(c, [&](const ParamSpec& p) {
    const int64_t n = p.numel();
    // A token runs k experts of each MoE layer; experts are the same size, so experts 0..k-1 stand
    // for whichever k the router picks.
    const bool active = p.component != Component::Embedding &&
                        (p.component != Component::RoutedExpert || p.expert < k);
    auto& cc = r.by_component[static_cast<size_t>(p.component)];
    cc.total += n;
    r.total += n;
    if (p.trainable) r.trainable += n;
    if (active) {
      cc.activated += n;
      r.activated += n;
      if (p.matmul) r.activated_matmul += n;
    }
    if (p.layer >= 0) {
      r.layer_total[static_cast<size_t>(p.layer)] += n;
      if (p.component == Component::RoutedExpert) r.layer_routed[static_cast<size_t>(p.layer)] += n;
    } else if (p.component == Component::Embedding) {
      r.embedding += n;
    } else {
      r.head += n;
    }
  });
  return r;
}

FlopsPerToken flops_per_token(const ModelConfig& c, int64_t seq_len, int64_t context) {
  LM_CHECK(seq_len >= 1 && context >= 0, "flops_per_token: seq_len {} must be >= 1 and context {} >= 0", seq_len,
           context);
  const ParamCounts pc = count_params(c);
  FlopsPerToken f;
  f.seq_len = seq_len;
  f.context = context;
  f.matmul_fwd = 2.0 * static_cast<double>(pc.activated_matmul);
  const double Hm = static_cast<double>(c.num_attention_heads);
  const double mla_layers = static_cast<double>(c.num_mla_layers());
  const double kda_layers = static_cast<double>(c.num_kda_layers());
  const double keys_mean = (static_cast<double>(seq_len) + 1.0) / 2.0;
  f.mla_attn_fwd_train =
      mla_layers * 2.0 * Hm * static_cast<double>(c.mla_qk_head_dim() + c.v_head_dim) * keys_mean;
  const double K = static_cast<double>(c.kda_head_dim), C = static_cast<double>(kKdaChunk);
  f.kda_attn_fwd = kda_layers * static_cast<double>(c.kda_num_heads) * (6 * K * K + 3 * C * K + C * C);
  f.train = 3.0 * (f.matmul_fwd + f.mla_attn_fwd_train + f.kda_attn_fwd);
  const double absorbed = 2.0 * Hm * static_cast<double>(2 * c.kv_lora_rank + c.qk_rope_head_dim);
  f.decode = f.matmul_fwd + mla_layers * absorbed * static_cast<double>(context) +
             kda_layers * static_cast<double>(c.kda_num_heads) * 8.0 * K * K;
  return f;
}

DecodeMemory decode_memory(const ModelConfig& c, int64_t context, int cache_bytes, int weight_bytes_per_param) {
  LM_CHECK(context >= 0, "decode_memory: context {} must not be negative", context);
  LM_CHECK(cache_bytes > 0 && weight_bytes_per_param > 0, "decode_memory: byte sizes must be positive");
  DecodeMemory m;
  m.context = context;
  m.cache_bytes = cache_bytes;
  m.mla_bytes_per_token = c.mla_cache_dim() * cache_bytes * c.num_mla_layers();
  m.mla_bytes_per_seq = m.mla_bytes_per_token * context;
  const int64_t HK = c.kda_key_dim();
  m.kda_state_bytes_per_seq = HK * c.kda_head_dim * 4 * c.num_kda_layers();  // H*K*V fp32, V = K
  m.conv_state_bytes_per_seq = 3 * HK * (c.kda_conv_kernel - 1) * cache_bytes * c.num_kda_layers();
  m.total_bytes_per_seq = m.mla_bytes_per_seq + m.kda_state_bytes_per_seq + m.conv_state_bytes_per_seq;
  m.weight_bytes = count_params(c).total * weight_bytes_per_param;
  return m;
}

DecodeTraffic decode_traffic(const ModelConfig& c, int64_t context, int64_t batch) {
  LM_CHECK(context >= 0 && batch >= 1, "decode_traffic: context {} and batch {}", context, batch);
  const ParamCounts pc = count_params(c);
  const double routed = double(pc[Component::RoutedExpert].total);
  DecodeTraffic t;
  t.weights = 2.0 * (double(pc.total) - double(pc.embedding) - routed) + 2.0 * double(batch * c.hidden_size);
  if (c.num_experts > 0 && routed > 0) {
    const double E = double(c.num_experts), k = double(c.num_experts_per_token);
    t.experts = routed * 2.0 * (1.0 - std::pow(1.0 - k / E, double(batch)));  // (the selected share of every layer)
  }
  const DecodeMemory m = decode_memory(c, context, 2, 2);
  t.kda_states = double(batch) * (2.0 * double(m.kda_state_bytes_per_seq) + 2.0 * double(m.conv_state_bytes_per_seq));
  t.mla_cache = double(batch) * double(m.mla_bytes_per_seq);
  return t;
}

InferenceMemory inference_memory(const ModelConfig& c, int64_t context, int64_t batch, int64_t prefill_chunk,
                                 int64_t pool_tokens) {
  LM_CHECK(context >= 1 && batch >= 1 && prefill_chunk >= 1, "inference_memory: context {}, batch {}, chunk {}",
           context, batch, prefill_chunk);
  InferenceMemory m;
  int64_t small = 0;
  for (const ParamSpec& s : param_specs(c))
    if (!s.matmul && s.component != Component::Embedding) small += (s.numel() + 63) / 64 * 64;
  m.weights = 2.0 * double(count_params(c).total) + 4.0 * double(small);
  const int64_t HK = c.kda_key_dim(), K = c.kda_head_dim, H = c.kda_num_heads;
  m.kda_caches = double(batch) * double(c.num_kda_layers()) * 4.0 * double(HK * K + 3 * HK * (c.kda_conv_kernel - 1));
  const double tokens = pool_tokens > 0 ? double((pool_tokens + 63) / 64 * 64) : double(batch * ((context + 63) / 64 * 64));
  m.mla_cache = double(c.num_mla_layers()) * 2.0 * tokens * double(c.mla_cache_dim());
  // One layer's prefill activations at n rows (every sublayer kind's buffers: the layers share one set).
  const double n = double(std::min(prefill_chunk, context)), d = double(c.hidden_size);
  double a = n * d * (4 + 2 + 2 + 2) + n * 8;  // the stream, the normed inputs xn / yn, hn; rstds
  if (c.num_kda_layers() > 0)
    a += n * (2.0 * double(3 * HK + K + H + 8) + 2.0 * 7 * double(HK) + 2.0 * double(K) + 4.0 * double(H));
  if (c.num_mla_layers() > 0) {
    const double Hm = double(c.num_attention_heads), Dq = double(c.qk_nope_head_dim + c.qk_rope_head_dim),
                 Dv = double(c.v_head_dim), R = double(c.kv_lora_rank), RD = double(c.mla_cache_dim()),
                 Q = double(c.q_lora_rank.value_or(0));
    a += n * (2 * Hm * Dq + 6 * Q + 4 * RD + 2 * R + 2 * Hm * (Dq + Dv + Dq + Dv + Dv) + 4 * Hm + 4 * Hm * Dv * 2);
    // a continued chunk's attention partials (o, lse, fp32 merge) and one block of decompressed keys
    const double nk = double(std::min<int64_t>(16384, context));
    a += n * Hm * (2 * Dv + 4 + 4 * Dv + 4) + nk * (2 * R + 4 * RD + 2 * Hm * (Dq + Dv) + 2 * Hm * (Dq + Dv));
  }
  if (c.num_experts > 0) {
    const double E = double(c.num_experts), k = double(c.num_experts_per_token), l = double(c.expert_width()),
                 I = double(c.moe_intermediate_size), Is = double(c.shared_intermediate_size());
    a += n * (8 * E + 8 * k + 4 + 2 * (l + 2 * Is)) + n * k * (8 + 2 * l + 4 * I + 2 * I + 2 * l) + n * 2 * l * 2 +
         n * (2 * 2 * Is + 2 * Is);
  }
  a += n * 2 * double(c.intermediate_size) * 3;  // a dense FFN's ab and h
  if (c.has_attn_res()) a += 2.0 * double(c.num_hidden_layers) * n * d * 4;  // AttnRes states per layer
  m.activations = a + 4.0 * double(batch) * double(c.vocab_size) * 3;  // + the logits (device, pinned twice)
  m.workspace = 0.75 * 1073741824.0;  // the CUDA context, cuBLAS(Lt) workspaces, the side streams' handles
  return m;
}

namespace {

// The GPU model's fused KDA input projection width (q, k, v, f_a, β side by side, 16-byte rows: Impl::kda_in_ld) and
// the KDA operator's padded head dim.
double kda_in_ld(const ModelConfig& c) {
  return double((3 * c.kda_key_dim() + c.kda_head_dim + c.kda_num_heads + 7) / 8 * 8);
}
double kda_kp(const ModelConfig& c) { return double((c.kda_head_dim + 63) / 64 * 64); }

// Bytes per token of layer i's internals kept for its backward (model/cuda/gpu_model_impl.hpp: LayerActs; the KDA
// operator's kept tensors as ops/kda/cuda/api.cu lays them out per 64-token chunk and head, when `saved`): its
// mixer's, its FFN's, and the norm outputs and mid state around them.
double gpu_mixer_per_token(const ModelConfig& c, int64_t i, bool saved = true) {
  if (c.is_kda(i)) {
    const double H = double(c.kda_num_heads), K = double(c.kda_head_dim), HK = double(c.kda_key_dim());
    const double LF = kda_in_ld(c), KP = kda_kp(c);
    return 2 * LF + 7 * 2 * HK + 4 * H + (c.kda_full_rank_gate ? 0 : 2 * K) +
           (saved ? H * (4 * 64 * KP * 2 + 4096 * 2 + KP * 4 + 2 * 4096 * 2 + KP * KP * 2 + 64 * KP * 2) / 64 : 0);
  }
  const double Hm = double(c.num_attention_heads), Dq = double(c.mla_qk_head_dim()), Dv = double(c.v_head_dim),
               R = double(c.kv_lora_rank), RD = double(c.mla_cache_dim()), Q = double(c.q_lora_rank.value_or(0)),
               Dkv = double(c.qk_nope_head_dim + c.v_head_dim);
  return 2 * Hm * Dq + (Q > 0 ? 6 * Q + 4 : 0) + 4 * RD + 2 * R + 4 + 2 * Hm * (Dkv + Dq + Dv + Dv) + 4 * Hm +
         (c.mla_use_output_gate ? 2 * 2 * Hm * Dv : 0);
}
double gpu_ffn_per_token(const ModelConfig& c, int64_t i) {
  if (!c.is_moe(i)) return 2 * 2 * double(c.intermediate_size) + 2 * double(c.intermediate_size);  // ab, h
  const double E = double(c.num_experts), k = double(c.num_experts_per_token), l = double(c.expert_width()),
               I = double(c.moe_intermediate_size), Is = double(c.shared_intermediate_size());
  return 4 * E + 8 * k + 8 * k                          // logits, topk idx / w, prow / ppos
         + 2 * (c.num_shared_experts > 0 ? l + 2 * Is : l)  // z (with the shared expert's ab when fused)
         + k * (2 * l + 4 * I + 2 * I + 2 * l)          // xs, eab, eh, eo
         + 2 * l + (c.latent_moe_use_norm ? 2 * l + 4 : 0)  // u, un, u_rstd
         + (c.num_shared_experts > 0 ? 2 * Is : 0);     // the shared expert's h
}

}  // namespace

std::vector<bool> gpu_transient_states(const ModelConfig& c) {
  const StackPlan sp = StackPlan::build(c);
  std::vector<bool> t(size_t(c.num_hidden_layers), true);
  if (sp.attn_res)
    for (int64_t i = 0; i < sp.size(); ++i) t[size_t(i)] = i > 0 && !sp[i].opens_block;
  return t;
}

GpuTrainingMemory gpu_training_memory(const ModelConfig& c, int64_t rows, std::vector<bool> keep, bool offload) {
  const int64_t L = c.num_hidden_layers;
  LM_CHECK(rows >= 1, "gpu_training_memory: rows {} must be >= 1", rows);
  LM_CHECK(int64_t(keep.size()) == L, "gpu_training_memory: {} keep flags for {} layers", keep.size(), L);
  const StackPlan sp = StackPlan::build(c);
  const ParamCounts pc = count_params(c);
  GpuTrainingMemory m;
  m.rows = rows;
  m.keep = keep;
  const double n = double(rows), d = double(c.hidden_size), P = double(pc.total);
  double routed = 0;
  for (int64_t r : pc.layer_routed) routed += double(r);
  m.params = P * (4 + 4 + 2 + 8) + 2 * routed;  // master, grad, bf16, AdamW m and v; the transposed experts
  // States: AttnRes, each layer's output (its successor's input; the blocks are among them) and the embedding;
  // plain, each layer's input, the stream and h_final. The final norm's output and rstd, ids and targets, and each
  // MoE layer's Quantile Balancing statistics.
  // Offloaded, the transient ones pass through two device buffers and wait in pinned host memory.
  double transient_states = 0;
  for (bool t : gpu_transient_states(c)) transient_states += t;
  const double on_device = double(L + 1) + (offload ? 2 - transient_states : 0);
  m.offload = offload;
  m.host = offload ? transient_states * n * 4 * d : 0;
  m.states = n * (4 * d * on_device + 2 * d + 4 + 8 + (sp.attn_res ? 0 : 4 * d)) +
             n * double(c.num_moe_layers()) * (4 * double(c.num_experts) + 4);
  // The kept layers' internals, and the one set of every sublayer kind that the recomputed layers share, and that a
  // forward without a backward (an evaluation's loss) uses: the KDA operator's kept tensors are in it once a KDA
  // layer recomputes, and a recompute also writes its output state aside (plain residuals: runs the stream in a copy).
  const double common = 2 * 2 * d + 2 * 4 + 4 * d;  // xn, yn; rstd1, rstd2; pmid (AttnRes) or y_in (plain)
  double sh_kda = 0, sh_mla = 0, sh_moe = 0, sh_ffn = 0;
  bool kda_recomputes = false;
  for (int64_t i = 0; i < L; ++i) {
    if (keep[size_t(i)]) m.kept += n * (common + gpu_mixer_per_token(c, i) + gpu_ffn_per_token(c, i)), ++m.kept_layers;
    else kda_recomputes = kda_recomputes || c.is_kda(i);
  }
  for (int64_t i = 0; i < L; ++i) {
    double& sm = c.is_kda(i) ? sh_kda : sh_mla;
    double& sf = c.is_moe(i) ? sh_moe : sh_ffn;
    sm = std::max(sm, gpu_mixer_per_token(c, i, kda_recomputes)), sf = std::max(sf, gpu_ffn_per_token(c, i));
  }
  m.shared = n * (common + sh_kda + sh_mla + sh_moe + sh_ffn + (m.kept_layers < L ? 4 * d : 0));
  // The backward's scratch: the walk's (d_hn, dnorm, dx_in, d_prefix fp32, dy bf16, each closed block's gradient,
  // a block group's deferred reads), and the largest sublayer gradients of each kind.
  const double blocks = double(sp.attn_res ? sp.out_closed : 0);
  const double reads = double(c.attn_res_block_size.value_or(0) + 1);  // a block group's deferred reads, at most
  const double sc = n * (4 * 4 * d + 2 * d) + blocks * n * 4 * d + (sp.attn_res ? reads * n * (2 * d + 16 * blocks) : 0);
  // Per kind its own buffers, plus the largest use of the names two kinds share (d_o, dq, dk, dv: KDA and MLA;
  // ffn_dh, ffn_dab: the dense FFN and the shared expert).
  double mixer_sc = 0, both_sc = 0, glu_sc = 0;
  if (c.num_kda_layers() > 0) {
    const double HK = double(c.kda_key_dim()), K = double(c.kda_head_dim), LF = kda_in_ld(c);
    mixer_sc += 2 * LF + 4 * HK + 2 * 2 * HK + 2 * K;
    both_sc = std::max(both_sc, 4 * 2 * HK);
  }
  if (c.num_mla_layers() > 0) {
    const double Hm = double(c.num_attention_heads), Dq = double(c.mla_qk_head_dim()), Dv = double(c.v_head_dim),
                 R = double(c.kv_lora_rank), RD = double(c.mla_cache_dim()), Q = double(c.q_lora_rank.value_or(0)),
                 Dkv = double(c.qk_nope_head_dim + c.v_head_dim);
    mixer_sc += 4 * Hm * Dv + 2 * Hm * Dv + 2 * Hm * Dkv + 2 * RD + 4 * R + 6 * Q;
    both_sc = std::max(both_sc, 2 * Hm * (Dv + 2 * Dq + Dv));
  }
  double moe_sc = 0;
  if (c.num_experts > 0) {
    const double E = double(c.num_experts), k = double(c.num_experts_per_token), l = double(c.expert_width()),
                 I = double(c.moe_intermediate_size), Is = double(c.shared_intermediate_size());
    moe_sc = 8 * l + k * (2 * l + 4 + 2 * I + 4 * I + 2 * l) + 2 * ((E + 7) / 8 * 8 + l + 2 * Is);
    if (c.num_shared_experts > 0) glu_sc = 8 * Is;
  }
  if (c.num_dense_ffn_layers() > 0) glu_sc = std::max(glu_sc, 8 * double(c.intermediate_size));
  m.scratch = sc + n * (mixer_sc + both_sc + moe_sc) + std::min(n, double(kGpuFfnRows)) * glu_sc;
  // Transients (the largest): the attention backward's fp32 dQ accumulator and statistics, the KDA backward's
  // state gradients, an expert FFN's hidden rows, an AttnRes backward's rebuilt state.
  double tr = 4 * d;
  if (c.num_mla_layers() > 0)
    tr = std::max(tr, double(c.num_attention_heads) * (8 + 4 * double(c.mla_qk_head_dim())));
  if (c.num_kda_layers() > 0) {
    const double KP = kda_kp(c);
    tr = std::max(tr, double(c.kda_num_heads) * (KP * KP * 2 + 64 * KP * 2 + KP * 4 + 4) / 64);
  }
  if (c.num_experts > 0) tr = std::max(tr, double(c.num_experts_per_token) * double(c.moe_intermediate_size) * 2);
  m.transient = n * tr;
  m.workspace = 0.75 * 1073741824.0;
  return m;
}

GpuTrainingMemory gpu_training_plan(const ModelConfig& c, int64_t rows, double device_bytes, double host_bytes) {
  const int64_t L = c.num_hidden_layers;
  std::vector<bool> keep(size_t(L), true);
  GpuTrainingMemory m = gpu_training_memory(c, rows, keep);
  if (m.total() <= device_bytes) return m;
  // The states move to the host first: their copies overlap the layers, a recompute costs a forward.
  const bool offload = gpu_training_memory(c, rows, keep, true).host <= host_bytes;
  std::vector<int64_t> order;  // the layers to keep first
  for (int64_t i = 0; i < L; ++i)
    if (!c.is_kda(i)) order.push_back(i);
  for (int64_t i = 0; i < L; ++i)
    if (c.is_kda(i)) order.push_back(i);
  keep.assign(size_t(L), false);
  m = gpu_training_memory(c, rows, keep, offload);
  const double G = 1073741824.0;
  LM_CHECK(m.total() <= device_bytes,
           "training at {} tokens needs {:.1f} GiB of device memory even recomputing every layer{} (parameters and "
           "optimiser {:.1f}, states {:.1f}, one layer's internals {:.1f}, backward scratch {:.1f}, workspace {:.1f}); "
           "the device has {:.1f} GiB",
           rows, m.total() / G,
           offload ? fmt::format(" and keeping {:.1f} GiB of states in host memory", m.host / G)
                   : fmt::format(" ({:.1f} GiB of states would not fit the {:.1f} GiB of pinned host memory)",
                                 gpu_training_memory(c, rows, keep, true).host / G, host_bytes / G),
           m.params / G, m.states / G, m.shared / G, m.scratch / G, (m.transient + m.workspace) / G, device_bytes / G);
  for (int64_t i : order) {
    keep[size_t(i)] = true;
    GpuTrainingMemory t = gpu_training_memory(c, rows, keep, offload);
    if (t.total() > device_bytes) {
      keep[size_t(i)] = false;
      continue;
    }
    m = std::move(t);
  }
  return m;
}

std::string gpu_training_summary(const GpuTrainingMemory& m, const ModelConfig& c) {
  const int64_t L = c.num_hidden_layers;
  std::string rec;
  for (int64_t i = 0; i < L; ++i)
    if (!m.keep[size_t(i)]) rec += fmt::format("{}{}", rec.empty() ? "" : ",", i);
  const double G = 1073741824.0;
  return fmt::format("memory plan at {} tokens: {} of {} layers keep their internals{}{}; predicted {:.1f} GiB "
                     "(parameters and AdamW {:.1f}, states {:.1f}, kept {:.1f}, recompute set {:.1f}, backward "
                     "scratch {:.1f}, transient {:.1f}, workspace {:.1f})",
                     m.rows, m.kept_layers, L, rec.empty() ? "" : fmt::format(", layers {} are recomputed", rec),
                     m.offload ? fmt::format(", {:.1f} GiB of input states wait in pinned host memory", m.host / G) : "",
                     m.total() / G, m.params / G, m.states / G, m.kept / G, m.shared / G, m.scratch / G,
                     m.transient / G, m.workspace / G);
}

std::string_view optimizer_name(Optimizer o) { return o == Optimizer::AdamW ? "adamw" : "muon"; }
std::string_view recompute_name(Recompute r) { return r == Recompute::None ? "none" : "full"; }

void ParallelPlan::validate(const ModelConfig& c) const {
  LM_CHECK(dp >= 1 && ep >= 1 && pp >= 1 && tp >= 1 && cp >= 1,
           "parallel plan: dp, ep, cp, pp, tp must be >= 1 (got {}, {}, {}, {}, {})", dp, ep, cp, pp, tp);
  LM_CHECK(seq_len % cp == 0, "parallel plan: cp = {} does not divide the sequence length {}", cp, seq_len);
  LM_CHECK(micro_batch >= 1 && seq_len >= 1, "parallel plan: micro-batch {} and sequence length {} must be >= 1",
           micro_batch, seq_len);
  LM_CHECK(pp <= c.num_hidden_layers, "parallel plan: pp = {} exceeds the {} layers", pp, c.num_hidden_layers);
  if (c.num_experts > 0) {
    LM_CHECK(c.num_experts % ep == 0, "parallel plan: ep = {} does not divide num_experts = {}", ep, c.num_experts);
    LM_CHECK((dp * cp * tp) % ep == 0, "parallel plan: ep = {} must divide dp x cp x tp = {} (expert groups are carved "
             "from the data-, context- and tensor-parallel ranks of a stage)", ep, dp * cp * tp);
  } else {
    LM_CHECK(ep == 1, "parallel plan: ep = {} but the model has no routed experts", ep);
  }
}

namespace {

// bf16 activations saved for backward per token, by layer, in bytes (no recomputation). The SPEC
// formulas name what is kept; norms keep their input, GLUs their gate/up outputs, attention its
// projections and the softmax log-sum-exp (flash-style, no T x T matrix), KDA its chunk-start states.
double activation_bytes_per_token(const ModelConfig& c, int64_t i) {
  const double d = static_cast<double>(c.hidden_size);
  double v = 4 * d;  // layer input, mixer-norm output, ffn input, ffn-norm output
  if (c.has_attn_res()) v += 2 * d;  // the two AttnRes read outputs (the sources are counted per stage)
  double bytes32 = 0;                // fp32 values
  if (c.is_kda(i)) {
    const double HK = static_cast<double>(c.kda_key_dim()), K = static_cast<double>(c.kda_head_dim),
                 H = static_cast<double>(c.kda_num_heads);
    v += 3 * HK + 3 * HK + K + HK + H + HK + HK + HK;  // q,k,v proj; conv out; f_a; g; beta; gate; o; gated o
    bytes32 += H * K * K / static_cast<double>(kKdaChunk);  // state at each chunk start
  } else {
    const double Hm = static_cast<double>(c.num_attention_heads), qk = static_cast<double>(c.mla_qk_head_dim()),
                 vh = static_cast<double>(c.v_head_dim), kvl = static_cast<double>(c.kv_lora_rank);
    if (c.q_lora_rank) v += 2 * static_cast<double>(*c.q_lora_rank);
    v += Hm * qk + static_cast<double>(c.mla_cache_dim()) + kvl + Hm * (qk + vh) + Hm * vh;
    if (c.mla_use_output_gate) v += 2 * Hm * vh;
    bytes32 += Hm;  // log-sum-exp
  }
  if (c.is_moe(i)) {
    const double w = static_cast<double>(c.expert_width()), I = static_cast<double>(c.moe_intermediate_size),
                 k = static_cast<double>(c.num_experts_per_token);
    bytes32 += static_cast<double>(c.num_experts);  // router scores
    v += k * (w + 3 * I);                            // dispatched inputs, gate/up, activation per chosen expert
    v += 3 * static_cast<double>(c.shared_intermediate_size());
    if (c.has_latent_moe()) {
      v += w + w;        // latent input z and the normed expert sum
      bytes32 += w;      // fp32 expert sum u
    }
  } else {
    v += 3 * static_cast<double>(c.intermediate_size);
  }
  return 2 * v + 4 * bytes32;
}

}  // namespace

TrainingMemory training_memory(const ModelConfig& c, const ParallelPlan& plan) {
  plan.validate(c);
  const ParamCounts pc = count_params(c);
  TrainingMemory best;
  const int64_t L = c.num_hidden_layers, P = plan.pp;
  const double tokens = static_cast<double>(plan.micro_batch) * static_cast<double>(plan.seq_len);
  const double dense_dp = static_cast<double>(plan.dp * plan.cp);                 // replicas of a dense shard
  const double expert_dp = static_cast<double>(plan.dp * plan.cp * plan.tp / plan.ep);  // of an expert shard
  const double state_bytes = plan.optimizer == Optimizer::AdamW ? 8.0 : 4.0;       // m,v  or  momentum
  int64_t first = 0;
  for (int64_t s = 0; s < P; ++s) {
    const int64_t n = L / P + (s < L % P ? 1 : 0);  // contiguous layers; early stages take the remainder
    double dense = 0, expert = 0, act_layer_sum = 0;
    for (int64_t i = first; i < first + n; ++i) {
      expert += static_cast<double>(pc.layer_routed[static_cast<size_t>(i)]);
      dense += static_cast<double>(pc.layer_total[static_cast<size_t>(i)] - pc.layer_routed[static_cast<size_t>(i)]);
      act_layer_sum += activation_bytes_per_token(c, i);
    }
    if (s == 0) dense += static_cast<double>(pc.embedding);
    if (s == P - 1) dense += static_cast<double>(pc.head);
    first += n;

    TrainingMemory m;
    m.plan = plan;
    m.stage = static_cast<int>(s);
    m.stage_layers = n;
    m.dense_params = dense / static_cast<double>(plan.tp);
    m.expert_params = expert / static_cast<double>(plan.ep);
    const double held = m.dense_params + m.expert_params;
    m.weight_bytes = 2.0 * held;
    m.grad_bytes = 4.0 * held;
    const double sharded = plan.zero1 ? m.dense_params / dense_dp + m.expert_params / expert_dp : held;
    m.master_bytes = 4.0 * sharded;
    m.optimizer_bytes = state_bytes * sharded;
    m.activation_bytes_per_token_layer = n > 0 ? act_layer_sum / static_cast<double>(n) : 0;
    // 1F1B: stage s holds up to (P - s) micro-batches in flight.
    const double in_flight = static_cast<double>(P - s);
    const double sources = c.has_attn_res() ? static_cast<double>(c.attn_res_max_sources()) * 2.0 *
                                                  static_cast<double>(c.hidden_size)
                                            : 0.0;
    double act;
    if (plan.recompute == Recompute::None) {
      act = in_flight * tokens * (act_layer_sum + sources);
    } else {
      // Keep only each layer's input (plus AttnRes sources); rebuild one layer at a time in backward.
      const double boundary = static_cast<double>(n) * 2.0 * static_cast<double>(c.hidden_size) + sources;
      act = in_flight * tokens * boundary + tokens * m.activation_bytes_per_token_layer;
    }
    m.activation_bytes = act / static_cast<double>(plan.tp * plan.cp);
    m.total_bytes = m.weight_bytes + m.grad_bytes + m.master_bytes + m.optimizer_bytes + m.activation_bytes;
    if (s == 0 || m.total_bytes > best.total_bytes) best = m;
  }

  auto& a = best.assumptions;
  a.push_back(fmt::format("{} GPU(s) = dp {} x cp {} x pp {} x tp {}; routed experts split over ep {} (ep groups "
                          "carved from dp x cp x tp), not tensor-split; dense weights split over tp and pp; each "
                          "sequence split over cp",
                          plan.gpus(), plan.dp, plan.cp, plan.pp, plan.tp, plan.ep));
  a.push_back("layers split contiguously over pipeline stages (earlier stages take the remainder); embedding on the "
              "first stage, final norm + lm_head on the last; the largest stage is reported");
  a.push_back(fmt::format("bf16 weights (2 B), fp32 gradients (4 B), fp32 master weights (4 B), {} state {} B/param; "
                          "{}",
                          optimizer_name(plan.optimizer), plan.optimizer == Optimizer::AdamW ? "m+v 8" : "momentum 4",
                          plan.zero1 ? "master + optimizer state sharded over each parameter's data-parallel replicas "
                                       "(ZeRO-1: dp*cp for dense, dp*cp*tp/ep for experts)"
                                     : "no optimizer-state sharding"));
  a.push_back(fmt::format("activations: bf16, micro-batch {} x {} tokens, 1F1B schedule (stage s keeps pp-s "
                          "micro-batches in flight), divided by tp (sequence parallel), flash-style attention (no "
                          "T x T), chunked cross-entropy (no [T, vocab] logits), recompute {}",
                          plan.micro_batch, plan.seq_len, recompute_name(plan.recompute)));
  a.push_back("not counted: communication buffers, allocator fragmentation, CUDA context, load imbalance of experts");
  return best;
}

TrainingTraffic training_traffic(const ModelConfig& c, const ParallelPlan& plan) {
  plan.validate(c);
  const ParamCounts pc = count_params(c);
  auto ring = [](double bytes, int64_t n) { return n > 1 ? bytes * double(n - 1) / double(n) : 0.0; };
  TrainingTraffic t;
  // Per GPU: its share of the model (the largest stage's, as training_memory reports it).
  const TrainingMemory m = training_memory(c, plan);
  const int64_t dense_rep = plan.dp * plan.cp, expert_rep = plan.dp * plan.cp * plan.tp / plan.ep;
  auto dp_bytes = [&](double params, int64_t rep) {
    return plan.zero1 ? ring(4.0 * params, rep) + ring(2.0 * params, rep) : 2.0 * ring(4.0 * params, rep);
  };
  t.dp = dp_bytes(m.dense_params, dense_rep) + dp_bytes(m.expert_params, expert_rep);
  const double tokens = double(plan.micro_batch) * double(plan.seq_len) / double(plan.cp);  // this rank's
  const double frac_layers = double(m.stage_layers) / double(c.num_hidden_layers);
  if (c.num_experts > 0 && plan.ep > 1) {
    const double l = double(c.expert_width()), k = double(c.num_experts_per_token);
    const double per_layer = 4.0 * tokens * k * l * 2.0 * double(plan.ep - 1) / double(plan.ep);
    t.ep = per_layer * double(c.num_moe_layers()) * frac_layers;
  }
  if (plan.cp > 1) {
    const double H = double(c.kda_num_heads), K = double(c.kda_head_dim);
    const double kda = 2.0 * double(plan.cp - 1) * 2.0 * H * K * K * 4.0 +  // transition + state, fwd and bwd
                       2.0 * 3.0 * 3.0 * double(c.kda_key_dim()) * 2.0;      // the conv halo (3 rows of q, k, v)
    const double mla = double(plan.cp - 1) * tokens * double(c.mla_cache_dim()) * (2.0 + 4.0);
    t.cp = (kda * double(c.num_kda_layers()) + mla * double(c.num_mla_layers())) * frac_layers;
  }
  if (plan.pp > 1) t.pp = 2.0 * tokens * double(c.hidden_size) * 2.0 / double(plan.tp);
  if (plan.tp > 1)
    t.tp = 2.0 * 2.0 * 2.0 * double(m.stage_layers) * ring(tokens * double(c.hidden_size) * 2.0, plan.tp);
  return t;
}

}  // namespace lm::model
