// Host side of the KDA CUDA operator: checks, chunk tables, workspace, and the kernel sequence.
//
// Legend: B batch, T tokens, H heads, K key dim, V value dim, C chunk 64, N sequences, NC chunks over all
//         sequences, KP = max(K, V) padded to 64|128, NW warps per block of the recurrences.
// forward:  prep (K1) -> recurrence with the output (K2).
// backward: prep (K1, keeping M and P_kk) -> recurrence keeping S0, E -> reverse recurrence keeping dS, dE
//           -> per-chunk gradients -> dA_log / ddt_bias reduction.
// forward keeping them (`saved`): the backward's prep -> recurrence with the output keeping S0, E; the backward
//           given `saved` starts at the reverse recurrence.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "core/cuda/device.hpp"
#include "core/half.hpp"
#include "ops/kda/cuda/kda_cuda.hpp"
#include "ops/kda/cuda/launch.hpp"

namespace lm::kda::cuda {

using detail::ChunkInfo;
using detail::OpParams;

namespace {

constexpr cu::Checker check{"kda cuda"};

struct Plan {
  int KP = 128, NW = 1, N = 0, NC = 0;
  bool bounded = false, gate_f32 = false;
  float scale = 0.f;
  std::vector<ChunkInfo> chunks;
  std::vector<int> seq_chunk0;
};

bool bounded_ok(const GateParams& g) {
  return g.form == GateForm::LowerBound && g.lower_bound < 0 && -g.lower_bound <= 10.0;
}

Plan make_plan(const Problem& p) {
  if (p.T < 0 || p.B < 1 || p.H < 1) check.fail("bad shape B=" + std::to_string(p.B) + " T=" + std::to_string(p.T));
  if (p.beta_ld != 0 && p.beta_ld < p.H) check.fail("beta_ld must be 0 or at least H");
  if (p.K < 8 || p.K > 128 || p.K % 8 || p.V < 8 || p.V > 128 || p.V % 8)
    check.fail("K and V must be multiples of 8 in [8, 128], got K=" + std::to_string(p.K) + " V=" + std::to_string(p.V));
  if (p.gate.form == GateForm::LowerBound && !(p.gate.lower_bound < 0)) check.fail("lower_bound must be < 0");
  if (int64_t(p.B) * p.T * p.H * std::max(p.K, p.V) >= (int64_t(1) << 31) * 64)
    check.fail("problem too large for 32-bit chunk indices");
  Plan pl;
  pl.KP = std::max(p.K, p.V) <= 64 ? 64 : 128;
  pl.gate_f32 = p.gate_dtype == GateDType::F32;
  pl.scale = p.scale > 0 ? p.scale : float(1.0 / std::sqrt(double(p.K)));
  const bool bok = bounded_ok(p.gate);
  switch (p.diag) {
    case DiagPath::Auto: pl.bounded = bok; break;
    case DiagPath::Exact: pl.bounded = false; break;
    case DiagPath::Bounded:
      if (!bok) check.fail("the bounded diagonal path needs a lower-bounded gate with -10 <= lower_bound < 0");
      pl.bounded = true;
      break;
  }
  std::vector<int64_t> cu;
  if (p.cu_seqlens) {
    if (p.B != 1) check.fail("varlen needs B == 1");
    if (p.N < 1) check.fail("varlen needs N >= 1");
    cu.assign(p.cu_seqlens, p.cu_seqlens + p.N + 1);
    if (cu.front() != 0 || cu.back() != p.T) check.fail("cu_seqlens must start at 0 and end at T");
    for (size_t i = 1; i < cu.size(); ++i)
      if (cu[i] < cu[i - 1]) check.fail("cu_seqlens must be non-decreasing");
  } else {
    for (int64_t b = 0; b <= p.B; ++b) cu.push_back(b * p.T);
  }
  pl.N = int(cu.size() - 1);
  pl.seq_chunk0.push_back(0);
  for (int n = 0; n < pl.N; ++n) {
    for (int64_t t0 = cu[n]; t0 < cu[n + 1]; t0 += detail::kC)
      pl.chunks.push_back(ChunkInfo{n, int(t0), int(std::min<int64_t>(detail::kC, cu[n + 1] - t0)), 0});
    pl.seq_chunk0.push_back(int(pl.chunks.size()));
  }
  pl.NC = int(pl.chunks.size());
  // Warps per block of the recurrences: fewest waves (one block per SM: their shared memory), where two
  // warps per scheduler (NW = 8) cost about half again per chunk; ties go to more, smaller blocks. With
  // K = V = 128 the warpgroup kernels take 4 or 8 warps, and only those are considered.
  const int TW = int((p.V + 15) / 16), sms = cu::sm_count();
  const bool wg = detail::wgmma_recurrences(int(p.K), int(p.V));
  double best = 1e300;
  for (int nw : {1, 2, 4, 8}) {
    if (nw > pl.KP / 16 || (nw > 1 && nw / 2 >= TW) || (wg && nw < 4)) continue;
    const int64_t blocks = int64_t(pl.N) * p.H * ((TW + nw - 1) / nw);
    const double cost = double((blocks + sms - 1) / sms) * (nw == 8 ? 1.5 : 1.0);
    if (cost < best - 1e-9) best = cost, pl.NW = nw;
  }
  return pl;
}

// One device allocation: tables first, then 256-byte aligned workspace tensors.
struct Arena {
  char* base = nullptr;
  size_t off = 0;
  template <class T>
  T* take(size_t count) {
    T* r = reinterpret_cast<T*>(base + off);
    off += (count * sizeof(T) + 255) / 256 * 256;
    return r;
  }
};

// The workspace in two parts. Part::Forward / Part::Kept: the chunk tables and prep's tensors, with M, P_kk, S0
// and E when kept for a backward (what a forward given `saved` leaves there). Part::BackwardOnly: dS, dE and the
// partial sums of dA_log and ddt_bias. Each part's pointers go into op->ws (null op: sizes only).
enum class Part { Forward, Kept, BackwardOnly };
size_t layout(const Plan& pl, const Problem& p, Part part, OpParams* op, char* base) {
  Arena a{base, 0};
  const size_t chs = size_t(pl.NC) * size_t(p.H), KP = size_t(pl.KP);
  detail::Ws w = op ? op->ws : detail::Ws{};
  if (part == Part::BackwardOnly) {
    w.dS = a.take<detail::bf16>(chs * KP * KP);
    w.dE = a.take<detail::bf16>(chs * 64 * KP);
    w.ddt_part = a.take<float>(chs * KP);
    w.dA_part = a.take<float>(std::max<size_t>(chs, 1));
    if (op) op->ws = w;
    return a.off;
  }
  auto* chunks = a.take<ChunkInfo>(std::max<size_t>(pl.chunks.size(), 1));
  auto* sc0 = a.take<int>(pl.seq_chunk0.size());
  w.W = a.take<detail::bf16>(chs * 64 * KP);
  w.U = a.take<detail::bf16>(chs * 64 * KP);
  w.Qg = a.take<detail::bf16>(chs * 64 * KP);
  w.Kd = a.take<detail::bf16>(chs * 64 * KP);
  w.Aqk = a.take<detail::bf16>(chs * 4096);
  w.Gl = a.take<float>(chs * KP);
  if (part == Part::Kept) {
    w.M = a.take<detail::bf16>(chs * 4096);
    w.Pkk = a.take<detail::bf16>(chs * 4096);
    w.S0 = a.take<detail::bf16>(chs * KP * KP);
    w.E = a.take<detail::bf16>(chs * 64 * KP);
  }
  if (op) {
    op->chunks = chunks;
    op->seq_chunk0 = sc0;
    op->ws = w;
  }
  return a.off;
}

OpParams base_params(const Problem& p, const Plan& pl, const Inputs& in) {
  OpParams op{};
  op.q = static_cast<const detail::bf16*>(in.q);
  op.k = static_cast<const detail::bf16*>(in.k);
  op.v = static_cast<const detail::bf16*>(in.v);
  op.g_raw = in.g_raw;
  op.beta_raw = in.beta_raw;
  op.A_log = in.A_log;
  op.dt_bias = in.dt_bias;
  op.h0 = in.h0;
  op.H = int(p.H), op.K = int(p.K), op.V = int(p.V), op.NC = pl.NC;
  op.beta_ld = p.beta_ld ? p.beta_ld : p.H;
  op.scale = pl.scale;
  op.lb = float(p.gate.lower_bound);
  op.softplus = p.gate.form == GateForm::Softplus ? 1 : 0;
  return op;
}

void upload_tables(const Plan& pl, const OpParams& op, cudaStream_t s) {
  if (!pl.chunks.empty())
    check(cudaMemcpyAsync(const_cast<ChunkInfo*>(op.chunks), pl.chunks.data(), pl.chunks.size() * sizeof(ChunkInfo),
                          cudaMemcpyHostToDevice, s),
          "chunk table");
  check(cudaMemcpyAsync(const_cast<int*>(op.seq_chunk0), pl.seq_chunk0.data(), pl.seq_chunk0.size() * sizeof(int),
                        cudaMemcpyHostToDevice, s),
        "sequence table");
}

char* alloc_async(size_t bytes, cudaStream_t s) {
  void* p = nullptr;
  check(cu::malloc_async(&p, std::max<size_t>(bytes, 256), s), "workspace allocation");
  return static_cast<char*>(p);
}

void check_inputs(const Inputs& in) {
  if (!in.q || !in.k || !in.v || !in.g_raw || !in.beta_raw || !in.A_log || !in.dt_bias)
    check.fail("q, k, v, g_raw, beta_raw, A_log and dt_bias are required");
}

struct BenchWs {
  char* base = nullptr;
  size_t bytes = 0;
} g_bench;

}  // namespace

size_t saved_bytes(const Problem& p) { return layout(make_plan(p), p, Part::Kept, nullptr, nullptr); }

void forward(const Problem& p, const Inputs& in, void* o, float* ht, void* stream, void* saved, void* started) {
  check_inputs(in);
  if (!o) check.fail("o is required");
  const Plan pl = make_plan(p);
  auto s = lm::cu::stream(stream);
  cu::keep_freed_memory_in_pool();  // the workspace freed below stays in the pool for the next call
  const Part part = saved ? Part::Kept : Part::Forward;
  char* base = saved ? static_cast<char*>(saved) : alloc_async(layout(pl, p, part, nullptr, nullptr), s);
  OpParams op = base_params(p, pl, in);
  layout(pl, p, part, &op, base);
  op.o = static_cast<detail::bf16*>(o);
  op.ht = ht;
  upload_tables(pl, op, s);
  detail::launch_prep(op, pl.KP, pl.bounded, pl.gate_f32, saved != nullptr, s);
  check(cudaGetLastError(), "prep kernel launch");
  op.started = started;
  detail::launch_recur_fwd(op, pl.KP, pl.NW, pl.N, saved ? 2 : 0, s);
  check(cudaGetLastError(), "recurrence kernel launch");
  if (!saved) check(cudaFreeAsync(base, s), "workspace free");
}

void backward(const Problem& p, const Inputs& in, const void* do_, const float* dht, const Grads& gr, void* stream,
              const void* saved, void* started) {
  check_inputs(in);
  if (!do_ || !gr.dq || !gr.dk || !gr.dv || !gr.dg_raw || !gr.dbeta_raw || !gr.dA_log || !gr.ddt_bias)
    check.fail("do and every gradient except dh0 are required");
  const Plan pl = make_plan(p);
  auto s = lm::cu::stream(stream);
  cu::keep_freed_memory_in_pool();  // the workspace freed below stays in the pool for the next call
  // One allocation: the kept part (unless the forward left it in `saved`), then the backward's own.
  const size_t kept = saved ? 0 : layout(pl, p, Part::Kept, nullptr, nullptr);
  char* base = alloc_async(kept + layout(pl, p, Part::BackwardOnly, nullptr, nullptr), s);
  OpParams op = base_params(p, pl, in);
  layout(pl, p, Part::Kept, &op, saved ? static_cast<char*>(const_cast<void*>(saved)) : base);
  layout(pl, p, Part::BackwardOnly, &op, base + kept);
  op.dout = static_cast<const detail::bf16*>(do_);
  op.dht = dht;
  op.dq = static_cast<detail::bf16*>(gr.dq);
  op.dk = static_cast<detail::bf16*>(gr.dk);
  op.dv = static_cast<detail::bf16*>(gr.dv);
  op.dg_raw = gr.dg_raw;
  op.dbeta_raw = gr.dbeta_raw;
  op.dA_log = gr.dA_log;
  op.ddt_bias = gr.ddt_bias;
  op.dh0 = gr.dh0;
  if (!saved) {
    upload_tables(pl, op, s);
    detail::launch_prep(op, pl.KP, pl.bounded, pl.gate_f32, true, s);
    check(cudaGetLastError(), "prep kernel launch");
    detail::launch_recur_fwd(op, pl.KP, pl.NW, pl.N, 1, s);
    check(cudaGetLastError(), "state recurrence launch");
  }
  op.started = started;
  detail::launch_recur_bwd(op, pl.KP, pl.NW, pl.N, s);
  check(cudaGetLastError(), "reverse recurrence launch");
  detail::launch_chunk_bwd(op, pl.KP, pl.bounded, pl.gate_f32, s);
  check(cudaGetLastError(), "chunk backward launch");
  detail::launch_reduce(op, pl.KP, s);
  check(cudaGetLastError(), "reduce launch");
  check(cudaFreeAsync(base, s), "workspace free");
}

void decode_step(float* state, const Inputs& in, void* o, int64_t S, int64_t H, int64_t K, int64_t V, GateParams gate,
                 float scale, GateDType gate_dtype, void* stream, int64_t beta_ld) {
  check_inputs(in);
  if (!state || !o) check.fail("state and o are required");
  if (beta_ld != 0 && beta_ld < H) check.fail("decode: beta_ld must be 0 or at least H");
  if (K < 8 || K > 128 || K % 8 || V < 8 || V % 8) check.fail("decode: K must be a multiple of 8 in [8, 128], V of 8");
  if (S < 1 || H < 1) return;
  if (gate.form == GateForm::LowerBound && !(gate.lower_bound < 0)) check.fail("lower_bound must be < 0");
  OpParams op{};
  op.q = static_cast<const detail::bf16*>(in.q);
  op.k = static_cast<const detail::bf16*>(in.k);
  op.v = static_cast<const detail::bf16*>(in.v);
  op.g_raw = in.g_raw;
  op.beta_raw = in.beta_raw;
  op.A_log = in.A_log;
  op.dt_bias = in.dt_bias;
  op.H = int(H), op.K = int(K), op.V = int(V);
  op.beta_ld = beta_ld ? beta_ld : H;
  op.scale = scale > 0 ? scale : float(1.0 / std::sqrt(double(K)));
  op.lb = float(gate.lower_bound);
  op.softplus = gate.form == GateForm::Softplus ? 1 : 0;
  op.o = static_cast<detail::bf16*>(o);
  detail::launch_decode(state, op, S, K <= 64 ? 64 : 128, gate_dtype == GateDType::F32, lm::cu::stream(stream));
  check(cudaGetLastError(), "decode kernel launch");
}

void run_forward_stage(const Problem& p, const Inputs& in, void* o, Stage st, void* stream) {
  check_inputs(in);
  const Plan pl = make_plan(p);
  auto s = lm::cu::stream(stream);
  const size_t bytes = layout(pl, p, Part::Forward, nullptr, nullptr);
  if (g_bench.bytes < bytes) {
    if (g_bench.base) check(cudaFree(g_bench.base), "free");
    void* b = nullptr;
    check(cudaMalloc(&b, bytes), "bench workspace");
    g_bench.base = static_cast<char*>(b);
    g_bench.bytes = bytes;
  }
  OpParams op = base_params(p, pl, in);
  layout(pl, p, Part::Forward, &op, g_bench.base);
  op.o = static_cast<detail::bf16*>(o);
  upload_tables(pl, op, s);
  switch (st) {
    case Stage::Prep: detail::launch_prep(op, pl.KP, pl.bounded, pl.gate_f32, false, s); break;
    case Stage::PrepBeforeTiles: detail::launch_prep(op, pl.KP, pl.bounded, pl.gate_f32, false, s, 1); break;
    case Stage::PrepThroughTiles: detail::launch_prep(op, pl.KP, pl.bounded, pl.gate_f32, false, s, 2); break;
    case Stage::PrepThroughDiagonalTiles: detail::launch_prep(op, pl.KP, pl.bounded, pl.gate_f32, false, s, 3); break;
    case Stage::Recurrence: detail::launch_recur_fwd(op, pl.KP, pl.NW, pl.N, 0, s); break;
  }
  check(cudaGetLastError(), "stage launch");
}

PrepDebug debug_prep(const Problem& p, const Inputs& in) {
  check_inputs(in);
  const Plan pl = make_plan(p);
  const size_t bytes = layout(pl, p, Part::Forward, nullptr, nullptr);
  char* base = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&base), bytes), "debug workspace");
  check(cudaMemset(base, 0xff, bytes), "debug workspace poison");
  OpParams op = base_params(p, pl, in);
  layout(pl, p, Part::Forward, &op, base);
  upload_tables(pl, op, nullptr);
  detail::launch_prep(op, pl.KP, pl.bounded, pl.gate_f32, false, nullptr);
  check(cudaGetLastError(), "prep kernel launch");
  check(cudaDeviceSynchronize(), "prep kernel");
  PrepDebug r;
  r.KP = pl.KP, r.NC = pl.NC;
  const size_t chs = size_t(pl.NC) * size_t(p.H);
  auto bf = [&](const detail::bf16* src, size_t n) {
    std::vector<uint16_t> b(n);
    check(cudaMemcpy(b.data(), src, n * 2, cudaMemcpyDeviceToHost), "copy");
    std::vector<float> f(n);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t u = uint32_t(b[i]) << 16;
      float x;
      std::memcpy(&x, &u, 4);
      f[i] = x;
    }
    return f;
  };
  auto hf = [&](const detail::bf16* src, size_t n) {  // fp16 bits (the forward's U, Kd, A_qk)
    std::vector<uint16_t> b(n);
    check(cudaMemcpy(b.data(), src, n * 2, cudaMemcpyDeviceToHost), "copy");
    std::vector<float> f(n);
    for (size_t i = 0; i < n; ++i) f[i] = f16_to_f32(b[i]);
    return f;
  };
  r.W = bf(op.ws.W, chs * 64 * pl.KP), r.U = hf(op.ws.U, chs * 64 * pl.KP);
  r.Qg = bf(op.ws.Qg, chs * 64 * pl.KP), r.Kd = hf(op.ws.Kd, chs * 64 * pl.KP);
  r.Aqk = hf(op.ws.Aqk, chs * 4096);
  r.Gl.resize(chs * pl.KP);
  check(cudaMemcpy(r.Gl.data(), op.ws.Gl, r.Gl.size() * 4, cudaMemcpyDeviceToHost), "copy");
  check(cudaFree(base), "free");
  return r;
}

void release_bench_workspace() {
  if (g_bench.base) cudaFree(g_bench.base);
  g_bench = {};
}

int device_count() { return cu::device_count(); }
void* device_alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc");
  return p;
}
void device_free(void* p) {
  if (p) cudaFree(p);
}
void copy_to_device(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "copy to device");
}
void copy_to_host(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy to host");
}
void device_fill(void* p, int byte, size_t bytes) { check(cudaMemset(p, byte, bytes), "memset"); }
void synchronize() { check(cudaDeviceSynchronize(), "synchronize"); }
void* stream_create() {
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  return s;
}
void stream_destroy(void* s) {
  if (s) cudaStreamDestroy(static_cast<cudaStream_t>(s));
}
void* event_create() {
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return e;
}
void event_destroy(void* e) {
  if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

}  // namespace lm::kda::cuda
