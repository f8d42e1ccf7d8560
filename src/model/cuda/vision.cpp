// The vision tower and projector on the GPU (GpuModel::Impl, gpu_model_impl.hpp; the CPU layer is model/vision.cpp,
// whose formulas and order it follows) and the splice of its features into the text rows (SPEC §9).
//
// Legend (model/vision.hpp): Lv patches (L there), Mr merged rows, S = mh·mw slots, D tower width, Q qkv width,
//         H heads, Dh = Q/H, I MLP width, Pv = 3·p·p, mD = S·D, d text width, G rows of the batch's position tables.
//   x = pixels W_peᵀ + pos (+ time)                              fp32 [Lv, D]   (pixels bf16 [Lv, Pv])
//   block: xn0 = RMSNorm0(x) → qkv = xn0 W_qkvᵀ (bf16), RoPE2D on q and k in place → o = attn(q, k, v) within
//          each media → x += o W_oᵀ;  xn1 = RMSNorm1(x) → a = xn1 fc0ᵀ (fp32) → g = gelu_tanh(a) → x += g fc1ᵀ
//   y = RMSNorm_final(x) → m = merge(y) → a0 = m W_0ᵀ (fp32) → g0 = gelu_erf(a0) → a2 = g0 W_2ᵀ (fp32)
//   feat = RMSNorm_post(a2)                                       bf16 [Mr, d]
// dtypes as the text layers: GEMM operands bf16, products that feed a norm or the residual fp32, weights' gradients
// fp32 (accumulated), the position table and norm weights read in fp32.
#ifdef LONGMOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <map>

#include "core/half.hpp"
#include "model/cuda/glue_cuda.hpp"
#include "model/cuda/gpu_model_impl.hpp"
#include "model/cuda/vision_glue_cuda.hpp"
#include "ops/bilinear/cuda/bilinear_cuda.hpp"
#include "ops/full_attention/cuda/full_attention_cuda.hpp"
#include "ops/gelu/cuda/gelu_cuda.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"
#include "ops/rmsnorm/cuda/rmsnorm_cuda.hpp"
#include "ops/rope2d/cuda/rope2d_cuda.hpp"
#include "ops/rope2d/rope2d.hpp"

