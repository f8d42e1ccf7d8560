// GpuModel::Impl's construction (gpu_model_impl.hpp): the streams and events of the KDA overlap and the expert
// offsets' copies, the flat parameter arrays and where each tensor lies in them (the fusion groups that one GEMM
// reads as a single matrix), the transposed expert weights, and the bytes of the kept activations.
//
// Legend: d hidden, L layers, P parameter elements; E experts, I expert width, l latent width; KDA H heads, K head
//         dim. Flat arrays [P]: decaying tensors [0, decay_end), other trainable ones [decay_end, train_end), then
//         the QB biases, each tensor 64-element aligned. Fusion groups (back to back, zero rows up to 16-byte rows):
//         KDA [q; k; v; f_a; b] [3·H·K + K + H -> kda_in_ld(), d], MoE [gate; 0; latent down; shared gate; shared up]
//         [moe_in_ld(), d], a dense FFN's [gate; up] [2I, d], the experts W13 [E, 2I, l] then W2 [E, l, I].
#ifdef LONGMOE_HAVE_CUDA

#include "model/cuda/gpu_model_impl.hpp"

#include <cstdlib>
#include <memory>

#include "core/env.hpp"
#include "model/cuda/glue_cuda.hpp"

namespace lm::model::cuda {

GpuModel::Impl::Impl(const ModelConfig& cfg, const std::function<bool(const ParamSpec&)>& decays, bool inference_only)
    : c(cfg), d(cfg.hidden_size), V(cfg.vocab_size), L(cfg.num_hidden_layers), infer_only(inference_only) {
  c.validate("model config");
  if (c.vision && c.vision->media_placeholder_token_id)
    placeholder = static_cast<int32_t>(*c.vision->media_placeholder_token_id);
  plan = StackPlan::build(c);
  LM_CHECK(available(), "no usable CUDA device");
  if (env::overlap()) {
    int least = 0, greatest = 0;
    ck(cudaDeviceGetStreamPriorityRange(&least, &greatest), "stream priorities");
    ck(cudaStreamCreateWithPriority(&core, cudaStreamNonBlocking, greatest), "cudaStreamCreate");
    ck(cudaEventCreateWithFlags(&fork_ev, cudaEventDisableTiming), "cudaEventCreate");
    ck(cudaEventCreateWithFlags(&join_ev, cudaEventDisableTiming), "cudaEventCreate");
    ck(cudaEventCreateWithFlags(&started, cudaEventDisableTiming), "cudaEventCreate");
  }
  specs = model_param_specs(c);  // (with the vision tower's when the config has one)
  layout(decays);
  if (infer_only) {
    size_t n = 0;
    for (const ParamSpec& s : specs)
      if (fp32_read(s)) small_off[s.name] = n, n += (size_t(s.numel()) + 63) / 64 * 64;
    ck(cudaMemset(small.ensure(std::max<size_t>(n, 1) * 4), 0, std::max<size_t>(n, 1) * 4), "memset");
  } else {
    master.ensure(P * 4), grad.ensure(P * 4);
    ck(cudaMemset(master.p, 0, P * 4), "memset"), ck(cudaMemset(grad.p, 0, P * 4), "memset");
  }
  wbf.ensure(P * 2);
  ck(cudaMemset(wbf.p, 0, P * 2), "memset");  // (the zero rows of the fused matrices stay zero)
  acts.resize(size_t(L));
  for (bool t : gpu_transient_states(c)) transient.push_back(t);
  size_t t = 0;
  wT_off.assign(L, 0);
  const size_t per = static_cast<size_t>(c.num_experts) * 3 * c.moe_intermediate_size * c.expert_width();
  for (int64_t i = 0; i < L; ++i)
    if (plan[i].moe()) wT_off[i] = t, t += per;
  if (t && !infer_only) wT.ensure(t * 2);
  offsets_h.resize(L);
  for (int64_t i = 0; i < L; ++i) {
    if (!plan[i].moe()) continue;
    ck(cudaMallocHost(reinterpret_cast<void**>(&offsets_h[i].p), sizeof(int32_t) * (c.num_experts + 1)),
       "cudaMallocHost");
    ck(cudaEventCreateWithFlags(&offsets_h[i].done, cudaEventDisableTiming), "cudaEventCreate");
    if (!side) {
      ck(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreate");
      ck(cudaEventCreateWithFlags(&permuted, cudaEventDisableTiming), "cudaEventCreate");
    }
  }
}
GpuModel::Impl::~Impl() {
  for (auto& o : offsets_h) {
    if (o.p) cudaFreeHost(o.p);
    if (o.done) cudaEventDestroy(o.done);
  }
  if (permuted) cudaEventDestroy(permuted);
  if (side) cudaStreamDestroy(side);
  for (cudaEvent_t e : {fork_ev, join_ev, started})
    if (e) cudaEventDestroy(e);
  if (core) cudaStreamDestroy(core);
}
GpuModel::Impl::StateRing::~StateRing() {
  if (xfer) cudaStreamSynchronize(xfer), cudaStreamDestroy(xfer);
  if (pin) cudaFreeHost(pin);
  for (cudaEvent_t e : {copied[0], copied[1], loaded[0], loaded[1], released[0], released[1], written})
    if (e) cudaEventDestroy(e);
}
// W13ᵀ, W2ᵀ of every MoE layer from the bf16 copy.
void GpuModel::Impl::refresh_transposed() {
  if (infer_only) return;  // (the backward's operands)
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, l = c.expert_width();
  for (int64_t i = 0; i < L; ++i) {
    if (!plan[i].moe()) continue;
    const std::string X = P_(i) + ".block_sparse_moe.experts.0.";
    uint16_t* t13 = as<uint16_t>(wT.p) + wT_off[i];
    transpose_bf16(W(X + "w1.weight"), t13, E, 2 * I, l);
    transpose_bf16(W(X + "w2.weight"), t13 + E * l * 2 * I, E, l, I);
  }
}

// Places every tensor: decaying ones first, then the other trainable ones, then the QB biases, so AdamW is
// two launches. Groups that one GEMM reads as a single matrix are placed back to back.
void GpuModel::Impl::layout(const std::function<bool(const ParamSpec&)>& decays) {
  std::map<std::string, const ParamSpec*> by_name;
  for (const auto& s : specs) by_name[s.name] = &s;
  auto decay_of = [&](const ParamSpec& s) { return decays ? decays(s) : s.shape.size() >= 2; };
  size_t cur = 0;
  auto align = [&] { cur = (cur + 63) / 64 * 64; };
  auto place = [&](const std::string& n) {
    const ParamSpec* s = by_name.at(n);
    slots[n] = Slot{cur, s->numel()};
    cur += static_cast<size_t>(s->numel());
  };
  auto placed = [&](const std::string& n) { return slots.count(n) != 0; };
  auto group_of = [&](const ParamSpec& s) { return !s.trainable ? 2 : decay_of(s) ? 0 : 1; };
  // Tensors that one GEMM reads as a single matrix, back to back: all in the optimizer group (pass) of the one
  // that triggered them, or a clear error.
  auto place_group = [&](const std::string& pre, std::initializer_list<const char*> members, const ParamSpec& by,
                         int grp) {
    for (const char* m : members) {
      const ParamSpec* ms = by_name.at(pre + m);
      LM_CHECK(group_of(*ms) == grp,
               "gpu model: {} needs the same optimizer group as {} (they are one matrix on the GPU)", ms->name,
               by.name);
      place(pre + m);
    }
  };
  auto ends_with = [](const std::string& s, const std::string& t) {
    return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
  };
  for (int pass = 0; pass < 3; ++pass) {
    for (const auto& s : specs) {
      const int grp = group_of(s);
      if (grp != pass || placed(s.name)) continue;
      align();
      if (s.component == Component::RoutedExpert) {
        // The whole layer: W13 [E, 2I, l] then W2 [E, l, I].
        auto w = [&](int64_t e, int j) {
          return fmt::format("model.layers.{}.block_sparse_moe.experts.{}.w{}.weight", s.layer, e, j);
        };
        for (int64_t e = 0; e < c.num_experts; ++e) place(w(e, 1)), place(w(e, 3));
        align();
        for (int64_t e = 0; e < c.num_experts; ++e) place(w(e, 2));
      } else if (moe_in_fused() && s.name.find(".block_sparse_moe.") != std::string::npos &&
                 (ends_with(s.name, ".block_sparse_moe.gate.weight") ||
                  ends_with(s.name, ".routed_expert_down_proj.weight") ||
                  ends_with(s.name, ".shared_experts.gate_proj.weight") ||
                  ends_with(s.name, ".shared_experts.up_proj.weight"))) {
        // The MoE layer's projections of yn, whichever comes first: router gate [E, d], latent down [l, d],
        // the shared expert's gate and up [2·Is, d] as one matrix (moe_in_*): the backward's input gradient is
        // one GEMM, the forward's bf16 products (all but the fp32 router logits) one more.
        const std::string pre = s.name.substr(0, s.name.find(".block_sparse_moe.") + 17);
        place_group(pre, {".gate.weight"}, s, grp);
        // zero rows after the router's E up to moe_in_epad(), so the gradient columns after it stay 16-byte
        // aligned (they stay zero: their input-gradient columns are zeroed, see moe_backward)
        cur += static_cast<size_t>((moe_in_epad() - c.num_experts) * d);
        place_group(pre, {".routed_expert_down_proj.weight", ".shared_experts.gate_proj.weight",
                          ".shared_experts.up_proj.weight"}, s, grp);
      } else if (ends_with(s.name, ".gate_proj.weight") && s.component != Component::Mla) {
        place(s.name);
        place(fmt::format("{}.up_proj.weight", std::string_view(s.name).substr(0, s.name.size() - 17)));
      } else if (s.component == Component::Kda &&
                 (ends_with(s.name, ".q_proj.weight") || ends_with(s.name, ".k_proj.weight") ||
                  ends_with(s.name, ".v_proj.weight") || ends_with(s.name, ".f_a_proj.weight") ||
                  ends_with(s.name, ".b_proj.weight"))) {
        // KDA's projections of xn that feed no norm, whichever comes first: one [3·H·K + K + H, d] matrix
        // (kda_in_weight; the gate's low-rank f_a and β ride along in one GEMM each way with q, k, v). (The
        // output gate g stays apart: read from these rows its gated norm ran slower than the GEMM gained.)
        const std::string pre = s.name.substr(0, s.name.rfind('.', s.name.size() - 8));
        place_group(pre, {".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".f_a_proj.weight", ".b_proj.weight"},
                    s, grp);
        // Zero rows up to kda_in_ld(), so the fused GEMMs run on multiples of 8 (N = 4748 took the slow
        // kernels). They stay zero: their output columns are never read and their input-gradient
        // columns are zeroed (so their weight gradients are 0 too).
        cur += static_cast<size_t>((kda_in_ld() - kda_in_cols()) * d);
      } else {
        place(s.name);
      }
    }
    align();
    if (pass == 0) decay_end = cur;
    if (pass == 1) train_end = cur;
  }
  P = cur;
}

size_t KdaActs::bytes() const {
  static_assert(sizeof(KdaActs) == 11 * sizeof(DBuf), "KdaActs::bytes lists every buffer");
  return bytes_of({&qkvp, &qc, &kc, &vc, &f, &gate_o, &ga, &o, &on, &orstd, &saved});
}
size_t MlaActs::bytes() const {
  static_assert(sizeof(MlaActs) == 14 * sizeof(DBuf), "MlaActs::bytes lists every buffer");
  return bytes_of({&q, &qa, &qan, &qa_rstd, &ckr, &cn, &c_rstd, &kv, &k, &v, &o, &lse, &graw, &og});
}
size_t FfnActs::bytes() const {
  static_assert(sizeof(FfnActs) == 2 * sizeof(DBuf), "FfnActs::bytes lists every buffer");
  return bytes_of({&ab, &h});
}
size_t MoeActs::bytes() const {
  static_assert(sizeof(MoeActs) == 17 * sizeof(DBuf) + sizeof(FfnActs), "MoeActs::bytes lists every buffer");
  return bytes_of({&logits, &topk_idx, &topk_w, &scores, &alpha, &zs, &z, &offsets, &prow, &ppos, &xs, &eab, &eh,
                   &eo, &u, &un, &u_rstd}) +
         shared.bytes();
}
size_t LayerActs::bytes() const {
  static_assert(sizeof(LayerActs) == sizeof(KdaActs) + sizeof(MlaActs) + sizeof(FfnActs) + sizeof(MoeActs) +
                                         8 * sizeof(DBuf),
                "LayerActs::bytes lists every buffer");
  return bytes_of({&xn, &yn, &rstd1, &rstd2, &pmid, &pout, &x_in, &y_in}) + kda.bytes() + mla.bytes() + mlp.bytes() +
         moe.bytes();
}
size_t StackActs::bytes() const {
  static_assert(sizeof(StackActs) == 4 * sizeof(DBuf), "StackActs::bytes lists every buffer");
  return bytes_of({&prefix, &h_final, &hn, &rstd_f});
}
size_t Scratch::bytes() const {
  static_assert(sizeof(Scratch) == 36 * sizeof(DBuf) + 4 * sizeof(std::vector<DBuf>),
                "Scratch::bytes lists every buffer");
  return bytes_of({&d_hn,  &rl_scale, &dnorm, &dx_in, &d_prefix, &dy_bf,  &dp,   &d_on,   &d_gate, &df,       &dA,
                   &ddt,   &d_ga,  &d_o,   &dq,       &dk,     &dv,   &d_og,   &d_g,    &dkv,      &dckr,
                   &dcn,   &dqan,  &dqa,   &ffn_dh,   &ffn_dab, &dun, &du,     &d_eo,   &d_topk_w, &e_dh,
                   &e_dab, &dxs,   &moe_dcat, &d_logits, &dz}) +
         bytes_of(d_block) + bytes_of(ar_delta) + bytes_of(ar_coef) + bytes_of(ar_q);
}
void GpuModel::Impl::release_activations() {
  ck(cudaDeviceSynchronize(), "sync");
  acts.clear();
  acts.resize(size_t(L));
  // (DBuf has no assignment: the members are rebuilt in place)
  std::destroy_at(&acts_shared), std::construct_at(&acts_shared);
  std::destroy_at(&top), std::construct_at(&top);
  std::destroy_at(&scratch), std::construct_at(&scratch);
  for (DBuf& b : ring.buf) std::destroy_at(&b), std::construct_at(&b);
  std::destroy_at(&vis), std::construct_at(&vis);
  kda_saved.clear();
  ++DBuf::epoch();
}
size_t GpuModel::Impl::act_bytes() const {
  size_t b = top.bytes() + scratch.bytes() + acts_shared.bytes() + bytes_of({&ring.buf[0], &ring.buf[1]});
  for (const LayerActs& a : acts) b += a.bytes();
  return b + vis.bytes() + bytes_of({&splice_pos, &splice_feat});
}

}  // namespace lm::model::cuda

#endif
