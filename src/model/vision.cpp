// The vision tower and projector (SPEC §9) on the ops/ kernels: forward keeps the activations, backward
// consumes them. Shapes and formulas: model/vision.hpp (L patches, M merged rows, D, Q, H, Dh, I, P, mD, d).
#include "model/vision.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "model/linear.hpp"
#include "ops/bilinear/bilinear.hpp"
#include "ops/full_attention/full_attention.hpp"
#include "ops/gelu/gelu.hpp"
#include "ops/rmsnorm/rmsnorm.hpp"
#include "ops/rope2d/rope2d.hpp"

namespace lm::model {

// ---- the batch --------------------------------------------------------------------------------------------

VisionBatch VisionBatch::make(const VisionConfig& c, const std::vector<MediaGrid>& media, int64_t pixel_rows,
                              const std::string& ctx) {
  LM_CHECK(!media.empty(), "{}: no media (need at least one (t, h, w) row)", ctx);
  constexpr int64_t kMaxSide = 1 << 16;
  VisionBatch b;
  b.media = media;
  b.cu_patches.assign(1, 0);
  b.cu_merged.assign(1, 0);
  for (size_t n = 0; n < media.size(); ++n) {
    const auto [t, h, w] = media[n];
    LM_CHECK(t >= 1 && h >= 1 && w >= 1 && h <= kMaxSide && w <= kMaxSide,
             "{}: media {} has (t, h, w) = ({}, {}, {}); each must be >= 1 (and h, w <= {})", ctx, n, t, h, w,
             kMaxSide);
    LM_CHECK(t <= c.init_pos_emb_time,
             "{}: media {} has {} frames, more than init_pos_emb_time = {} (the time table's length)", ctx, n, t,
             c.init_pos_emb_time);
    LM_CHECK(h % c.merge_h == 0 && w % c.merge_w == 0,
             "{}: media {} has a {}x{} patch grid; the {}x{} merge needs both sides to be multiples of it", ctx, n, h,
             w, c.merge_h, c.merge_w);
    b.cu_patches.push_back(b.cu_patches.back() + t * h * w);
    b.cu_merged.push_back(b.cu_merged.back() + (h / c.merge_h) * (w / c.merge_w));
    LM_CHECK(b.cu_patches.back() <= (int64_t{1} << 31), "{}: more than 2^31 patches", ctx);
  }
  LM_CHECK(b.patches() == pixel_rows,
           "{}: the grids describe {} patches (sum of t*h*w) but pixel_values has {} rows", ctx, b.patches(),
           pixel_rows);
  b.row.resize(static_cast<size_t>(b.patches()));
  b.col.resize(b.row.size());
  for (size_t n = 0; n < media.size(); ++n) {
    const auto [t, h, w] = media[n];
    for (int64_t f = 0; f < t; ++f)
      for (int64_t r = 0; r < h * w; ++r) {
        const size_t i = static_cast<size_t>(b.cu_patches[n] + f * h * w + r);
        b.row[i] = static_cast<int32_t>(r / w);
        b.col[i] = static_cast<int32_t>(r % w);
      }
  }
  return b;
}

VisionBatch VisionBatch::make(const VisionConfig& c, const int32_t* grid_thws, int64_t N, int64_t pixel_rows,
                              const std::string& ctx) {
  LM_CHECK(N >= 1, "{}: grid_thws has {} rows; need at least one (t, h, w)", ctx, N);
  std::vector<MediaGrid> m(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) m[n] = {grid_thws[n * 3], grid_thws[n * 3 + 1], grid_thws[n * 3 + 2]};
  return make(c, m, pixel_rows, ctx);
}

std::vector<double> vision_time_table(int64_t frames, int64_t D) {
  const int64_t half = D / 2;
  std::vector<double> t(static_cast<size_t>(frames * D));
  for (int64_t f = 0; f < frames; ++f)
    for (int64_t i = 0; i < half; ++i) {
      const double omega = std::pow(10000.0, -static_cast<double>(i) / static_cast<double>(half));
      t[f * D + i] = std::sin(static_cast<double>(f) * omega);
      t[f * D + half + i] = std::cos(static_cast<double>(f) * omega);
    }
  return t;
}

// ---- the tower ----------------------------------------------------------------------------------------------

template <class F>
VisionTower<F>::VisionTower(const VisionConfig& c, ParamStore<F>& ps)
    : c_(c),
      D_(c.hidden_size),
      Q_(c.qkv_hidden_size),
      H_(c.num_heads),
      Dh_(c.head_dim()),
      I_(c.intermediate_size),
      P_(c.patch_dim()),
      mD_(c.merged_dim()),
      d_(c.text_hidden_size) {
  c.validate("VisionTower");
  Wpe_ = &ps.at("vision_tower.patch_embed.proj.weight");
  pos_ = &ps.at("vision_tower.patch_embed.pos_emb.weight");
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string B = "vision_tower.encoder.blocks." + std::to_string(i) + ".";
    blocks_.push_back({&ps.at(B + "norm0.weight"), &ps.at(B + "wqkv.weight"), &ps.at(B + "wo.weight"),
                       &ps.at(B + "norm1.weight"), &ps.at(B + "mlp.fc0.weight"), &ps.at(B + "mlp.fc1.weight")});
  }
  final_norm_ = &ps.at("vision_tower.encoder.final_layernorm.weight");
  W0_ = &ps.at("mm_projector.proj.0.weight");
  W2_ = &ps.at("mm_projector.proj.2.weight");
  post_norm_ = &ps.at("mm_projector.post_norm.weight");
}

