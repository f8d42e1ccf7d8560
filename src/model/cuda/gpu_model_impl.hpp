#pragma once
// Private to model/cuda/*.cpp (built with CUDA only): GpuModel::Impl, the device state of the decoder on one GPU
// (gpu_model.hpp), its device buffers (DBuf), the activations kept per layer (LayerActs with KdaActs, MlaActs,
// FfnActs, MoeActs), the walk's own buffers (StackActs), the backward's scratch shared across layers (Scratch),
// and small inline helpers. Impl's parts are defined beside the CPU layers they mirror:
//   layout.cpp     construction, streams and events, the parameter layout (fusion groups), the transposed experts
//   kda_mixer.cpp  the KDA mixer (model/kda_mixer.cpp)      mla.cpp  gated MLA (model/mla.cpp)
//   ffn.cpp        the dense GLU FFN and shared expert (model/ffn.cpp)   moe.cpp  the latent MoE (model/moe.cpp)
//   stack.cpp      the forward and backward walk over the stack plan (model/model.cpp, model/stack.hpp)
//   gpu_model.cpp  the public API
//
// Legend: rows tokens (n), d hidden, V vocabulary, L layers (wired by the stack plan, model/stack.hpp); KDA H heads,
//         K = V head dim, HK = H·K; MLA Hm heads, Dn/Dr/Dv head dims, Dq = Dn + Dr, Dkv = Dn + Dv, R kv_lora_rank,
//         Q q_lora_rank; MoE E experts, k per token, I expert width, l latent width, M = rows·k permuted rows,
//         Is shared expert width; P parameter elements of the flat arrays.
// dtypes: GEMM operands bf16 (weights: the bf16 copy of the fp32 master); GEMM outputs that feed reductions
// or the residual are fp32; the residual stream, AttnRes sources and their gradients fp32; gradients that
// feed a weight-gradient GEMM bf16; weight gradients accumulate in fp32.
// Activations: every buffer only grows (DBuf::ensure through grow(), at least 256 bytes) and is reused by the next
// step of the same shape; Scratch buffers of the same name serve every layer (and both mixers) of a backward.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "core/error.hpp"
#include "model/cuda/gpu_model.hpp"
#include "model/layers.hpp"
#include "ops/attention/cuda/attention_cuda.hpp"
#include "ops/attnres/cuda/attnres_cuda.hpp"
#include "ops/kda/cuda/kda_cuda.hpp"
#include "ops/kda/cuda/short_conv_cuda.hpp"

