#pragma once
// 2-D rotary position embedding of the vision tower (SPEC §9), in place on q or k.
//
// Legend: rows tokens (patches), H heads, Dh head dim (a multiple of 4), J = Dh/4 frequencies,
//         ld row stride of x in elements (>= H·Dh; head h at columns h·Dh ..), (row_r, col_r) the place of
//         token r in its own image.
// Per head, channel pairs (2m, 2m+1) are complex numbers z_m = x[2m] + i·x[2m+1]:
//   pair m = 2j   turns by col·θ_j,   pair m = 2j+1 turns by row·θ_j,   θ_j = theta^(−4j/Dh),  j < J,
//   z_m ← z_m · e^{iφ}:  (a, b) ← (a cos φ − b sin φ, a sin φ + b cos φ).
// The map is a rotation, so the backward (the transpose) is the turn by −φ: rope2d_apply(..., inverse = true).
// Table layout cs [rows, J, 2, 2] = per (token, j): (cos, sin) of col·θ_j, then (cos, sin) of row·θ_j; angles
// are formed in double, so float and double paths differ only by the final rounding.
#include <cstdint>

namespace lm::ops {

// cs [rows, 4J] from the places; theta = 10000 in K3.
template <class F>
void rope2d_table(const int32_t* row, const int32_t* col, int64_t rows, int64_t Dh, double theta, F* cs);

// x [rows, ld] turned in place (by −φ when inverse: the gradient of the forward turn).
template <class F>
void rope2d_apply(F* x, int64_t rows, int64_t H, int64_t Dh, int64_t ld, const F* cs, bool inverse = false);

// The definition, straight from the formula (angles and products in double; tests only): y [rows, H·Dh] dense.
template <class F>
void rope2d_reference(const F* x, F* y, int64_t rows, int64_t H, int64_t Dh, const int32_t* row, const int32_t* col,
                      double theta);

}  // namespace lm::ops
