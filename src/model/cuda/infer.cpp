// Inference on the GPU (GpuModel::Impl, gpu_model_impl.hpp; the CPU engine is infer/session.cpp): the slot caches
// (InferState, laid out by each mixer's cache_spec), and the walk of stack.cpp run in prefill or decode mode, where
// the mixers continue from and update the caches (kda_mixer.cpp, mla.cpp); the LM head over the rows asked for.
//
// Legend: rows tokens of the call (prefill: n of one sequence; decode: S slots, one token each), d hidden,
//         V vocabulary, L layers; per slot the caches of model/cache.hpp (KDA "S" [H, K, K] and "conv" [3, HK, W-1]
//         fp32, MLA latent rows bf16 [max_tokens, R + Dr]).
#ifdef LONGMOE_HAVE_CUDA

#include "model/cuda/gpu_model_impl.hpp"

#include "ops/gemm/cuda/gemm_cuda.hpp"

namespace lm::model::cuda {

size_t InferState::bytes() const {
  return bytes_of(state) + bytes_of(conv) + bytes_of(latent) + bytes_of({&beta, &q_lat, &q_rope, &o_lat, &logits});
}

void GpuModel::Impl::reserve_caches(int64_t n_slots, int64_t max_tokens) {
  LM_CHECK(n_slots >= 1 && max_tokens >= 1, "gpu model: caches need at least one slot of one token (got {} x {})",
           n_slots, max_tokens);
  LM_CHECK(c.num_mla_layers() == 0 || (c.kv_lora_rank == 512 && c.qk_rope_head_dim == 64),
           "gpu model: inference needs kv_lora_rank 512 and qk_rope_head_dim 64 in MLA layers (the absorbed decode "
           "kernel's), this config has {} and {}", c.kv_lora_rank, c.qk_rope_head_dim);
  inf.state.clear(), inf.conv.clear(), inf.latent.clear();
  inf.state.resize(size_t(L)), inf.conv.resize(size_t(L)), inf.latent.resize(size_t(L));
  for (int64_t i = 0; i < L; ++i) {
    const CacheSpec spec = plan[i].kda() ? KdaMixer<float>::cache_spec(c) : GatedMla<float>::cache_spec(c);
    for (const CacheSpec::State& st : spec.states) {
      LM_CHECK(st.dtype == DType::F32, "gpu model: cache state '{}' must be fp32", st.name);
      DBuf& b = st.name == "S" ? inf.state[size_t(i)] : inf.conv[size_t(i)];
      LM_CHECK(st.name == "S" || st.name == "conv", "gpu model: unknown cache state '{}'", st.name);
      ck(cudaMemset(b.ensure(size_t(n_slots) * st.numel() * 4), 0, size_t(n_slots) * st.numel() * 4), "cache");
    }
    if (spec.row_width) {
      LM_CHECK(spec.row_dtype == DType::BF16, "gpu model: latent rows must be bf16");
      const size_t bytes = size_t(n_slots) * max_tokens * spec.row_width * 2;
      inf.latent[size_t(i)].ensure(bytes);
    }
  }
  inf.slots = n_slots, inf.max_tokens = max_tokens;
  inf.pos.assign(size_t(n_slots), 0);
}

std::vector<float> GpuModel::Impl::infer(const int32_t* ids, const Seqs& s, int64_t out_rows) {
  struct Off {  // the walk leaves inference mode however it ends
    InferState& f;
    ~Off() { f.mode = InferState::Mode::Off; }
  } off{inf};
  const bool was_training = training;
  training = false;
  forward(ids, nullptr, s);
  training = was_training;
  const int64_t n = rows;
  float* logits = grow<float>(inf.logits, size_t(out_rows) * V * 4);
  const auto* hn = as<uint16_t>(got(top.hn, "hn")) + (n - out_rows) * d;
  oc::linear_fwd(hn, W("lm_head.weight"), logits, DType::F32, out_rows, d, V);
  std::vector<float> h(size_t(out_rows) * V);
  ck(cudaMemcpy(h.data(), logits, h.size() * 4, cudaMemcpyDeviceToHost), "logits");
  return h;
}

// ---- the public API (gpu_model.hpp) ----------------------------------------------------------------
void GpuModel::reserve_caches(int64_t slots, int64_t max_tokens) { p_->reserve_caches(slots, max_tokens); }
int64_t GpuModel::cache_slots() const { return p_->inf.slots; }
int64_t GpuModel::slot_tokens(int64_t slot) const {
  LM_CHECK(slot >= 0 && slot < p_->inf.slots, "gpu model: slot {} outside [0, {})", slot, p_->inf.slots);
  return p_->inf.pos[size_t(slot)];
}
size_t GpuModel::cache_bytes() const { return p_->inf.bytes(); }

std::vector<float> GpuModel::prefill(int64_t slot, const int32_t* ids, int64_t n, std::vector<float>* all_logits) {
  Impl& m = *p_;
  InferState& f = m.inf;
  LM_CHECK(f.slots > 0, "gpu model: prefill before reserve_caches");
  LM_CHECK(slot >= 0 && slot < f.slots, "gpu model: prefill slot {} outside [0, {})", slot, f.slots);
  LM_CHECK(n >= 1, "gpu model: prefill of an empty prompt");
  LM_CHECK(n <= f.max_tokens, "gpu model: a prompt of {} tokens exceeds the cache of {} tokens per sequence", n,
           f.max_tokens);
  for (int64_t t = 0; t < n; ++t)
    LM_CHECK(ids[t] >= 0 && ids[t] < m.V, "gpu model: token id {} at prompt position {} is outside the vocabulary "
             "[0, {})", ids[t], t, m.V);
  m.profiling = profiling;
  f.mode = InferState::Mode::Prefill, f.first = slot, f.S = 1;
  f.pos[size_t(slot)] = 0;  // (dropped first: a walk that fails leaves an empty slot, never a half-written one)
  std::vector<float> lg = m.infer(ids, Seqs::batch(1, n), all_logits ? n : 1);
  f.pos[size_t(slot)] = n;
  if (!all_logits) return lg;
  *all_logits = std::move(lg);
  return std::vector<float>(all_logits->end() - m.V, all_logits->end());
}

std::vector<float> GpuModel::decode(int64_t first, int64_t S, const int32_t* ids) {
  Impl& m = *p_;
  InferState& f = m.inf;
  LM_CHECK(S >= 1 && first >= 0 && first + S <= f.slots, "gpu model: decode slots [{}, {}) outside [0, {})", first,
           first + S, f.slots);
  for (int64_t s = first; s < first + S; ++s) {
    LM_CHECK(f.pos[size_t(s)] > 0, "gpu model: decode of slot {}, which holds no sequence", s);
    LM_CHECK(f.pos[size_t(s)] < f.max_tokens, "gpu model: slot {} is full ({} tokens)", s, f.max_tokens);
  }
  for (int64_t s = 0; s < S; ++s)
    LM_CHECK(ids[s] >= 0 && ids[s] < m.V, "gpu model: token id {} of slot {} is outside the vocabulary [0, {})",
             ids[s], first + s, m.V);
  m.profiling = profiling;
  f.mode = InferState::Mode::Decode, f.first = first, f.S = S;
  std::vector<float> lg = m.infer(ids, Seqs::batch(S, 1), S);
  for (int64_t s = first; s < first + S; ++s) ++f.pos[size_t(s)];
  return lg;
}

void GpuModel::copy_slot(int64_t from, int64_t to) {
  InferState& f = p_->inf;
  LM_CHECK(from >= 0 && from < f.slots && to >= 0 && to < f.slots, "gpu model: copy_slot {} -> {} outside [0, {})",
           from, to, f.slots);
  if (from == to) return;
  auto copy = [&](const std::vector<DBuf>& bufs, size_t per_slot, size_t bytes) {
    for (const DBuf& b : bufs)
      if (b.p)
        ck(cudaMemcpyAsync(as<char>(b.p) + to * per_slot, as<char>(b.p) + from * per_slot, bytes,
                           cudaMemcpyDeviceToDevice, nullptr),
           "copy_slot");
  };
  auto per_slot = [&](const std::vector<DBuf>& bufs) {
    for (const DBuf& b : bufs)
      if (b.p) return b.bytes / size_t(f.slots);
    return size_t(0);
  };
  const size_t ps = per_slot(f.state), pc = per_slot(f.conv), pl = per_slot(f.latent);
  copy(f.state, ps, ps);
  copy(f.conv, pc, pc);
  copy(f.latent, pl, pl / size_t(f.max_tokens) * size_t(f.pos[size_t(from)]));  // the rows in use
  f.pos[size_t(to)] = f.pos[size_t(from)];
}

}  // namespace lm::model::cuda

#endif