namespace lm::model::cuda {

namespace oc = lm::ops::cuda;
namespace kc = lm::kda::cuda;

inline constexpr cu::Checker ck{"gpu model"};

constexpr double kLoraEps = 1e-6;  // the MLA q_a / kv_a norms (as mla.cpp)

// Clears a flag however the scope ends (a training step's `training`, a recompute's `recomputing`).
struct ClearOnExit {
  bool& f;
  ~ClearOnExit() { f = false; }
};

// A device buffer that only grows (activations are reused between steps of the same shape).
struct DBuf {
  // Counts reallocations of any DBuf: a CUDA graph that captured buffer addresses is stale once it moves.
  static uint64_t& epoch() {
    static uint64_t e = 0;
    return e;
  }
  void* p = nullptr;
  size_t bytes = 0;
  DBuf() = default;
  DBuf(DBuf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr, o.bytes = 0; }  // (vectors of DBuf)
  DBuf(const DBuf&) = delete;
  DBuf& operator=(const DBuf&) = delete;
  ~DBuf() {
    if (p) cudaFree(p);
  }
  void* ensure(size_t n) {
    if (n > bytes) {
      ++epoch();
      if (p) ck(cudaFree(p), "cudaFree");
      p = nullptr;
      ck(cudaMalloc(&p, n), fmt::format("cudaMalloc of {:.1f} MiB", n / 1048576.0).c_str());
      bytes = n;
    }
    return p;
  }
};

template <class T = void>
T* as(void* p) {
  return static_cast<T*>(p);
}

// An activation or scratch buffer of at least `bytes` (and 256) bytes, grown if needed.
template <class T = void>
T* grow(DBuf& b, size_t bytes) {
  return static_cast<T*>(b.ensure(std::max<size_t>(bytes, 256)));
}
// A buffer the forward wrote; lm::Error naming its activation ("hn"; per layer "L3.qc", "L3.mlp.h") when there is
// none (no forward yet).
template <class T = void>
T* got(const DBuf& b, int64_t layer, std::string_view name, std::string_view sub = {}) {
  if (!b.p) {
    std::string key = layer >= 0 ? fmt::format("L{}.{}", layer, name) : std::string(name);
    if (!sub.empty()) key += fmt::format(".{}", sub);
    throw Error(fmt::format("gpu model: activation '{}' missing (no forward yet?)", key));
  }
  return static_cast<T*>(b.p);
}
template <class T = void>
T* got(const DBuf& b, std::string_view name) {
  return got<T>(b, -1, name);
}
inline size_t bytes_of(std::initializer_list<const DBuf*> bs) {
  size_t n = 0;
  for (const DBuf* b : bs) n += b->bytes;
  return n;
}
inline size_t bytes_of(const std::vector<DBuf>& bs) {
  size_t n = 0;
  for (const DBuf& b : bs) n += b.bytes;
  return n;
}

// ---- activations kept for the backward (bf16 unless noted; n = rows) --------------------------------------
// KDA layer (kda_mixer.cpp).
struct KdaActs {
  DBuf qkvp;        // [n, kda_in_ld()] q, k, v (before their convolutions), f_a and β_raw side by side
  DBuf qc, kc, vc;  // [n, HK] after the short convolutions (+ SiLU)
  DBuf f;           // [n, HK] the gate's raw input (x W_faᵀ) W_fbᵀ
  DBuf gate_o;      // [n, HK] the output gate
  DBuf ga;          // [n, K] the low-rank output gate's first product
  DBuf o, on;       // [n, HK] the operator's output, the gated norm's output
  DBuf orstd;       // fp32 [n, H] the gated norm's rstd
  DBuf saved;       // the operator's intra-chunk tensors and chunk-start states (kc::saved_bytes), when kept
  size_t bytes() const;
};
// Gated MLA layer (mla.cpp).
struct MlaActs {
  DBuf q;            // [n, Hm, Dq]
  DBuf qa;           // fp32 [n, Q] q_a product
  DBuf qan;          // [n, Q] its RMSNorm
  DBuf qa_rstd;      // fp32 [n]
  DBuf ckr;          // fp32 [n, R + Dr] = [c | k_r]
  DBuf cn;           // [n, R] RMSNorm(c)
  DBuf c_rstd;       // fp32 [n]
  DBuf kv;           // [n, Hm, Dkv]
  DBuf k, v;         // [n, Hm, Dq], [n, Hm, Dv]
  DBuf o;            // [n, Hm, Dv] attention output
  DBuf lse;          // fp32 [n, Hm]
  DBuf graw, og;     // [n, Hm, Dv] output gate logits, o ⊙ σ(graw)
  size_t bytes() const;
};
// GLU FFN (ffn.cpp): a layer's dense FFN ("L<i>.mlp") or an MoE layer's shared expert ("L<i>.shared").
struct FfnActs {
  DBuf ab;  // [n, 2I] gate/up product (not kept for the fused shared expert: its ab lies in MoeActs::zs)
  DBuf h;   // [n, I] GLU(ab)
  size_t bytes() const;
};
// Latent MoE layer (moe.cpp).
struct MoeActs {
  DBuf logits;         // fp32 [n, E]
  DBuf topk_idx;       // int32 [n, k]
  DBuf topk_w;         // fp32 [n, k]
  DBuf scores;         // fp32 [n, E] unbiased σ(logits) (Quantile Balancing)
  DBuf alpha;          // fp32 [n] admission cutoff (Quantile Balancing)
  DBuf zs;             // [n, l + 2·Is] fused: latent z and the shared expert's ab side by side
  DBuf z;              // [n, l] latent z (not fused)
  DBuf offsets;        // int32 [E + 1] expert row offsets
  DBuf prow, ppos;     // int32 [M] permuted row -> assignment, assignment -> permuted row
  DBuf xs;             // [M, l] gathered expert inputs
  DBuf eab;            // [M, 2I] expert gate/up products
  DBuf eh;             // [M, I] expert GLU outputs
  DBuf eo;             // [M, l] expert outputs
  DBuf u;              // [n, l] combined
  DBuf un;             // [n, l] RMSNorm_l(u)
  DBuf u_rstd;         // fp32 [n]
  FfnActs shared;      // the shared expert
  size_t bytes() const;
};
// One layer: its norm outputs and states, and its sublayers' activations (only its mixer's and FFN's are used).
struct LayerActs {
  DBuf xn, yn;        // [n, d] the mixer's and the FFN's normed inputs
  DBuf rstd1, rstd2;  // fp32 [n] their rstd
  DBuf pmid, pout;    // fp32 [n, d] AttnRes: the partial block sum after the mixer, after the FFN
  DBuf x_in, y_in;    // fp32 [n, d] plain residuals: h before the mixer, before the FFN
  KdaActs kda;
  MlaActs mla;
  FfnActs mlp;
  MoeActs moe;
  size_t bytes() const;
};
// The walk's own buffers (stack.cpp).
struct StackActs {
  DBuf prefix;   // fp32 [n, d] the embedding (plain residuals: the residual stream h)
  DBuf h_final;  // fp32 [n, d] plain residuals: h after the last layer
  DBuf hn;       // [n, d] the final norm's output (the LM head's input)
  DBuf rstd_f;   // fp32 [n]
  size_t bytes() const;
};
// The vision tower and projector (vision.cpp) of the last forward: the batch (host), its index arrays and the
// activations its backward reads (bf16 unless noted; L patches, M merged rows, G position-table rows).
struct VisionActs {
  VisionBatch b;
  struct Size {  // a distinct (h, w) of the batch: its position table at rows [off, off + h·w) of pos
    int64_t h = 0, w = 0, off = 0;
  };
  std::vector<Size> sizes;
  int64_t G = 0;
  // int32 index arrays in one buffer, at these element offsets (vision_glue_cuda.hpp): pos_row [L], frame [L],
  // merge first [M·S], frames [M], stride [M], unmerge cell [L], per-patch frames [L], grad start [G + 1], src [L]
  int64_t o_pos_row = 0, o_frame = 0, o_first = 0, o_mframes = 0, o_stride = 0, o_cell = 0, o_pframes = 0,
          o_start = 0, o_src = 0;
  bool clips = false;  // some media has t > 1 (the time table is added)
  DBuf idx, pixels, cs, pos, time;  // int32; [L, P]; fp32 [L, Dh] RoPE table; fp32 [G, D]; fp32 [frames, D]
  struct Block {
    DBuf x_in, x_mid;        // fp32 [L, D] the block's input, after the attention residual
    DBuf xn0, rstd0, xn1, rstd1;  // [L, D] norm outputs, fp32 [L] rstd
    DBuf qkv, o, lse;        // [L, 3Q] after RoPE, [L, Q], fp32 [L, H]
    DBuf a, g;               // fp32 [L, I] fc0's output, gelu_tanh(a)
  };
  std::vector<Block> blocks;
  DBuf x, y, rstd_f;         // fp32 [L, D] the last block's output, its final norm, fp32 [L]
  DBuf m, a0, g0, a2, rstd_p, feat;  // [M, mD], fp32 [M, mD], [M, mD], fp32 [M, d], fp32 [M], features [M, d]
  // the backward's scratch
  DBuf dfeat, da2, dg0, dm, dx, dxb, dy, dg, dxn, dout, dqkv, dpos;
  bool have = false;  // a forward ran since the weights' last backward
  size_t bytes() const;
};

// The backward's scratch, shared by every layer (one buffer per name, grown to the largest use).
struct Scratch {
  // the walk (stack.cpp), fp32 [n, d] unless noted
  DBuf d_hn;                   // the final norm output's gradient (from the LM head)
  DBuf rl_scale;               // fp32 [n] the cross-entropy backward's per-row scales (RL, weighted rows)
  DBuf dnorm, dx_in, d_prefix;
  DBuf dy_bf;                  // [n, d] bf16 of a layer part's output gradient
  std::vector<DBuf> d_block;   // per closed block, its gradient
  std::vector<DBuf> ar_delta;  // per deferred AttnRes read of a block group: δ [n, d] bf16,
  std::vector<DBuf> ar_coef;   //   the coefficients fp32 [n, 4 · blocks],
  std::vector<DBuf> ar_q;      //   q fp32 [d]
  // KDA (kda_mixer.cpp)
  DBuf dp;                 // [n, kda_in_ld()] the fused input projection's input gradients
  DBuf d_on;               // fp32 [n, HK]
  DBuf d_gate, df;         // [n, HK]
  DBuf dA, ddt;            // fp32 [H], [HK]
  DBuf d_ga;               // [n, K]
  // KDA and MLA
  DBuf d_o, dq, dk, dv;
  // MLA (mla.cpp)
  DBuf d_og;               // fp32 [n, Hm·Dv]
  DBuf d_g;                // [n, Hm·Dv]
  DBuf dkv, dckr;          // [n, Hm, Dkv], [n, R + Dr]
  DBuf dcn, dqan;          // fp32 [n, R], [n, Q]
  DBuf dqa;                // [n, Q]
  // GLU FFN (ffn.cpp): the dense FFN and the shared expert
  DBuf ffn_dh;             // fp32 [n, I]
  DBuf ffn_dab;            // [n, 2I]
  // MoE (moe.cpp)
  DBuf dun, du;            // fp32 [n, l]
  DBuf d_eo;               // [M, l]
  DBuf d_topk_w;           // fp32 [M]
  DBuf e_dh, e_dab, dxs;   // [M, I], [M, 2I], [M, l]
  DBuf moe_dcat;           // fused: [n, moe_in_ld()] the router, latent and shared input gradients side by side
  DBuf d_logits, dz;       // not fused: [n, E], [n, l]
  size_t bytes() const;
};

// Inference (infer.cpp): the per-sequence caches of `slots` sequences, laid out as each layer's cache_spec (the CPU
// layers' own description, model/cache.hpp): KDA state fp32 [slots, H, K, K] and conv inputs fp32 [slots, 3, HK, W-1],
// and the MLA latent rows bf16 in a paged pool per MLA layer [blocks, kBlock, R + Dr]. A block id names the same
// block in every MLA layer's pool; each slot lists its blocks (table_h, mirrored on the device in `table`), and a
// block may serve several slots (copy_slot shares them; refs counts the slots, and the first write into a shared
// block copies it). While `mode` is Prefill or Decode, the walk's mixers read and write the caches instead of
// keeping activations for a backward (kda_forward, mla_forward).
// The walk runs on `stream` (cu::StreamScope), so that a decode step can be captured into a CUDA graph and replayed:
// its inputs (ids, lengths) come from pinned host arrays and its logits go to one, all copied inside the graph.
struct InferState {
  enum class Mode { Off, Prefill, Decode };
  static constexpr int64_t kBlock = GpuModel::kCacheBlock;
  Mode mode = Mode::Off;
  int64_t slots = 0, max_tokens = 0;
  int64_t first = 0, S = 0;   // the slots of the call: prefill one (S = 1), decode [first, first + S)
  int64_t start = 0;          // prefill: tokens the slot already held (a continued sequence)
  std::vector<DBuf> state, conv, latent;  // [L] (only the buffers of the layer's own kind are allocated)
  std::vector<int64_t> pos;              // [slots] tokens cached
  // the paged latent pool
  int64_t blocks = 0, table_ld = 0;           // pool blocks; blocks per slot at most (ceil(max_tokens / kBlock))
  std::vector<std::vector<int32_t>> table_h;  // [slots] each slot's blocks
  std::vector<int32_t> refs, free_blocks;     // [blocks] slots holding each block; the unused ones
  DBuf table;                                 // int32 [slots, table_ld]
  // Snapshots: per snapshot the tokens it holds and its latent blocks (counted in refs like a slot's), and its
  // KDA states and conv inputs in pinned host memory, snap_bytes apiece (every layer's state, then its conv inputs).
  struct Snap {
    int64_t pos = 0;
    std::vector<int32_t> blocks;
  };
  std::vector<Snap> snaps;
  char* snap_pin = nullptr;
  size_t snap_bytes = 0;
  DBuf lens;                                  // int32 [slots] positions cached before a decode step
  int32_t *ids_pin = nullptr, *lens_pin = nullptr;  // pinned [slots]: a decode step's inputs
  float* logits_pin = nullptr;                      // pinned [slots, V]: its logits
  DBuf q_lat, o_lat, dec_ws;  // decode scratch: [S, Hm, R] each; the paged decode's workspace
  DBuf logits;                              // fp32 [rows, V]
  // A continued prefill's scratch (n chunk rows, nk <= 16384 cached keys at a time): the attention partials and
  // their merge, bf16 [n, Hm, Dv] + fp32 [n, Hm], fp32 [n, Hm, Dv] + [n, Hm]; a key block's latent rows cn bf16
  // [nk, R] and ckr fp32 [nk, R + Dr], kv [nk, Hm, Dkv], k [nk, Hm, Dq], v [nk, Hm, Dv]; KDA's initial state.
  struct Prefill {
    DBuf o_part, lse_part, o_acc, lse_acc, cn, ckr, kv, k, v, h0;
    size_t bytes() const;
  } pre;
  cudaStream_t stream = nullptr;
  // Decode graphs by (first, S), valid while no activation buffer has been reallocated since their capture.
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    uint64_t epoch = 0;
  };
  std::map<std::pair<int64_t, int64_t>, Graph> graphs;
  bool use_graphs = true;
  int64_t captures = 0;  // decode graphs captured so far
  std::string graph_nodes;  // the last one's nodes by kind
  size_t bytes() const;
  void drop_graphs();
  ~InferState();
  // A walk in prefill or decode mode leaves it however it ends.
  struct LeaveMode {
    InferState& f;
    ~LeaveMode() { f.mode = Mode::Off; }
  };
};

