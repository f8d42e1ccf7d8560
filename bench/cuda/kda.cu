// KDA on the GPU: forward and forward+backward times (bounded and softplus gates), the bounded/exact ratio of
// the A-tile stage (inside K1, prep: where the diagonal tiles are MMAs or pairwise), of prep and of the whole
// operator, and batched decode, next to the peer figures
// (fla 0.5.2 Triton kernels measured on an H200). Median of CUDA-event timings after warm-up.
//
// Legend: B batch, T tokens, H heads, K key dim = V value dim.
// Run by `longmoe bench kda --device cuda [--reps N] [--prof]` (--prof: one forward + backward of the first
// shape, for a profiler).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/cuda/benches.hpp"
#include "bench/cuda/common.cuh"
#include "ops/kda/cuda/kda_cuda.hpp"

namespace kc = lm::kda::cuda;

namespace {

using namespace lm::bench_cuda;

struct Shape {
  int B, T, H, K;
  double peer_fwd_b, peer_fwd_s, peer_fb_b, peer_fb_s;
};

}  // namespace

namespace lm::bench_cuda {

int kda(int reps_arg, bool prof) {
  const int reps = prof ? 1 : std::max(3, reps_arg);
  if (!print_device()) return 2;
  const std::vector<Shape> shapes = {{1, 8192, 96, 128, 2.60, 2.89, 12.38, 15.99},
                                     {1, 32768, 32, 128, 3.71, 4.08, 16.45, 21.22},
                                     {8, 4096, 16, 128, 1.67, 1.86, 7.77, 10.18},
                                     {1, 65536, 16, 128, 5.22, 5.59, 20.78, 25.56}};
  struct Row {
    Shape s;
    // tb, te: the A-tile stage, bounded / exact; db, de: its diagonal tiles alone
    double fb, fs, fbb, fbs, pb, pe, fe, fbe, rec, tb, te, head, db, de;
    double kf, kfb;  // training pair, bounded: the forward keeping its tensors (`saved`), and with the backward
  };
  std::vector<Row> rows;
  for (const Shape& s : shapes) {
    const size_t rowsn = size_t(s.B) * s.T, nqk = rowsn * s.H * s.K;
    auto* q = rand_bf16(nqk, 1), *k = rand_bf16(nqk, 2), *v = rand_bf16(nqk, 3), *g = rand_bf16(nqk, 4);
    auto* beta = rand_bf16(rowsn * s.H, 5), *dO = rand_bf16(nqk, 6);
    float* A_log = rand_f32(size_t(s.H), 7, 0.5f, 1.4f);
    float* dt_bias = rand_f32(size_t(s.H) * s.K, 8, 0.5f, 0.f);
    auto* o = dalloc<__nv_bfloat16>(nqk);
    auto *dq = dalloc<__nv_bfloat16>(nqk), *dk = dalloc<__nv_bfloat16>(nqk), *dv = dalloc<__nv_bfloat16>(nqk);
    auto *dg = dalloc<__nv_bfloat16>(nqk), *db = dalloc<__nv_bfloat16>(rowsn * s.H);
    float *dA = dalloc<float>(size_t(s.H)), *ddt = dalloc<float>(size_t(s.H) * s.K);
    CK(cudaDeviceSynchronize());
    kc::Problem p;
    p.B = s.B, p.T = s.T, p.H = s.H, p.K = s.K, p.V = s.K;
    kc::Inputs in{q, k, v, g, beta, A_log, dt_bias, nullptr};
    kc::Grads gr{dq, dk, dv, dg, db, dA, ddt, nullptr};
    auto cfg = [&](lm::kda::GateForm f, lm::kda::DiagPath d) {
      p.gate.form = f;
      p.gate.lower_bound = -5.0;
      p.diag = d;
    };
    using lm::kda::DiagPath;
    using lm::kda::GateForm;
    auto fwd = [&] { kc::forward(p, in, o, nullptr); };
    auto fb = [&] {
      kc::forward(p, in, o, nullptr);
      kc::backward(p, in, dO, nullptr, gr);
    };
    if (prof) {
      cfg(GateForm::LowerBound, DiagPath::Bounded);
      fb();
      CK(cudaDeviceSynchronize());
      return 0;
    }
    const int rf = reps * 2, rb = reps;
    Row r{s, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    // The A-tile stage: prep through the tiles minus prep up to them (same inputs, same launch shape).
    auto tile_stage = [&](double* before_out, double* diag_out) {
      const double before = median_ms([&] { kc::run_forward_stage(p, in, o, kc::Stage::PrepBeforeTiles); }, 3, rf);
      const double through = median_ms([&] { kc::run_forward_stage(p, in, o, kc::Stage::PrepThroughTiles); }, 3, rf);
      const double diag =
          median_ms([&] { kc::run_forward_stage(p, in, o, kc::Stage::PrepThroughDiagonalTiles); }, 3, rf);
      if (before_out) *before_out = before;
      *diag_out = diag - before;
      return through - before;
    };
    cfg(GateForm::LowerBound, DiagPath::Bounded);
    r.fb = median_ms(fwd, 3, rf);
    r.fbb = median_ms(fb, 2, rb);
    r.pb = median_ms([&] { kc::run_forward_stage(p, in, o, kc::Stage::Prep); }, 3, rf);
    r.rec = median_ms([&] { kc::run_forward_stage(p, in, o, kc::Stage::Recurrence); }, 3, rf);
    r.tb = tile_stage(&r.head, &r.db);
    {
      void* saved = nullptr;
      CK(cudaMalloc(&saved, kc::saved_bytes(p)));
      r.kf = median_ms([&] { kc::forward(p, in, o, nullptr, nullptr, saved); }, 3, rf);
      r.kfb = median_ms(
          [&] {
            kc::forward(p, in, o, nullptr, nullptr, saved);
            kc::backward(p, in, dO, nullptr, gr, nullptr, saved);
          },
          2, rb);
      CK(cudaFree(saved));
    }
    cfg(GateForm::LowerBound, DiagPath::Exact);
    r.fe = median_ms(fwd, 3, rf);
    r.fbe = median_ms(fb, 2, rb);
    r.pe = median_ms([&] { kc::run_forward_stage(p, in, o, kc::Stage::Prep); }, 3, rf);
    r.te = tile_stage(nullptr, &r.de);
    cfg(GateForm::Softplus, DiagPath::Exact);
    r.fs = median_ms(fwd, 3, rf);
    r.fbs = median_ms(fb, 2, rb);
    CK(cudaDeviceSynchronize());
    rows.push_back(r);
    kc::release_bench_workspace();
    for (void* x : std::vector<void*>{q, k, v, g, beta, dO, A_log, dt_bias, o, dq, dk, dv, dg, db, dA, ddt}) CK(cudaFree(x));
    std::printf("done (%d,%d,%d,%d)\n", s.B, s.T, s.H, s.K);
    std::fflush(stdout);
  }

  // decode: B = 64, H = 96, K = V = 128, fp32 state read and written once per step
  const int DB = 64, DH = 96, DK = 128;
  const size_t sq = size_t(DB) * DH * DK, ns = sq * DK;
  float* state = rand_f32(ns, 11, 0.1f, 0.f);
  auto *q = rand_bf16(sq, 12), *k = rand_bf16(sq, 13), *v = rand_bf16(sq, 14), *g = rand_bf16(sq, 15);
  auto* beta = rand_bf16(size_t(DB) * DH, 16);
  float* A_log = rand_f32(DH, 17, 0.5f, 1.4f);
  float* dt_bias = rand_f32(size_t(DH) * DK, 18, 0.5f, 0.f);
  auto* o = dalloc<__nv_bfloat16>(sq);
  CK(cudaDeviceSynchronize());
  kc::Inputs din{q, k, v, g, beta, A_log, dt_bias, nullptr};
  lm::kda::GateParams gp;
  const double dec_ms =
      median_ms([&] { kc::decode_step(state, din, o, DB, DH, DK, DK, gp); }, 5, 50);
  const double dec_tb = 2.0 * ns * 4 / (dec_ms * 1e-3) / 1e12;
  // copy ceiling for reference: device-to-device copy of the state
  float* tmp = dalloc<float>(ns);
  const double cp_ms = median_ms([&] { CK(cudaMemcpyAsync(tmp, state, ns * 4, cudaMemcpyDeviceToDevice)); }, 3, 20);
  const double cp_tb = 2.0 * ns * 4 / (cp_ms * 1e-3) / 1e12;

  std::printf("\nKDA CUDA, ms (median); peer = fla 0.5.2 Triton on an H200\n");
  std::printf("%-20s | %-23s | %-23s | %-25s | %-25s\n", "(B,T,H,K=V)", "fwd bounded / softplus", "peer",
              "fwd+bwd bounded / softpl", "peer");
  for (const Row& r : rows)
    std::printf("(%d,%d,%d,%d)%*s | %9.3f / %9.3f   | %9.2f / %9.2f   | %10.3f / %10.3f  | %10.2f / %10.2f\n", r.s.B,
                r.s.T, r.s.H, r.s.K, int(20 - 13 - std::log10(double(r.s.T)) - std::log10(double(r.s.H))), "", r.fb, r.fs,
                r.s.peer_fwd_b, r.s.peer_fwd_s, r.fbb, r.fbs, r.s.peer_fb_b, r.s.peer_fb_s);
  std::printf("\ntraining pair, bounded: the forward keeps its intra-chunk tensors and chunk-start states for the"
              " backward (as `longmoe train` runs it)\n");
  std::printf("%-20s | %-10s | %-14s | %-10s\n", "(B,T,H,K=V)", "fwd keeps", "fwd+bwd keeps", "peer");
  for (const Row& r : rows)
    std::printf("(%d,%d,%d,%d)%*s | %10.3f | %14.3f | %10.2f\n", r.s.B, r.s.T, r.s.H, r.s.K,
                int(20 - 13 - std::log10(double(r.s.T)) - std::log10(double(r.s.H))), "", r.kf, r.kfb, r.s.peer_fb_b);
  std::printf("\nlower-bound gate, exact / bounded diagonal path (time ratio; > 1 means the bounded path is faster)\n");
  std::printf("%-20s | %-36s | %-14s | %-21s | %-8s | %-21s | %-8s | %-13s | %-11s | fwd TFLOP/s\n",
              "(B,T,H,K=V)", "prep bnd/exact ms (head, rec: bnd)", "prep exact/bnd", "A-tile stage bnd/exact",
              "tile e/b", "diag tiles bnd/exact", "diag e/b", "fwd exact/bnd", "fwd+bwd e/b");
  for (const Row& r : rows) {
    const double flop = double(r.s.B) * r.s.T * r.s.H * (6.0 * r.s.K * r.s.K + 3.0 * 64 * r.s.K + 64.0 * 64);
    std::printf(
        "(%d,%d,%d,%d)%*s | %6.3f / %6.3f (head %.3f, rec %.3f) | %14.2f | %9.3f / %9.3f | %8.2f | %9.3f / %9.3f | "
        "%8.2f | %13.2f | %11.2f | %.1f\n",
        r.s.B, r.s.T, r.s.H, r.s.K, int(20 - 13 - std::log10(double(r.s.T)) - std::log10(double(r.s.H))), "", r.pb,
        r.pe, r.head, r.rec, r.pe / r.pb, r.tb, r.te, r.te / r.tb, r.db, r.de, r.de / r.db, r.fe / r.fb, r.fbe / r.fbb,
        flop / (r.fb * 1e-3) / 1e12);
  }
  std::printf("\ndecode B=64 H=96 K=V=128: %.1f us/step, %.2f TB/s (state read+write); peer 266-277 us, ~3.0 TB/s;"
              " D2D copy of the state %.2f TB/s\n",
              dec_ms * 1e3, dec_tb, cp_tb);
  return 0;
}

}  // namespace lm::bench_cuda
