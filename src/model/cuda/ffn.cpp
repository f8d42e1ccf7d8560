// GLU feed-forward blocks on the GPU (GpuModel::Impl, gpu_model_impl.hpp; the CPU layer is model/ffn.cpp): a
// layer's dense FFN and an MoE layer's shared expert (moe.cpp), forward and backward. Their activations are
// FfnActs (named "L<i>.mlp.*" or "L<i>.shared.*" in messages); the backward's scratch ffn_dh, ffn_dab is shared.
//
// Legend: n rows, din input width (d), I intermediate width.
//   ab = x [W_gate; W_up]ᵀ   [n, 2I]  (one GEMM: gate_proj and up_proj lie back to back; row stride ldab)
//   h  = GLU(ab)             [n, I]   (SiTU-GLU or SwiGLU)
//   y  = base + h W_downᵀ    fp32 [n, din]
#ifdef LONGMOE_HAVE_CUDA

#include "model/cuda/gpu_model_impl.hpp"

#include "ops/gemm/cuda/gemm_cuda.hpp"
#include "ops/glu/cuda/glu_cuda.hpp"

#include <algorithm>

namespace lm::model::cuda {

ops::GluParams GpuModel::Impl::glu() const { return glu_params(c); }

// Dense GLU FFN under `prefix` (gate_proj and up_proj adjacent: one [2I, din] weight) over x [n, din] bf16.
// y = base + ffn(x) (base null: y = ffn(x); base == y: in place).
void GpuModel::Impl::ffn_forward(FfnActs& a, const std::string& prefix, const void* x, int64_t n, int64_t din,
                                 int64_t I, float* y, const float* base) {
  void* ab = grow(a.ab, size_t(n) * 2 * I * 2);
  oc::linear_fwd(x, W(prefix + ".gate_proj.weight"), ab, DType::BF16, n, din, 2 * I);
  ffn_down_forward(a, prefix, ab, 2 * I, n, din, I, y, base);
}
// The FFN after its gate/up product ab [n, 2I] (row stride ldab): y = base + down(GLU(ab)), h kept in a.h.
void GpuModel::Impl::ffn_down_forward(FfnActs& a, const std::string& prefix, const void* ab, int64_t ldab, int64_t n,
                                      int64_t din, int64_t I, float* y, const float* base) {
  void* h = grow(a.h, size_t(n) * I * 2);
  oc::glu_forward(ab, h, n, I, glu(), nullptr, ldab);
  oc::linear_fwd(h, W(prefix + ".down_proj.weight"), y, DType::F32, n, I, din, false, nullptr, 0, 0, base);
}
// Rows [r, r + m) of the backward down to the gate/up product's gradient: dh = dy W_down (fp32 [m, I] in
// scratch.ffn_dh), W_down's gradient += hᵀ dy, dab = GLU'(ab) dh (row strides ldab, lddab; dab of the piece).
void GpuModel::Impl::ffn_down_piece(const std::string& prefix, const void* h, const void* ab, int64_t ldab, int64_t r,
                                    int64_t m, int64_t din, int64_t I, const void* dy, void* dab, int64_t lddab) {
  float* dh = grow<float>(scratch.ffn_dh, size_t(std::min(m, ffn_rows)) * I * 4);
  oc::linear_bwd(static_cast<const uint16_t*>(h) + r * I, W(prefix + ".down_proj.weight"),
                 static_cast<const uint16_t*>(dy) + r * din, dh, DType::F32, G(prefix + ".down_proj.weight"), m, I,
                 din);
  oc::glu_backward(static_cast<const uint16_t*>(ab) + r * ldab, dh, DType::F32, dab, m, I, glu(), nullptr, ldab,
                   lddab);
}
// Its backward down to the gate/up product's gradient dab [n, 2I] (row stride lddab), ffn_rows rows at a time: the
// fp32 dh scratch is [ffn_rows, I] whatever n (W_down's gradient sums the pieces).
void GpuModel::Impl::ffn_down_backward(const FfnActs& a, int64_t i, const char* key, const std::string& prefix,
                                       const void* ab, int64_t ldab, int64_t n, int64_t din, int64_t I, const void* dy,
                                       void* dab, int64_t lddab) {
  const void* h = got(a.h, i, key, "h");
  for (int64_t r = 0; r < n; r += ffn_rows)
    ffn_down_piece(prefix, h, ab, ldab, r, std::min(ffn_rows, n - r), din, I, dy,
                   static_cast<uint16_t*>(dab) + r * lddab, lddab);
}
// The whole backward, ffn_rows rows at a time (its dab scratch is [ffn_rows, 2I]).
void GpuModel::Impl::ffn_backward(const FfnActs& a, int64_t i, const char* key, const std::string& prefix,
                                  const void* x, int64_t n, int64_t din, int64_t I, const void* dy, float* dx,
                                  bool accumulate_dx) {
  void* dab = grow(scratch.ffn_dab, size_t(std::min(n, ffn_rows)) * 2 * I * 2);
  const void *ab = got(a.ab, i, key, "ab"), *h = got(a.h, i, key, "h");
  for (int64_t r = 0; r < n; r += ffn_rows) {
    const int64_t m = std::min(ffn_rows, n - r);
    ffn_down_piece(prefix, h, ab, 2 * I, r, m, din, I, dy, dab, 2 * I);
    // gate_proj's slot starts the stacked [2I, din] weight and its gradient.
    oc::linear_bwd(static_cast<const uint16_t*>(x) + r * din, W(prefix + ".gate_proj.weight"), dab, dx + r * din,
                   DType::F32, G(prefix + ".gate_proj.weight"), m, din, 2 * I, accumulate_dx);
  }
}

}  // namespace lm::model::cuda

#endif