struct GpuModel::Impl {
  ModelConfig c;
  int64_t d, V, L;
  StackPlan plan;
  // ---- parameters (layout.cpp) ---------------------------------------------------------------------
  using Slot = ParamSlot;
  std::map<std::string, Slot> slots;
  std::vector<ParamSpec> specs;
  size_t P = 0;                     // elements (with alignment gaps)
  size_t decay_end = 0, train_end = 0;  // [0, decay_end) decays, [decay_end, train_end) trains without decay
  DBuf master, grad, wbf;           // fp32 [P], fp32 [P], bf16 [P] (the optimiser's moments: train/cuda/adamw.hpp)
  // Inference only (GpuModel::Inference): no master weights, gradients or transposed experts; the bf16 copy [P]
  // holds every tensor, and the ones read in fp32 (norm gains, convs, A_log, dt_bias, biases, AttnRes queries: all
  // but the GEMM and embedding matrices) also lie in `small`.
  bool infer_only = false;
  DBuf small;
  std::map<std::string, size_t> small_off;
  static bool fp32_read(const ParamSpec& s) { return !s.matmul && s.component != Component::Embedding; }
  // Transposed bf16 expert weights per MoE layer, W13ᵀ [E, l, 2I] then W2ᵀ [E, I, l], for the backward's
  // grouped products dxs = dab · W13_e and dh = d_eo · W2_e (refreshed with the bf16 copy).
  DBuf wT;
  std::vector<size_t> wT_off;  // per layer, elements into wT (MoE layers only)
  // ---- activations ---------------------------------------------------------------------------
  std::vector<LayerActs> acts;  // [L]
  // Without a backward to follow (inference, loss) every layer's internals share one set of buffers: activation
  // memory is one layer's, not L layers' (AttnRes's block states stay per layer, in acts).
  LayerActs acts_shared;
  // The memory plan (GpuModel::set_memory_plan): keep[i] says whether layer i's training forward keeps its internals
  // for the backward (acts[i]) or leaves them in acts_shared, to be rebuilt by a second forward of the layer just
  // before its backward (`recomputing`). The layer's input state stays either way (the AttnRes states pout, the
  // plain residual x_in), and the Quantile Balancing statistics (scores, alpha) stay per layer.
  std::vector<char> keep;  // [L] (empty: every layer keeps)
  bool recomputing = false;
  // The plan's offload (GpuModel::set_offload_states): the layers' transient input states (transient[i],
  // model::gpu_transient_states) pass through the two buffers of `ring` instead of one buffer per layer. A training
  // forward copies each out to pinned host memory on `xfer` as soon as it is written (the next layer reads it
  // meanwhile; the buffer is written again two transient states later, once its copy has landed), and the backward
  // brings each back into the other buffer while the layer above runs its backward. Without a backward (loss) they
  // only pass through. The copies are exact: the step's loss and gradients are those without offload.
  bool offload = false;
  std::vector<char> transient;  // [L]
  struct StateRing {
    DBuf buf[2];
    cudaEvent_t copied[2] = {}, loaded[2] = {}, released[2] = {}, written = nullptr;
    cudaStream_t xfer = nullptr;
    char* pin = nullptr;  // [transient layers, rows, d] fp32
    size_t pin_bytes = 0;
    std::vector<int64_t> slot;  // [L] index of layer i's state in pin (-1: not transient)
    std::vector<int> in_buf;    // [L] the backward: the buffer layer i's state was loaded into (-1: not yet)
    int next = 0;
    ~StateRing();
  } ring;
  bool ring_states() const { return offload && !recomputing; }
  // (stack.cpp)
  void ring_reserve();                // a training forward: the stream, events and pinned memory for `rows`
  float* ring_take(int& r);           // the next buffer for a transient state (training: once its last one is out)
  void ring_out(int64_t i, int r);    // training: copies layer i's input state, just written to buf[r], out
  void ring_begin_backward();         // the first state back in
  void ring_prefetch(int64_t below);  // the next transient state below layer `below` into the next buffer
  const float* ring_load(int64_t i);  // layer i's input state back on the device (and the next one on its way)
  void ring_release(int64_t i);       // after layer i's backward: its buffer may take the next state
  bool keeps(int64_t i) const { return keep.empty() || keep[size_t(i)]; }
  LayerActs& layer_acts(int64_t i) { return training && keeps(i) && !recomputing ? acts[size_t(i)] : acts_shared; }
  StackActs top;
  Scratch scratch;
  DBuf ids_d, tgt_d;
  std::vector<int32_t> ids_h;
  // Per MoE layer, the expert offsets of the last forward, copied to pinned host memory without stopping the
  // stream (read by expert_loads and by the cuBLAS weight-gradient fallback, long after the copy has landed).
  struct HostOffsets {
    int32_t* p = nullptr;
    cudaEvent_t done = nullptr;
  };
  std::vector<HostOffsets> offsets_h;
  // The copies of offsets_h run on `side` (non-blocking, so it never joins the default stream implicitly) after
  // `permuted`: the expert GEMMs do not queue behind a device-to-host copy.
  cudaStream_t side = nullptr;
  cudaEvent_t permuted = nullptr;
  // `core`: a high-priority stream for the KDA operator. GEMMs off its path (the output gate's projections, o_proj's
  // weight gradient) stay on the default stream, queued behind `started`, which the launch of the operator's
  // recurrence records as a programmatic event (it fires once the recurrence's blocks have begun; in H200 traces it
  // is observed when the recurrence ends): they never take SMs the recurrence's blocks need, and run beside the
  // rest of the operator (the last wave of the chunk backward), where the priority hands freed SMs to the core.
  // Queued before them, they took SMs first and stretched the reverse recurrence from 200 to ~330 us.
  // fork(): core waits for everything queued on the default stream; join(): the default stream waits for core.
  // Both within one KDA layer, so no scratch buffer is reused across them. LONGMOE_OVERLAP=0: one stream.
  cudaStream_t core = nullptr;
  // The stream the walk runs on: the legacy default stream, or inference's (InferState::stream, cu::StreamScope).
  static cudaStream_t walk() { return cu::stream(nullptr); }
  cudaEvent_t fork_ev = nullptr, join_ev = nullptr, started = nullptr;
  void after_start() {
    if (core) ck(cudaStreamWaitEvent(walk(), started, 0), "wait");
  }
  void fork() {
    if (!core) return;
    ck(cudaEventRecord(fork_ev, walk()), "cudaEventRecord");
    ck(cudaStreamWaitEvent(core, fork_ev, 0), "wait");
  }
  void join() {
    if (!core) return;
    ck(cudaEventRecord(join_ev, core), "cudaEventRecord");
    ck(cudaStreamWaitEvent(walk(), join_ev, 0), "wait");
  }
  int64_t rows = 0;
  Seqs seqs;
  // AttnRes states of the last forward (buffers in `acts` and `top`): each layer's input state, the closed blocks,
  // and the state after the last layer.
  std::vector<const float*> state_in, block_src;
  const float* state_last = nullptr;
  Profile* prof = nullptr;
  bool profiling = false;
  // Training (forward then backward; layer_acts, saves): each KDA layer's operator leaves its intra-chunk tensors and
  // chunk-start states in kda_saved[i] (its layer_acts' kda.saved) for the backward, which then skips recomputing
  // them. LONGMOE_KDA_SAVE=0 recomputes them instead (about 0.43 GB less per KDA layer at 16K tokens).
  bool training = false;
  std::vector<void*> kda_saved;
  InferState inf;
  // The splice (SPEC §9): what the media placeholders of the next forward take, set around it by the caller: the
  // tower's features of `media` (training steps and losses; the backward continues into the tower), or feature rows
  // computed before (inference: once per image, host fp32 [n_rows, d]). `placeholder` is -1 without a tower.
  struct SpliceIn {
    const Media<float>* media = nullptr;
    const float* rows = nullptr;
    int64_t n_rows = 0;
  };
  SpliceIn splice_in;
  struct SpliceScope {  // splice_in for the calls inside one public entry point, however it ends
    Impl& m;
    SpliceScope(Impl& im, SpliceIn in) : m(im) { m.splice_in = in; }
    ~SpliceScope() { m.splice_in = {}; }
  };
  int32_t placeholder = -1;
  std::vector<int32_t> splice_pos_h;  // the last forward's placeholder rows
  DBuf splice_pos, splice_feat;       // int32 [Mf], fp32 [Mf, d] (inference rows)
  bool splice_grad = false;           // the last forward spliced the tower's features (its backward runs)
  VisionActs vis;

