// The decoder on one GPU (gpu_model.hpp): the walk of model.cpp and the sublayers of kda_mixer.cpp, mla.cpp,
// ffn.cpp and moe.cpp, with device buffers and the CUDA kernels of ops/*/cuda.
//
// Legend: rows tokens, d hidden, V vocabulary, L layers (wired by the stack plan, model/stack.hpp); KDA H heads, K = V head dim,
//         HK = H·K; MLA Hm heads, Dn/Dr/Dv head dims, Dq = Dn + Dr, Dkv = Dn + Dv, R kv_lora_rank, Q q_lora_rank;
//         MoE E experts, k per token, I expert width, l latent width, M = rows·k permuted rows.
// dtypes: GEMM operands bf16 (weights: the bf16 copy of the fp32 master); GEMM outputs that feed reductions
// or the residual are fp32; the residual stream, AttnRes sources and their gradients fp32; gradients that
// feed a weight-gradient GEMM bf16; weight gradients accumulate in fp32.
#include "model/cuda/gpu_model.hpp"

#include "core/error.hpp"

#ifndef LONGMOE_HAVE_CUDA

namespace lm::model::cuda {
bool available() { return false; }
bool built_with_cuda() { return false; }
struct GpuModel::Impl {};
[[noreturn]] static void no_cuda() { throw Error("longmoe was built without CUDA (nvcc was not found at build time)"); }
GpuModel::GpuModel(const ModelConfig&, std::function<bool(const ParamSpec&)>) { no_cuda(); }
GpuModel::~GpuModel() = default;
const ModelConfig& GpuModel::config() const { no_cuda(); }
int64_t GpuModel::num_params() const { no_cuda(); }
size_t GpuModel::device_bytes() const { no_cuda(); }
void GpuModel::upload(const ParamStore<float>&) { no_cuda(); }
void GpuModel::download(ParamStore<float>&) const { no_cuda(); }
void GpuModel::download_grads(ParamStore<float>&) const { no_cuda(); }
void GpuModel::zero_grads() { no_cuda(); }
GpuModel::LossStats GpuModel::forward_backward(const int32_t*, const int32_t*, const Seqs&, int64_t) { no_cuda(); }
GpuModel::LossStats GpuModel::loss(const int32_t*, const int32_t*, const Seqs&) { no_cuda(); }
void GpuModel::adamw(const AdamWStep&) { no_cuda(); }
void GpuModel::balance() { no_cuda(); }
double GpuModel::grad_norm() const { no_cuda(); }
void GpuModel::get_adam(const std::string&, float*, float*) const { no_cuda(); }
void GpuModel::set_adam(const std::string&, const float*, const float*) { no_cuda(); }
std::vector<int64_t> GpuModel::expert_loads(int64_t) const { no_cuda(); }
std::vector<float> GpuModel::final_hidden() const { no_cuda(); }
std::vector<std::pair<std::string, double>> GpuModel::detail_profile() const { no_cuda(); }
}  // namespace lm::model::cuda

#else

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/half.hpp"
#include "model/cuda/glue_cuda.hpp"
#include "ops/attention/cuda/attention_cuda.hpp"
#include "ops/attnres/cuda/attnres_cuda.hpp"
#include "ops/cross_entropy/cuda/cross_entropy_cuda.hpp"
#include "ops/embedding/cuda/embedding_cuda.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"
#include "ops/glu/cuda/glu_cuda.hpp"
#include "ops/kda/cuda/kda_cuda.hpp"
#include "ops/kda/cuda/short_conv_cuda.hpp"
#include "ops/moe/cuda/moe_cuda.hpp"
#include "ops/rmsnorm/cuda/rmsnorm_cuda.hpp"

namespace lm::model::cuda {

namespace oc = lm::ops::cuda;
namespace kc = lm::kda::cuda;

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(fmt::format("gpu model: {}: {}", what, cudaGetErrorString(e)));
}

constexpr double kLoraEps = 1e-6;  // the MLA q_a / kv_a norms (as mla.cpp)