namespace lm::model::cuda {

namespace {
std::string block_name(int64_t i) { return "vision_tower.encoder.blocks." + std::to_string(i) + "."; }

template <class T>
void to_device(DBuf& b, const std::vector<T>& h) {
  T* p = grow<T>(b, h.size() * sizeof(T));
  ck(cudaMemcpyAsync(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, cu::stream(nullptr)),
      "vision upload");  // (the walk's stream; from pageable memory: the source has been read when it returns)
}
}  // namespace

size_t VisionActs::bytes() const {
  size_t n = bytes_of({&idx, &pixels, &cs, &pos, &time, &x, &y, &rstd_f, &m, &a0, &g0, &a2, &rstd_p, &feat, &dfeat,
                       &da2, &dg0, &dm, &dx, &dxb, &dy, &dg, &dxn, &dout, &dqkv, &dpos});
  for (const Block& k : blocks)
    n += bytes_of({&k.x_in, &k.x_mid, &k.xn0, &k.rstd0, &k.xn1, &k.rstd1, &k.qkv, &k.o, &k.lse, &k.a, &k.g});
  return n;
}

const void* GpuModel::Impl::vision_forward(const Media<float>& media, int64_t* rows_out) {
  LM_CHECK(c.vision, "this model has no vision tower (its config has no vision_config); it takes no images");
  const VisionConfig& v = *c.vision;
  Timed timed(part(Profile::Vision, false));
  const int64_t Pv = v.patch_dim(), D = v.hidden_size, Q = v.qkv_hidden_size, H = v.num_heads, Dh = v.head_dim(),
                I = v.intermediate_size, mD = v.merged_dim(), S = v.merge_size(), dt = v.text_hidden_size;
  const auto n_px = static_cast<int64_t>(media.pixel_values.size());
  LM_CHECK(n_px % Pv == 0, "the images' pixel_values hold {} values, not whole patches of {} (3·{}·{})", n_px, Pv,
           v.patch_size, v.patch_size);
  VisionActs& a = vis;
  a.have = false;
  a.b = VisionBatch::make(v, media.grids, n_px / Pv, "the images' grids");
  const VisionBatch& b = a.b;
  const int64_t Lv = b.patches(), Mr = b.merged(), N = b.size();
  const float eps = static_cast<float>(VisionConfig::kNormEps);

  // The batch's index arrays (vision_glue_cuda.hpp), one upload.
  a.sizes.clear();
  a.clips = false;
  std::vector<int64_t> size_of(static_cast<size_t>(N));
  int64_t t_max = 1;
  for (int64_t n = 0; n < N; ++n) {
    const MediaGrid& g = b.media[size_t(n)];
    auto it = std::find_if(a.sizes.begin(), a.sizes.end(), [&](const auto& s) { return s.h == g.h && s.w == g.w; });
    if (it == a.sizes.end()) {
      const int64_t off = a.sizes.empty() ? 0 : a.sizes.back().off + a.sizes.back().h * a.sizes.back().w;
      a.sizes.push_back({g.h, g.w, off});
      it = a.sizes.end() - 1;
    }
    size_of[size_t(n)] = it - a.sizes.begin();
    a.clips |= g.t > 1;
    t_max = std::max(t_max, g.t);
  }
  a.G = a.sizes.back().off + a.sizes.back().h * a.sizes.back().w;
  std::vector<int32_t> idx;
  auto at = [&](int64_t n) {
    const int64_t o = static_cast<int64_t>(idx.size());
    idx.resize(size_t(o + n));
    return o;
  };
  a.o_pos_row = at(Lv), a.o_frame = at(Lv), a.o_first = at(Mr * S), a.o_mframes = at(Mr), a.o_stride = at(Mr);
  a.o_cell = at(Lv), a.o_pframes = at(Lv), a.o_start = at(a.G + 1), a.o_src = at(Lv);
  std::vector<std::vector<int32_t>> users(size_t(a.G));  // patch rows reading each position row, in order
  for (int64_t n = 0; n < N; ++n) {
    const MediaGrid& g = b.media[size_t(n)];
    const int64_t hw = g.h * g.w, cols = g.w / v.merge_w, base = a.sizes[size_t(size_of[size_t(n)])].off;
    for (int64_t i = 0; i < g.t * hw; ++i) {
      const int64_t r = b.cu_patches[size_t(n)] + i, pr = (i % hw) / g.w, pc = i % g.w;
      idx[size_t(a.o_pos_row + r)] = int32_t(base + i % hw);
      idx[size_t(a.o_frame + r)] = g.t > 1 ? int32_t(i / hw) : -1;
      const int64_t cell = b.cu_merged[size_t(n)] + (pr / v.merge_h) * cols + pc / v.merge_w;
      idx[size_t(a.o_cell + r)] = int32_t(cell * S + (pr % v.merge_h) * v.merge_w + pc % v.merge_w);
      idx[size_t(a.o_pframes + r)] = int32_t(g.t);
      users[size_t(base + i % hw)].push_back(int32_t(r));
    }
    for (int64_t cell = 0; cell < (g.h / v.merge_h) * cols; ++cell) {
      const int64_t j = b.cu_merged[size_t(n)] + cell, R = cell / cols, C = cell % cols;
      idx[size_t(a.o_mframes + j)] = int32_t(g.t), idx[size_t(a.o_stride + j)] = int32_t(hw);
      for (int64_t kr = 0; kr < v.merge_h; ++kr)
        for (int64_t kc = 0; kc < v.merge_w; ++kc)
          idx[size_t(a.o_first + j * S + kr * v.merge_w + kc)] =
              int32_t(b.cu_patches[size_t(n)] + (R * v.merge_h + kr) * g.w + C * v.merge_w + kc);
    }
  }
  for (int64_t j = 0, k = 0; j < a.G; ++j) {
    idx[size_t(a.o_start + j)] = int32_t(k);
    for (int32_t r : users[size_t(j)]) idx[size_t(a.o_src + k++)] = r;
    if (j + 1 == a.G) idx[size_t(a.o_start + a.G)] = int32_t(k);
  }
  to_device(a.idx, idx);
  const int32_t* ix = as<int32_t>(a.idx.p);
  {
    std::vector<uint16_t> px(static_cast<size_t>(n_px));
    for (size_t i = 0; i < px.size(); ++i) px[i] = f32_to_bf16(media.pixel_values[i]);
    to_device(a.pixels, px);
    std::vector<float> cs(static_cast<size_t>(Lv * Dh));
    ops::rope2d_table(b.row.data(), b.col.data(), Lv, Dh, VisionConfig::kRopeTheta, cs.data());
    to_device(a.cs, cs);
    if (a.clips) {
      const std::vector<double> t = vision_time_table(t_max, D);
      to_device(a.time, std::vector<float>(t.begin(), t.end()));
    }
  }
  // The position table resized once per distinct grid.
  float* pos = grow<float>(a.pos, size_t(a.G * D) * 4);
  const float* table = M("vision_tower.patch_embed.pos_emb.weight");
  for (const auto& s : a.sizes) {
    if (s.h == v.init_pos_emb_height && s.w == v.init_pos_emb_width)
      ck(cudaMemcpyAsync(pos + s.off * D, table, size_t(s.h * s.w * D) * 4, cudaMemcpyDeviceToDevice, walk()),
         "position table");
    else
      oc::bilinear_resize_forward(table, v.init_pos_emb_height, v.init_pos_emb_width, D, pos + s.off * D, s.h, s.w);
  }

  float* x = grow<float>(a.x, size_t(Lv * D) * 4);
  oc::linear_fwd(a.pixels.p, W("vision_tower.patch_embed.proj.weight"), x, DType::F32, Lv, Pv, D);
  vision_add_position(x, pos, ix + a.o_pos_row, a.clips ? as<float>(a.time.p) : nullptr, ix + a.o_frame, Lv, D);

  oc::FullAttnShape fs;
  fs.H = H, fs.Dh = Dh, fs.cu_seqlens = b.cu_patches.data(), fs.N = N, fs.ld_qkv = 3 * Q, fs.ld_o = Q;
  fs.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dh)));
  a.blocks.resize(size_t(v.num_layers));
  const size_t LD4 = size_t(Lv * D) * 4;
  for (int64_t i = 0; i < v.num_layers; ++i) {
    const std::string B = block_name(i);
    VisionActs::Block& k = a.blocks[size_t(i)];
    float* x_in = grow<float>(k.x_in, LD4);
    ck(cudaMemcpyAsync(x_in, x, LD4, cudaMemcpyDeviceToDevice, walk()), "vision x_in");
    oc::rmsnorm_forward(x, DType::F32, M(B + "norm0.weight"), grow(k.xn0, size_t(Lv * D) * 2),
                        grow<float>(k.rstd0, size_t(Lv) * 4), Lv, D, eps);
    void* qkv = grow(k.qkv, size_t(Lv * 3 * Q) * 2);
    oc::linear_fwd(k.xn0.p, W(B + "wqkv.weight"), qkv, DType::BF16, Lv, D, 3 * Q);
    oc::rope2d_apply(qkv, Lv, H, Dh, 3 * Q, as<float>(a.cs.p));                        // q
    oc::rope2d_apply(as<uint16_t>(qkv) + Q, Lv, H, Dh, 3 * Q, as<float>(a.cs.p));      // k
    void* o = grow(k.o, size_t(Lv * Q) * 2);
    oc::full_attention_forward(fs, qkv, as<uint16_t>(qkv) + Q, as<uint16_t>(qkv) + 2 * Q, o,
                               grow<float>(k.lse, size_t(Lv * H) * 4));
    oc::linear_fwd(o, W(B + "wo.weight"), x, DType::F32, Lv, Q, D, /*accumulate=*/true);
    ck(cudaMemcpyAsync(grow<float>(k.x_mid, LD4), x, LD4, cudaMemcpyDeviceToDevice, walk()), "vision x_mid");
    oc::rmsnorm_forward(x, DType::F32, M(B + "norm1.weight"), grow(k.xn1, size_t(Lv * D) * 2),
                        grow<float>(k.rstd1, size_t(Lv) * 4), Lv, D, eps);
    float* fa = grow<float>(k.a, size_t(Lv * I) * 4);
    oc::linear_fwd(k.xn1.p, W(B + "mlp.fc0.weight"), fa, DType::F32, Lv, D, I);
    oc::gelu_forward(fa, grow(k.g, size_t(Lv * I) * 2), Lv * I, ops::GeluKind::Tanh);
    oc::linear_fwd(k.g.p, W(B + "mlp.fc1.weight"), x, DType::F32, Lv, I, D, /*accumulate=*/true);
  }
  oc::rmsnorm_forward(x, DType::F32, M("vision_tower.encoder.final_layernorm.weight"), grow(a.y, size_t(Lv * D) * 2),
                      grow<float>(a.rstd_f, size_t(Lv) * 4), Lv, D, eps);
  vision_merge(a.y.p, ix + a.o_first, ix + a.o_mframes, ix + a.o_stride, grow(a.m, size_t(Mr * mD) * 2), Mr, S, D);
  float* a0 = grow<float>(a.a0, size_t(Mr * mD) * 4);
  oc::linear_fwd(a.m.p, W("mm_projector.proj.0.weight"), a0, DType::F32, Mr, mD, mD);
  oc::gelu_forward(a0, grow(a.g0, size_t(Mr * mD) * 2), Mr * mD, ops::GeluKind::Erf);
  float* a2 = grow<float>(a.a2, size_t(Mr * dt) * 4);
  oc::linear_fwd(a.g0.p, W("mm_projector.proj.2.weight"), a2, DType::F32, Mr, mD, dt);
  oc::rmsnorm_forward(a2, DType::F32, M("mm_projector.post_norm.weight"), grow(a.feat, size_t(Mr * dt) * 2),
                      grow<float>(a.rstd_p, size_t(Mr) * 4), Mr, dt, static_cast<float>(v.projector_ln_eps));
  a.have = true;
  if (rows_out) *rows_out = Mr;
  return a.feat.p;
}

