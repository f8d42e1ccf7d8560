#pragma once
// GELU activations of the vision tower (SPEC §9), elementwise, forward and backward.
//
// Legend: n elements (any shape, contiguous).
//   Tanh (`gelu_pytorch_tanh`, the tower's MLP):
//     y = ½ x (1 + tanh(u)),  u = √(2/π) (x + 0.044715 x³)
//     dy/dx = ½ (1 + tanh u) + ½ x (1 − tanh² u) √(2/π) (1 + 3·0.044715 x²)
//   Erf (`gelu`, nn.GELU(), the projector):
//     y = x Φ(x) = ½ x (1 + erf(x / √2)),   dy/dx = Φ(x) + x φ(x),  φ(x) = exp(−x²/2) / √(2π)
#include <cstdint>

namespace lm::ops {

enum class GeluKind { Tanh, Erf };

// y [n] = gelu(x); y may alias x.
template <class F>
void gelu_forward(const F* x, F* y, int64_t n, GeluKind kind);

// dx [n] = dy · gelu'(x); dx may alias dy (not x).
template <class F>
void gelu_backward(const F* x, const F* dy, F* dx, int64_t n, GeluKind kind);

}  // namespace lm::ops
