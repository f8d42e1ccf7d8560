// The stack on the GPU (GpuModel::Impl, gpu_model_impl.hpp; the CPU walk is model/model.cpp): the embedding, each
// layer's norm or fused AttnRes read + norm before its mixer (kda_mixer.cpp | mla.cpp) and its FFN (ffn.cpp |
// moe.cpp) as the stack plan (model/stack.hpp) wires them, the final read and norm; then the backward in reverse,
// with the AttnRes closed-block gradients (deferred and flushed per block group) and the embedding's gradient.
//
// Legend: rows tokens, d hidden, V vocabulary, L layers, RD4 = rows·d·4 bytes (one fp32 [rows, d] state).
//   AttnRes: prefix = embed(ids); layer i: xn = RMSNorm([Read_attn](closed ++ [state_in])) (rstd1);
//            pmid = [state_in +] mixer(xn); yn = RMSNorm(Read_mlp(closed ++ [pmid])) (rstd2); pout = pmid + ffn(yn);
//            hn = RMSNorm(Read_out(closed ++ [last pout])) (rstd_f)
//   plain:   h = prefix; x_in = h, xn = RMSNorm(x_in), h += mixer(xn); y_in = h, yn = RMSNorm(y_in), h += ffn(yn);
//            h_final = h, hn = RMSNorm(h_final)
//   backward scratch: d_prefix (the running state gradient), dnorm, dx_in fp32, dy_bf bf16, d_block[j] per closed
//            block, ar_delta/ar_coef/ar_q[r] per deferred read of a block group.
//   grad_ready: ready(L) after the top (LM head, final read and norm), ready(i) after layer i, ready(-1) at the end.
#ifdef LONGMOE_HAVE_CUDA

#include "model/cuda/gpu_model_impl.hpp"

#include <cstdlib>
#include <utility>

#include "core/env.hpp"
#include "model/cuda/glue_cuda.hpp"
#include "model/cuda/vision_glue_cuda.hpp"
#include "ops/embedding/cuda/embedding_cuda.hpp"
#include "ops/rmsnorm/cuda/rmsnorm_cuda.hpp"