// x [L, D] += pos(h, w) per frame (the table itself when (h, w) = (P0h, P0w), else bilinearly resized), and for
// clips (t > 1) the time row of each frame.
template <class F>
void VisionTower<F>::add_position(const VisionBatch& b, F* x) const {
  const int64_t D = D_, P0h = c_.init_pos_emb_height, P0w = c_.init_pos_emb_width;
  const F* table = pos_->w();
  Buf<F> resized;
  for (int64_t n = 0; n < b.size(); ++n) {
    const int64_t t = b.media[n].t, h = b.media[n].h, w = b.media[n].w;
    const F* pos = table;
    if (h != P0h || w != P0w) {
      resized.resize(h * w * D);
      ops::bilinear_resize_forward(table, P0h, P0w, D, resized.data(), h, w);
      pos = resized.data();
    }
    const std::vector<double> time = t > 1 ? vision_time_table(t, D) : std::vector<double>();
    parallel_for(
        t * h * w,
        [&](int64_t i) {
          const int64_t f = i / (h * w), r = i % (h * w);
          F* xr = x + (b.cu_patches[n] + i) * D;
          const F* pr = pos + r * D;
          if (t > 1)
            for (int64_t c = 0; c < D; ++c) xr[c] += pr[c] + static_cast<F>(time[f * D + c]);
          else
            for (int64_t c = 0; c < D; ++c) xr[c] += pr[c];
        },
        16);
  }
}

// m [M, mD]: per media and merged cell (R, C), slot (kr, kc) = kr·mw + kc holds the mean over frames of patch
// (R·mh + kr, C·mw + kc).
template <class F>
void VisionTower<F>::merge(const VisionBatch& b, const F* y, F* m) const {
  const int64_t D = D_, mh = c_.merge_h, mw = c_.merge_w;
  for (int64_t n = 0; n < b.size(); ++n) {
    const int64_t t = b.media[n].t, h = b.media[n].h, w = b.media[n].w;
    const int64_t cols = w / mw, cells = (h / mh) * cols;
    const F inv_t = F(1) / static_cast<F>(t);
    parallel_for(
        cells,
        [&](int64_t cell) {
          const int64_t R = cell / cols, C = cell % cols;
          F* mr = m + (b.cu_merged[n] + cell) * mD_;
          for (int64_t kr = 0; kr < mh; ++kr)
            for (int64_t kc = 0; kc < mw; ++kc) {
              F* slot = mr + (kr * mw + kc) * D;
              const int64_t r = (R * mh + kr) * w + (C * mw + kc);
              std::fill(slot, slot + D, F(0));
              for (int64_t f = 0; f < t; ++f) {
                const F* yr = y + (b.cu_patches[n] + f * h * w + r) * D;
                for (int64_t c = 0; c < D; ++c) slot[c] += yr[c];
              }
              for (int64_t c = 0; c < D; ++c) slot[c] *= inv_t;
            }
        },
        4);
  }
}

