// Images in (io/image.hpp): PNG and JPEG decoded to RGB, resized to multiples of 28 px within a patch budget,
// normalised and patched as SPEC §9 says; corrupt, truncated, zero-sized, oversized or foreign images are clear
// errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#define STB_IMAGE_WRITE_IMPLEMENTATION
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wcast-align"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <stb/stb_image_write.h>
#pragma GCC diagnostic pop

#include <zlib.h>

#include "core/error.hpp"
#include "io/image.hpp"

using namespace lm;

namespace {

void sink(void* ctx, void* data, int size) {
  static_cast<std::string*>(ctx)->append(static_cast<const char*>(data), static_cast<size_t>(size));
}
std::vector<uint8_t> gradient(int w, int h) {
  std::vector<uint8_t> px(size_t(w * h * 3));
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      uint8_t* p = &px[size_t((y * w + x) * 3)];
      p[0] = uint8_t(x * 255 / std::max(1, w - 1)), p[1] = uint8_t(y * 255 / std::max(1, h - 1)), p[2] = 128;
    }
  return px;
}
std::string png(int w, int h, const std::vector<uint8_t>& px) {
  std::string s;
  EXPECT_TRUE(stbi_write_png_to_func(sink, &s, w, h, 3, px.data(), w * 3));
  return s;
}
std::string jpg(int w, int h, const std::vector<uint8_t>& px) {
  std::string s;
  EXPECT_TRUE(stbi_write_jpg_to_func(sink, &s, w, h, 3, px.data(), 95));
  return s;
}
void expect_error(const std::string& bytes, const std::string& needle) {
  try {
    io::decode_image(bytes, "img.png", int64_t(1) << 20);
    ADD_FAILURE() << "accepted: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "wanted '" << needle << "': " << e.what();
    EXPECT_NE(std::string(e.what()).find("img.png"), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Image, PngAndJpegDecode) {
  const auto px = gradient(50, 30);
  const io::Image a = io::decode_image(png(50, 30, px), "a.png");
  ASSERT_EQ(a.width, 50);
  ASSERT_EQ(a.height, 30);
  EXPECT_EQ(a.rgb, px);  // lossless
  const io::Image b = io::decode_image(jpg(50, 30, px), "b.jpg");
  ASSERT_EQ(b.width, 50);
  double err = 0;
  for (size_t i = 0; i < px.size(); ++i) err = std::max(err, std::abs(double(b.rgb[i]) - double(px[i])));
  EXPECT_LT(err, 40.0);  // lossy, but the same picture
}

TEST(Image, PatchesAreNormalisedRowMajorAndMultiplesOf28) {
  // A 56 x 28 image (already multiples of 28): no resize; pixel (y, x) lands in patch (y/14, x/14) at (y%14, x%14).
  const auto px = gradient(56, 28);
  const io::ImagePatches p = io::image_patches(io::decode_image(png(56, 28, px), "p.png"));
  EXPECT_EQ(p.t, 1);
  EXPECT_EQ(p.h, 2);
  EXPECT_EQ(p.w, 4);
  ASSERT_EQ(p.pixel_values.size(), size_t(8 * 3 * 14 * 14));
  for (int y : {0, 13, 14, 27})
    for (int x : {0, 15, 55})
      for (int c = 0; c < 3; ++c) {
        const int64_t patch = (y / 14) * 4 + x / 14;
        const float want = (float(px[size_t((y * 56 + x) * 3 + c)]) / 255.f - 0.5f) / 0.5f;
        EXPECT_FLOAT_EQ(p.pixel_values[size_t(((patch * 3 + c) * 14 + y % 14) * 14 + x % 14)], want);
      }
  // Other sizes: sides rounded to multiples of 28, the aspect ratio kept, the budget held.
  for (auto [w, h, budget] : {std::tuple{100, 60, 4096}, {2000, 1000, 256}, {10, 10, 4096}, {3000, 40, 64}}) {
    const io::ImagePatches q = io::image_patches(io::decode_image(png(w, h, gradient(w, h)), "q.png"), 14, 2, budget);
    EXPECT_EQ(q.h % 2, 0) << w << "x" << h;
    EXPECT_EQ(q.w % 2, 0) << w << "x" << h;
    EXPECT_LE(q.h * q.w, budget) << w << "x" << h;
    EXPECT_EQ(q.pixel_values.size(), size_t(q.h * q.w * 3 * 196));
    if (budget == 256) {
      EXPECT_NEAR(double(q.w) / double(q.h), 2.0, 0.3);
    }
    for (float v : q.pixel_values) ASSERT_TRUE(v >= -1.f && v <= 1.f);
  }
  EXPECT_THROW(io::image_patches(io::decode_image(png(10, 10, gradient(10, 10)), "r.png"), 14, 2, 3), Error);
}

TEST(Image, BadImagesAreClearErrors) {
  const std::string good = png(40, 20, gradient(40, 20));
  expect_error("", "empty");
  expect_error("GIF89a this is not a png at all", "not a PNG or JPEG");
  expect_error(good.substr(0, good.size() / 2), "cannot be decoded");  // truncated
  std::string corrupt = good;
  for (size_t i = 60; i < corrupt.size() - 20; i += 7) corrupt[i] = char(corrupt[i] ^ 0x5a);
  expect_error(corrupt, "cannot be decoded");
  // The header claims 3000 x 3000 pixels, over the 2^20 allowed here: refused from the header, before decoding.
  auto with_ihdr = [&](const unsigned char (&dims)[8]) {  // IHDR's width and height replaced, its CRC redone
    std::string s = good;
    for (int i = 0; i < 8; ++i) s[size_t(16 + i)] = char(dims[i]);
    const uint32_t crc = uint32_t(crc32(0, reinterpret_cast<const Bytef*>(s.data() + 12), 17));
    for (int i = 0; i < 4; ++i) s[size_t(29 + i)] = char((crc >> (24 - 8 * i)) & 0xff);
    return s;
  };
  expect_error(with_ihdr({0, 0, 0x0b, 0xb8, 0, 0, 0x0b, 0xb8}), "pixels");
  std::string zero = with_ihdr({0, 0, 0, 0, 0, 0, 0, 20});  // width 0
  try {
    io::decode_image(zero, "img.png");
    ADD_FAILURE() << "a zero-width image was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("img.png"), std::string::npos) << e.what();
  }
}

// JPEG streams with broken Huffman tables and markers (the kind that hit undefined behaviour in stb_image's
// decoder): each is an error naming the file or a decoded image, never a crash.
TEST(Image, MangledJpegsAreErrorsNotCrashes) {
  const std::string good = jpg(40, 24, gradient(40, 24));
  int errors = 0;
  for (size_t at = 2; at < good.size(); at += 5) {
    std::string bad = good;
    bad[at] = char(bad[at] ^ 0xff);
    try {
      const io::Image img = io::decode_image(bad, "m.jpg");
      EXPECT_EQ(img.rgb.size(), size_t(img.width * img.height * 3));
    } catch (const Error& e) {
      ++errors;
      EXPECT_NE(std::string(e.what()).find("m.jpg"), std::string::npos) << e.what();
    }
  }
  EXPECT_GT(errors, 0);
  expect_error(good.substr(0, 100), "cannot be decoded");
}
