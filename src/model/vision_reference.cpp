// The float64 definition of the vision tower and projector (SPEC §9), formula by formula, in plain loops: no
// GEMM, no ops/ kernel, so it checks them rather than repeating them. Shapes: model/vision.hpp.
#include <algorithm>
#include <cmath>
#include <complex>
#include <limits>
#include <numbers>

#include "model/vision.hpp"

namespace lm::model {

namespace {

using Vec = std::vector<double>;

// y [rows, out] = x [rows, in] Wᵀ, W [out, in].
Vec linear(const Vec& x, const double* W, int64_t rows, int64_t in, int64_t out) {
  Vec y(static_cast<size_t>(rows * out), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < in; ++i) s += x[r * in + i] * W[o * in + i];
      y[r * out + o] = s;
    }
  return y;
}

// RMSNorm: x / sqrt(mean(x²) + eps) · w, per row of width D.
Vec rmsnorm(const Vec& x, const double* w, int64_t rows, int64_t D, double eps) {
  Vec y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < D; ++c) ss += x[r * D + c] * x[r * D + c];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
    for (int64_t c = 0; c < D; ++c) y[r * D + c] = x[r * D + c] * inv * w[c];
  }
  return y;
}

double gelu_tanh(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }

// PyTorch's bilinear source coordinate (align_corners = False): s = max(scale (o + ½) − ½, 0).
void source_taps(int64_t o, int64_t n_in, int64_t n_out, int64_t& i0, int64_t& i1, double& lam) {
  const double s = std::max(static_cast<double>(n_in) / static_cast<double>(n_out) * (o + 0.5) - 0.5, 0.0);
  i0 = std::min(static_cast<int64_t>(std::floor(s)), n_in - 1);
  i1 = std::min(i0 + 1, n_in - 1);
  lam = s - static_cast<double>(i0);
}

}  // namespace

