// The raster layer of the plots (canvas.hpp).
#include "plot/canvas.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"
#include "io/file.hpp"
#include "plot/font.hpp"

// The one translation unit that compiles stb_image_write (header-only library from libstb-dev).
#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STBI_WRITE_NO_STDIO
#include <stb/stb_image_write.h>

namespace lm::plot {

Rgb Image::at(int x, int y) const {
  LM_CHECK(x >= 0 && y >= 0 && x < width && y < height, "pixel ({}, {}) outside a {}x{} image", x, y, width, height);
  const size_t i = (static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)) * 3;
  return {rgb[i], rgb[i + 1], rgb[i + 2]};
}

Canvas::Canvas(int w, int h, Rgb bg) : w_(w), h_(h), px_(static_cast<size_t>(w) * static_cast<size_t>(h) * 3) {
  for (size_t i = 0; i < px_.size(); i += 3) px_[i] = bg.r, px_[i + 1] = bg.g, px_[i + 2] = bg.b;
}

Image Canvas::take() {
  Image img;
  img.width = w_, img.height = h_;
  img.rgb = std::move(px_);
  return img;
}

void Canvas::set(int x, int y, Rgb c) {
  if (x < cx0_ || y < cy0_ || x > cx1_ || y > cy1_ || x < 0 || y < 0 || x >= w_ || y >= h_) return;
  const size_t i = (static_cast<size_t>(y) * static_cast<size_t>(w_) + static_cast<size_t>(x)) * 3;
  px_[i] = c.r, px_[i + 1] = c.g, px_[i + 2] = c.b;
}

void Canvas::fill(int x0, int y0, int x1, int y1, Rgb c) {
  for (int y = y0; y <= y1; ++y)
    for (int x = x0; x <= x1; ++x) set(x, y, c);
}

void Canvas::frame(int x0, int y0, int x1, int y1, Rgb c) {
  fill(x0, y0, x1, y0, c), fill(x0, y1, x1, y1, c), fill(x0, y0, x0, y1, c), fill(x1, y0, x1, y1, c);
}

void Canvas::disc(double cx, double cy, int r, Rgb c) {
  if (!(std::fabs(cx) < 1e6 && std::fabs(cy) < 1e6)) return;  // far off the canvas (or NaN)
  const int x0 = static_cast<int>(std::lround(cx)), y0 = static_cast<int>(std::lround(cy));
  for (int dy = -r; dy <= r; ++dy)
    for (int dx = -r; dx <= r; ++dx)
      if (dx * dx + dy * dy <= r * r + r / 2) set(x0 + dx, y0 + dy, c);
}

void Canvas::line(double x0, double y0, double x1, double y1, Rgb c, int width, double* dash) {
  if (!clip_segment(x0, y0, x1, y1)) return;
  const double dx = x1 - x0, dy = y1 - y0;
  const int n = std::max(1, static_cast<int>(std::ceil(std::max(std::fabs(dx), std::fabs(dy)))));
  const int lo = -(width - 1) / 2, hi = width / 2;
  for (int i = 0; i <= n; ++i) {
    if (dash) {
      const double d = *dash + std::hypot(dx, dy) * i / n;
      if (std::fmod(d, 12.0) >= 7.0) continue;  // 7 on, 5 off
    }
    const int x = static_cast<int>(std::lround(x0 + dx * i / n)), y = static_cast<int>(std::lround(y0 + dy * i / n));
    for (int oy = lo; oy <= hi; ++oy)
      for (int ox = lo; ox <= hi; ++ox) set(x + ox, y + oy, c);
  }
  if (dash) *dash += std::hypot(dx, dy);
}

void Canvas::text(int x, int y, std::string_view s, Rgb c, int scale) {
  for (size_t i = 0; i < s.size(); ++i) {
    const uint8_t* g = glyph(s[i]);
    for (int r = 0; r < kGlyphH; ++r)
      for (int col = 0; col < kGlyphW; ++col)
        if (g[r] & (0x10 >> col)) {
          const int px = x + (static_cast<int>(i) * kAdvance + col) * scale, py = y + r * scale;
          fill(px, py, px + scale - 1, py + scale - 1, c);
        }
  }
}

void Canvas::text_up(int x, int y, std::string_view s, Rgb c, int scale) {
  for (size_t i = 0; i < s.size(); ++i) {
    const uint8_t* g = glyph(s[i]);
    for (int r = 0; r < kGlyphH; ++r)
      for (int col = 0; col < kGlyphW; ++col)
        if (g[r] & (0x10 >> col)) {
          const int u = (static_cast<int>(i) * kAdvance + col) * scale;
          const int px = x + r * scale, py = y - u - scale;
          fill(px, py, px + scale - 1, py + scale - 1, c);
        }
  }
}

bool Canvas::clip_segment(double& x0, double& y0, double& x1, double& y1) const {
  if (!std::isfinite(x0) || !std::isfinite(y0) || !std::isfinite(x1) || !std::isfinite(y1)) return false;
  const double xmin = cx0_ - 2, xmax = cx1_ + 2, ymin = cy0_ - 2, ymax = cy1_ + 2;
  double t0 = 0, t1 = 1;
  const double dx = x1 - x0, dy = y1 - y0;
  const double p[4] = {-dx, dx, -dy, dy}, q[4] = {x0 - xmin, xmax - x0, y0 - ymin, ymax - y0};
  for (int k = 0; k < 4; ++k) {
    if (p[k] == 0) {
      if (q[k] < 0) return false;
      continue;
    }
    const double t = q[k] / p[k];
    if (p[k] < 0) t0 = std::max(t0, t);
    else t1 = std::min(t1, t);
    if (t0 > t1) return false;
  }
  const double ax = x0 + t0 * dx, ay = y0 + t0 * dy;
  x1 = x0 + t1 * dx, y1 = y0 + t1 * dy, x0 = ax, y0 = ay;
  return true;
}

std::string encode_png(const Image& img) {
  LM_CHECK(img.width > 0 && img.height > 0 &&
               img.rgb.size() == static_cast<size_t>(img.width) * static_cast<size_t>(img.height) * 3,
           "encode_png: image buffer does not match {}x{}", img.width, img.height);
  std::string out;
  auto sink = [](void* ctx, void* data, int size) {
    static_cast<std::string*>(ctx)->append(static_cast<const char*>(data), static_cast<size_t>(size));
  };
  const int ok = stbi_write_png_to_func(sink, &out, img.width, img.height, 3, img.rgb.data(), img.width * 3);
  LM_CHECK(ok != 0 && !out.empty(), "PNG encoding of a {}x{} image failed", img.width, img.height);
  return out;
}

void write_png(const std::string& path, const Image& img) { io::write_file_atomic(path, encode_png(img)); }

}  // namespace lm::plot