  // GpuModel::set_grad_ready's hook: ready(stage) once the backward has queued that stage's gradient writes.
  std::function<void(int64_t)> grad_ready;
  void ready(int64_t stage) const {
    if (grad_ready) grad_ready(stage);
  }

  // layout.cpp
  Impl(const ModelConfig& cfg, const std::function<bool(const ParamSpec&)>& decays, bool inference_only);
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  void refresh_transposed();  // W13ᵀ, W2ᵀ of every MoE layer from the bf16 copy
  void layout(const std::function<bool(const ParamSpec&)>& decays);
  size_t act_bytes() const;  // every activation and scratch buffer now allocated
  // Frees every activation and scratch buffer (a new memory plan: buffers only grow, so the last plan's would
  // stay next to the new one's).
  void release_activations();

  // ---- parameter pointers ----------------------------------------------------------------------
  const Slot& slot(const std::string& n) const {
    auto it = slots.find(n);
    LM_CHECK(it != slots.end(), "gpu model: no parameter '{}'", n);
    return it->second;
  }
  bool has(const std::string& n) const { return slots.count(n) != 0; }
  float* M(const std::string& n) const {
    if (!infer_only) return as<float>(master.p) + slot(n).off;
    auto it = small_off.find(n);
    LM_CHECK(it != small_off.end(), "gpu model: '{}' has no fp32 copy in an inference-only model", n);
    return as<float>(small.p) + it->second;
  }
  float* G(const std::string& n) const {
    LM_CHECK(!infer_only, "gpu model: an inference-only model has no gradients ('{}')", n);
    return as<float>(grad.p) + slot(n).off;
  }
  void* W(const std::string& n) const { return as<uint16_t>(wbf.p) + slot(n).off; }
  // KDA layer i's q, k, v, f_a and β projections as one [3·H·K + K + H, d] matrix (layout() places them back to
  // back, then zero rows up to kda_in_ld()); its output and input-gradient rows are kda_in_ld() wide.
  void* kda_in_weight(int64_t i) const { return W(P_(i) + ".self_attn.q_proj.weight"); }
  // MoE layers with a latent projection and a shared expert: router gate, latent down and the shared expert's
  // gate/up projections side by side (layout()). moe_in_bf16(): the columns of the bf16 forward product (latent z,
  // then the shared ab) = its row stride; moe_in_ld(): the input-gradient rows [d_logits | dz | dab_shared].
  bool moe_in_fused() const {
    return c.num_experts > 0 && c.has_latent_moe() && c.num_shared_experts > 0 && c.expert_width() % 8 == 0 &&
           c.shared_intermediate_size() % 4 == 0;
  }
  int64_t moe_in_epad() const { return (c.num_experts + 7) / 8 * 8; }  // the router's rows, then zero rows
  int64_t moe_in_bf16() const { return c.expert_width() + 2 * c.shared_intermediate_size(); }
  int64_t moe_in_ld() const { return moe_in_epad() + moe_in_bf16(); }
  int64_t kda_in_cols() const { return 3 * c.kda_num_heads * c.kda_head_dim + c.kda_head_dim + c.kda_num_heads; }
  int64_t kda_in_ld() const { return (kda_in_cols() + 7) / 8 * 8; }  // 16-byte rows