namespace lm::model::cuda {

void GpuModel::Impl::mixer_forward(int64_t i, const void* xn, float* y, const float* base) {
  if (plan[i].kda()) {
    Timed t(part(Profile::Kda, false));
    kda_forward(i, xn, y, base);
  } else {
    Timed t(part(Profile::Mla, false));
    mla_forward(i, xn, y, base);
  }
}
void GpuModel::Impl::ffn_fwd(int64_t i, const void* yn, float* y, const float* base) {
  if (plan[i].moe()) {
    Timed t(part(Profile::Moe, false));
    moe_forward(i, yn, y, base);
  } else {
    Timed t(part(Profile::DenseFfn, false));
    ffn_forward(layer_acts(i).mlp, P_(i) + ".mlp", yn, rows, d, c.intermediate_size, y, base);
  }
}
void GpuModel::Impl::norm_fwd(const float* x, const std::string& w, DBuf& y, DBuf& rstd) {
  Timed t(part(Profile::Norm, false));
  oc::rmsnorm_forward(x, DType::F32, M(w), grow(y, size_t(rows) * d * 2), grow<float>(rstd, size_t(rows) * 4), rows, d,
                      eps());
}
// An AttnRes read over src with (w, g) and the RMSNorm (gain nw) that consumes it, fused: only the bf16 norm
// output and its rstd are stored (the backward rebuilds h from the sources).
void GpuModel::Impl::read_norm(const std::vector<const float*>& src, const std::string& w, const std::string& g,
                               const std::string& nw, DBuf& y, DBuf& rstd) {
  Timed t(part(Profile::AttnRes, false));
  oc::attnres_norm_forward(src.data(), static_cast<int64_t>(src.size()), rows, d, M(w), M(g), eps(), M(nw), eps(),
                           grow(y, size_t(rows) * d * 2), grow<float>(rstd, size_t(rows) * 4));
}
void GpuModel::Impl::copy(float* dst, const float* src) {
  ck(cudaMemcpyAsync(dst, src, size_t(rows) * d * 4, cudaMemcpyDeviceToDevice, walk()), "copy");
}

// blocks: the closed blocks so far (a block this layer opens is among them: its input state).
const float* GpuModel::Impl::layer_forward(int64_t i, const float* in, const std::vector<const float*>& blocks) {
  const LayerPlan& lp = plan[i];
  const std::string Pi = P_(i);
  LayerActs& la = layer_acts(i);
  const size_t RD4 = size_t(rows) * d * 4;
  auto with = [&](int64_t closed, const float* last) {
    std::vector<const float*> src(blocks.begin(), blocks.begin() + closed);
    src.push_back(last);
    return src;
  };
  if (lp.attn_closed == 0)
    norm_fwd(in, Pi + ".input_layernorm.weight", la.xn, la.rstd1);
  else
    read_norm(with(lp.attn_closed, in), Pi + ".self_attention_res_proj.weight", Pi + ".self_attention_res_norm.weight",
              Pi + ".input_layernorm.weight", la.xn, la.rstd1);
  float* mid = grow<float>(la.pmid, RD4);  // (never a block: only the FFN's read takes it)
  mixer_forward(i, got(la.xn, i, "xn"), mid, lp.opens_block ? nullptr : in);
  read_norm(with(lp.mlp_closed, mid), Pi + ".mlp_res_proj.weight", Pi + ".mlp_res_norm.weight",
            Pi + ".post_attention_layernorm.weight", la.yn, la.rstd2);
  // The output state is the next layer's input (and maybe a block): per layer, or through the ring when the next
  // layer alone reads it (offload); a recompute writes a copy aside.
  int r = -1;
  float* out = recomputing                                  ? grow<float>(acts_shared.pout, RD4)
               : ring_states() && i + 1 < L && transient[i + 1] ? ring_take(r)
                                                            : grow<float>(acts[size_t(i)].pout, RD4);
  ffn_fwd(i, got(la.yn, i, "yn"), out, mid);
  if (r >= 0 && training) ring_out(i + 1, r);
  return out;
}
// Training keeps the residual before each part for the backward (x_in per layer: the layer's input state; y_in with
// the layer's internals); without a backward the norms read the stream itself.
void GpuModel::Impl::layer_forward_plain(int64_t i, float* h) {
  const std::string Pi = P_(i);
  LayerActs& la = layer_acts(i);
  const size_t RD4 = size_t(rows) * d * 4;
  float* x_in = h;
  if (training && ring_states()) {
    int r = 0;
    copy(x_in = ring_take(r), h);
    ring_out(i, r);
  } else if (training && !recomputing) {
    copy(x_in = grow<float>(acts[size_t(i)].x_in, RD4), h);
  }
  norm_fwd(x_in, Pi + ".input_layernorm.weight", la.xn, la.rstd1);
  mixer_forward(i, got(la.xn, i, "xn"), h, h);
  float* y_in = h;
  if (training) copy(y_in = grow<float>(la.y_in, RD4), h);
  norm_fwd(y_in, Pi + ".post_attention_layernorm.weight", la.yn, la.rstd2);
  ffn_fwd(i, got(la.yn, i, "yn"), h, h);
}

// Returns the number of targets >= 0 (0 without targets).
int64_t GpuModel::Impl::forward(const int32_t* ids, const int32_t* targets, const Seqs& s) {
  rows = s.rows();
  LM_CHECK(rows > 0, "gpu model: empty batch");
  int64_t n_valid = 0;
  for (int64_t t = 0; t < rows; ++t) {
    LM_CHECK(ids[t] >= 0 && ids[t] < V, "gpu model: token id {} at position {} is outside the vocabulary [0, {})",
             ids[t], t, V);
    if (targets) {
      LM_CHECK(targets[t] < V, "gpu model: target {} at position {} is outside the vocabulary [0, {})", targets[t], t,
               V);
      n_valid += targets[t] >= 0;
    }
  }
  seqs = s;
  ids_h.assign(ids, ids + rows);
  if (inf.mode == InferState::Mode::Decode)  // ids from the pinned inputs of a decode step (a graph replays the copy)
    ck(cudaMemcpyAsync(ids_d.ensure(size_t(rows) * 4), ids, size_t(rows) * 4, cudaMemcpyHostToDevice, walk()), "ids");
  else
    ck(cudaMemcpy(ids_d.ensure(size_t(rows) * 4), ids, size_t(rows) * 4, cudaMemcpyHostToDevice), "ids");
  if (targets) {
    // A target naming the media placeholder carries no loss (Model::count_targets).
    std::vector<int32_t> masked;
    if (placeholder >= 0 && std::find(targets, targets + rows, placeholder) != targets + rows) {
      masked.assign(targets, targets + rows);
      for (int32_t& t : masked)
        if (t == placeholder) t = -1, --n_valid;
      targets = masked.data();
    }
    ck(cudaMemcpy(tgt_d.ensure(size_t(rows) * 4), targets, size_t(rows) * 4, cudaMemcpyHostToDevice), "targets");
  }
  const size_t RD4 = size_t(rows) * d * 4;
  ring.next = 0;
  if (training && offload) ring_reserve();
  float* prefix = grow<float>(top.prefix, RD4);
  {
    Timed t(part(Profile::Embedding, false));
    oc::embedding_forward(as<int32_t>(ids_d.p), rows, W("model.embed_tokens.weight"), d, prefix);
  }
  if (inf.mode != InferState::Mode::Decode) splice_forward(ids, prefix);  // (a decode step's ids hold no placeholder)
  if (plan.attn_res) {
    // Every state of the partial block sum has its own buffer (the embedding in top.prefix, then each layer
    // part's output: pmid after the mixer, pout after the FFN), written by the layer part's last GEMM as
    // state + product: no copies, and the closed blocks are the states themselves.
    std::vector<const float*> blocks;
    state_in.assign(L, nullptr);
    const float* cur = prefix;
    for (int64_t i = 0; i < L; ++i) {
      state_in[i] = cur;
      if (plan[i].opens_block) blocks.push_back(cur);
      cur = layer_forward(i, cur, blocks);
    }
    block_src = blocks;
    state_last = cur;
    std::vector<const float*> src(blocks.begin(), blocks.begin() + plan.out_closed);
    src.push_back(cur);
    read_norm(src, "model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight", "model.norm.weight",
              top.hn, top.rstd_f);
  } else {
    for (int64_t i = 0; i < L; ++i) layer_forward_plain(i, prefix);
    const float* h_final = prefix;
    if (training) copy(grow<float>(top.h_final, RD4), prefix), h_final = got<float>(top.h_final, "h_final");
    norm_fwd(h_final, "model.norm.weight", top.hn, top.rstd_f);
  }
  return n_valid;
}

// ---- backward ------------------------------------------------------------------------------
void GpuModel::Impl::norm_bwd(const float* x, const std::string& w, const float* rstd, const float* dy, float* dx) {
  Timed t(part(Profile::Norm, true));
  oc::rmsnorm_backward(x, DType::F32, M(w), rstd, dy, DType::F32, dx, DType::F32, G(w), rows, d, eps());
}
// Backward of read_norm from the norm output's gradient dy: adds into dsrc (the last one is also written to
// dyb as bf16, the upstream gradient of the layer part that produced the last source).
// defer (nullable): the closed sources' gradients are left to attnres_flush.
void GpuModel::Impl::read_norm_bwd(const std::vector<const float*>& src, const std::vector<float*>& dsrc,
                                   const std::string& w, const std::string& g, const std::string& nw,
                                   const float* rstd, const float* dy, void* dyb, const oc::AttnResDeferred* defer) {
  Timed t(part(Profile::AttnRes, true));
  oc::attnres_norm_backward(src.data(), static_cast<int64_t>(src.size()), rows, d, M(w), M(g), eps(), M(nw), eps(),
                            rstd, dy, dsrc.data(), G(w), G(g), G(nw), dyb, nullptr, defer);
}
// d(layer part) fp32 -> bf16 for the GEMMs.
const void* GpuModel::Impl::to_bf16(const float* x) {
  void* y = grow(scratch.dy_bf, size_t(rows) * d * 2);
  cast_f32_bf16(x, y, rows * d);
  return y;
}
// dyb: the bf16 gradient of the mixer's output.
void GpuModel::Impl::mixer_bwd(int64_t i, const void* dyb, float* dxn) {
  if (plan[i].kda()) {
    Timed t(part(Profile::Kda, true));
    kda_backward(i, dyb, dxn);
  } else {
    Timed t(part(Profile::Mla, true));
    mla_backward(i, dyb, dxn);
  }
}
void GpuModel::Impl::ffn_bwd(int64_t i, const void* dyb, float* dyn) {
  if (plan[i].moe()) {
    Timed t(part(Profile::Moe, true));
    moe_backward(i, dyb, dyn);
  } else {
    Timed t(part(Profile::DenseFfn, true));
    LayerActs& la = layer_acts(i);
    ffn_backward(la.mlp, i, "mlp", P_(i) + ".mlp", got(la.yn, i, "yn"), rows, d, c.intermediate_size, dyb, dyn, false);
  }
}

// A layer the memory plan does not keep: its forward again, from its kept input state, into the shared buffers.
// Its outputs are the first forward's (the same kernels on the same inputs): the output state goes aside, and the
// plain residual stream runs in a scratch copy.
void GpuModel::Impl::recompute(int64_t i, const float* in) {
  recomputing = true;
  const ClearOnExit leave{recomputing};
  if (plan.attn_res) {
    layer_forward(i, in, block_src);
  } else {
    float* h = grow<float>(acts_shared.x_in, size_t(rows) * d * 4);
    copy(h, in);
    layer_forward_plain(i, h);
  }
}

// ---- the ring of transient states (offload) ------------------------------------------------------------
void GpuModel::Impl::ring_reserve() {
  if (!ring.xfer) {
    ck(cudaStreamCreateWithFlags(&ring.xfer, cudaStreamNonBlocking), "cudaStreamCreate");
    for (cudaEvent_t* e : {&ring.copied[0], &ring.copied[1], &ring.loaded[0], &ring.loaded[1], &ring.released[0],
                           &ring.released[1], &ring.written})
      ck(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate");
  }
  ring.slot.assign(size_t(L), -1);
  int64_t n = 0;
  for (int64_t i = 0; i < L; ++i)
    if (transient[size_t(i)]) ring.slot[size_t(i)] = n++;
  const size_t need = size_t(n) * size_t(rows) * d * 4;
  if (ring.pin_bytes < need) {
    ck(cudaStreamSynchronize(ring.xfer), "sync");  // (the last step's copies)
    if (ring.pin) ck(cudaFreeHost(ring.pin), "cudaFreeHost");
    ring.pin = nullptr, ring.pin_bytes = 0;
    ck(cudaMallocHost(reinterpret_cast<void**>(&ring.pin), need),
       fmt::format("cudaMallocHost of {:.2f} GiB for the offloaded states", need / 1073741824.0).c_str());
    ring.pin_bytes = need;
  }
}
float* GpuModel::Impl::ring_take(int& r) {
  r = ring.next, ring.next ^= 1;
  if (training) ck(cudaStreamWaitEvent(walk(), ring.copied[r], 0), "wait");  // its last state is out
  return grow<float>(ring.buf[r], size_t(rows) * d * 4);
}
void GpuModel::Impl::ring_out(int64_t i, int r) {
  const size_t RD4 = size_t(rows) * d * 4;
  ck(cudaEventRecord(ring.written, walk()), "cudaEventRecord");
  ck(cudaStreamWaitEvent(ring.xfer, ring.written, 0), "wait");
  ck(cudaMemcpyAsync(ring.pin + size_t(ring.slot[size_t(i)]) * RD4, ring.buf[r].p, RD4, cudaMemcpyDeviceToHost,
                     ring.xfer),
     "offload");
  ck(cudaEventRecord(ring.copied[r], ring.xfer), "cudaEventRecord");
}
void GpuModel::Impl::ring_prefetch(int64_t below) {
  int64_t j = below - 1;
  while (j >= 0 && !transient[size_t(j)]) --j;
  if (j < 0) return;
  const int r = ring.next;
  ring.next ^= 1;
  const size_t RD4 = size_t(rows) * d * 4;
  ck(cudaStreamWaitEvent(ring.xfer, ring.released[r], 0), "wait");
  ck(cudaMemcpyAsync(grow<float>(ring.buf[r], RD4), ring.pin + size_t(ring.slot[size_t(j)]) * RD4, RD4,
                     cudaMemcpyHostToDevice, ring.xfer),
     "reload");
  ck(cudaEventRecord(ring.loaded[r], ring.xfer), "cudaEventRecord");
  ring.in_buf[size_t(j)] = r;
}
void GpuModel::Impl::ring_begin_backward() {
  if (!offload) return;
  // Both buffers are free once the forward queued so far is done with them; the topmost state comes first.
  for (cudaEvent_t e : ring.released) ck(cudaEventRecord(e, walk()), "cudaEventRecord");
  ring.in_buf.assign(size_t(L), -1);
  ring.next = 0;
  ring_prefetch(L);
}
const float* GpuModel::Impl::ring_load(int64_t i) {
  const int r = ring.in_buf[size_t(i)];
  LM_CHECK(r >= 0, "gpu model: layer {}'s offloaded input state was not brought back", i);
  ck(cudaStreamWaitEvent(walk(), ring.loaded[r], 0), "wait");
  ring_prefetch(i);
  return as<float>(ring.buf[r].p);
}
void GpuModel::Impl::ring_release(int64_t i) {
  if (offload && transient[size_t(i)]) ck(cudaEventRecord(ring.released[ring.in_buf[size_t(i)]], walk()), "record");
}

void GpuModel::Impl::backward(const float* d_hn) {
  const size_t RD4 = size_t(rows) * d * 4;
  float* dnorm = grow<float>(scratch.dnorm, RD4);
  float* dx_in = grow<float>(scratch.dx_in, RD4);
  float* d_prefix = grow<float>(scratch.d_prefix, RD4);
  void* dyb = grow(scratch.dy_bf, size_t(rows) * d * 2);  // (the buffer to_bf16 writes)
  ring_begin_backward();
  if (plan.attn_res) {
    ck(cudaMemsetAsync(d_prefix, 0, RD4, walk()), "memset");
    std::vector<float*> d_blocks;
    const auto nblocks = static_cast<int64_t>(block_src.size());
    if (scratch.d_block.size() < size_t(nblocks)) scratch.d_block.resize(size_t(nblocks));
    for (int64_t j = 0; j < nblocks; ++j) {
      float* db = grow<float>(scratch.d_block[j], RD4);
      ck(cudaMemsetAsync(db, 0, RD4, walk()), "memset");
      d_blocks.push_back(db);
    }
    // The first nb closed blocks and a last source, with their gradients (d_prefix for the last).
    std::vector<const float*> src;
    std::vector<float*> dsrc;
    auto sources = [&](int64_t nb, const float* last) {
      src.assign(block_src.begin(), block_src.begin() + nb);
      dsrc.assign(d_blocks.begin(), d_blocks.begin() + nb);
      src.push_back(last), dsrc.push_back(d_prefix);
    };
    // The reads of a block group share their closed blocks: each read stores its δ and coefficients
    // (deferred), and the group's closed-block gradients are updated once, before the block that opened the
    // group hands its gradient on (LONGMOE_ATTNRES_DEFER=0: every read updates them itself).
    static const bool defer_on = env::attnres_defer();
    const bool defer = defer_on && nblocks > 0 && oc::attnres_can_defer(nblocks + 1, d);
    std::vector<oc::AttnResDeferred> group;
    group.reserve(size_t(oc::kAttnResMaxFlushReads));  // (deferred() hands out pointers into it)
    auto flush = [&] {
      if (group.empty()) return;
      Timed t(part(Profile::AttnRes, true));
      oc::attnres_flush(block_src.data(), group[0].closed, rows, d, group.data(), int64_t(group.size()),
                        d_blocks.data());
      group.clear();
    };
    auto deferred = [&](int64_t nb) -> const oc::AttnResDeferred* {
      if (!defer || nb == 0) return nullptr;
      if (int64_t(group.size()) == oc::kAttnResMaxFlushReads) flush();  // (block groups of more than 31 layers)
      const size_t r = group.size();
      oc::AttnResDeferred a;
      a.closed = nb;
      if (scratch.ar_delta.size() <= r)
        scratch.ar_delta.resize(r + 1), scratch.ar_coef.resize(r + 1), scratch.ar_q.resize(r + 1);
      a.delta = grow(scratch.ar_delta[r], RD4 / 2);
      a.coef = grow<float>(scratch.ar_coef[r], size_t(rows) * nblocks * 16);
      a.q = grow<float>(scratch.ar_q[r], size_t(d) * 4);
      group.push_back(a);
      return &group.back();
    };
    sources(plan.out_closed, state_last);
    read_norm_bwd(src, dsrc, "model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight",
                  "model.norm.weight", got<float>(top.rstd_f, "rstd_f"), d_hn, dyb, deferred(plan.out_closed));
    ready(L);
    for (int64_t i = L - 1; i >= 0; --i) {
      const LayerPlan& lp = plan[i];
      const std::string Pi = P_(i);
      const int64_t nb_mlp = lp.mlp_closed, nb_attn = lp.attn_closed;
      if (offload && transient[size_t(i)]) state_in[size_t(i)] = ring_load(i);
      if (!keeps(i)) recompute(i, state_in[size_t(i)]);
      LayerActs& la = layer_acts(i);
      ffn_bwd(i, dyb, dnorm);  // dyb: bf16 of d_prefix, the gradient of this layer's output state
      sources(nb_mlp, got<float>(la.pmid, i, "pmid"));
      read_norm_bwd(src, dsrc, Pi + ".mlp_res_proj.weight", Pi + ".mlp_res_norm.weight",
                    Pi + ".post_attention_layernorm.weight", got<float>(la.rstd2, i, "rstd2"), dnorm, dyb,
                    deferred(nb_mlp));
      mixer_bwd(i, dyb, dnorm);
      if (lp.opens_block) {  // the block closed here was this layer's input state: its gradient is complete now
        flush();
        std::swap(d_prefix, d_blocks[nb_attn]);
      }
      if (nb_attn == 0) {
        norm_bwd(state_in[i], Pi + ".input_layernorm.weight", got<float>(la.rstd1, i, "rstd1"), dnorm, dx_in);
        add_f32(d_prefix, dx_in, rows * d);
        if (i > 0) cast_f32_bf16(d_prefix, dyb, rows * d);
      } else {
        sources(nb_attn, state_in[i]);
        read_norm_bwd(src, dsrc, Pi + ".self_attention_res_proj.weight", Pi + ".self_attention_res_norm.weight",
                      Pi + ".input_layernorm.weight", got<float>(la.rstd1, i, "rstd1"), dnorm, dyb,
                      deferred(nb_attn));
      }
      ring_release(i);
      ready(i);
    }
    flush();  // (layer 0 opens a block, so nothing is left here)
  } else {
    norm_bwd(got<float>(top.h_final, "h_final"), "model.norm.weight", got<float>(top.rstd_f, "rstd_f"), d_hn,
             d_prefix);
    ready(L);
    for (int64_t i = L - 1; i >= 0; --i) {
      const std::string Pi = P_(i);
      const float* x_in = offload ? ring_load(i) : got<float>(acts[size_t(i)].x_in, i, "x_in");
      if (!keeps(i)) recompute(i, x_in);
      LayerActs& la = layer_acts(i);
      ffn_bwd(i, to_bf16(d_prefix), dnorm);
      norm_bwd(got<float>(la.y_in, i, "y_in"), Pi + ".post_attention_layernorm.weight", got<float>(la.rstd2, i, "rstd2"),
               dnorm, dx_in);
      add_f32(d_prefix, dx_in, rows * d);
      mixer_bwd(i, to_bf16(d_prefix), dnorm);
      norm_bwd(x_in, Pi + ".input_layernorm.weight", got<float>(la.rstd1, i, "rstd1"), dnorm, dx_in);
      add_f32(d_prefix, dx_in, rows * d);
      ring_release(i);
      ready(i);
    }
  }
  if (splice_grad) {  // the placeholders' rows: their gradient into the tower, none into the embedding
    const auto Mf = static_cast<int64_t>(splice_pos_h.size());
    float* dfeat = grow<float>(vis.dfeat, size_t(Mf * d) * 4);
    splice_rows_backward(d_prefix, as<int32_t>(splice_pos.p), dfeat, Mf, d);
    vision_backward(dfeat);
  }
  {
    Timed t(part(Profile::Embedding, true));
    oc::embedding_backward(ids_h.data(), rows, d_prefix, V, d, G("model.embed_tokens.weight"));
  }
  ready(-1);
}

}  // namespace lm::model::cuda

#endif
