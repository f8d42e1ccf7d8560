// Causal MLA attention on the GPU: forward and forward+backward TFLOP/s, and the absorbed decode's time and
// cache bandwidth. Median of CUDA-event timings after warm-up; prints "RESULT key value" lines that
// bench/peer_attention_moe.py sets beside PyTorch's figures from the same machine and run.
//
// Legend: B batch, T tokens, H heads, Dk/Dv head dims, Tc cached positions.
// FLOPs (the same formula on both sides): causal pairs P = B·H·T²/2; forward 2·P·(Dk + Dv) (S = QKᵀ and PV);
// backward 2·P·(3·Dk + 2·Dv) (S recomputed, dV, dP, dS·K, dSᵀ·Q); forward+backward is their sum.
// The default kernels are the wgmma ones; the mma.sync pair and each wgmma backward alone are timed too
// (fwd_mma, bwd_mma, bwd_wgmma; backward alone includes its row statistics and dQ conversion).
// Run by `longmoe bench attention --device cuda [--reps N] [--peer]`.
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
#include "core/cuda/device.hpp"
#include "ops/attention/cuda/attention_cuda.hpp"

namespace oc = lm::ops::cuda;

namespace lm::bench_cuda {

int attention(int reps_arg) {
  const int reps = std::max(3, reps_arg);
  if (!print_device()) return 2;
  struct Shape {
    int B, T, H, Dk, Dv;
  };
  const std::vector<Shape> shapes = {{1, 8192, 32, 192, 128}, {1, 8192, 64, 192, 128}, {1, 8192, 32, 128, 128},
                                     {4, 4096, 32, 192, 128}};
  for (const Shape& s : shapes) {
    const size_t rows = size_t(s.B) * s.T, nq = rows * s.H * s.Dk, nv = rows * s.H * s.Dv;
    auto *q = rand_bf16(nq, 1), *k = rand_bf16(nq, 2), *v = rand_bf16(nv, 3), *dO = rand_bf16(nv, 4);
    __nv_bfloat16 *o, *dq, *dk, *dv;
    float* lse;
    CK(cudaMalloc(&o, nv * 2));
    CK(cudaMalloc(&dq, nq * 2));
    CK(cudaMalloc(&dk, nq * 2));
    CK(cudaMalloc(&dv, nv * 2));
    CK(cudaMalloc(&lse, rows * s.H * 4));
    CK(cudaDeviceSynchronize());
    oc::AttnShape a;
    a.B = s.B, a.T = s.T, a.H = s.H, a.Dk = s.Dk, a.Dv = s.Dv;
    auto fwd = [&] { oc::attention_forward(a, q, k, v, o, lse); };
    auto fb = [&] {
      oc::attention_forward(a, q, k, v, o, lse);
      oc::attention_backward(a, q, k, v, o, lse, dO, dq, dk, dv);
    };
    const double tf = median_ms(fwd, 3, reps), tfb = median_ms(fb, 2, reps);
    oc::AttnShape am = a;
    am.fwd_kernel = oc::FwdKernel::Mma;
    am.bwd_kernel = oc::BwdKernel::Mma;
    const double tfm = median_ms([&] { oc::attention_forward(am, q, k, v, o, lse); }, 3, reps);
    const double tbm = median_ms([&] { oc::attention_backward(am, q, k, v, o, lse, dO, dq, dk, dv); }, 2, reps);
    const double tbw = median_ms([&] { oc::attention_backward(a, q, k, v, o, lse, dO, dq, dk, dv); }, 2, reps);
    const double pairs = double(s.B) * s.H * double(s.T) * s.T / 2;
    const double ff = 2 * pairs * (s.Dk + s.Dv), fbw = 2 * pairs * (3.0 * s.Dk + 2.0 * s.Dv);
    char key[96];
    std::snprintf(key, sizeof key, "attn_B%d_T%d_H%d_%d_%d", s.B, s.T, s.H, s.Dk, s.Dv);
    result("RESULT %s_fwd_ms %.4f\nRESULT %s_fwd_tflops %.1f\n", key, tf, key, ff / tf / 1e9);
    result("RESULT %s_fwdbwd_ms %.4f\nRESULT %s_fwdbwd_tflops %.1f\n", key, tfb, key, (ff + fbw) / tfb / 1e9);
    result("RESULT %s_bwd_tflops %.1f\n", key, fbw / (tfb - tf) / 1e9);
    result("RESULT %s_fwd_mma_tflops %.1f\nRESULT %s_bwd_mma_tflops %.1f\n", key, ff / tfm / 1e9, key,
                fbw / tbm / 1e9);
    result("RESULT %s_bwd_wgmma_tflops %.1f\nRESULT %s_bwd_wgmma_ms %.4f\n", key, fbw / tbw / 1e9, key, tbw);
    std::fflush(stdout);
    for (void* p : std::vector<void*>{q, k, v, dO, o, dq, dk, dv, lse}) CK(cudaFree(p));
  }

  // Absorbed decode over the 576-wide latent cache: one query per head, bytes = the cache read once. Calls take
  // turns over enough copies of the cache (>= 256 MB) that it comes from device memory, not L2, as it does in a
  // model's decode step; the device copy bandwidth of the same run is its limit.
  const double bw = cu::copy_bandwidth();
  std::printf("absorbed decode (device copy bandwidth %.2f TB/s, measured here):\n", bw / 1e12);
  result("RESULT copy_tbps %.2f\n", bw / 1e12);
  struct Dec {
    int H, Tc;
  };
  for (const Dec d : {Dec{64, 32768}, Dec{128, 32768}, Dec{16, 131072}, Dec{32, 8192}, Dec{64, 1048576}}) {
    auto* ql = rand_bf16(size_t(d.H) * 512, 5, 0.5f);
    auto* qr = rand_bf16(size_t(d.H) * 64, 6, 0.5f);
    const double bytes = double(d.Tc) * 576 * 2, flop = 2.0 * d.H * d.Tc * (576 + 512);
    const int copies = int(std::ceil(256e6 / bytes));
    std::vector<__nv_bfloat16*> caches;
    for (int i = 0; i < copies; ++i) caches.push_back(rand_bf16(size_t(d.Tc) * 576, 7 + uint32_t(i)));
    __nv_bfloat16* ol;
    CK(cudaMalloc(&ol, size_t(d.H) * 512 * 2));
    oc::DecodeShape ds;
    ds.H = d.H, ds.Tc = d.Tc;
    int turn = 0;
    const double t = median_ms([&] { oc::mla_decode(ds, ql, qr, caches[size_t(turn++ % copies)], ol, nullptr); }, 5,
                               std::max(reps * 2, copies));
    result("RESULT decode_H%d_Tc%d_us %.2f\nRESULT decode_H%d_Tc%d_tbps %.2f\nRESULT decode_H%d_Tc%d_tflops %.1f\n",
           d.H, d.Tc, t * 1e3, d.H, d.Tc, bytes / t / 1e9, d.H, d.Tc, flop / t / 1e9);
    std::printf("  H %3d, Tc %7d: %8.2f us, %.2f TB/s of cache read = %.1f%% of copy\n", d.H, d.Tc, t * 1e3,
                bytes / t / 1e9, 100.0 * bytes / t * 1e3 / bw);
    for (void* p : std::vector<void*>{ql, qr, ol}) CK(cudaFree(p));
    for (void* p : caches) CK(cudaFree(p));
  }
  return 0;
}

}  // namespace lm::bench_cuda