  // ---- timing --------------------------------------------------------------------------------
  // Synchronised wall time of a scope added to *acc (profiling only: acc is null otherwise).
  struct Timed {
    double* acc;
    std::chrono::steady_clock::time_point t0;
    explicit Timed(double* a) : acc(a) {
      if (!acc) return;
      ck(cudaDeviceSynchronize(), "sync");
      t0 = std::chrono::steady_clock::now();
    }
    ~Timed() {
      if (!acc) return;
      cudaDeviceSynchronize();
      *acc += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  };
  // A layer kind's forward or backward slot of `prof`, and finer sections inside a layer ("kda.core.bwd", ...).
  std::map<std::string, double> detail;
  double* part(int kind, bool bwd) {
    return profiling && prof ? (bwd ? &prof->bwd[kind] : &prof->fwd[kind]) : nullptr;
  }
  double* section(const char* name) { return profiling ? &detail[name] : nullptr; }

  float eps() const { return static_cast<float>(c.rms_norm_eps); }
  std::string P_(int64_t i) const { return fmt::format("model.layers.{}", i); }

  // ---- KDA mixer (kda_mixer.cpp) --------------------------------------------------------------------
  kc::Problem kda_problem() const;
  kc::ConvShape conv_shape(int64_t C, int64_t ldx = 0) const;
  // y [rows, d] fp32 = base + mixer(xn) (base null: y = mixer(xn); base == y: in place). In inference (inf.mode)
  // the short convs and the state continue from the slot caches and leave them updated.
  void kda_forward(int64_t i, const void* xn, float* y, const float* base);
  // dxn [rows, d] fp32 written from dy bf16 [rows, d].
  void kda_backward(int64_t i, const void* dy, float* dxn);