void GpuModel::Impl::vision_backward(const float* dfeat) {
  VisionActs& a = vis;
  LM_CHECK(a.have, "gpu model: the vision backward has no forward to differentiate");
  const VisionConfig& v = *c.vision;
  Timed timed(part(Profile::Vision, true));
  const VisionBatch& b = a.b;
  const int64_t Pv = v.patch_dim(), D = v.hidden_size, Q = v.qkv_hidden_size, H = v.num_heads, Dh = v.head_dim(),
                I = v.intermediate_size, mD = v.merged_dim(), dt = v.text_hidden_size;
  const int64_t Lv = b.patches(), Mr = b.merged();
  const float eps = static_cast<float>(VisionConfig::kNormEps);
  const int32_t* ix = as<int32_t>(a.idx.p);

  // Projector, then the merge's transpose.
  void* da2 = grow(a.da2, size_t(Mr * dt) * 2);
  oc::rmsnorm_backward(a.a2.p, DType::F32, M("mm_projector.post_norm.weight"), as<float>(a.rstd_p.p), dfeat, DType::F32,
                       da2, DType::BF16, G("mm_projector.post_norm.weight"), Mr, dt,
                       static_cast<float>(v.projector_ln_eps));
  float* dg0 = grow<float>(a.dg0, size_t(Mr * mD) * 4);
  oc::linear_bwd(a.g0.p, W("mm_projector.proj.2.weight"), da2, dg0, DType::F32, G("mm_projector.proj.2.weight"), Mr,
                 mD, dt);
  void* dm = grow(a.dm, size_t(Mr * mD) * 2);
  oc::gelu_backward(as<float>(a.a0.p), dg0, DType::F32, dm, Mr * mD, ops::GeluKind::Erf);
  // m's gradient (bf16, unmerged at once) in the buffer that later holds dx in bf16
  void* dmerged = grow(a.dxb, size_t(std::max(Mr * mD, Lv * D)) * 2);
  oc::linear_bwd(a.m.p, W("mm_projector.proj.0.weight"), dm, dmerged, DType::BF16, G("mm_projector.proj.0.weight"), Mr,
                 mD, mD);
  const size_t LD4 = size_t(Lv * D) * 4;
  float* dy = grow<float>(a.dy, LD4);
  vision_unmerge(dmerged, ix + a.o_cell, ix + a.o_pframes, dy, Lv, D);
  float* dx = grow<float>(a.dx, LD4);
  oc::rmsnorm_backward(a.x.p, DType::F32, M("vision_tower.encoder.final_layernorm.weight"), as<float>(a.rstd_f.p), dy,
                       DType::F32, dx, DType::F32, G("vision_tower.encoder.final_layernorm.weight"), Lv, D, eps);

  oc::FullAttnShape fs;
  fs.H = H, fs.Dh = Dh, fs.cu_seqlens = b.cu_patches.data(), fs.N = b.size(), fs.ld_qkv = 3 * Q, fs.ld_o = Q;
  fs.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dh)));
  void* dxb = a.dxb.p;  // bf16 [Lv, D] of dx for the products' backward
  float* dg = grow<float>(a.dg, size_t(Lv * I) * 4);
  void* dgb = grow(a.dout, size_t(Lv * std::max(I, Q)) * 2);  // gelu's bf16 output, later the attention's d o
  float* dxn = grow<float>(a.dxn, LD4);
  void* dqkv = grow(a.dqkv, size_t(Lv * 3 * Q) * 2);
  for (int64_t i = v.num_layers - 1; i >= 0; --i) {
    const std::string B = block_name(i);
    const VisionActs::Block& k = a.blocks[size_t(i)];
    // MLP residual: x_out = x_mid + fc1 gelu(fc0 RMSNorm1(x_mid)).
    cast_f32_bf16(dx, dxb, Lv * D);
    oc::linear_bwd(k.g.p, W(B + "mlp.fc1.weight"), dxb, dg, DType::F32, G(B + "mlp.fc1.weight"), Lv, I, D);
    oc::gelu_backward(as<float>(k.a.p), dg, DType::F32, dgb, Lv * I, ops::GeluKind::Tanh);
    oc::linear_bwd(k.xn1.p, W(B + "mlp.fc0.weight"), dgb, dxn, DType::F32, G(B + "mlp.fc0.weight"), Lv, D, I);
    oc::rmsnorm_backward(k.x_mid.p, DType::F32, M(B + "norm1.weight"), as<float>(k.rstd1.p), dxn, DType::F32, dx,
                         DType::F32, G(B + "norm1.weight"), Lv, D, eps, 0, 0, /*accumulate_dx=*/true);
    // Attention residual: x_mid = x_in + W_o attn(RoPE(W_qkv RMSNorm0(x_in))).
    cast_f32_bf16(dx, dxb, Lv * D);
    oc::linear_bwd(k.o.p, W(B + "wo.weight"), dxb, dgb, DType::BF16, G(B + "wo.weight"), Lv, Q, D);
    const auto* qkv = as<uint16_t>(k.qkv.p);
    auto* dq = as<uint16_t>(dqkv);
    oc::full_attention_backward(fs, qkv, qkv + Q, qkv + 2 * Q, k.o.p, as<float>(k.lse.p), dgb, dq, dq + Q, dq + 2 * Q);
    oc::rope2d_apply(dq, Lv, H, Dh, 3 * Q, as<float>(a.cs.p), /*inverse=*/true);
    oc::rope2d_apply(dq + Q, Lv, H, Dh, 3 * Q, as<float>(a.cs.p), /*inverse=*/true);
    oc::linear_bwd(k.xn0.p, W(B + "wqkv.weight"), dqkv, dxn, DType::F32, G(B + "wqkv.weight"), Lv, D, 3 * Q);
    oc::rmsnorm_backward(k.x_in.p, DType::F32, M(B + "norm0.weight"), as<float>(k.rstd0.p), dxn, DType::F32, dx,
                         DType::F32, G(B + "norm0.weight"), Lv, D, eps, 0, 0, /*accumulate_dx=*/true);
  }

  // Patch embedding: dW_pe += dxᵀ pixels; the position tables gather their patches' gradients (every frame, every
  // media of that grid), then go through the resize's transpose into the table. The time table is fixed.
  cast_f32_bf16(dx, dxb, Lv * D);
  oc::linear_bwd(a.pixels.p, W("vision_tower.patch_embed.proj.weight"), dxb, nullptr, DType::BF16,
                 G("vision_tower.patch_embed.proj.weight"), Lv, Pv, D);
  float* dpos = grow<float>(a.dpos, size_t(a.G * D) * 4);
  vision_position_grad(dx, ix + a.o_start, ix + a.o_src, dpos, a.G, D);
  float* dtable = G("vision_tower.patch_embed.pos_emb.weight");
  for (const auto& s : a.sizes) {
    if (s.h == v.init_pos_emb_height && s.w == v.init_pos_emb_width)
      add_f32(dtable, dpos + s.off * D, s.h * s.w * D);
    else
      oc::bilinear_resize_backward(dpos + s.off * D, v.init_pos_emb_height, v.init_pos_emb_width, D, s.h, s.w,
                                   dtable);
  }
  a.have = false;
}

