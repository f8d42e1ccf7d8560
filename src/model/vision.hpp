#pragma once
// The K3 vision tower (MoonViT-V2) and the patchmergerv2 projector (SPEC §9), forward and backward on the CPU.
//
// Legend: N media (images or clips) packed in one batch, media n has (t_n frames, h_n patch rows, w_n patch
//         columns); L = Σ t·h·w patches, M = Σ (h/mh)·(w/mw) merged rows (mh×mw = merge_kernel_size, 2×2 in K3);
//         P = 3·p·p flattened patch (p = patch_size), D vt_hidden_size, Q qkv_hidden_size, H heads, Dh = Q/H,
//         I vt_intermediate_size, mD = mh·mw·D the merged width, d text_hidden_size, P0h×P0w the position table.
//   x     = pixels W_peᵀ + pos(h, w) [+ time(f) for clips]      [L, D]   (the 14×14 stride-14 conv is this GEMM)
//   per block:  xn0 = RMSNorm0(x);  qkv = xn0 W_qkvᵀ  [L, 3Q] = [q | k | v], each [L, H, Dh]
//               q, k ← RoPE2D(q, k);  o = softmax(q kᵀ/√Dh) v within each media  [L, Q]
//               x += o W_oᵀ;  x += gelu_tanh(RMSNorm1(x) fc0ᵀ) fc1ᵀ
//   y     = RMSNorm_final(x)                                      [L, D]   (tower eps 2^-7)
//   m     = merge(y): per media mean over frames, each mh×mw block → one row, (row, col) order   [M, mD]
//   feats = RMSNorm_post(gelu_erf(m W_0ᵀ) W_2ᵀ)                   [M, d]   (eps projector_ln_eps)
// pixel_values [L, 3, p, p] are read as [L, P]; grid_thws [N, 3] as (t, h, w) per media.
//
// Two implementations: VisionTower<F> (float for use, double for the finite-difference tests) on the ops/
// kernels (OpenBLAS GEMMs, tiled attention), and vision_reference_forward, the formulas written out in float64
// loops, which the tests hold the fast path and the golden files against.
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.hpp"
#include "model/layers.hpp"
#include "model/params.hpp"

namespace lm::model {

struct MediaGrid {
  int64_t t = 1, h = 0, w = 0;  // frames, patch rows, patch columns
  int64_t patches() const { return t * h * w; }
};

// The media of one batch and what the tower derives from them once.
struct VisionBatch {
  std::vector<MediaGrid> media;
  std::vector<int64_t> cu_patches;  // [N + 1] patch-row offsets (a media's frames are contiguous)
  std::vector<int64_t> cu_merged;   // [N + 1] merged-row offsets
  std::vector<int32_t> row, col;    // [L] each patch's place in its own image (the same in every frame)

  int64_t size() const { return static_cast<int64_t>(media.size()); }
  int64_t patches() const { return cu_patches.empty() ? 0 : cu_patches.back(); }
  int64_t merged() const { return cu_merged.empty() ? 0 : cu_merged.back(); }

  // Checks the grid against the config and the pixel rows (lm::Error naming `ctx`): every t, h, w >= 1,
  // t <= init_pos_emb_time, h and w multiples of the merge kernel, Σ t·h·w = pixel_rows.
  static VisionBatch make(const VisionConfig& c, const std::vector<MediaGrid>& media, int64_t pixel_rows,
                          const std::string& ctx = "grid_thws");
  // grid_thws [N, 3] int32 (frames, patch rows, patch columns).
  static VisionBatch make(const VisionConfig& c, const int32_t* grid_thws, int64_t N, int64_t pixel_rows,
                          const std::string& ctx = "grid_thws");
};

// The intermediates the golden files hold (filled on request).
template <class F>
struct VisionTrace {
  Buf<F> patch_embed;          // [L, D] after the position (and time) embedding
  std::vector<Buf<F>> blocks;  // [layers][L, D] the output of each block
  Buf<F> tower_out;            // [L, D] after the final norm
  Buf<F> merged;               // [M, mD]
  Buf<F> features;             // [M, d]
};

// The fixed sin/cos time table of clips: time[f, i] = sin(f ω_i), time[f, D/2 + i] = cos(f ω_i),
// ω_i = 10000^(−i/(D/2)), i < D/2, f < frames. [frames, D], computed in double.
std::vector<double> vision_time_table(int64_t frames, int64_t D);

template <class F>
class VisionTower {
 public:
  // `ps` holds vision_param_specs(c) (it outlives the tower); gradients are accumulated when it has them.
  VisionTower(const VisionConfig& c, ParamStore<F>& ps);
  const VisionConfig& config() const { return c_; }

  // pixels [L, P] (pixel_values, normalised); features [M, d] written. Keeps what backward needs.
  void forward(const F* pixels, const VisionBatch& b, F* features, VisionTrace<F>* trace = nullptr);
  // From d features [M, d] of the last forward: every weight's gradient accumulated (no input gradient: the
  // pixels are data). lm::Error without a forward or when the store has no gradients.
  void backward(const F* dfeatures);

 private:
  struct Block {
    Param<F> *norm0, *wqkv, *wo, *norm1, *fc0, *fc1;
  };
  struct BlockActs {
    Buf<F> x_in, xn0, rstd0;  // block input, RMSNorm0 output and rstd
    Buf<F> qkv, o, lse;       // [L, 3Q] after RoPE, [L, Q], [L, H]
    Buf<F> x_mid, xn1, rstd1; // after the attention residual; RMSNorm1
    Buf<F> a, g;              // [L, I] fc0 output, gelu_tanh(a)
  };
  void add_position(const VisionBatch& b, F* x) const;
  void merge(const VisionBatch& b, const F* y, F* m) const;
  void unmerge(const VisionBatch& b, const F* dm, F* dy) const;

  VisionConfig c_;
  int64_t D_, Q_, H_, Dh_, I_, P_, mD_, d_;
  Param<F> *Wpe_, *pos_, *final_norm_, *W0_, *W2_, *post_norm_;
  std::vector<Block> blocks_;

  // Activations of the last forward.
  bool have_forward_ = false;
  VisionBatch b_;
  Buf<F> pixels_, cs_;  // [L, P]; RoPE table [L, Dh]
  std::vector<BlockActs> acts_;
  Buf<F> x_last_, rstd_f_, y_, m_, a0_, g0_, a2_, rstd_p_;
};

// The float64 definition (SPEC §9 formula by formula: explicit loops for the conv, the bilinear resize, RoPE
// with complex numbers, softmax attention, the merge and the projector). Fills every field of the trace.
// `ps` holds vision_param_specs(c) in double. Tests and `longmoe verify` only: O(L²·D) per block.
VisionTrace<double> vision_reference_forward(const VisionConfig& c, const ParamStore<double>& ps,
                                             const double* pixels, const VisionBatch& b);

}  // namespace lm::model