  // ---- gated MLA (mla.cpp) -------------------------------------------------------------------------
  oc::AttnShape attn_shape() const;
  // In inference: prefill also writes the latent rows; decode appends each slot's row and attends in the absorbed
  // form over its latent cache (mla_decode_step).
  void mla_forward(int64_t i, const void* xn, float* y, const float* base);
  void mla_decode_step(int64_t i, const void* q, const void* cn, const float* ckr, void* o);
  void mla_prefill_attend(int64_t i, const void* q, const void* k, const void* v, void* o);
  void mla_backward(int64_t i, const void* dy, float* dxn);

  // ---- GLU FFN (ffn.cpp): a's activation names are "L<i>.<key>.ab", "L<i>.<key>.h" ---------------
  ops::GluParams glu() const;
  // Dense GLU FFN under `prefix` (gate_proj and up_proj adjacent: one [2I, din] weight) over x [n, din] bf16.
  // y = base + ffn(x) (base null: y = ffn(x); base == y: in place).
  void ffn_forward(FfnActs& a, const std::string& prefix, const void* x, int64_t n, int64_t din, int64_t I, float* y,
                   const float* base);
  // The FFN after its gate/up product ab [n, 2I] (row stride ldab): y = base + down(GLU(ab)), h kept in a.h.
  void ffn_down_forward(FfnActs& a, const std::string& prefix, const void* ab, int64_t ldab, int64_t n, int64_t din,
                        int64_t I, float* y, const float* base);
  // Rows per piece of the FFN backward (its fp32 dh and dab scratch are [ffn_rows, ·]; GpuModel::ffn_rows).
  int64_t ffn_rows = kGpuFfnRows;
  void ffn_down_piece(const std::string& prefix, const void* h, const void* ab, int64_t ldab, int64_t r, int64_t m,
                      int64_t din, int64_t I, const void* dy, void* dab, int64_t lddab);
  // Its backward down to the gate/up product's gradient dab [n, 2I] (row stride lddab), ffn_rows rows at a time.
  void ffn_down_backward(const FfnActs& a, int64_t i, const char* key, const std::string& prefix, const void* ab,
                         int64_t ldab, int64_t n, int64_t din, int64_t I, const void* dy, void* dab, int64_t lddab);
  void ffn_backward(const FfnActs& a, int64_t i, const char* key, const std::string& prefix, const void* x, int64_t n,
                    int64_t din, int64_t I, const void* dy, float* dx, bool accumulate_dx);

