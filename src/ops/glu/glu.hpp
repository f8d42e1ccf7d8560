#pragma once
// Gated linear units of the FFNs (SPEC §4), forward and backward, elementwise.
//
// Legend: rows tokens (or tokens routed to one expert), I intermediate width.
// Layout (row-major): ab [rows, 2I] = [a | b]: a = W_gate x in columns [0, I), b = W_up x in [I, 2I);
//                     h, dh [rows, I]; dab [rows, 2I] laid out like ab.
// One GEMM with the stacked weight [W_gate; W_up] ([2I, d]) produces ab directly, and dab feeds the
// backward GEMMs of that stacked weight unchanged.
//
//   SiTU:   h = A(a) * B(b),  A = beta1 * tanh(a / beta1) * sigmoid(a),  B = beta2 * tanh(b / beta2)
//           (beta2 <= 0 or infinite: no cap, B = b). K3: beta1 = 4, beta2 = 25, so |h| < 100.
//           dA/da = (1 - t^2) s + beta1 t s (1 - s),  dB/db = 1 - u^2   (t = tanh(a/beta1), s = sigmoid(a),
//                                                                       u = tanh(b/beta2))
//   SwiGLU: h = silu(a) * b,  dsilu/da = s (1 + a (1 - s)).
#include <cstdint>

namespace lm::ops {

enum class GluKind { SiTU, SwiGLU };

struct GluParams {
  GluKind kind = GluKind::SiTU;
  double beta1 = 4.0;   // activation_situ_beta
  double beta2 = 25.0;  // activation_situ_linear_beta; <= 0 or inf: no cap on b
  static GluParams situ(double b1 = 4.0, double b2 = 25.0) { return {GluKind::SiTU, b1, b2}; }
  static GluParams swiglu() { return {GluKind::SwiGLU, 0.0, 0.0}; }
};

// h [rows, I] = GLU(a, b) with ab [rows, 2I].
template <class F>
void glu_forward(const F* ab, F* h, int64_t rows, int64_t I, const GluParams& p);

// dab [rows, 2I] written: [dh * B * dA/da | dh * A * dB/db]. dab may alias ab (in place).
template <class F>
void glu_backward(const F* ab, const F* dh, F* dab, int64_t rows, int64_t I, const GluParams& p);

}  // namespace lm::ops
