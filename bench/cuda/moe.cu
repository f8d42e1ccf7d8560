// MoE on the GPU: grouped expert GEMM TFLOP/s (plain, and with SiTU-GLU fused into the epilogue), the whole
// expert FFN, the decode expert FFN (few-row against wgmma kernels, against the copy bandwidth), and the router /
// permutation / gather / combine times. Median of CUDA-event timings after
// warm-up; prints "RESULT key value" lines that bench/peer_attention_moe.py sets beside torch._grouped_mm
// measured on the same shapes in the same run.
//
// Legend: E experts, m_e rows of expert e (M = Σ m_e), K reduction dim, N output dim, I intermediate width,
//         ℓ expert width (the latent, routed_expert_hidden_size). FLOPs = 2·M·N·K.
// Shapes: "g64": 64 experts × 2048 rows, 1024 → 768 (the issue's peer shape); "k3": K3's latent experts
// (ℓ = 3584, I = 3072), 64 experts × 256 rows (uniform) and with uneven counts (mean 256): W13 (ℓ → 2I) and
// W2 (I → ℓ). Weight gradients ("wgrad_k3_1b"): k3-1b training (E = 64, ℓ = 768, I = 384, mean 2048 rows),
// dW2 [ℓ, I] += d_eoᵀ · h and dW13 [2I, ℓ] += dabᵀ · xs, beside the per-expert cuBLAS products they replace.
// Run by `longmoe bench moe --device cuda [--reps N] [--peer]`.
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
#include "core/env.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"
#include "ops/moe/cuda/moe_cuda.hpp"

namespace oc = lm::ops::cuda;