  // ---- latent MoE (moe.cpp) ------------------------------------------------------------------------
  // y [rows, d] fp32 = base + moe(yn) (base == y: in place).
  void moe_forward(int64_t i, const void* yn, float* y, const float* base);
  void moe_backward(int64_t i, const void* dy, float* dyn);

  // ---- the vision tower (vision.cpp) ---------------------------------------------------------------
  // The tower and projector over `media` (SPEC §9): features bf16 [M, d] in vis.feat (M in *rows); keeps what
  // vision_backward reads. lm::Error for grids the config refuses.
  const void* vision_forward(const Media<float>& media, int64_t* rows);
  // From dfeat fp32 [M, d] of the last vision_forward: every tower and projector weight's gradient accumulated.
  void vision_backward(const float* dfeat);
  // The embedding rows of the placeholders in ids [rows] replaced (splice_in; checks the counts) before the walk.
  void splice_forward(const int32_t* ids, float* prefix);

  // ---- the stack (stack.cpp) -----------------------------------------------------------------------
  void mixer_forward(int64_t i, const void* xn, float* y, const float* base);
  void ffn_fwd(int64_t i, const void* yn, float* y, const float* base);
  void norm_fwd(const float* x, const std::string& w, DBuf& y, DBuf& rstd);
  void read_norm(const std::vector<const float*>& src, const std::string& w, const std::string& g,
                 const std::string& nw, DBuf& y, DBuf& rstd);
  void copy(float* dst, const float* src);
  // Layer i's forward from its input state `in` over the closed blocks `blocks` (AttnRes; the first lp.*_closed of
  // them are read): returns its output state. Plain residuals: h [rows, d] fp32 updated in place.
  const float* layer_forward(int64_t i, const float* in, const std::vector<const float*>& blocks);
  void layer_forward_plain(int64_t i, float* h);
  // Returns the number of targets >= 0 (0 without targets).
  int64_t forward(const int32_t* ids, const int32_t* targets, const Seqs& s);
  void norm_bwd(const float* x, const std::string& w, const float* rstd, const float* dy, float* dx);
  void read_norm_bwd(const std::vector<const float*>& src, const std::vector<float*>& dsrc, const std::string& w,
                     const std::string& g, const std::string& nw, const float* rstd, const float* dy, void* dyb,
                     const oc::AttnResDeferred* defer = nullptr);
  const void* to_bf16(const float* x);
  void mixer_bwd(int64_t i, const void* dyb, float* dxn);
  void ffn_bwd(int64_t i, const void* dyb, float* dyn);
  void recompute(int64_t i, const float* in);  // in: layer i's input state
  void backward(const float* d_hn);