VisionTrace<double> vision_reference_forward(const VisionConfig& c, const ParamStore<double>& ps,
                                             const double* pixels, const VisionBatch& b) {
  const int64_t L = b.patches(), M = b.merged(), D = c.hidden_size, Q = c.qkv_hidden_size, H = c.num_heads;
  const int64_t Dh = c.head_dim(), I = c.intermediate_size, P = c.patch_dim(), mD = c.merged_dim();
  const int64_t d = c.text_hidden_size, P0h = c.init_pos_emb_height, P0w = c.init_pos_emb_width;
  const double eps = VisionConfig::kNormEps;
  auto W = [&](const std::string& n) { return static_cast<const double*>(ps.at(n).w()); };
  VisionTrace<double> tr;

  // x = W_pe · flatten(patch): the conv's sum over channels and kernel positions ([3, p, p] flattened).
  Vec x(static_cast<size_t>(L * D));
  const double* Wpe = W("vision_tower.patch_embed.proj.weight");
  for (int64_t l = 0; l < L; ++l)
    for (int64_t o = 0; o < D; ++o) {
      double s = 0;
      for (int64_t i = 0; i < P; ++i) s += Wpe[o * P + i] * pixels[l * P + i];
      x[l * D + o] = s;
    }
  // x += pos(h, w) (bilinear from the P0h×P0w table unless equal), + time(f) for clips.
  const double* pos = W("vision_tower.patch_embed.pos_emb.weight");
  for (int64_t n = 0; n < b.size(); ++n) {
    const MediaGrid g = b.media[n];
    const Vec time = vision_time_table(g.t, D);
    for (int64_t f = 0; f < g.t; ++f)
      for (int64_t r = 0; r < g.h; ++r)
        for (int64_t q = 0; q < g.w; ++q) {
          double* xr = &x[(b.cu_patches[n] + (f * g.h + r) * g.w + q) * D];
          int64_t y0 = r, y1 = r, x0 = q, x1 = q;
          double ly = 0, lx = 0;
          if (g.h != P0h || g.w != P0w) source_taps(r, P0h, g.h, y0, y1, ly), source_taps(q, P0w, g.w, x0, x1, lx);
          for (int64_t ch = 0; ch < D; ++ch) {
            auto T = [&](int64_t yy, int64_t xx) { return pos[(yy * P0w + xx) * D + ch]; };
            xr[ch] += (1 - ly) * ((1 - lx) * T(y0, x0) + lx * T(y0, x1)) + ly * ((1 - lx) * T(y1, x0) + lx * T(y1, x1));
            if (g.t > 1) xr[ch] += time[f * D + ch];
          }
        }
  }
  tr.patch_embed = x;

  for (int64_t blk = 0; blk < c.num_layers; ++blk) {
    const std::string B = "vision_tower.encoder.blocks." + std::to_string(blk) + ".";
    // [q; k; v] = W_qkv RMSNorm0(x)
    const Vec qkv = linear(rmsnorm(x, W(B + "norm0.weight"), L, D, eps), W(B + "wqkv.weight"), L, D, 3 * Q);
    // RoPE2D: per head, pair m = (2m, 2m+1) as a complex number; pair 2j turns by col·θ_j, 2j+1 by row·θ_j.
    std::vector<std::complex<double>> qc(static_cast<size_t>(L * Q / 2)), kc(qc.size());
    for (int64_t l = 0; l < L; ++l)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t m = 0; m < Dh / 2; ++m) {
          const int64_t j = m / 2;
          const double theta = std::pow(VisionConfig::kRopeTheta, -4.0 * static_cast<double>(j) / static_cast<double>(Dh));
          const double place = m % 2 == 0 ? b.col[l] : b.row[l];
          const std::complex<double> turn = std::polar(1.0, place * theta);
          const int64_t ch = h * Dh + 2 * m;
          qc[(l * Q + ch) / 2] = std::complex<double>(qkv[l * 3 * Q + ch], qkv[l * 3 * Q + ch + 1]) * turn;
          kc[(l * Q + ch) / 2] = std::complex<double>(qkv[l * 3 * Q + Q + ch], qkv[l * 3 * Q + Q + ch + 1]) * turn;
        }
    auto qv = [&](int64_t l, int64_t ch) { return ch % 2 ? qc[(l * Q + ch) / 2].imag() : qc[(l * Q + ch) / 2].real(); };
    auto kv = [&](int64_t l, int64_t ch) { return ch % 2 ? kc[(l * Q + ch) / 2].imag() : kc[(l * Q + ch) / 2].real(); };
    // softmax(q kᵀ / √Dh) v inside each media.
    Vec o(static_cast<size_t>(L * Q), 0.0);
    for (int64_t n = 0; n < b.size(); ++n) {
      const int64_t s0 = b.cu_patches[n], s1 = b.cu_patches[n + 1];
      Vec p(static_cast<size_t>(s1 - s0));
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = s0; t < s1; ++t) {
          double mx = -std::numeric_limits<double>::infinity(), z = 0;
          for (int64_t s = s0; s < s1; ++s) {
            double dot = 0;
            for (int64_t e = 0; e < Dh; ++e) dot += qv(t, h * Dh + e) * kv(s, h * Dh + e);
            p[s - s0] = dot / std::sqrt(static_cast<double>(Dh));
            mx = std::max(mx, p[s - s0]);
          }
          for (auto& e : p) z += (e = std::exp(e - mx));
          for (int64_t s = s0; s < s1; ++s)
            for (int64_t e = 0; e < Dh; ++e) o[t * Q + h * Dh + e] += p[s - s0] / z * qkv[s * 3 * Q + 2 * Q + h * Dh + e];
        }
    }
    const Vec att = linear(o, W(B + "wo.weight"), L, Q, D);
    for (int64_t i = 0; i < L * D; ++i) x[i] += att[i];
    // x += fc1 gelu_tanh(fc0 RMSNorm1(x))
    Vec a = linear(rmsnorm(x, W(B + "norm1.weight"), L, D, eps), W(B + "mlp.fc0.weight"), L, D, I);
    for (auto& e : a) e = gelu_tanh(e);
    const Vec mlp = linear(a, W(B + "mlp.fc1.weight"), L, I, D);
    for (int64_t i = 0; i < L * D; ++i) x[i] += mlp[i];
    tr.blocks.push_back(x);
  }
  tr.tower_out = rmsnorm(x, W("vision_tower.encoder.final_layernorm.weight"), L, D, eps);

  // sd2_tpool: mean over frames, then each mh×mw block of patches → one row of (row, col)-ordered slots.
  tr.merged.assign(static_cast<size_t>(M * mD), 0.0);
  for (int64_t n = 0; n < b.size(); ++n) {
    const MediaGrid g = b.media[n];
    for (int64_t R = 0; R < g.h / c.merge_h; ++R)
      for (int64_t C = 0; C < g.w / c.merge_w; ++C)
        for (int64_t kr = 0; kr < c.merge_h; ++kr)
          for (int64_t kc2 = 0; kc2 < c.merge_w; ++kc2)
            for (int64_t f = 0; f < g.t; ++f)
              for (int64_t ch = 0; ch < D; ++ch) {
                const int64_t row = b.cu_merged[n] + R * (g.w / c.merge_w) + C;
                const int64_t patch = b.cu_patches[n] + (f * g.h + R * c.merge_h + kr) * g.w + C * c.merge_w + kc2;
                tr.merged[row * mD + (kr * c.merge_w + kc2) * D + ch] += tr.tower_out[patch * D + ch] / g.t;
              }
  }

  // features = RMSNorm_post(W_2 gelu_erf(W_0 m))
  Vec h0 = linear(tr.merged, W("mm_projector.proj.0.weight"), M, mD, mD);
  for (auto& e : h0) e = gelu_erf(e);
  tr.features = rmsnorm(linear(h0, W("mm_projector.proj.2.weight"), M, mD, d), W("mm_projector.post_norm.weight"), M,
                        d, c.projector_ln_eps);
  return tr;
}

}  // namespace lm::model