namespace {

using namespace lm::bench_cuda;

// Uneven expert counts with the given mean (deterministic): m_e = mean · (0.25 .. 1.75), summing to E·mean.
std::vector<int> uneven(int E, int mean) {
  std::vector<int> c(static_cast<size_t>(E));
  int total = 0;
  for (int e = 0; e < E; ++e) total += c[size_t(e)] = int(mean * (0.25 + 1.5 * ((e * 37) % E) / double(E - 1)));
  c[0] += E * mean - total;
  return c;
}

// Row offsets [E + 1] of per-expert counts, on the host and (out) on the device.
std::vector<int32_t> offsets_of(const std::vector<int>& counts, int32_t** dev) {
  std::vector<int32_t> off(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  *dev = lm::bench_cuda::dalloc<int32_t>(off.size());
  CK(cudaMemcpy(*dev, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  return off;
}

struct GemmCase {
  std::string name;
  std::vector<int> counts;
  int N, K;
  bool glu;
};

}  // namespace

namespace lm::bench_cuda {

int moe(int reps_arg) {
  const int reps = std::max(3, reps_arg);
  if (!print_device()) return 2;

  const std::vector<GemmCase> cases = {
      {"g64_2048x1024x768", std::vector<int>(64, 2048), 768, 1024, false},
      {"g64_2048x1024x768_glu", std::vector<int>(64, 2048), 768, 1024, true},  // I = 384: 2I = 768 weight rows
      {"k3_w13_uniform", std::vector<int>(64, 256), 6144, 3584, false},
      {"k3_w13_uniform_glu", std::vector<int>(64, 256), 6144, 3584, true},
      {"k3_w2_uniform", std::vector<int>(64, 256), 3584, 3072, false},
      {"k3_w13_uneven", uneven(64, 256), 6144, 3584, false},
      {"k3_w2_uneven", uneven(64, 256), 3584, 3072, false},
  };
  for (const GemmCase& c : cases) {
    const int E = int(c.counts.size());
    int32_t* doff = nullptr;
    const int64_t M = offsets_of(c.counts, &doff).back();
    auto* x = rand_bf16(size_t(M) * c.K, 1, 1.f);
    auto* w = rand_bf16(size_t(E) * c.N * c.K, 2, 0.02f);
    auto* y = dalloc<__nv_bfloat16>(size_t(M) * c.N);
    CK(cudaDeviceSynchronize());
    auto run = [&] {
      if (c.glu) oc::grouped_gemm_glu(x, w, y, nullptr, doff, M, c.N / 2, c.K, E);
      else oc::grouped_gemm(x, w, y, doff, M, c.N, c.K, E);
    };
    const double t = median_ms(run, 3, reps);
    result("RESULT gemm_%s_ms %.4f\nRESULT gemm_%s_tflops %.1f\n", c.name.c_str(), t, c.name.c_str(),
                2.0 * M * c.N * c.K / t / 1e9);
    // Tile order (0: m outer, 1: per expert n outer) and epilogue (0: direct, 1: staged) variants.
    for (int v = 0; v < 4; ++v) {
      setenv(env::kGgOrder, v & 1 ? "1" : "0", 1);
      setenv(env::kGgEpi, v & 2 ? "1" : "0", 1);
      const double tv = median_ms(run, 2, reps);
      result("RESULT gemm_%s_o%de%d_tflops %.1f\n", c.name.c_str(), v & 1, v >> 1, 2.0 * M * c.N * c.K / tv / 1e9);
    }
    unsetenv(env::kGgOrder);
    unsetenv(env::kGgEpi);
    std::fflush(stdout);
    for (void* p : std::vector<void*>{x, w, y, doff}) CK(cudaFree(p));
  }

  // Expert weight gradients at the k3-1b training shapes, accumulated into fp32 as the backward does
  // (model/cuda/moe.cpp), against the path they replace (its LONGMOE_MOE_WGRAD_CUBLAS=1 fallback): one cuBLAS product
  // per expert, concurrent on side streams (gemm_bf16_grouped). speedup = cuBLAS ms / ours; err = rel. RMS of
  // ours against cuBLAS (both written, not accumulated).
  struct WgradCase {
    std::string name;
    std::vector<int> counts;
    int N, K;
  };
  const std::vector<WgradCase> wcases = {
      {"k3_1b_dw2_uniform", std::vector<int>(64, 2048), 768, 384},  // dy = d_eo [M, ℓ], x = h [M, I]
      {"k3_1b_dw2_uneven", uneven(64, 2048), 768, 384},
      {"k3_1b_dw13_uniform", std::vector<int>(64, 2048), 768, 768},  // dy = dab [M, 2I], x = xs [M, ℓ]
      {"k3_1b_dw13_uneven", uneven(64, 2048), 768, 768},
  };
  for (const WgradCase& c : wcases) {
    const int E = int(c.counts.size());
    int32_t* doff = nullptr;
    const std::vector<int32_t> off = offsets_of(c.counts, &doff);
    const int64_t M = off.back(), N = c.N, K = c.K, NK = N * K;
    auto* dy = rand_bf16(size_t(M) * N, 6, 1.f);
    auto* x = rand_bf16(size_t(M) * K, 7, 1.f);
    float* dw = rand_f32(size_t(E) * NK, 8, 1.f);
    float* dw_ref = dalloc<float>(size_t(E) * NK);
    auto groups_into = [&](float* out) {  // as model/cuda/moe.cpp's cuBLAS fallback builds them
      std::vector<oc::GemmGroup> g;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = off[size_t(e)], me = off[size_t(e + 1)] - r0;
        g.push_back({N, K, me, dy + r0 * N, N, x + r0 * K, K, out + e * NK, K});
      }
      return g;
    };
    const std::vector<oc::GemmGroup> groups = groups_into(dw), groups_ref = groups_into(dw_ref);
    CK(cudaDeviceSynchronize());
    // Agreement first (written, not accumulated), so a wrong kernel's timing is not taken at face value.
    oc::grouped_gemm_wgrad(dy, x, dw, doff, M, N, K, E, false);
    oc::gemm_bf16_grouped(true, false, groups_ref, 1.f, 0.f, lm::DType::F32);
    CK(cudaDeviceSynchronize());
    std::vector<float> a(size_t(E) * NK), b(a.size());
    CK(cudaMemcpy(a.data(), dw, a.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), dw_ref, b.size() * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double d = double(a[i]) - b[i];
      num += d * d, den += double(b[i]) * b[i];
    }
    const double rel = std::sqrt(num / std::max(den, 1e-300));
    const double tg = median_ms([&] { oc::grouped_gemm_wgrad(dy, x, dw, doff, M, N, K, E, true); }, 3, reps);
    const double tb =
        median_ms([&] { oc::gemm_bf16_grouped(true, false, groups, 1.f, 1.f, lm::DType::F32); }, 3, reps);
    const double fl = 2.0 * M * N * K;
    std::printf("wgrad %-20s M %lld N %lld K %lld: ours %.3f ms %.1f TFLOP/s | cuBLAS per expert %.3f ms "
                "%.1f TFLOP/s | speed-up %.2f | rel. err vs cuBLAS %.1e\n",
                c.name.c_str(), (long long)M, (long long)N, (long long)K, tg, fl / tg / 1e9, tb, fl / tb / 1e9, tb / tg,
                rel);
    const char* n = c.name.c_str();
    result("RESULT wgrad_%s_ms %.4f\nRESULT wgrad_%s_tflops %.1f\n", n, tg, n, fl / tg / 1e9);
    result("RESULT wgrad_%s_cublas_ms %.4f\nRESULT wgrad_%s_cublas_tflops %.1f\n", n, tb, n, fl / tb / 1e9);
    result("RESULT wgrad_%s_speedup %.3f\nRESULT wgrad_%s_err %.2e\n", n, tb / tg, n, rel);
    std::fflush(stdout);
    for (void* p : std::vector<void*>{dy, x, dw, dw_ref, doff}) CK(cudaFree(p));
  }

  // Decode: the expert FFN of a few tokens (GLU product, then W2), the few-row kernels (few_rows.cu, what decode
  // steps take) against the wgmma ones in the same run. Each timed call routes the m tokens to k distinct experts
  // drawn afresh (16 routings in turn), so the weights come from device memory, not L2. GB = the selected experts'
  // weights (3·d·I bf16 each, the bytes a decode step must read), against the device copy bandwidth.
  {
    const double bw = cu::copy_bandwidth();
    std::printf("expert FFN at decode (device copy bandwidth %.2f TB/s, measured here):\n", bw / 1e12);
    struct DecCase {
      const char* name;
      int E, k, d, I;
    };
    for (const DecCase& dc : {DecCase{"kimi_linear_48b", 256, 8, 2304, 1024}, DecCase{"k3_1b", 64, 8, 768, 384}})
      for (const int m : {1, 4, 8, 32, 64, 128}) {
        const int E = dc.E, k = dc.k, M = m * k, d = dc.d, I = dc.I;
        constexpr int kRoutings = 16;
        std::vector<int32_t*> offs;
        double distinct = 0;
        for (int r = 0; r < kRoutings; ++r) {
          std::vector<int> counts(size_t(E), 0);
          for (int t = 0; t < m; ++t)  // k distinct experts per token
            for (int j = 0; j < k; ++j) {
              int e = int((uint64_t(r + 1) * 2654435761u + uint64_t(t) * 40503u + uint64_t(j) * 97u) % uint64_t(E));
              while (counts[size_t(e)] > t) e = (e + 1) % E;
              ++counts[size_t(e)];
            }
          for (int c : counts) distinct += c > 0;
          int32_t* dv = nullptr;
          offsets_of(counts, &dv);
          offs.push_back(dv);
        }
        distinct /= kRoutings;
        auto* xs = rand_bf16(size_t(M) * d, 11, 1.f);
        auto* w13 = rand_bf16(size_t(E) * 2 * I * d, 12, 0.02f);
        auto* w2 = rand_bf16(size_t(E) * d * I, 13, 0.02f);
        auto* h = dalloc<__nv_bfloat16>(size_t(M) * I);
        auto* eo = dalloc<__nv_bfloat16>(size_t(M) * d);
        int it = 0;
        auto timed = [&](bool few) {
          return median_ms([&] {
                   for (int r = 0; r < kRoutings; ++r, ++it) {
                     const int32_t* o = offs[size_t(it % kRoutings)];
                     if (few) {
                       oc::grouped_gemm_glu_few_rows(xs, w13, h, nullptr, o, M, I, d, E);
                       oc::grouped_gemm_few_rows(h, w2, eo, o, M, d, I, E);
                     } else {
                       oc::grouped_gemm_glu(xs, w13, h, nullptr, o, M, I, d, E);
                       oc::grouped_gemm(h, w2, eo, o, M, d, I, E);
                     }
                   }
                 }, 2, reps) / kRoutings;
        };
        const double gb = distinct * 3.0 * d * I * 2 / 1e9;
        const double t_few = timed(true), t_mma = timed(false);
        std::printf("  %-16s m %2d (M %3d, %5.1f experts, %.3f GB): few-row %7.1f us %5.2f TB/s (%4.1f%% of copy) | "
                    "wgmma %7.1f us %5.2f TB/s (%4.1f%%) | speed-up %.2f\n",
                    dc.name, m, M, distinct, gb, t_few * 1e3, gb / t_few, 100 * gb / t_few * 1e12 / bw, t_mma * 1e3,
                    gb / t_mma, 100 * gb / t_mma * 1e12 / bw, t_mma / t_few);
        result("RESULT decode_ffn_%s_m%d_few_us %.1f\nRESULT decode_ffn_%s_m%d_wgmma_us %.1f\n", dc.name, m,
               t_few * 1e3, dc.name, m, t_mma * 1e3);
        std::fflush(stdout);
        for (int32_t* o : offs) CK(cudaFree(o));
        for (void* p : std::vector<void*>{xs, w13, w2, h, eo}) CK(cudaFree(p));
      }
  }

  // Routing path at a K3-like step: m tokens, n = 896 experts, k = 16, d = 3584 (latent rows).
  {
    const int m = 8192, n = 896, k = 16, d = 3584;
    float* logits = dalloc<float>(size_t(m) * n);
    fill_f32<<<1024, 256>>>(logits, size_t(m) * n, 3, 2.f);
    float* bias = dalloc<float>(n);
    fill_f32<<<4, 256>>>(bias, n, 4, 0.1f);
    int32_t *idx = dalloc<int32_t>(size_t(m) * k), *off = dalloc<int32_t>(n + 1), *rows = dalloc<int32_t>(size_t(m) * k),
            *pos = dalloc<int32_t>(size_t(m) * k);
    float *w = dalloc<float>(size_t(m) * k), *alpha = dalloc<float>(m);
    auto* x = rand_bf16(size_t(m) * d, 5, 1.f);
    auto* xs = dalloc<__nv_bfloat16>(size_t(m) * k * d);
    auto* y = dalloc<__nv_bfloat16>(size_t(m) * d);
    CK(cudaGetLastError());
    oc::RouterOut ro{idx, w, nullptr, nullptr, alpha};
    const double tr = median_ms([&] { oc::router_forward(logits, bias, m, n, k, true, 2.5f, ro); }, 3, reps);
    const double tp = median_ms([&] { oc::moe_permute(idx, m, k, n, off, rows, pos); }, 3, reps);
    const double tg = median_ms([&] { oc::moe_gather(x, rows, xs, m, k, d); }, 3, reps);
    const double tc = median_ms([&] { oc::moe_combine(xs, w, pos, y, m, k, d); }, 3, reps);
    const double gb = double(m) * k * d * 2 * 2;  // gather: rows read (from L2 mostly) + written; combine alike
    result("RESULT route_m%d_n%d_k%d_router_us %.1f\nRESULT route_m%d_n%d_k%d_permute_us %.1f\n", m, n, k, tr * 1e3,
                m, n, k, tp * 1e3);
    result("RESULT route_gather_d%d_us %.1f\nRESULT route_gather_d%d_tbps %.2f\n", d, tg * 1e3, d, gb / tg / 1e9);
    result("RESULT route_combine_d%d_us %.1f\nRESULT route_combine_d%d_tbps %.2f\n", d, tc * 1e3, d,
                (double(m) * k * d * 2 + double(m) * d * 2) / tc / 1e9);
    for (void* p : std::vector<void*>{logits, bias, idx, off, rows, pos, w, alpha, x, xs, y}) CK(cudaFree(p));
  }
  return 0;
}

}  // namespace lm::bench_cuda
