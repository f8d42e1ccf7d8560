// Decoding with Debian's libpng (its simplified API) and libjpeg-turbo, not stb_image: fuzzing stb_image's JPEG
// decoder (fuzz/fuzz_image.cpp) hit undefined behaviour in its Huffman tables within a few dozen inputs.
// Resizing with stb_image_resize (header-only, libstb-dev; compiled in this translation unit).
#include "io/image.hpp"

#include <png.h>
#include <jpeglib.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstring>

#include "core/error.hpp"

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
#include <stb/stb_image_resize.h>
#pragma GCC diagnostic pop

namespace lm::io {

namespace {

Image decode_png(std::string_view bytes, const std::string& ctx, int64_t max_pixels) {
  png_image im;
  std::memset(&im, 0, sizeof im);
  im.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&im, bytes.data(), bytes.size())) {
    const std::string why = im.message;
    png_image_free(&im);
    throw Error(fmt::format("{}: the PNG cannot be read ({})", ctx, why));
  }
  const int64_t w = im.width, h = im.height;
  if (w <= 0 || h <= 0 || w * h > max_pixels) {
    png_image_free(&im);
    LM_CHECK(w > 0 && h > 0, "{}: the image has a zero side ({} x {})", ctx, w, h);
    throw Error(fmt::format("{}: the image is {} x {} pixels, more than the {} allowed", ctx, w, h, max_pixels));
  }
  im.format = PNG_FORMAT_RGB;
  Image img;
  img.width = w, img.height = h;
  img.rgb.resize(size_t(w * h * 3));
  if (!png_image_finish_read(&im, nullptr, img.rgb.data(), 0, nullptr)) {
    const std::string why = im.message;
    png_image_free(&im);
    throw Error(fmt::format("{}: the PNG cannot be decoded ({}; corrupt or truncated?)", ctx, why));
  }
  return img;
}

// libjpeg reports errors through error_exit, which must not return: it jumps back here.
struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};
void jpeg_fail(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}
void jpeg_quiet(j_common_ptr, int) {}  // (warnings: corrupt-data ones end in an error or a usable image)

Image decode_jpeg(std::string_view bytes, const std::string& ctx, int64_t max_pixels) {
  jpeg_decompress_struct cinfo;
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  err.mgr.emit_message = jpeg_quiet;
  err.message[0] = 0;
  Image img;  // (declared before setjmp: a longjmp back to it skips no destructor)
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    throw Error(fmt::format("{}: the JPEG cannot be decoded ({}; corrupt or truncated?)", ctx, err.message));
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&cinfo, TRUE);
  const int64_t w = cinfo.image_width, h = cinfo.image_height;
  if (w <= 0 || h <= 0 || w * h > max_pixels) {  // (from the header, before decoding)
    jpeg_destroy_decompress(&cinfo);
    LM_CHECK(w > 0 && h > 0, "{}: the image has a zero side ({} x {})", ctx, w, h);
    throw Error(fmt::format("{}: the image is {} x {} pixels, more than the {} allowed", ctx, w, h, max_pixels));
  }
  cinfo.out_color_space = JCS_RGB;
  jpeg_start_decompress(&cinfo);
  img.width = w, img.height = h;
  img.rgb.resize(size_t(w * h * 3));
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = img.rgb.data() + size_t(cinfo.output_scanline) * size_t(w) * 3;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return img;
}

}  // namespace

Image decode_image(std::string_view bytes, const std::string& ctx, int64_t max_pixels) {
  LM_CHECK(!bytes.empty(), "{}: the image is empty", ctx);
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  if (bytes.size() >= 8 && png_sig_cmp(b, 0, 8) == 0) return decode_png(bytes, ctx, max_pixels);
  if (bytes.size() >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) return decode_jpeg(bytes, ctx, max_pixels);
  throw Error(fmt::format("{}: not a PNG or JPEG image (neither signature)", ctx));
}

Image resize_image(const Image& img, int64_t W, int64_t H) {
  LM_CHECK(img.width > 0 && img.height > 0 && img.rgb.size() == size_t(img.width * img.height * 3) && W > 0 && H > 0,
           "resize_image: an empty or inconsistent image ({} x {}, {} bytes) or size {} x {}", img.width, img.height,
           img.rgb.size(), W, H);
  Image out{W, H, std::vector<uint8_t>(size_t(W * H * 3))};
  LM_CHECK(stbir_resize_uint8(img.rgb.data(), int(img.width), int(img.height), 0, out.rgb.data(), int(W), int(H), 0, 3),
           "resizing {} x {} to {} x {} failed", img.width, img.height, W, H);
  return out;
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
  const std::vector<uint8_t> rs = W == img.width && H == img.height ? img.rgb : resize_image(img, W, H).rgb;
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
