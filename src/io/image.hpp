#pragma once
// Images in (SPEC §9 pre-processing): PNG and JPEG decoding (libpng, libjpeg-turbo), resizing to multiples of
// patch·merge (28 px in K3) within a patch budget, normalisation and patching into the vision tower's inputs.
//
// Legend: W×H pixels, p = patch_size (14), m = merge (2; the tower merges m×m patches), L = (H/p)·(W/p) patches.
//   pixel_values [L, 3, p, p] = ((x / 255) − 0.5) / 0.5, patches row-major over the image, channels R, G, B
//   grid (t, h, w) = (1, H/p, W/p)
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lm::io {

struct Image {
  int64_t width = 0, height = 0;
  std::vector<uint8_t> rgb;  // [height, width, 3]
};

// Decodes a PNG or JPEG held in memory. lm::Error naming `ctx` for an empty, corrupt or truncated image, another
// format, a zero side, or more than `max_pixels` pixels (checked from the header, before decoding).
Image decode_image(std::string_view bytes, const std::string& ctx, int64_t max_pixels = int64_t(1) << 26);

// `img` resized (bilinear) to W×H, e.g. a 28×28 Fashion-MNIST item upscaled to 56×56. lm::Error for an empty image or
// a zero side.
Image resize_image(const Image& img, int64_t W, int64_t H);

struct ImagePatches {
  int64_t t = 1, h = 0, w = 0;      // the grid in patches
  std::vector<float> pixel_values;  // [h·w, 3, p, p]
};

// The image resized (bilinear, aspect ratio kept) so that both sides are multiples of p·m and (H/p)·(W/p) <=
// max_patches, then normalised and cut into p×p patches. lm::Error when max_patches cannot hold even m×m patches.
ImagePatches image_patches(const Image& img, int64_t patch = 14, int64_t merge = 2, int64_t max_patches = 4096);

}  // namespace lm::io