// The transpose of merge: every frame's patch gets its slot's gradient / t.
template <class F>
void VisionTower<F>::unmerge(const VisionBatch& b, const F* dm, F* dy) const {
  const int64_t D = D_, mh = c_.merge_h, mw = c_.merge_w;
  for (int64_t n = 0; n < b.size(); ++n) {
    const int64_t t = b.media[n].t, h = b.media[n].h, w = b.media[n].w;
    const F inv_t = F(1) / static_cast<F>(t);
    parallel_for(
        t * h * w,
        [&](int64_t i) {
          const int64_t r = i % (h * w), pr = r / w, pc = r % w;
          const int64_t cell = (pr / mh) * (w / mw) + pc / mw, slot = (pr % mh) * mw + pc % mw;
          const F* g = dm + (b.cu_merged[n] + cell) * mD_ + slot * D;
          F* o = dy + (b.cu_patches[n] + i) * D;
          for (int64_t c = 0; c < D; ++c) o[c] = g[c] * inv_t;
        },
        16);
  }
}

template <class F>
void VisionTower<F>::forward(const F* pixels, const VisionBatch& b, F* features, VisionTrace<F>* trace) {
  const int64_t L = b.patches(), M = b.merged(), D = D_, Q = Q_;
  const F eps = static_cast<F>(VisionConfig::kNormEps);
  LM_CHECK(static_cast<int64_t>(b.row.size()) == L && static_cast<int64_t>(b.cu_patches.size()) == b.size() + 1,
           "VisionTower::forward: the batch was not built by VisionBatch::make");
  b_ = b;
  pixels_.assign(pixels, pixels + L * P_);

  // Patch embedding: the stride-p conv over non-overlapping patches is one GEMM.
  Buf<F> x(L * D);
  linear_forward(pixels, Wpe_->w(), x.data(), L, P_, D);
  add_position(b, x.data());
  if (trace) trace->patch_embed = x, trace->blocks.assign(blocks_.size(), Buf<F>());

  cs_.resize(L * Dh_);
  ops::rope2d_table(b.row.data(), b.col.data(), L, Dh_, VisionConfig::kRopeTheta, cs_.data());
  ops::FullAttnDims ad;
  ad.H = H_, ad.D = Dh_, ad.cu_seqlens = b.cu_patches.data(), ad.N = b.size(), ad.ld_qkv = 3 * Q, ad.ld_o = Q;
  const F scale = static_cast<F>(1.0 / std::sqrt(static_cast<double>(Dh_)));

  acts_.resize(blocks_.size());
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& bl = blocks_[i];
    BlockActs& a = acts_[i];
    a.x_in = x;
    a.xn0.resize(L * D), a.rstd0.resize(L);
    ops::rmsnorm_forward(x.data(), bl.norm0->w(), a.xn0.data(), a.rstd0.data(), L, D, eps);
    a.qkv.resize(L * 3 * Q);
    linear_forward(a.xn0.data(), bl.wqkv->w(), a.qkv.data(), L, D, 3 * Q);
    ops::rope2d_apply(a.qkv.data(), L, H_, Dh_, 3 * Q, cs_.data());      // q
    ops::rope2d_apply(a.qkv.data() + Q, L, H_, Dh_, 3 * Q, cs_.data());  // k
    a.o.resize(L * Q), a.lse.resize(L * H_);
    ops::full_attention_forward(a.qkv.data(), a.qkv.data() + Q, a.qkv.data() + 2 * Q, a.o.data(), a.lse.data(), ad,
                                scale);
    linear_forward(a.o.data(), bl.wo->w(), x.data(), L, Q, D, /*accumulate=*/true);
    a.x_mid = x;
    a.xn1.resize(L * D), a.rstd1.resize(L);
    ops::rmsnorm_forward(x.data(), bl.norm1->w(), a.xn1.data(), a.rstd1.data(), L, D, eps);
    a.a.resize(L * I_), a.g.resize(L * I_);
    linear_forward(a.xn1.data(), bl.fc0->w(), a.a.data(), L, D, I_);
    ops::gelu_forward(a.a.data(), a.g.data(), L * I_, ops::GeluKind::Tanh);
    linear_forward(a.g.data(), bl.fc1->w(), x.data(), L, I_, D, /*accumulate=*/true);
    if (trace) trace->blocks[i] = x;
  }

  x_last_ = x;
  y_.resize(L * D), rstd_f_.resize(L);
  ops::rmsnorm_forward(x.data(), final_norm_->w(), y_.data(), rstd_f_.data(), L, D, eps);
  m_.resize(M * mD_);
  merge(b, y_.data(), m_.data());

  a0_.resize(M * mD_), g0_.resize(M * mD_), a2_.resize(M * d_), rstd_p_.resize(M);
  linear_forward(m_.data(), W0_->w(), a0_.data(), M, mD_, mD_);
  ops::gelu_forward(a0_.data(), g0_.data(), M * mD_, ops::GeluKind::Erf);
  linear_forward(g0_.data(), W2_->w(), a2_.data(), M, mD_, d_);
  ops::rmsnorm_forward(a2_.data(), post_norm_->w(), features, rstd_p_.data(), M, d_,
                       static_cast<F>(c_.projector_ln_eps));
  have_forward_ = true;
  if (trace) {
    trace->tower_out = y_;
    trace->merged = m_;
    trace->features.assign(features, features + M * d_);
  }
}