void GpuModel::Impl::splice_forward(const int32_t* ids, float* prefix) {
  splice_pos_h.clear();
  splice_grad = false;
  const SpliceIn in = splice_in;
  const bool has_media = (in.media && !in.media->empty()) || in.n_rows > 0;
  if (placeholder < 0) {
    LM_CHECK(!has_media, "gpu model: this model has no vision tower (its config has no vision_config); it takes no "
             "images");
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    if (ids[r] == placeholder) splice_pos_h.push_back(int32_t(r));
  const auto n_ph = static_cast<int64_t>(splice_pos_h.size());
  if (!has_media) {
    LM_CHECK(n_ph == 0, "gpu model: the prompt has {} media placeholder token(s) (id {}) but no image to fill them",
             n_ph, placeholder);
    return;
  }
  const VisionConfig& v = *c.vision;
  const int64_t dt = d;
  const void* feat = nullptr;
  int64_t Mf = 0;
  const bool from_tower = in.media && !in.media->empty();
  if (from_tower) {
    feat = vision_forward(*in.media, &Mf);
    splice_grad = training;
  } else {
    Mf = in.n_rows;
    float* f = grow<float>(splice_feat, size_t(Mf * dt) * 4);
    ck(cudaMemcpyAsync(f, in.rows, size_t(Mf * dt) * 4, cudaMemcpyHostToDevice, walk()), "feature rows");
    feat = f;
  }
  LM_CHECK(Mf == n_ph,
           "gpu model: the prompt has {} media placeholder token(s) (id {}), but its image(s) give {} feature rows; a "
           "prompt carries one placeholder per feature row, (h/{})·(w/{}) per image of h x w patches",
           n_ph, placeholder, Mf, v.merge_h, v.merge_w);
  to_device(splice_pos, splice_pos_h);
  splice_rows(prefix, as<int32_t>(splice_pos.p), feat, /*feat_bf16=*/from_tower, Mf, dt);
}

}  // namespace lm::model::cuda

#endif
