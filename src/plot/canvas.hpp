#pragma once
// The plots' raster layer: an RGB canvas with a clip rectangle, filled rectangles, frames, discs, thick
// (optionally dashed) lines and text in the built-in font (font.hpp), horizontal or rotated; and images
// encoded as PNG (stb_image_write) and written atomically. Knows nothing about charts (chart.hpp).
//
// Coordinates are pixels, x to the right, y down; rectangle corners are inclusive.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lm::plot {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};

struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // row-major, 3 bytes per pixel
  Rgb at(int x, int y) const;
};

class Canvas {
 public:
  Canvas(int w, int h, Rgb bg);
  int width() const { return w_; }
  int height() const { return h_; }
  // The finished picture (the canvas is left empty).
  Image take();

  void set(int x, int y, Rgb c);  // one pixel, if inside the canvas and the clip rectangle
  // Inclusive clip rectangle for every later drawing call; reset_clip() lifts it.
  void clip(int x0, int y0, int x1, int y1) { cx0_ = x0, cy0_ = y0, cx1_ = x1, cy1_ = y1; }
  void reset_clip() { cx0_ = 0, cy0_ = 0, cx1_ = w_ - 1, cy1_ = h_ - 1; }

  void fill(int x0, int y0, int x1, int y1, Rgb c);   // inclusive corners
  void frame(int x0, int y0, int x1, int y1, Rgb c);  // the rectangle's outline
  void disc(double cx, double cy, int r, Rgb c);
  // Segment with a square pen of `width` pixels; `dash` (if non-null) is the running distance along
  // a dashed polyline, so the dash pattern continues across its many short segments.
  void line(double x0, double y0, double x1, double y1, Rgb c, int width, double* dash = nullptr);
  // Text in the built-in font, `scale` pixels per font pixel; (x, y) is its top-left corner.
  void text(int x, int y, std::string_view s, Rgb c, int scale);
  // Text rotated 90° counter-clockwise, read bottom to top; (x, y) is its bottom-left corner.
  void text_up(int x, int y, std::string_view s, Rgb c, int scale);

 private:
  // Liang–Barsky against the clip rectangle (keeps huge or far-away coordinates from costing
  // time or overflowing); false when nothing is left.
  bool clip_segment(double& x0, double& y0, double& x1, double& y1) const;

  int w_, h_;
  int cx0_ = 0, cy0_ = 0, cx1_ = w_ - 1, cy1_ = h_ - 1;
  std::vector<uint8_t> px_;
};

std::string encode_png(const Image& img);
void write_png(const std::string& path, const Image& img);  // atomic (io/file.hpp)

}  // namespace lm::plot