  // ---- inference (infer.cpp) --------------------------------------------------------------------------
  void reserve_caches(int64_t slots, int64_t max_tokens, int64_t pool_tokens);
  // (features: the rows of the prompt's media placeholders, their count checked)
  void check_prompt(const char* what, int64_t slot, const int32_t* ids, int64_t n, int64_t chunk,
                    std::span<const float> features = {}) const;
  std::vector<float> prefill_chunks(int64_t slot, const int32_t* ids, int64_t n, int64_t chunk,
                                    std::vector<float>* all_logits, const float* features = nullptr);
  // Runs the walk over `rows` tokens in inference mode and returns the logits of the last `out_rows` rows.
  std::vector<float> infer(const int32_t* ids, const Seqs& s, int64_t out_rows);
  // The decode walk of slots [first, first + S) with its inputs in ids_pin / lens_pin, up to the logits in
  // logits_pin (not synchronised): eager, or captured into inf.graphs and replayed.
  void decode_walk(int64_t first, int64_t S);
  void decode_walk_eager(int64_t first, int64_t S);
  // The latent blocks of `slot` cover positions [0, upto), and the block holding position `from` (and later) is
  // the slot's own (copied first when shared); lm::Error when the pool has no free block left.
  void claim_blocks(int64_t slot, int64_t from, int64_t upto);
  int64_t fresh_blocks(int64_t slot, int64_t from, int64_t upto) const;  // the pool blocks that claim would take
  void release_blocks(int64_t slot) { release_blocks(inf.table_h[size_t(slot)]); }
  void release_blocks(std::vector<int32_t>& blocks);  // (emptied)
  // `slot` (what it held dropped) holds `pos` tokens in `blocks`, shared with their other holders.
  void share_blocks(int64_t slot, const std::vector<int32_t>& blocks, int64_t pos);
  // Each per-slot cache buffer (KDA states, then conv inputs) with its bytes per slot.
  template <class F>
  void for_each_slot_cache(F&& f) const {
    for (const std::vector<DBuf>* bufs : {&inf.state, &inf.conv})
      for (const DBuf& b : *bufs)
        if (b.p) f(b, b.bytes / size_t(inf.slots));
  }
};

}  // namespace lm::model::cuda