template <class F>
void VisionTower<F>::backward(const F* dfeatures) {
  LM_CHECK(have_forward_, "VisionTower::backward: no forward to differentiate");
  LM_CHECK(Wpe_->grad.defined(), "VisionTower::backward: the parameter store has no gradients (enable_grads)");
  const VisionBatch& b = b_;
  const int64_t L = b.patches(), M = b.merged(), D = D_, Q = Q_;
  const F eps = static_cast<F>(VisionConfig::kNormEps);

  // Projector, then the merge.
  Buf<F> da2(M * d_), dg0(M * mD_), dm(M * mD_);
  ops::rmsnorm_backward(a2_.data(), post_norm_->w(), rstd_p_.data(), dfeatures, da2.data(), post_norm_->g(), M, d_,
                        static_cast<F>(c_.projector_ln_eps));
  linear_backward(g0_.data(), W2_->w(), da2.data(), dg0.data(), W2_->g(), M, mD_, d_);
  ops::gelu_backward(a0_.data(), dg0.data(), dg0.data(), M * mD_, ops::GeluKind::Erf);
  linear_backward(m_.data(), W0_->w(), dg0.data(), dm.data(), W0_->g(), M, mD_, mD_);
  Buf<F> dy(L * D), dx(L * D), tmp(L * D);
  unmerge(b, dm.data(), dy.data());
  ops::rmsnorm_backward(x_last_.data(), final_norm_->w(), rstd_f_.data(), dy.data(), dx.data(), final_norm_->g(), L, D,
                        eps);

  ops::FullAttnDims ad;
  ad.H = H_, ad.D = Dh_, ad.cu_seqlens = b.cu_patches.data(), ad.N = b.size(), ad.ld_qkv = 3 * Q, ad.ld_o = Q;
  const F scale = static_cast<F>(1.0 / std::sqrt(static_cast<double>(Dh_)));
  Buf<F> dg(L * I_), dxn(L * D), dout(L * Q), dqkv(L * 3 * Q);
  for (size_t i = blocks_.size(); i-- > 0;) {
    const Block& bl = blocks_[i];
    BlockActs& a = acts_[i];
    // MLP residual: x_out = x_mid + fc1 gelu(fc0 RMSNorm1(x_mid)).
    linear_backward(a.g.data(), bl.fc1->w(), dx.data(), dg.data(), bl.fc1->g(), L, I_, D);
    ops::gelu_backward(a.a.data(), dg.data(), dg.data(), L * I_, ops::GeluKind::Tanh);
    linear_backward(a.xn1.data(), bl.fc0->w(), dg.data(), dxn.data(), bl.fc0->g(), L, D, I_);
    ops::rmsnorm_backward(a.x_mid.data(), bl.norm1->w(), a.rstd1.data(), dxn.data(), tmp.data(), bl.norm1->g(), L, D,
                          eps);
    for (int64_t j = 0; j < L * D; ++j) dx[j] += tmp[j];
    // Attention residual: x_mid = x_in + W_o attn(RoPE(W_qkv RMSNorm0(x_in))).
    linear_backward(a.o.data(), bl.wo->w(), dx.data(), dout.data(), bl.wo->g(), L, Q, D);
    ops::full_attention_backward(a.qkv.data(), a.qkv.data() + Q, a.qkv.data() + 2 * Q, a.o.data(), a.lse.data(),
                                 dout.data(), dqkv.data(), dqkv.data() + Q, dqkv.data() + 2 * Q, ad, scale);
    ops::rope2d_apply(dqkv.data(), L, H_, Dh_, 3 * Q, cs_.data(), /*inverse=*/true);
    ops::rope2d_apply(dqkv.data() + Q, L, H_, Dh_, 3 * Q, cs_.data(), /*inverse=*/true);
    linear_backward(a.xn0.data(), bl.wqkv->w(), dqkv.data(), dxn.data(), bl.wqkv->g(), L, D, 3 * Q);
    ops::rmsnorm_backward(a.x_in.data(), bl.norm0->w(), a.rstd0.data(), dxn.data(), tmp.data(), bl.norm0->g(), L, D,
                          eps);
    for (int64_t j = 0; j < L * D; ++j) dx[j] += tmp[j];
  }

  // Patch embedding: dW_pe += dxᵀ pixels; the position table gathers each media's frames, through the resize's
  // transpose when it was resized. The time table is fixed (no gradient).
  linear_backward(pixels_.data(), Wpe_->w(), dx.data(), static_cast<F*>(nullptr), Wpe_->g(), L, P_, D);
  F* dpos = pos_->g();
  const int64_t P0h = c_.init_pos_emb_height, P0w = c_.init_pos_emb_width;
  Buf<F> dgrid;
  for (int64_t n = 0; n < b.size(); ++n) {
    const int64_t t = b.media[n].t, h = b.media[n].h, w = b.media[n].w;
    dgrid.assign(h * w * D, F(0));
    for (int64_t f = 0; f < t; ++f) {
      const F* src = dx.data() + (b.cu_patches[n] + f * h * w) * D;
      for (int64_t j = 0; j < h * w * D; ++j) dgrid[j] += src[j];
    }
    if (h == P0h && w == P0w) {
      for (int64_t j = 0; j < h * w * D; ++j) dpos[j] += dgrid[j];
    } else {
      ops::bilinear_resize_backward(dgrid.data(), P0h, P0w, D, h, w, dpos);
    }
  }
}

template class VisionTower<float>;
template class VisionTower<double>;

}  // namespace lm::model
