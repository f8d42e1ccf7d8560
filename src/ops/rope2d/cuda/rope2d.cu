// 2-D RoPE on the GPU, in place (math and table layout in ops/rope2d/rope2d.hpp; the loop of rope2d.cpp).
//
// Legend: rows tokens, H heads, Dh head dim, J = Dh/4, ld row stride of x. x bf16 [rows, ld]; cs fp32
//         [rows, J, 2, 2]: per (token, j) (cos, sin) of the column angle (channels 4j, 4j+1), then of the row
//         angle (channels 4j+2, 4j+3).
// One thread per complex pair (2m, 2m+1) of one head: items rows · H · Dh/2, grid-stride. Pair m = 2j + s reads
// cs[r, j, s, :] = cs[r·Dh + 2m .. 2m+1]: the pair's channel offset within the head equals its table offset.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#include "ops/rope2d/cuda/rope2d_cuda.hpp"

namespace lm::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr cu::Checker check{"rope2d cuda"};

__global__ void rope2d_kernel(bf16* x, int64_t rows, int64_t H, int64_t Dh, int64_t ld, const float* __restrict__ cs,
                              float sgn) {
  const int64_t half = Dh / 2, per_row = H * half, n = rows * per_row;
  for (int64_t it = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; it < n; it += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = it / per_row, rem = it - r * per_row, h = rem / half, m = rem - h * half;
    const float co = cs[r * Dh + 2 * m], si = sgn * cs[r * Dh + 2 * m + 1];
    bf16* z = x + r * ld + h * Dh + 2 * m;
    const float a = __bfloat162float(z[0]), b = __bfloat162float(z[1]);
    z[0] = __float2bfloat16_rn(a * co - b * si);
    z[1] = __float2bfloat16_rn(a * si + b * co);
  }
}

constexpr int kThreads = 256;

}  // namespace

void rope2d_apply(void* x, int64_t rows, int64_t H, int64_t Dh, int64_t ld, const float* cs, bool inverse,
                  void* stream) {
  if (rows < 0 || H < 1 || Dh < 4 || Dh % 4 != 0)
    check.fail("rope2d_apply: need rows >= 0, H >= 1 and Dh a multiple of 4, got rows=" + std::to_string(rows) +
               " H=" + std::to_string(H) + " Dh=" + std::to_string(Dh));
  if (ld < H * Dh) check.fail("rope2d_apply: row stride " + std::to_string(ld) + " < H·Dh = " + std::to_string(H * Dh));
  if (rows == 0) return;
  if (!x || !cs) check.fail("rope2d_apply: null argument");
  const int64_t items = rows * H * (Dh / 2);
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, 132 * 16)));
  rope2d_kernel<<<grid, kThreads, 0, lm::cu::stream(stream)>>>(static_cast<bf16*>(x), rows, H, Dh, ld, cs,
                                                               inverse ? -1.f : 1.f);
  check(cudaGetLastError(), "rope2d_apply launch");
}

}  // namespace lm::ops::cuda
