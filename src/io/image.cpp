// The one translation unit that compiles stb_image and stb_image_resize (header-only, libstb-dev).
#include "io/image.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_NO_STDIO
#define STBI_MAX_DIMENSIONS (1 << 16)
#define STB_IMAGE_RESIZE_IMPLEMENTATION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wshadow"
#pragma GCC diagnostic ignored "-Wcast-align"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#pragma GCC diagnostic ignored "-Wnull-dereference"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wpedantic"
#include <stb/stb_image.h>
#include <stb/stb_image_resize.h>
#pragma GCC diagnostic pop

namespace lm::io {

Image decode_image(std::string_view bytes, const std::string& ctx, int64_t max_pixels) {
  LM_CHECK(!bytes.empty(), "{}: the image is empty", ctx);
  LM_CHECK(bytes.size() <= size_t(INT32_MAX), "{}: the image is larger than 2 GiB", ctx);
  const auto* p = reinterpret_cast<const stbi_uc*>(bytes.data());
  const int n = static_cast<int>(bytes.size());
  int w = 0, h = 0, c = 0;
  LM_CHECK(stbi_info_from_memory(p, n, &w, &h, &c), "{}: not a PNG or JPEG image ({})", ctx, stbi_failure_reason());
  LM_CHECK(w > 0 && h > 0, "{}: the image has a zero side ({} x {})", ctx, w, h);
  LM_CHECK(int64_t(w) * h <= max_pixels, "{}: the image is {} x {} pixels, more than the {} allowed", ctx, w, h,
           max_pixels);
  stbi_uc* px = stbi_load_from_memory(p, n, &w, &h, &c, 3);
  LM_CHECK(px != nullptr, "{}: the image cannot be decoded ({}; corrupt or truncated?)", ctx, stbi_failure_reason());
  Image img;
  img.width = w, img.height = h;
  img.rgb.assign(px, px + size_t(w) * h * 3);
  stbi_image_free(px);
  return img;
}

ImagePatches image_patches(const Image& img, int64_t patch, int64_t merge, int64_t max_patches) {
  LM_CHECK(img.width > 0 && img.height > 0 && img.rgb.size() == size_t(img.width * img.height * 3),
           "image_patches: an empty or inconsistent image ({} x {}, {} bytes)", img.width, img.height, img.rgb.size());
  LM_CHECK(patch >= 1 && merge >= 1, "image_patches: patch {} and merge {} must be >= 1", patch, merge);
  LM_CHECK(max_patches >= merge * merge, "image_patches: a budget of {} patches cannot hold one {}x{} merge block",
           max_patches, merge, merge);
  const int64_t unit = patch * merge;
  // The nearest multiples of `unit` at the image's own size, or at a smaller scale while the patch count exceeds the
  // budget (both sides scaled alike: the aspect ratio is kept to within a unit).
  double s = std::min(1.0, std::sqrt(double(max_patches * patch * patch) / (double(img.width) * double(img.height))));
  int64_t W = 0, H = 0;
  for (;; s *= 0.98) {
    W = std::max<int64_t>(unit, int64_t(std::llround(double(img.width) * s / double(unit))) * unit);
    H = std::max<int64_t>(unit, int64_t(std::llround(double(img.height) * s / double(unit))) * unit);
    if ((W / patch) * (H / patch) <= max_patches) break;
    if (W == unit && H == unit) break;  // (max_patches >= merge² holds one unit square)
  }
  std::vector<uint8_t> rs(size_t(W * H * 3));
  if (W == img.width && H == img.height) {
    rs = img.rgb;
  } else {
    LM_CHECK(stbir_resize_uint8(img.rgb.data(), int(img.width), int(img.height), 0, rs.data(), int(W), int(H), 0, 3),
             "image_patches: resizing {} x {} to {} x {} failed", img.width, img.height, W, H);
  }
  ImagePatches out;
  out.h = H / patch, out.w = W / patch;
  out.pixel_values.resize(size_t(out.h * out.w * 3 * patch * patch));
  for (int64_t ph = 0; ph < out.h; ++ph)
    for (int64_t pw = 0; pw < out.w; ++pw) {
      float* dst = out.pixel_values.data() + (ph * out.w + pw) * 3 * patch * patch;
      for (int64_t ch = 0; ch < 3; ++ch)
        for (int64_t y = 0; y < patch; ++y)
          for (int64_t x = 0; x < patch; ++x) {
            const uint8_t v = rs[size_t(((ph * patch + y) * W + pw * patch + x) * 3 + ch)];
            dst[(ch * patch + y) * patch + x] = (float(v) / 255.f - 0.5f) / 0.5f;
          }
    }
  return out;
}

}  // namespace lm::io