// A device buffer that only grows (activations are reused between steps of the same shape).
struct DBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DBuf() = default;
  DBuf(const DBuf&) = delete;
  DBuf& operator=(const DBuf&) = delete;
  ~DBuf() {
    if (p) cudaFree(p);
  }
  void* ensure(size_t n) {
    if (n > bytes) {
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

}  // namespace

bool available() { return kc::device_count() > 0; }
bool built_with_cuda() { return true; }

struct GpuModel::Impl {
  ModelConfig c;
  int64_t d, V, L;
  StackPlan plan;
  // ---- parameters ------------------------------------------------------------------------------
  struct Slot {
    size_t off = 0;  // elements into the flat arrays
    int64_t numel = 0;
  };
  std::map<std::string, Slot> slots;
  std::vector<ParamSpec> specs;
  size_t P = 0;                     // elements (with alignment gaps)
  size_t decay_end = 0, train_end = 0;  // [0, decay_end) decays, [decay_end, train_end) trains without decay
  DBuf master, grad, mom1, mom2, wbf;
  // Transposed bf16 expert weights per MoE layer, W13ᵀ [E, l, 2I] then W2ᵀ [E, I, l], for the backward's
  // grouped products dxs = dab · W13_e and dh = d_eo · W2_e (refreshed with the bf16 copy).
  DBuf wT;
  std::vector<size_t> wT_off;  // per layer, elements into wT (MoE layers only)
  // ---- activations ---------------------------------------------------------------------------
  std::map<std::string, DBuf> act;  // "L3.qp", "block2", scratch "s.dy" ...
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
  cudaEvent_t fork_ev = nullptr, join_ev = nullptr, started = nullptr;
  void after_start() {
    if (core) ck(cudaStreamWaitEvent(nullptr, started, 0), "wait");
  }
  void fork() {
    if (!core) return;
    ck(cudaEventRecord(fork_ev, nullptr), "cudaEventRecord");
    ck(cudaStreamWaitEvent(core, fork_ev, 0), "wait");
  }
  void join() {
    if (!core) return;
    ck(cudaEventRecord(join_ev, core), "cudaEventRecord");
    ck(cudaStreamWaitEvent(nullptr, join_ev, 0), "wait");
  }
  int64_t rows = 0;
  Seqs seqs;
  // AttnRes states of the last forward (buffers in `act`): each layer's input state, the closed blocks, and the
  // state after the last layer.
  std::vector<const float*> state_in, block_src;
  const float* state_last = nullptr;
  Profile* prof = nullptr;
  bool profiling = false;
  // Training forward (a backward follows): each KDA layer's operator leaves its intra-chunk tensors and chunk-start
  // states in kda_saved[i] (a buffer in `act`, null when not kept) for the backward, which then skips
  // recomputing them. LONGMOE_KDA_SAVE=0 recomputes them instead (about 0.43 GB less per KDA layer at 16K tokens).
  bool training = false;
  std::vector<void*> kda_saved;

  explicit Impl(const ModelConfig& cfg, const std::function<bool(const ParamSpec&)>& decays)
      : c(cfg), d(cfg.hidden_size), V(cfg.vocab_size), L(cfg.num_hidden_layers) {
    c.validate("model config");
    plan = StackPlan::build(c);
    LM_CHECK(available(), "no usable CUDA device");
    const char* ov = std::getenv("LONGMOE_OVERLAP");
    if (!(ov && ov[0] == '0')) {
      int least = 0, greatest = 0;
      ck(cudaDeviceGetStreamPriorityRange(&least, &greatest), "stream priorities");
      ck(cudaStreamCreateWithPriority(&core, cudaStreamNonBlocking, greatest), "cudaStreamCreate");
      ck(cudaEventCreateWithFlags(&fork_ev, cudaEventDisableTiming), "cudaEventCreate");
      ck(cudaEventCreateWithFlags(&join_ev, cudaEventDisableTiming), "cudaEventCreate");
      ck(cudaEventCreateWithFlags(&started, cudaEventDisableTiming), "cudaEventCreate");
    }
    specs = param_specs(c);
    layout(decays);
    master.ensure(P * 4), grad.ensure(P * 4), mom1.ensure(P * 4), mom2.ensure(P * 4), wbf.ensure(P * 2);
    ck(cudaMemset(master.p, 0, P * 4), "memset"), ck(cudaMemset(grad.p, 0, P * 4), "memset");
    ck(cudaMemset(mom1.p, 0, P * 4), "memset"), ck(cudaMemset(mom2.p, 0, P * 4), "memset");
    ck(cudaMemset(wbf.p, 0, P * 2), "memset");
    size_t t = 0;
    wT_off.assign(L, 0);
    const size_t per = static_cast<size_t>(c.num_experts) * 3 * c.moe_intermediate_size * c.expert_width();
    for (int64_t i = 0; i < L; ++i)
      if (plan[i].moe()) wT_off[i] = t, t += per;
    if (t) wT.ensure(t * 2);
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
  ~Impl() {
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
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // W13ᵀ, W2ᵀ of every MoE layer from the bf16 copy.
  void refresh_transposed() {
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
  void layout(const std::function<bool(const ParamSpec&)>& decays) {
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

  // ---- parameter pointers ----------------------------------------------------------------------
  const Slot& slot(const std::string& n) const {
    auto it = slots.find(n);
    LM_CHECK(it != slots.end(), "gpu model: no parameter '{}'", n);
    return it->second;
  }
  bool has(const std::string& n) const { return slots.count(n) != 0; }
  float* M(const std::string& n) const { return as<float>(master.p) + slot(n).off; }
  float* G(const std::string& n) const { return as<float>(grad.p) + slot(n).off; }
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

  // ---- activations ---------------------------------------------------------------------------
  template <class T = void>
  T* buf(const std::string& key, size_t bytes) {
    return static_cast<T*>(act[key].ensure(std::max<size_t>(bytes, 256)));
  }
  template <class T = void>
  T* get(const std::string& key) {
    auto it = act.find(key);
    LM_CHECK(it != act.end() && it->second.p, "gpu model: activation '{}' missing (no forward yet?)", key);
    return static_cast<T*>(it->second.p);
  }
  static std::string K(int64_t i, const char* n) { return fmt::format("L{}.{}", i, n); }

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

  // ================================ KDA mixer (kda_mixer.cpp) ===================================
  // Whether a KDA layer may keep `bytes` for its backward: yes while a quarter of the device stays free after it
  // (long sequences then recompute in their later layers rather than run out of memory in the backward).
  bool kda_keep_fits(const std::string& key, size_t bytes) {
    auto it = act.find(key);
    if (it != act.end() && it->second.p && it->second.bytes >= bytes) return true;
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) return false;
    return free > bytes + total / 4;
  }

  kc::Problem kda_problem() const {
    kc::Problem p;
    p.B = seqs.B, p.T = seqs.T, p.H = c.kda_num_heads, p.K = c.kda_head_dim, p.V = c.kda_head_dim;
    if (!seqs.cu.empty()) p.cu_seqlens = seqs.cu.data(), p.N = seqs.num_seqs();
    if (c.kda_gate_lower_bound) p.gate = kda::GateParams{kda::GateForm::LowerBound, *c.kda_gate_lower_bound};
    else p.gate = kda::GateParams{kda::GateForm::Softplus, 0.0};
    p.gate_dtype = kc::GateDType::BF16;
    p.beta_ld = kda_in_ld();  // beta_raw and its gradient live in the fused input projection's rows
    return p;
  }
  kc::ConvShape conv_shape(int64_t C, int64_t ldx = 0) const {
    kc::ConvShape s;
    s.B = seqs.B, s.T = seqs.T, s.C = C, s.W = c.kda_conv_kernel, s.ldx = ldx;
    if (!seqs.cu.empty()) s.cu_seqlens = seqs.cu.data(), s.N = seqs.num_seqs();
    return s;
  }

  // y [rows, d] fp32 = base + mixer(xn) (base null: y = mixer(xn); base == y: in place).
  void kda_forward(int64_t i, const void* xn, float* y, const float* base) {
    const int64_t H = c.kda_num_heads, Kd = c.kda_head_dim, HK = H * Kd, n = rows;
    const std::string A = P_(i) + ".self_attn.";
    auto bf = [&](const char* nm, int64_t w) { return buf(K(i, nm), size_t(n) * w * 2); };
    // qkvp [n, LF]: the q, k, v (before their convolutions), f_a and β_raw projections side by side (their
    // weights are one matrix, see layout())
    const int64_t LF = kda_in_ld();
    void *qkvp = bf("qkvp", LF), *qc = bf("qc", HK), *kc_ = bf("kc", HK), *vc = bf("vc", HK), *f = bf("f", HK),
         *go = bf("gate_o", HK), *o = bf("o", HK), *on = bf("on", HK);
    float* orstd = buf<float>(K(i, "orstd"), size_t(n) * H * 4);
    std::optional<Timed> sec(std::in_place, section("kda.proj.fwd"));
    oc::linear_fwd(xn, kda_in_weight(i), qkvp, DType::BF16, n, d, LF, false, nullptr, 0, LF);
    sec.emplace(section("kda.conv.fwd"));
    const kc::ConvShape cs = conv_shape(HK, LF);
    auto* pre = static_cast<const uint16_t*>(qkvp);
    const uint16_t *fa = pre + 3 * HK, *braw = fa + Kd;
    kc::short_conv_forward(pre, M(A + "q_conv1d.weight"), qc, cs);
    kc::short_conv_forward(pre + HK, M(A + "k_conv1d.weight"), kc_, cs);
    kc::short_conv_forward(pre + 2 * HK, M(A + "v_conv1d.weight"), vc, cs);
    sec.emplace(section("kda.proj.fwd"));
    oc::linear_fwd(fa, W(A + "f_b_proj.weight"), f, DType::BF16, n, Kd, HK, false, nullptr, LF);
    kc::Inputs in;
    in.q = qc, in.k = kc_, in.v = vc, in.g_raw = f, in.beta_raw = braw;
    in.A_log = M(A + "A_log"), in.dt_bias = M(A + "dt_bias");
    sec.emplace(section("kda.core.fwd"));
    static const bool keep = [] {
      const char* e = std::getenv("LONGMOE_KDA_SAVE");
      return !(e && e[0] == '0');
    }();
    if (kda_saved.size() != size_t(L)) kda_saved.assign(size_t(L), nullptr);
    const kc::Problem kp = kda_problem();
    const size_t kb = training && keep ? kc::saved_bytes(kp) : 0;
    kda_saved[i] = kb && kda_keep_fits(K(i, "kda_saved"), kb) ? buf(K(i, "kda_saved"), kb) : nullptr;
    fork();  // the core on its stream; the output gate's projections beside it
    kc::forward(kp, in, o, nullptr, core, kda_saved[i], started);
    sec.emplace(section("kda.proj.fwd"));
    after_start();
    if (c.kda_full_rank_gate) {
      oc::linear_fwd(xn, W(A + "g_proj.weight"), go, DType::BF16, n, d, HK);
    } else {
      void* ga = bf("ga", Kd);
      oc::linear_fwd(xn, W(A + "g_a_proj.weight"), ga, DType::BF16, n, d, Kd);
      oc::linear_fwd(ga, W(A + "g_b_proj.weight"), go, DType::BF16, n, Kd, HK);
    }
    join();
    sec.emplace(section("kda.onorm.fwd"));
    oc::rmsnorm_gated_forward(o, go, M(A + "o_norm.weight"), on, orstd, n * H, Kd, eps());
    sec.emplace(section("kda.proj.fwd"));
    oc::linear_fwd(on, W(A + "o_proj.weight"), y, DType::F32, n, HK, d, false, nullptr, 0, 0, base);
  }

  // dxn [rows, d] fp32 written from dy bf16 [rows, d].
  void kda_backward(int64_t i, const void* dy, float* dxn) {
    const int64_t H = c.kda_num_heads, Kd = c.kda_head_dim, HK = H * Kd, n = rows;
    const std::string A = P_(i) + ".self_attn.";
    const void* xn = get(K(i, "xn"));
    const int64_t LF = kda_in_ld();
    void *qkvp = get(K(i, "qkvp")), *qc = get(K(i, "qc")), *kc_ = get(K(i, "kc")), *vc = get(K(i, "vc")),
         *f = get(K(i, "f")), *go = get(K(i, "gate_o")), *o = get(K(i, "o")), *on = get(K(i, "on"));
    auto* pre = static_cast<const uint16_t*>(qkvp);
    const uint16_t *fa = pre + 3 * HK, *braw = fa + Kd;
    // The input gradients of the fused projection side by side [n, LF], then one GEMM each way.
    auto* dp = static_cast<uint16_t*>(buf("s.dp", size_t(n) * LF * 2));
    const int64_t NF = kda_in_cols();
    if (LF > NF)
      ck(cudaMemset2DAsync(dp + NF, size_t(LF) * 2, 0, size_t(LF - NF) * 2, size_t(n), nullptr), "memset");
    float* orstd = get<float>(K(i, "orstd"));
    float* d_on = buf<float>("s.d_on", size_t(n) * HK * 4);
    std::optional<Timed> sec(std::in_place, section("kda.proj.bwd"));
    // o_proj's input gradient, the gated norm's backward, then the KDA core's backward on its stream, with
    // o_proj's weight gradient and the output gate's backward beside it on this one.
    oc::linear_bwd(on, W(A + "o_proj.weight"), dy, d_on, DType::F32, nullptr, n, HK, d);
    void *d_o = buf("s.d_o", size_t(n) * HK * 2), *d_gate = buf("s.d_gate", size_t(n) * HK * 2);
    sec.emplace(section("kda.onorm.bwd"));
    oc::rmsnorm_gated_backward(o, go, M(A + "o_norm.weight"), orstd, d_on, d_o, d_gate, G(A + "o_norm.weight"), n * H,
                               Kd, eps());
    void *dq = buf("s.dq", size_t(n) * HK * 2), *dk = buf("s.dk", size_t(n) * HK * 2),
         *dv = buf("s.dv", size_t(n) * HK * 2), *df = buf("s.df", size_t(n) * HK * 2);
    uint16_t* dbraw = dp + 3 * HK + Kd;
    float *dA = buf<float>("s.dA", size_t(H) * 4), *ddt = buf<float>("s.ddt", size_t(HK) * 4);
    kc::Inputs in;
    in.q = qc, in.k = kc_, in.v = vc, in.g_raw = f, in.beta_raw = braw;
    in.A_log = M(A + "A_log"), in.dt_bias = M(A + "dt_bias");
    kc::Grads gr;
    gr.dq = dq, gr.dk = dk, gr.dv = dv, gr.dg_raw = df, gr.dbeta_raw = dbraw, gr.dA_log = dA, gr.ddt_bias = ddt;
    sec.emplace(section("kda.core.bwd"));
    fork();
    kc::backward(kda_problem(), in, d_o, nullptr, gr, core, kda_saved.empty() ? nullptr : kda_saved[i], started);
    sec.emplace(section("kda.proj.bwd"));
    after_start();
    oc::linear_bwd(on, nullptr, dy, nullptr, DType::F32, G(A + "o_proj.weight"), n, HK, d);
    if (c.kda_full_rank_gate) {
      oc::linear_bwd(xn, W(A + "g_proj.weight"), d_gate, dxn, DType::F32, G(A + "g_proj.weight"), n, d, HK, false);
    } else {
      void* d_ga = buf("s.d_ga", size_t(n) * Kd * 2);
      oc::linear_bwd(get(K(i, "ga")), W(A + "g_b_proj.weight"), d_gate, d_ga, DType::BF16, G(A + "g_b_proj.weight"), n,
                     Kd, HK);
      oc::linear_bwd(xn, W(A + "g_a_proj.weight"), d_ga, dxn, DType::F32, G(A + "g_a_proj.weight"), n, d, Kd, false);
    }
    join();
    add_f32(G(A + "A_log"), dA, H), add_f32(G(A + "dt_bias"), ddt, HK);
    sec.emplace(section("kda.proj.bwd"));
    oc::linear_bwd(fa, W(A + "f_b_proj.weight"), df, dp + 3 * HK, DType::BF16, G(A + "f_b_proj.weight"), n, Kd, HK,
                   false, nullptr, LF, 0, LF);
    const kc::ConvShape cs = conv_shape(HK, LF);
    sec.emplace(section("kda.conv.bwd"));
    int64_t j = 0;
    for (const auto& [conv, dpost] :
         {std::pair{"q_conv1d", dq}, std::pair{"k_conv1d", dk}, std::pair{"v_conv1d", dv}}) {
      const std::string cw = A + conv + ".weight";
      kc::short_conv_backward(pre + j * HK, M(cw), dpost, dp + j * HK, G(cw), cs);
      ++j;
    }
    sec.emplace(section("kda.proj.bwd"));
    oc::linear_bwd(xn, kda_in_weight(i), dp, dxn, DType::F32, G(A + "q_proj.weight"), n, d, LF, true, nullptr, 0,
                   LF);
  }

  // ================================ gated MLA (mla.cpp) =========================================
  oc::AttnShape attn_shape() const {
    oc::AttnShape a;
    a.B = seqs.B, a.T = seqs.T, a.H = c.num_attention_heads, a.Hkv = a.H;
    a.Dk = c.qk_nope_head_dim + c.qk_rope_head_dim, a.Dv = c.v_head_dim;
    if (!seqs.cu.empty()) a.cu_seqlens = seqs.cu.data(), a.N = seqs.num_seqs();
    return a;
  }

  void mla_forward(int64_t i, const void* xn, float* y, const float* base) {
    const int64_t H = c.num_attention_heads, Dn = c.qk_nope_head_dim, Dr = c.qk_rope_head_dim, Dv = c.v_head_dim,
                  R = c.kv_lora_rank, Q = c.q_lora_rank.value_or(0), Dq = Dn + Dr, Dkv = Dn + Dv, RD = R + Dr,
                  n = rows;
    const std::string A = P_(i) + ".self_attn.";
    void* q = buf(K(i, "q"), size_t(n) * H * Dq * 2);
    if (Q) {
      float* qa = buf<float>(K(i, "qa"), size_t(n) * Q * 4);
      void* qan = buf(K(i, "qan"), size_t(n) * Q * 2);
      float* qrs = buf<float>(K(i, "qa_rstd"), size_t(n) * 4);
      oc::linear_fwd(xn, W(A + "q_a_proj.weight"), qa, DType::F32, n, d, Q);
      oc::rmsnorm_forward(qa, DType::F32, M(A + "q_a_layernorm.weight"), qan, qrs, n, Q, float(kLoraEps));
      oc::linear_fwd(qan, W(A + "q_b_proj.weight"), q, DType::BF16, n, Q, H * Dq);
    } else {
      oc::linear_fwd(xn, W(A + "q_proj.weight"), q, DType::BF16, n, d, H * Dq);
    }
    float* ckr = buf<float>(K(i, "ckr"), size_t(n) * RD * 4);
    void* cn = buf(K(i, "cn"), size_t(n) * R * 2);
    float* crs = buf<float>(K(i, "c_rstd"), size_t(n) * 4);
    oc::linear_fwd(xn, W(A + "kv_a_proj_with_mqa.weight"), ckr, DType::F32, n, d, RD);
    oc::rmsnorm_forward(ckr, DType::F32, M(A + "kv_a_layernorm.weight"), cn, crs, n, R, float(kLoraEps), RD, R);
    void* kv = buf(K(i, "kv"), size_t(n) * H * Dkv * 2);
    oc::linear_fwd(cn, W(A + "kv_b_proj.weight"), kv, DType::BF16, n, R, H * Dkv);
    void *k = buf(K(i, "k"), size_t(n) * H * Dq * 2), *v = buf(K(i, "v"), size_t(n) * H * Dv * 2);
    mla_split_kv(kv, ckr, k, v, n, H, Dn, Dr, Dv, R);
    void* o = buf(K(i, "o"), size_t(n) * H * Dv * 2);
    float* lse = buf<float>(K(i, "lse"), size_t(n) * H * 4);
    oc::attention_forward(attn_shape(), q, k, v, o, lse);
    const void* o_in = o;
    if (c.mla_use_output_gate) {
      void *graw = buf(K(i, "graw"), size_t(n) * H * Dv * 2), *og = buf(K(i, "og"), size_t(n) * H * Dv * 2);
      oc::linear_fwd(xn, W(A + "g_proj.weight"), graw, DType::BF16, n, d, H * Dv);
      sigmoid_gate_forward(o, graw, og, n * H * Dv);
      o_in = og;
    }
    oc::linear_fwd(o_in, W(A + "o_proj.weight"), y, DType::F32, n, H * Dv, d, false, nullptr, 0, 0, base);
  }

  void mla_backward(int64_t i, const void* dy, float* dxn) {
    const int64_t H = c.num_attention_heads, Dn = c.qk_nope_head_dim, Dr = c.qk_rope_head_dim, Dv = c.v_head_dim,
                  R = c.kv_lora_rank, Q = c.q_lora_rank.value_or(0), Dq = Dn + Dr, Dkv = Dn + Dv, RD = R + Dr,
                  HV = H * Dv, n = rows;
    const std::string A = P_(i) + ".self_attn.";
    const void* xn = get(K(i, "xn"));
    void *o = get(K(i, "o")), *q = get(K(i, "q")), *k = get(K(i, "k")), *v = get(K(i, "v"));
    float* d_og = buf<float>("s.d_og", size_t(n) * HV * 4);
    const bool gated = c.mla_use_output_gate;
    oc::linear_bwd(gated ? get(K(i, "og")) : o, W(A + "o_proj.weight"), dy, d_og, DType::F32, G(A + "o_proj.weight"), n,
                   HV, d);
    void* d_o = buf("s.d_o", size_t(n) * HV * 2);
    bool dx_written = false;
    if (gated) {
      void* d_g = buf("s.d_g", size_t(n) * HV * 2);
      sigmoid_gate_backward(o, get(K(i, "graw")), d_og, d_o, d_g, n * HV);
      oc::linear_bwd(xn, W(A + "g_proj.weight"), d_g, dxn, DType::F32, G(A + "g_proj.weight"), n, d, HV, false);
      dx_written = true;
    } else {
      cast_f32_bf16(d_og, d_o, n * HV);
    }
    void *dq = buf("s.dq", size_t(n) * H * Dq * 2), *dk = buf("s.dk", size_t(n) * H * Dq * 2),
         *dv = buf("s.dv", size_t(n) * HV * 2);
    oc::attention_backward(attn_shape(), q, k, v, o, get<float>(K(i, "lse")), d_o, dq, dk, dv);
    void *dkv = buf("s.dkv", size_t(n) * H * Dkv * 2), *dckr = buf("s.dckr", size_t(n) * RD * 2);
    mla_merge_dkv(dk, dv, dkv, dckr, n, H, Dn, Dr, Dv, R);
    float* dcn = buf<float>("s.dcn", size_t(n) * R * 4);
    oc::linear_bwd(get(K(i, "cn")), W(A + "kv_b_proj.weight"), dkv, dcn, DType::F32, G(A + "kv_b_proj.weight"), n, R,
                   H * Dkv);
    oc::rmsnorm_backward(get(K(i, "ckr")), DType::F32, M(A + "kv_a_layernorm.weight"), get<float>(K(i, "c_rstd")), dcn,
                         DType::F32, dckr, DType::BF16, G(A + "kv_a_layernorm.weight"), n, R, float(kLoraEps), RD, R,
                         false, RD);
    oc::linear_bwd(xn, W(A + "kv_a_proj_with_mqa.weight"), dckr, dxn, DType::F32, G(A + "kv_a_proj_with_mqa.weight"), n,
                   d, RD, dx_written);
    if (Q) {
      float* dqan = buf<float>("s.dqan", size_t(n) * Q * 4);
      void* dqa = buf("s.dqa", size_t(n) * Q * 2);
      oc::linear_bwd(get(K(i, "qan")), W(A + "q_b_proj.weight"), dq, dqan, DType::F32, G(A + "q_b_proj.weight"), n, Q,
                     H * Dq);
      oc::rmsnorm_backward(get(K(i, "qa")), DType::F32, M(A + "q_a_layernorm.weight"), get<float>(K(i, "qa_rstd")), dqan,
                           DType::F32, dqa, DType::BF16, G(A + "q_a_layernorm.weight"), n, Q, float(kLoraEps));
      oc::linear_bwd(xn, W(A + "q_a_proj.weight"), dqa, dxn, DType::F32, G(A + "q_a_proj.weight"), n, d, Q, true);
    } else {
      oc::linear_bwd(xn, W(A + "q_proj.weight"), dq, dxn, DType::F32, G(A + "q_proj.weight"), n, d, H * Dq, true);
    }
  }

  // ================================ FFNs (ffn.cpp, moe.cpp) =====================================
  ops::GluParams glu() const { return glu_params(c); }

  // Dense GLU FFN under `prefix` (gate_proj and up_proj adjacent: one [2I, din] weight) over x [n, din] bf16.
  // y = base + ffn(x) (base null: y = ffn(x); base == y: in place).
  void ffn_forward(const std::string& key, const std::string& prefix, const void* x, int64_t n, int64_t din, int64_t I,
                   float* y, const float* base) {
    void* ab = buf(key + ".ab", size_t(n) * 2 * I * 2);
    oc::linear_fwd(x, W(prefix + ".gate_proj.weight"), ab, DType::BF16, n, din, 2 * I);
    ffn_down_forward(key, prefix, ab, 2 * I, n, din, I, y, base);
  }
  // The FFN after its gate/up product ab [n, 2I] (row stride ldab): y = base + down(GLU(ab)), h kept as key.h.
  void ffn_down_forward(const std::string& key, const std::string& prefix, const void* ab, int64_t ldab, int64_t n,
                        int64_t din, int64_t I, float* y, const float* base) {
    void* h = buf(key + ".h", size_t(n) * I * 2);
    oc::glu_forward(ab, h, n, I, glu(), nullptr, ldab);
    oc::linear_fwd(h, W(prefix + ".down_proj.weight"), y, DType::F32, n, I, din, false, nullptr, 0, 0, base);
  }
  // Its backward down to the gate/up product's gradient dab [n, 2I] (row stride lddab).
  void ffn_down_backward(const std::string& key, const std::string& prefix, const void* ab, int64_t ldab, int64_t n,
                         int64_t din, int64_t I, const void* dy, void* dab, int64_t lddab) {
    float* dh = buf<float>("s.ffn_dh", size_t(n) * I * 4);
    oc::linear_bwd(get(key + ".h"), W(prefix + ".down_proj.weight"), dy, dh, DType::F32,
                   G(prefix + ".down_proj.weight"), n, I, din);
    oc::glu_backward(ab, dh, DType::F32, dab, n, I, glu(), nullptr, ldab, lddab);
  }
  void ffn_backward(const std::string& key, const std::string& prefix, const void* x, int64_t n, int64_t din,
                    int64_t I, const void* dy, float* dx, bool accumulate_dx) {
    void* dab = buf("s.ffn_dab", size_t(n) * 2 * I * 2);
    ffn_down_backward(key, prefix, get(key + ".ab"), 2 * I, n, din, I, dy, dab, 2 * I);
    // gate_proj's slot starts the stacked [2I, din] weight and its gradient.
    oc::linear_bwd(x, W(prefix + ".gate_proj.weight"), dab, dx, DType::F32, G(prefix + ".gate_proj.weight"), n, din,
                   2 * I, accumulate_dx);
  }

  // y [rows, d] fp32 = base + moe(yn) (base == y: in place).
  void moe_forward(int64_t i, const void* yn, float* y, const float* base) {
    const int64_t E = c.num_experts, k = c.num_experts_per_token, I = c.moe_intermediate_size, l = c.expert_width(),
                  n = rows, Mr = n * k;
    const bool latent = c.has_latent_moe();
    const std::string B = P_(i) + ".block_sparse_moe.";
    float* logits = buf<float>(K(i, "logits"), size_t(n) * E * 4);
    std::optional<Timed> sec(std::in_place, section("moe.route.fwd"));
    oc::linear_fwd(yn, W(B + "gate.weight"), logits, DType::F32, n, d, E);
    int32_t* topk_idx = buf<int32_t>(K(i, "topk_idx"), size_t(Mr) * 4);
    float* topk_w = buf<float>(K(i, "topk_w"), size_t(Mr) * 4);
    oc::RouterOut ro;
    ro.topk_idx = topk_idx, ro.topk_w = topk_w;
    ro.scores = buf<float>(K(i, "scores"), size_t(n) * E * 4);
    ro.alpha = buf<float>(K(i, "alpha"), size_t(n) * 4);
    oc::router_forward(logits, M(B + "gate.e_score_correction_bias"), n, E, k, c.moe_renormalize,
                       static_cast<float>(c.routed_scaling_factor), ro);
    const void* z = yn;
    int64_t ldz = 0;
    const bool fused = moe_in_fused();
    sec.emplace(section("moe.latent.fwd"));
    if (fused) {  // z and the shared expert's ab side by side [n, l + 2·Is]
      const int64_t LZ = moe_in_bf16();
      void* zs = buf(K(i, "zs"), size_t(n) * LZ * 2);
      oc::linear_fwd(yn, W(B + "routed_expert_down_proj.weight"), zs, DType::BF16, n, d, LZ, false, nullptr, 0, LZ);
      z = zs, ldz = LZ;
    } else if (latent) {
      void* zb = buf(K(i, "z"), size_t(n) * l * 2);
      oc::linear_fwd(yn, W(B + "routed_expert_down_proj.weight"), zb, DType::BF16, n, d, l);
      z = zb;
    }
    int32_t *off = buf<int32_t>(K(i, "offsets"), size_t(E + 1) * 4), *prow = buf<int32_t>(K(i, "prow"), size_t(Mr) * 4),
            *ppos = buf<int32_t>(K(i, "ppos"), size_t(Mr) * 4);
    sec.emplace(section("moe.route.fwd"));
    ck(cudaStreamWaitEvent(nullptr, offsets_h[i].done, 0), "wait");  // the last copy of `off` has left
    oc::moe_permute(topk_idx, n, k, E, off, prow, ppos);
    ck(cudaEventRecord(permuted, nullptr), "cudaEventRecord");
    ck(cudaStreamWaitEvent(side, permuted, 0), "wait");
    ck(cudaMemcpyAsync(offsets_h[i].p, off, size_t(E + 1) * 4, cudaMemcpyDeviceToHost, side), "offsets to host");
    ck(cudaEventRecord(offsets_h[i].done, side), "cudaEventRecord");
    void *xs = buf(K(i, "xs"), size_t(Mr) * l * 2), *ab = buf(K(i, "eab"), size_t(Mr) * 2 * I * 2),
         *h = buf(K(i, "eh"), size_t(Mr) * I * 2), *eo = buf(K(i, "eo"), size_t(Mr) * l * 2);
    oc::moe_gather(z, prow, xs, n, k, l, nullptr, ldz);
    const std::string X = B + "experts.0.";
    const ops::GluParams gp = glu();
    oc::GluArgs ga;
    ga.swiglu = gp.kind == ops::GluKind::SwiGLU;
    ga.beta1 = static_cast<float>(gp.beta1), ga.beta2 = static_cast<float>(gp.beta2);
    sec.emplace(section("moe.experts.fwd"));
    oc::grouped_gemm_glu(xs, W(X + "w1.weight"), h, ab, off, Mr, I, l, E, ga);
    oc::grouped_gemm(h, W(X + "w2.weight"), eo, off, Mr, l, I, E);
    sec.emplace(section("moe.combine.fwd"));
    void* u = buf(K(i, "u"), size_t(n) * l * 2);
    oc::moe_combine(eo, topk_w, ppos, u, n, k, l);
    sec.emplace(section("moe.latent.fwd"));
    if (latent) {
      const void* un = u;
      if (c.latent_moe_use_norm) {
        void* unb = buf(K(i, "un"), size_t(n) * l * 2);
        float* urs = buf<float>(K(i, "u_rstd"), size_t(n) * 4);
        oc::rmsnorm_forward(u, DType::BF16, M(B + "routed_expert_norm.weight"), unb, urs, n, l, eps());
        un = unb;
      }
      oc::linear_fwd(un, W(B + "routed_expert_up_proj.weight"), y, DType::F32, n, l, d, false, nullptr, 0, 0, base);
    } else {
      throw Error("gpu model: MoE without a latent projection (Kimi Linear) is not supported on the GPU yet");
    }
    sec.emplace(section("moe.shared.fwd"));
    if (fused) {  // the shared expert from its ab columns of zs
      ffn_down_forward(K(i, "shared"), B + "shared_experts", static_cast<const uint16_t*>(z) + l, ldz, n, d,
                       c.shared_intermediate_size(), y, y);
    } else if (c.num_shared_experts > 0) {
      ffn_forward(K(i, "shared"), B + "shared_experts", yn, n, d, c.shared_intermediate_size(), y, y);
    }
  }

  void moe_backward(int64_t i, const void* dy, float* dyn) {
    const int64_t E = c.num_experts, k = c.num_experts_per_token, I = c.moe_intermediate_size, l = c.expert_width(),
                  n = rows, Mr = n * k;
    const std::string B = P_(i) + ".block_sparse_moe.";
    const void* yn = get(K(i, "yn"));
    // u -> latent norm -> up projection.
    float* dun = buf<float>("s.dun", size_t(n) * l * 4);
    float* du = buf<float>("s.du", size_t(n) * l * 4);
    const std::string up = B + "routed_expert_up_proj.weight";
    std::optional<Timed> sec(std::in_place, section("moe.latent.bwd"));
    if (c.latent_moe_use_norm) {
      oc::linear_bwd(get(K(i, "un")), W(up), dy, dun, DType::F32, G(up), n, l, d);
      oc::rmsnorm_backward(get(K(i, "u")), DType::BF16, M(B + "routed_expert_norm.weight"), get<float>(K(i, "u_rstd")),
                           dun, DType::F32, du, DType::F32, G(B + "routed_expert_norm.weight"), n, l, eps());
    } else {
      oc::linear_bwd(get(K(i, "u")), W(up), dy, du, DType::F32, G(up), n, l, d);
    }
    void* d_eo = buf("s.d_eo", size_t(Mr) * l * 2);
    float* d_topk_w = buf<float>("s.d_topk_w", size_t(Mr) * 4);
    const int32_t* ppos = get<int32_t>(K(i, "ppos"));
    sec.emplace(section("moe.combine.bwd"));
    oc::moe_combine_backward(get(K(i, "eo")), get<float>(K(i, "topk_w")), ppos, du, false, d_eo, d_topk_w, n, k, l);
    // Routed experts.
    const std::string X = B + "experts.0.";
    float *g13 = G(X + "w1.weight"), *g2 = G(X + "w2.weight");
    const auto* xs = static_cast<const uint16_t*>(get(K(i, "xs")));
    const auto* h = static_cast<const uint16_t*>(get(K(i, "eh")));
    const int32_t* off_d = get<int32_t>(K(i, "offsets"));
    const uint16_t* t13 = as<uint16_t>(wT.p) + wT_off[i];
    const uint16_t* t2 = t13 + E * l * 2 * I;
    void* dh = buf("s.e_dh", size_t(Mr) * I * 2);
    void* dab = buf("s.e_dab", size_t(Mr) * 2 * I * 2);
    void* dxs = buf("s.dxs", size_t(Mr) * l * 2);
    const auto* deo = static_cast<const uint16_t*>(d_eo);
    const auto* dabp = static_cast<const uint16_t*>(dab);
    // Weight gradients (reductions over each expert's rows) by the grouped wgrad kernel; with
    // LONGMOE_MOE_WGRAD_CUBLAS=1 as per-expert cuBLAS products on side streams (the host waits for the offsets).
    static const bool cublas_wgrad = [] {
      const char* v = std::getenv("LONGMOE_MOE_WGRAD_CUBLAS");
      return v && v[0] == '1';
    }();
    auto wgrad = [&](const uint16_t* gy, const uint16_t* x, float* dw, int64_t N, int64_t Kd) {
      if (!cublas_wgrad) return oc::grouped_gemm_wgrad(gy, x, dw, off_d, Mr, N, Kd, E, true);
      ck(cudaEventSynchronize(offsets_h[i].done), "offsets to host");
      const int32_t* off = offsets_h[i].p;
      std::vector<oc::GemmGroup> groups;
      for (int64_t e = 0; e < E; ++e) {  // dW_e += gy_eᵀ · x_e
        const int64_t r0 = off[e], me = off[e + 1] - r0;
        groups.push_back({N, Kd, me, gy + r0 * N, N, x + r0 * Kd, Kd, dw + e * N * Kd, Kd});
      }
      oc::gemm_bf16_grouped(true, false, groups, 1.f, 1.f, DType::F32);
    };
    sec.emplace(section("moe.experts.bwd"));
    oc::grouped_gemm(d_eo, t2, dh, off_d, Mr, I, l, E);  // dh_e = d_eo_e · W2_e
    wgrad(deo, h, g2, l, I);                             // dW2_e += d_eo_eᵀ · h_e
    sec.emplace(section("moe.glu.bwd"));
    oc::glu_backward(get(K(i, "eab")), dh, DType::BF16, dab, Mr, I, glu());
    sec.emplace(section("moe.experts.bwd"));
    oc::grouped_gemm(dab, t13, dxs, off_d, Mr, l, 2 * I, E);  // dxs_e = dab_e · W13_e
    wgrad(dabp, xs, g13, 2 * I, l);                           // dW13_e += dab_eᵀ · xs_e
    const bool fused = moe_in_fused();
    // fused: the input gradients of the one [E + l + 2·Is, d] matrix side by side, then one GEMM each way
    const int64_t LB = fused ? moe_in_ld() : 0;
    auto* dcat = fused ? static_cast<uint16_t*>(buf("s.moe_dcat", size_t(n) * LB * 2)) : nullptr;
    const int64_t EP = fused ? moe_in_epad() : E;
    if (fused && EP > E)
      ck(cudaMemset2DAsync(dcat + E, size_t(LB) * 2, 0, size_t(EP - E) * 2, size_t(n), nullptr), "memset");
    sec.emplace(section("moe.route.bwd"));
    void* d_logits = fused ? static_cast<void*>(dcat) : buf("s.d_logits", size_t(n) * E * 2);
    oc::router_backward(get<float>(K(i, "logits")), get<int32_t>(K(i, "topk_idx")), d_topk_w, d_logits, true, n, E, k,
                        c.moe_renormalize, static_cast<float>(c.routed_scaling_factor), nullptr, LB);
    if (!fused)
      oc::linear_bwd(yn, W(B + "gate.weight"), d_logits, dyn, DType::F32, G(B + "gate.weight"), n, d, E, false);
    sec.emplace(section("moe.gather.bwd"));
    void* dz = fused ? static_cast<void*>(dcat + EP) : buf("s.dz", size_t(n) * l * 2);
    oc::moe_gather_backward(dxs, ppos, dz, true, n, k, l, false, nullptr, LB);
    sec.emplace(section("moe.shared.bwd"));
    if (fused) {
      ffn_down_backward(K(i, "shared"), B + "shared_experts", static_cast<const uint16_t*>(get(K(i, "zs"))) + l,
                        moe_in_bf16(), n, d, c.shared_intermediate_size(), dy, dcat + EP + l, LB);
    } else if (c.num_shared_experts > 0) {
      ffn_backward(K(i, "shared"), B + "shared_experts", yn, n, d, c.shared_intermediate_size(), dy, dyn, true);
    }
    sec.emplace(section("moe.latent.bwd"));
    if (fused)  // dyn's only write: router, latent and shared input gradients in one product
      oc::linear_bwd(yn, W(B + "gate.weight"), dcat, dyn, DType::F32, G(B + "gate.weight"), n, d, LB, false, nullptr,
                     0, LB);
    else
      oc::linear_bwd(yn, W(B + "routed_expert_down_proj.weight"), dz, dyn, DType::F32,
                     G(B + "routed_expert_down_proj.weight"), n, d, l, true);
  }

  // ================================ the stack (model.cpp) =======================================
  void mixer_forward(int64_t i, const void* xn, float* y, const float* base) {
    if (plan[i].kda()) {
      Timed t(part(Profile::Kda, false));
      kda_forward(i, xn, y, base);
    } else {
      Timed t(part(Profile::Mla, false));
      mla_forward(i, xn, y, base);
    }
  }
  void ffn_fwd(int64_t i, const void* yn, float* y, const float* base) {
    if (plan[i].moe()) {
      Timed t(part(Profile::Moe, false));
      moe_forward(i, yn, y, base);
    } else {
      Timed t(part(Profile::DenseFfn, false));
      ffn_forward(K(i, "mlp"), P_(i) + ".mlp", yn, rows, d, c.intermediate_size, y, base);
    }
  }
  void norm_fwd(const float* x, const std::string& w, const std::string& key_y, const std::string& key_rstd) {
    Timed t(part(Profile::Norm, false));
    oc::rmsnorm_forward(x, DType::F32, M(w), buf(key_y, size_t(rows) * d * 2),
                        buf<float>(key_rstd, size_t(rows) * 4), rows, d, eps());
  }
  // An AttnRes read over src with (w, g) and the RMSNorm (gain nw) that consumes it, fused: only the bf16 norm
  // output and its rstd are stored (the backward rebuilds h from the sources).
  void read_norm(const std::vector<const float*>& src, const std::string& w, const std::string& g,
                 const std::string& nw, const std::string& key_y, const std::string& key_rstd) {
    Timed t(part(Profile::AttnRes, false));
    oc::attnres_norm_forward(src.data(), static_cast<int64_t>(src.size()), rows, d, M(w), M(g), eps(), M(nw), eps(),
                             buf(key_y, size_t(rows) * d * 2), buf<float>(key_rstd, size_t(rows) * 4));
  }
  void copy(float* dst, const float* src) {
    ck(cudaMemcpyAsync(dst, src, size_t(rows) * d * 4, cudaMemcpyDeviceToDevice, nullptr), "copy");
  }

  // Returns the number of targets >= 0 (0 without targets).
  int64_t forward(const int32_t* ids, const int32_t* targets, const Seqs& s) {
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
    ck(cudaMemcpy(ids_d.ensure(size_t(rows) * 4), ids, size_t(rows) * 4, cudaMemcpyHostToDevice), "ids");
    if (targets)
      ck(cudaMemcpy(tgt_d.ensure(size_t(rows) * 4), targets, size_t(rows) * 4, cudaMemcpyHostToDevice), "targets");
    const size_t RD4 = size_t(rows) * d * 4;
    float* prefix = buf<float>("prefix", RD4);
    {
      Timed t(part(Profile::Embedding, false));
      oc::embedding_forward(as<int32_t>(ids_d.p), rows, W("model.embed_tokens.weight"), d, prefix);
    }
    if (plan.attn_res) {
      // Every state of the partial block sum has its own buffer (the embedding in "prefix", then each layer
      // part's output: "pmid" after the mixer, "pout" after the FFN), written by the layer part's last GEMM as
      // state + product: no copies, and the closed blocks are the states themselves.
      std::vector<const float*> blocks;
      state_in.assign(L, nullptr);
      const float* cur = prefix;
      auto with = [&](int64_t closed, const float* last) {
        std::vector<const float*> src(blocks.begin(), blocks.begin() + closed);
        src.push_back(last);
        return src;
      };
      for (int64_t i = 0; i < L; ++i) {
        const LayerPlan& lp = plan[i];
        const std::string Pi = P_(i);
        state_in[i] = cur;
        if (lp.attn_closed == 0)
          norm_fwd(cur, Pi + ".input_layernorm.weight", K(i, "xn"), K(i, "rstd1"));
        else
          read_norm(with(lp.attn_closed, cur), Pi + ".self_attention_res_proj.weight",
                    Pi + ".self_attention_res_norm.weight", Pi + ".input_layernorm.weight", K(i, "xn"), K(i, "rstd1"));
        if (lp.opens_block) blocks.push_back(cur);
        float* mid = buf<float>(K(i, "pmid"), RD4);
        mixer_forward(i, get(K(i, "xn")), mid, lp.opens_block ? nullptr : cur);
        read_norm(with(lp.mlp_closed, mid), Pi + ".mlp_res_proj.weight", Pi + ".mlp_res_norm.weight",
                  Pi + ".post_attention_layernorm.weight", K(i, "yn"), K(i, "rstd2"));
        float* out = buf<float>(K(i, "pout"), RD4);
        ffn_fwd(i, get(K(i, "yn")), out, mid);
        cur = out;
      }
      block_src = blocks;
      state_last = cur;
      read_norm(with(plan.out_closed, cur), "model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight",
                "model.norm.weight", "hn", "rstd_f");
    } else {
      for (int64_t i = 0; i < L; ++i) {
        const std::string Pi = P_(i);
        float* x_in = buf<float>(K(i, "x_in"), RD4);
        copy(x_in, prefix);
        norm_fwd(x_in, Pi + ".input_layernorm.weight", K(i, "xn"), K(i, "rstd1"));
        mixer_forward(i, get(K(i, "xn")), prefix, prefix);
        float* y_in = buf<float>(K(i, "y_in"), RD4);
        copy(y_in, prefix);
        norm_fwd(y_in, Pi + ".post_attention_layernorm.weight", K(i, "yn"), K(i, "rstd2"));
        ffn_fwd(i, get(K(i, "yn")), prefix, prefix);
      }
      copy(buf<float>("h_final", RD4), prefix);
      norm_fwd(get<float>("h_final"), "model.norm.weight", "hn", "rstd_f");
    }
    return n_valid;
  }

  // ---- backward ------------------------------------------------------------------------------
  void norm_bwd(const float* x, const std::string& w, const float* rstd, const float* dy, float* dx) {
    Timed t(part(Profile::Norm, true));
    oc::rmsnorm_backward(x, DType::F32, M(w), rstd, dy, DType::F32, dx, DType::F32, G(w), rows, d, eps());
  }
  // Backward of read_norm from the norm output's gradient dy: adds into dsrc (the last one is also written to
  // dyb as bf16, the upstream gradient of the layer part that produced the last source).
  // defer (nullable): the closed sources' gradients are left to attnres_flush.
  void read_norm_bwd(const std::vector<const float*>& src, const std::vector<float*>& dsrc, const std::string& w,
                     const std::string& g, const std::string& nw, const float* rstd, const float* dy, void* dyb,
                     const oc::AttnResDeferred* defer = nullptr) {
    Timed t(part(Profile::AttnRes, true));
    oc::attnres_norm_backward(src.data(), static_cast<int64_t>(src.size()), rows, d, M(w), M(g), eps(), M(nw), eps(),
                              rstd, dy, dsrc.data(), G(w), G(g), G(nw), dyb, nullptr, defer);
  }
  // d(layer part) fp32 -> bf16 for the GEMMs.
  const void* to_bf16(const float* x) {
    void* y = buf("s.dy_bf", size_t(rows) * d * 2);
    cast_f32_bf16(x, y, rows * d);
    return y;
  }
  // dyb: the bf16 gradient of the mixer's output.
  void mixer_bwd(int64_t i, const void* dyb, float* dxn) {
    if (plan[i].kda()) {
      Timed t(part(Profile::Kda, true));
      kda_backward(i, dyb, dxn);
    } else {
      Timed t(part(Profile::Mla, true));
      mla_backward(i, dyb, dxn);
    }
  }
  void ffn_bwd(int64_t i, const void* dyb, float* dyn) {
    if (plan[i].moe()) {
      Timed t(part(Profile::Moe, true));
      moe_backward(i, dyb, dyn);
    } else {
      Timed t(part(Profile::DenseFfn, true));
      ffn_backward(K(i, "mlp"), P_(i) + ".mlp", get(K(i, "yn")), rows, d, c.intermediate_size, dyb, dyn, false);
    }
  }

  void backward(const float* d_hn) {
    const size_t RD4 = size_t(rows) * d * 4;
    float* dnorm = buf<float>("s.dnorm", RD4);
    float* dx_in = buf<float>("s.dx_in", RD4);
    float* d_prefix = buf<float>("s.d_prefix", RD4);
    void* dyb = buf("s.dy_bf", size_t(rows) * d * 2);
    if (plan.attn_res) {
      ck(cudaMemsetAsync(d_prefix, 0, RD4, nullptr), "memset");
      std::vector<float*> d_blocks;
      const auto nblocks = static_cast<int64_t>(block_src.size());
      for (int64_t j = 0; j < nblocks; ++j) {
        float* db = buf<float>(fmt::format("s.d_block{}", j), RD4);
        ck(cudaMemsetAsync(db, 0, RD4, nullptr), "memset");
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
      static const bool defer_on = [] {
        const char* v = std::getenv("LONGMOE_ATTNRES_DEFER");
        return !(v && v[0] == '0');
      }();
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
        a.delta = buf(fmt::format("s.ar_delta{}", r), RD4 / 2);
        a.coef = buf<float>(fmt::format("s.ar_coef{}", r), size_t(rows) * nblocks * 16);
        a.q = buf<float>(fmt::format("s.ar_q{}", r), size_t(d) * 4);
        group.push_back(a);
        return &group.back();
      };
      sources(plan.out_closed, state_last);
      read_norm_bwd(src, dsrc, "model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight",
                    "model.norm.weight", get<float>("rstd_f"), d_hn, dyb, deferred(plan.out_closed));
      for (int64_t i = L - 1; i >= 0; --i) {
        const LayerPlan& lp = plan[i];
        const std::string Pi = P_(i);
        const int64_t nb_mlp = lp.mlp_closed, nb_attn = lp.attn_closed;
        ffn_bwd(i, dyb, dnorm);  // dyb: bf16 of d_prefix, the gradient of this layer's output state
        sources(nb_mlp, get<float>(K(i, "pmid")));
        read_norm_bwd(src, dsrc, Pi + ".mlp_res_proj.weight", Pi + ".mlp_res_norm.weight",
                      Pi + ".post_attention_layernorm.weight", get<float>(K(i, "rstd2")), dnorm, dyb,
                      deferred(nb_mlp));
        mixer_bwd(i, dyb, dnorm);
        if (lp.opens_block) {  // the block closed here was this layer's input state: its gradient is complete now
          flush();
          std::swap(d_prefix, d_blocks[nb_attn]);
        }
        if (nb_attn == 0) {
          norm_bwd(state_in[i], Pi + ".input_layernorm.weight", get<float>(K(i, "rstd1")), dnorm, dx_in);
          add_f32(d_prefix, dx_in, rows * d);
          if (i > 0) cast_f32_bf16(d_prefix, dyb, rows * d);
        } else {
          sources(nb_attn, state_in[i]);
          read_norm_bwd(src, dsrc, Pi + ".self_attention_res_proj.weight", Pi + ".self_attention_res_norm.weight",
                        Pi + ".input_layernorm.weight", get<float>(K(i, "rstd1")), dnorm, dyb, deferred(nb_attn));
        }
      }
      flush();  // (layer 0 opens a block, so nothing is left here)
    } else {
      norm_bwd(get<float>("h_final"), "model.norm.weight", get<float>("rstd_f"), d_hn, d_prefix);
      for (int64_t i = L - 1; i >= 0; --i) {
        const std::string Pi = P_(i);
        ffn_bwd(i, to_bf16(d_prefix), dnorm);
        norm_bwd(get<float>(K(i, "y_in")), Pi + ".post_attention_layernorm.weight", get<float>(K(i, "rstd2")), dnorm,
                 dx_in);
        add_f32(d_prefix, dx_in, rows * d);
        mixer_bwd(i, to_bf16(d_prefix), dnorm);
        norm_bwd(get<float>(K(i, "x_in")), Pi + ".input_layernorm.weight", get<float>(K(i, "rstd1")), dnorm, dx_in);
        add_f32(d_prefix, dx_in, rows * d);
      }
    }
    Timed t(part(Profile::Embedding, true));
    oc::embedding_backward(ids_h.data(), rows, d_prefix, V, d, G("model.embed_tokens.weight"));
  }
};

// ================================ public API ========================================================

GpuModel::GpuModel(const ModelConfig& c, std::function<bool(const ParamSpec&)> decays)
    : p_(std::make_unique<Impl>(c, decays)) {
  p_->prof = &profile;
}
GpuModel::~GpuModel() = default;
const ModelConfig& GpuModel::config() const { return p_->c; }
int64_t GpuModel::num_params() const {
  int64_t n = 0;
  for (const auto& s : p_->specs) n += s.numel();
  return n;
}
size_t GpuModel::device_bytes() const {
  size_t b = p_->P * (4 * 4 + 2) + p_->wT.bytes;
  for (const auto& [k, v] : p_->act) b += v.bytes;
  return b;
}

void GpuModel::upload(const ParamStore<float>& ps) {
  for (const auto& prm : ps.all()) {
    const auto& s = p_->slot(prm.spec.name);
    ck(cudaMemcpy(p_->M(prm.spec.name), prm.w(), size_t(s.numel) * 4, cudaMemcpyHostToDevice), "upload");
  }
  cast_f32_bf16(as<float>(p_->master.p), p_->wbf.p, static_cast<int64_t>(p_->P));
  p_->refresh_transposed();
  ck(cudaDeviceSynchronize(), "upload");
}
void GpuModel::download(ParamStore<float>& ps) const {
  ck(cudaDeviceSynchronize(), "download");
  for (auto& prm : ps.all())
    ck(cudaMemcpy(prm.w(), p_->M(prm.spec.name), size_t(p_->slot(prm.spec.name).numel) * 4, cudaMemcpyDeviceToHost),
       "download");
}
void GpuModel::download_grads(ParamStore<float>& ps) const {
  LM_CHECK(ps.has_grads(), "download_grads: the store has no gradients");
  ck(cudaDeviceSynchronize(), "download");
  for (auto& prm : ps.all())
    if (prm.g())
      ck(cudaMemcpy(prm.g(), p_->G(prm.spec.name), size_t(p_->slot(prm.spec.name).numel) * 4,
                    cudaMemcpyDeviceToHost),
         "download grads");
}
void GpuModel::zero_grads() { ck(cudaMemsetAsync(p_->grad.p, 0, p_->P * 4, nullptr), "zero grads"); }

GpuModel::LossStats GpuModel::forward_backward(const int32_t* ids, const int32_t* targets, const Seqs& s,
                                               int64_t n_valid_total) {
  LM_CHECK(targets, "forward_backward: targets are required");
  Impl& m = *p_;
  m.profiling = profiling;
  m.training = true;
  const int64_t n_here = m.forward(ids, targets, s);
  m.training = false;
  const int64_t n_norm = n_valid_total > 0 ? n_valid_total : n_here;
  float* d_hn = m.buf<float>("s.d_hn", size_t(m.rows) * m.d * 4);
  oc::CeResult r;
  {
    Impl::Timed t(m.part(Profile::LmHead, true));
    r = oc::cross_entropy_forward_backward(m.get("hn"), m.W("lm_head.weight"), as<int32_t>(m.tgt_d.p), m.rows, m.d,
                                           m.V, n_norm > 0 ? 1.f / static_cast<float>(n_norm) : 0.f, d_hn,
                                           m.G("lm_head.weight"));
  }
  m.backward(d_hn);
  return LossStats{r.loss_sum, r.n_valid};
}

GpuModel::LossStats GpuModel::loss(const int32_t* ids, const int32_t* targets, const Seqs& s) {
  LM_CHECK(targets, "loss: targets are required");
  Impl& m = *p_;
  m.profiling = profiling;
  m.training = false;
  m.forward(ids, targets, s);
  Impl::Timed t(m.part(Profile::LmHead, false));
  const oc::CeResult r = oc::cross_entropy_forward(m.get("hn"), m.W("lm_head.weight"), as<int32_t>(m.tgt_d.p), m.rows,
                                                   m.d, m.V);
  return LossStats{r.loss_sum, r.n_valid};
}

void GpuModel::adamw(const AdamWStep& a) {
  Impl& m = *p_;
  AdamW k;
  k.lr = static_cast<float>(a.lr), k.b1 = static_cast<float>(a.beta1), k.b2 = static_cast<float>(a.beta2);
  k.eps = static_cast<float>(a.eps), k.gscale = static_cast<float>(a.grad_scale);
  k.bc1 = static_cast<float>(1.0 - std::pow(a.beta1, static_cast<double>(a.step)));
  k.bc2 = static_cast<float>(1.0 - std::pow(a.beta2, static_cast<double>(a.step)));
  auto run = [&](size_t b, size_t e, float wd) {
    k.wd = wd;
    adamw_update(as<float>(m.master.p) + b, as<float>(m.grad.p) + b, as<float>(m.mom1.p) + b, as<float>(m.mom2.p) + b,
                 as<uint16_t>(m.wbf.p) + b, static_cast<int64_t>(e - b), k);
  };
  run(0, m.decay_end, static_cast<float>(a.weight_decay));
  run(m.decay_end, m.train_end, 0.f);
  m.refresh_transposed();
}

void GpuModel::balance() {
  Impl& m = *p_;
  for (int64_t i = 0; i < m.L; ++i) {
    if (!m.plan[i].moe()) continue;
    const std::string b = m.P_(i) + ".block_sparse_moe.gate.e_score_correction_bias";
    qb_update(m.get<float>(Impl::K(i, "scores")), m.get<float>(Impl::K(i, "alpha")), m.M(b), m.rows, m.c.num_experts,
              m.c.num_experts_per_token);
  }
}

double GpuModel::grad_norm() const {
  return std::sqrt(sum_squares(as<float>(p_->grad.p), static_cast<int64_t>(p_->train_end)));
}

void GpuModel::get_adam(const std::string& name, float* m, float* v) const {
  const auto& s = p_->slot(name);
  ck(cudaDeviceSynchronize(), "get_adam");
  ck(cudaMemcpy(m, as<float>(p_->mom1.p) + s.off, size_t(s.numel) * 4, cudaMemcpyDeviceToHost), "get_adam");
  ck(cudaMemcpy(v, as<float>(p_->mom2.p) + s.off, size_t(s.numel) * 4, cudaMemcpyDeviceToHost), "get_adam");
}

void GpuModel::set_adam(const std::string& name, const float* m, const float* v) {
  const auto& s = p_->slot(name);
  ck(cudaMemcpy(as<float>(p_->mom1.p) + s.off, m, size_t(s.numel) * 4, cudaMemcpyHostToDevice), "set_adam");
  ck(cudaMemcpy(as<float>(p_->mom2.p) + s.off, v, size_t(s.numel) * 4, cudaMemcpyHostToDevice), "set_adam");
}

std::vector<int64_t> GpuModel::expert_loads(int64_t layer) const {
  const Impl& m = *p_;
  LM_CHECK(layer >= 0 && layer < m.L && m.plan[layer].moe(), "expert_loads: layer {} is not an MoE layer", layer);
  ck(cudaEventSynchronize(m.offsets_h[layer].done), "expert loads");
  std::vector<int64_t> r(m.c.num_experts);
  for (int64_t e = 0; e < m.c.num_experts; ++e) r[e] = m.offsets_h[layer].p[e + 1] - m.offsets_h[layer].p[e];
  return r;
}

std::vector<std::pair<std::string, double>> GpuModel::detail_profile() const {
  return {p_->detail.begin(), p_->detail.end()};
}

std::vector<float> GpuModel::final_hidden() const {
  Impl& m = *p_;
  std::vector<uint16_t> b(size_t(m.rows) * m.d);
  ck(cudaMemcpy(b.data(), m.get("hn"), b.size() * 2, cudaMemcpyDeviceToHost), "final hidden");
  std::vector<float> r(b.size());
  for (size_t i = 0; i < b.size(); ++i) r[i] = bf16_to_f32(b[i]);
  return r;
}

}  // namespace lm::model::cuda

#endif
