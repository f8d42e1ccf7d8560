// Batched single-token KDA decode (SPEC §2), fp32 state updated in place; memory-bound on the state.
//
// Legend: S sequences, H heads, K key dim, V value dim, KP = K padded to 64|128; d key row, e value column.
// One block per (sequence, head, 128 value columns); warp w owns key rows [w*KP/8, (w+1)*KP/8), a lane 4
// columns: all of a thread's 16 rows are loaded before any use (256 bytes in flight per thread); the
// per-row gate values go through shared memory to keep registers for the state. The state is read once and written once: with S' = Diag(e^g) S,
//   u = S'ᵀ k,  w = S'ᵀ q  (one reduction over d for both),  e = β (v - u),  S = S' + k eᵀ,
//   o = scale Sᵀ q = scale (w + (k·q) e).
#include "ops/kda/cuda/launch.hpp"

namespace lm::kda::cuda::detail {
namespace {

template <int KP, typename GT>
__global__ void __launch_bounds__(256, 2) decode_kernel(float* __restrict__ state, const OpParams p) {
  constexpr int RPW = KP / 8;
  __shared__ float4 red[8][2][32];
  __shared__ float rowd[8][RPW][3];  // per key row: decay e^g, unit k, unit q
  const int sh = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = p.H, K = p.K, V = p.V, h = sh % H;
  const int e0 = blockIdx.y * 128 + lane * 4;
  const bool eok = e0 < V;
  float* S = state + int64_t(sh) * K * V;
  // All of this lane's state loads first: 16 x 16 bytes in flight per thread.
  float4 s[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int d = warp * RPW + r;
    s[r] = (eok && d < K) ? __ldcs(reinterpret_cast<const float4*>(S + int64_t(d) * V + e0))
                          : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // norms and k·q (every warp, so no block barrier is needed before the rows)
  const bf16* q = p.q + int64_t(sh) * K;
  const bf16* k = p.k + int64_t(sh) * K;
  float sq = 0.f, sk = 0.f, qk = 0.f;
  for (int d = lane; d < K; d += 32) {
    const float x = __bfloat162float(q[d]), y = __bfloat162float(k[d]);
    sq += x * x, sk += y * y, qk += x * y;
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) {
    sq += __shfl_xor_sync(0xffffffffu, sq, o);
    sk += __shfl_xor_sync(0xffffffffu, sk, o);
    qk += __shfl_xor_sync(0xffffffffu, qk, o);
  }
  const float rq = 1.f / sqrtf(sq + 1e-6f), rk = 1.f / sqrtf(sk + 1e-6f);
  if (lane < RPW) {  // one lane per row of this warp: the gate and the unit vectors
    const int d = warp * RPW + lane;
    float dec = 1.f, kn = 0.f, qn = 0.f;
    if (d < K) {
      const GT* graw = static_cast<const GT*>(p.g_raw) + int64_t(sh) * K;
      dec = __expf(gate_fwd(to_f(graw[d]) + p.dt_bias[int64_t(h) * K + d], expf(p.A_log[h]), p.lb, p.softplus != 0));
      kn = __bfloat162float(k[d]) * rk;
      qn = __bfloat162float(q[d]) * rq;
    }
    rowd[warp][lane][0] = dec, rowd[warp][lane][1] = kn, rowd[warp][lane][2] = qn;
  }
  __syncwarp();
  float4 u = make_float4(0.f, 0.f, 0.f, 0.f), w = u;
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const float dec = rowd[warp][r][0], kn = rowd[warp][r][1], qn = rowd[warp][r][2];
    s[r].x *= dec, s[r].y *= dec, s[r].z *= dec, s[r].w *= dec;
    u.x += kn * s[r].x, u.y += kn * s[r].y, u.z += kn * s[r].z, u.w += kn * s[r].w;
    w.x += qn * s[r].x, w.y += qn * s[r].y, w.z += qn * s[r].z, w.w += qn * s[r].w;
  }
  red[warp][0][lane] = u;
  red[warp][1][lane] = w;
  __syncthreads();
  u = make_float4(0.f, 0.f, 0.f, 0.f), w = u;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 a0 = red[i][0][lane], a1 = red[i][1][lane];
    u.x += a0.x, u.y += a0.y, u.z += a0.z, u.w += a0.w;
    w.x += a1.x, w.y += a1.y, w.z += a1.z, w.w += a1.w;
  }
  if (!eok) return;
  const float beta = sigmoidf_(to_f(static_cast<const GT*>(p.beta_raw)[int64_t(sh / H) * p.beta_ld + h]));
  const uint2 vr = *reinterpret_cast<const uint2*>(p.v + int64_t(sh) * V + e0);
  const float2 v01 = unpack_bf16(vr.x), v23 = unpack_bf16(vr.y);
  const float4 ev = make_float4(beta * (v01.x - u.x), beta * (v01.y - u.y), beta * (v23.x - u.z), beta * (v23.y - u.w));
  if (warp == 0) {
    const float kq = qk * rq * rk, sc = p.scale;
    const uint2 o = make_uint2(pack_bf16(sc * (w.x + kq * ev.x), sc * (w.y + kq * ev.y)),
                               pack_bf16(sc * (w.z + kq * ev.z), sc * (w.w + kq * ev.w)));
    *reinterpret_cast<uint2*>(p.o + int64_t(sh) * V + e0) = o;
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int d = warp * RPW + r;
    const float kn = rowd[warp][r][1];
    if (d < K)
      __stcs(reinterpret_cast<float4*>(S + int64_t(d) * V + e0),
             make_float4(s[r].x + kn * ev.x, s[r].y + kn * ev.y, s[r].z + kn * ev.z, s[r].w + kn * ev.w));
  }
}

}  // namespace

void launch_decode(float* state, const OpParams& p, int64_t S, int KP, bool gate_f32, cudaStream_t s) {
  const dim3 grid(unsigned(S * p.H), unsigned((p.V + 127) / 128));
  if (KP == 64) {
    if (gate_f32) decode_kernel<64, float><<<grid, 256, 0, s>>>(state, p);
    else decode_kernel<64, bf16><<<grid, 256, 0, s>>>(state, p);
  } else {
    if (gate_f32) decode_kernel<128, float><<<grid, 256, 0, s>>>(state, p);
    else decode_kernel<128, bf16><<<grid, 256, 0, s>>>(state, p);
  }
}

}  // namespace lm::kda::cuda::detail
