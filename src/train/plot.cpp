// Training curves to PNG (plot.hpp): JSONL reading, a tiny rasteriser with a built-in 5×7 font,
// and the metrics -> panels mapping behind `longmoe plot`.
//
// Layout of a panel (pixels): title strip on top, y tick labels and the rotated y label on the left,
// x tick labels and the x label below; the plot rectangle [L, R] × [T, B] clips every series.
#include "train/plot.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "io/safetensors.hpp"  // write_file_atomic

// The one translation unit that compiles stb_image_write (header-only library from libstb-dev).
#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STBI_WRITE_NO_STDIO
#include <stb/stb_image_write.h>

namespace lm::train {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// 5×7 bitmap font for printable ASCII (32..126): 7 rows per glyph, bit 4 = leftmost column.

constexpr uint8_t kFont[95][7] = {
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},  // ' '
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04},  // '!'
    {0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00},  // '"'
    {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A},  // '#'
    {0x04, 0x0F, 0x14, 0x0E, 0x05, 0x1E, 0x04},  // '$'
    {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03},  // '%'
    {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D},  // '&'
    {0x04, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00},  // '\''
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02},  // '('
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08},  // ')'
    {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00},  // '*'
    {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00},  // '+'
    {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08},  // ','
    {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00},  // '-'
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C},  // '.'
    {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00},  // '/'
    {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E},  // '0'
    {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E},  // '1'
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F},  // '2'
    {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E},  // '3'
    {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02},  // '4'
    {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E},  // '5'
    {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E},  // '6'
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08},  // '7'
    {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E},  // '8'
    {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C},  // '9'
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00},  // ':'
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08},  // ';'
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02},  // '<'
    {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00},  // '='
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08},  // '>'
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04},  // '?'
    {0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E},  // '@'
    {0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11},  // 'A'
    {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E},  // 'B'
    {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E},  // 'C'
    {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C},  // 'D'
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F},  // 'E'
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10},  // 'F'
    {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F},  // 'G'
    {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11},  // 'H'
    {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // 'I'
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C},  // 'J'
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11},  // 'K'
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F},  // 'L'
    {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11},  // 'M'
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11},  // 'N'
    {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // 'O'
    {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10},  // 'P'
    {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D},  // 'Q'
    {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11},  // 'R'
    {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E},  // 'S'
    {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // 'T'
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E},  // 'U'
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04},  // 'V'
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A},  // 'W'
    {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11},  // 'X'
    {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04},  // 'Y'
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F},  // 'Z'
    {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E},  // '['
    {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00},  // '\\'
    {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E},  // ']'
    {0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00},  // '^'
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F},  // '_'
    {0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00},  // '`'
    {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F},  // 'a'
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E},  // 'b'
    {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E},  // 'c'
    {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F},  // 'd'
    {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E},  // 'e'
    {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08},  // 'f'
    {0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // 'g'
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11},  // 'h'
    {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E},  // 'i'
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C},  // 'j'
    {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12},  // 'k'
    {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E},  // 'l'
    {0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11},  // 'm'
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11},  // 'n'
    {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E},  // 'o'
    {0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10},  // 'p'
    {0x00, 0x00, 0x0D, 0x13, 0x0F, 0x01, 0x01},  // 'q'
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10},  // 'r'
    {0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E},  // 's'
    {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06},  // 't'
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D},  // 'u'
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04},  // 'v'
    {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A},  // 'w'
    {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11},  // 'x'
    {0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E},  // 'y'
    {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F},  // 'z'
    {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02},  // '{'
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04},  // '|'
    {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08},  // '}'
    {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00},  // '~'
};

constexpr int kGlyphW = 5, kGlyphH = 7, kAdvance = 6;

// ---------------------------------------------------------------------------------------------
// canvas

class Canvas {
 public:
  Canvas(int w, int h, Rgb bg) : w_(w), h_(h), px_(static_cast<size_t>(w) * static_cast<size_t>(h) * 3) {
    for (size_t i = 0; i < px_.size(); i += 3) px_[i] = bg.r, px_[i + 1] = bg.g, px_[i + 2] = bg.b;
  }
  int width() const { return w_; }
  int height() const { return h_; }
  std::vector<uint8_t>& pixels() { return px_; }

  void set(int x, int y, Rgb c) {
    if (x < cx0_ || y < cy0_ || x > cx1_ || y > cy1_ || x < 0 || y < 0 || x >= w_ || y >= h_) return;
    const size_t i = (static_cast<size_t>(y) * static_cast<size_t>(w_) + static_cast<size_t>(x)) * 3;
    px_[i] = c.r, px_[i + 1] = c.g, px_[i + 2] = c.b;
  }
  // Inclusive clip rectangle for every later drawing call; reset_clip() lifts it.
  void clip(int x0, int y0, int x1, int y1) { cx0_ = x0, cy0_ = y0, cx1_ = x1, cy1_ = y1; }
  void reset_clip() { cx0_ = 0, cy0_ = 0, cx1_ = w_ - 1, cy1_ = h_ - 1; }

  void fill(int x0, int y0, int x1, int y1, Rgb c) {  // inclusive corners
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  void frame(int x0, int y0, int x1, int y1, Rgb c) {
    fill(x0, y0, x1, y0, c), fill(x0, y1, x1, y1, c), fill(x0, y0, x0, y1, c), fill(x1, y0, x1, y1, c);
  }
  void disc(double cx, double cy, int r, Rgb c) {
    if (!(std::fabs(cx) < 1e6 && std::fabs(cy) < 1e6)) return;  // far off the canvas (or NaN)
    const int x0 = static_cast<int>(std::lround(cx)), y0 = static_cast<int>(std::lround(cy));
    for (int dy = -r; dy <= r; ++dy)
      for (int dx = -r; dx <= r; ++dx)
        if (dx * dx + dy * dy <= r * r + r / 2) set(x0 + dx, y0 + dy, c);
  }

  // Segment with a square pen of `width` pixels; `dash` (if non-null) is the running distance along
  // a dashed polyline, so the dash pattern continues across its many short segments.
  void line(double x0, double y0, double x1, double y1, Rgb c, int width, double* dash = nullptr) {
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

  void text(int x, int y, std::string_view s, Rgb c, int scale) {
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
  // Text rotated 90° counter-clockwise, read bottom to top; (x, y) is its bottom-left corner.
  void text_up(int x, int y, std::string_view s, Rgb c, int scale) {
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

 private:
  static const uint8_t* glyph(char ch) {
    const int c = static_cast<unsigned char>(ch);
    return kFont[(c >= 32 && c <= 126) ? c - 32 : '?' - 32];
  }
  // Liang–Barsky against the clip rectangle (keeps huge or far-away coordinates from costing
  // time or overflowing); false when nothing is left.
  bool clip_segment(double& x0, double& y0, double& x1, double& y1) const {
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

  int w_, h_;
  int cx0_ = 0, cy0_ = 0, cx1_ = w_ - 1, cy1_ = h_ - 1;
  std::vector<uint8_t> px_;
};

constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGrid{228, 228, 228}, kAxisText{40, 40, 40},
    kStageLine{150, 150, 150}, kLegendBorder{170, 170, 170}, kNote{120, 120, 120};

Rgb faint(Rgb c) {  // 65% towards white: raw curves under their smoothed version
  auto f = [](uint8_t v) { return static_cast<uint8_t>(v + (255 - v) * 65 / 100); };
  return {f(c.r), f(c.g), f(c.b)};
}

// ---------------------------------------------------------------------------------------------
// ticks and labels

double nice_step(double range, int target) {
  const double raw = range / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  return (f < 1.5 ? 1.0 : f < 3.0 ? 2.0 : f < 7.0 ? 5.0 : 10.0) * mag;
}

std::vector<double> linear_ticks(double lo, double hi, int target) {
  std::vector<double> t;
  const double step = nice_step(hi - lo, target);
  if (!(step > 0) || !std::isfinite(step)) return t;
  const double first = std::ceil(lo / step - 1e-9);
  for (int k = 0; k < 100; ++k) {
    double v = (first + k) * step;
    if (v > hi + step * 1e-9) break;
    if (std::fabs(v) < step * 1e-9) v = 0;
    t.push_back(v);
  }
  return t;
}

int decimals_for(double x) {  // digits after the point needed to print x exactly (at most 8)
  x = std::fabs(x);
  for (int d = 0; d < 8; ++d) {
    const double s = x * std::pow(10.0, d);
    if (std::fabs(s - std::round(s)) < 1e-6 * std::max(1.0, s)) return d;
  }
  return 8;
}

// `step` sets the precision, `mag` (largest magnitude on the axis) the notation: 12k / 1.5M for
// large values, 3.0e-4 for small ones, plain decimals otherwise.
std::string tick_label(double v, double step, double mag) {
  if (v == 0) return "0";
  if (mag >= 1e4) {
    const double u = mag < 1e6 ? 1e3 : mag < 1e9 ? 1e6 : mag < 1e12 ? 1e9 : 1e12;
    const char* suffix = u == 1e3 ? "k" : u == 1e6 ? "M" : u == 1e9 ? "G" : "T";
    return fmt::format("{:.{}f}{}", v / u, decimals_for(step / u), suffix);
  }
  if (mag < 1e-2) {
    const int e = static_cast<int>(std::floor(std::log10(mag)));
    const double p = std::pow(10.0, e);
    return fmt::format("{:.{}f}e{}", v / p, decimals_for(step / p), e);
  }
  return fmt::format("{:.{}f}", v, decimals_for(step));
}

struct Axis {
  double lo = 0, hi = 1;  // in plotted units (log10 of the value on a log axis)
  bool log = false;
  std::vector<double> ticks;  // plotted units
  std::vector<std::string> labels;
};

// Ticks for [lo, hi] (plotted units), with at most about `target` labels.
void make_ticks(Axis& a, int target) {
  a.ticks.clear(), a.labels.clear();
  if (!a.log) {
    a.ticks = linear_ticks(a.lo, a.hi, target);
    const double step = a.ticks.size() > 1 ? a.ticks[1] - a.ticks[0] : nice_step(a.hi - a.lo, target);
    const double mag = std::max(std::fabs(a.lo), std::fabs(a.hi));
    for (double t : a.ticks) a.labels.push_back(tick_label(t, step, mag));
    return;
  }
  const double decades = a.hi - a.lo;
  std::vector<double> vals;  // values, not logs
  const int k0 = static_cast<int>(std::floor(a.lo)), k1 = static_cast<int>(std::ceil(a.hi));
  const int stride = std::max(1, static_cast<int>(std::ceil(decades / std::max(1, target))));
  for (int k = k0; k <= k1; ++k) {
    for (double m : {1.0, 2.0, 5.0}) {
      if (m != 1.0 && decades > 2.0) continue;
      if (m == 1.0 && decades > 2.0 && (k - k0) % stride != 0) continue;
      const double v = m * std::pow(10.0, k), l = std::log10(v);
      if (l >= a.lo - 1e-9 && l <= a.hi + 1e-9) vals.push_back(v);
    }
  }
  if (vals.size() < 3) {  // less than a decade: linear ticks in value space, placed logarithmically
    const double vlo = std::pow(10.0, a.lo), vhi = std::pow(10.0, a.hi);
    vals.clear();
    for (double v : linear_ticks(vlo, vhi, target))
      if (v > 0) vals.push_back(v);
    const double step = vals.size() > 1 ? vals[1] - vals[0] : vhi - vlo;
    for (double v : vals) a.ticks.push_back(std::log10(v)), a.labels.push_back(tick_label(v, step, vhi));
    return;
  }
  for (double v : vals) a.ticks.push_back(std::log10(v)), a.labels.push_back(tick_label(v, v, v));
}

// ---------------------------------------------------------------------------------------------
// panel

constexpr int kScale = 2;               // font scale for all text
constexpr int kCharH = kGlyphH * kScale;  // 14 px

double plotted(double y, bool log) {
  if (!std::isfinite(y)) return kNaN;
  if (!log) return y;
  return y > 0 ? std::log10(y) : kNaN;
}

void draw_panel(Canvas& cv, const Panel& p, int x0, int y0, int w, int h) {
  // ---- data ranges ----
  double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
  for (const Series& s : p.series)
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      const double y = plotted(s.y[i], p.log_y);
      if (!std::isfinite(s.x[i]) || !std::isfinite(y)) continue;
      xlo = std::min(xlo, s.x[i]), xhi = std::max(xhi, s.x[i]);
      ylo = std::min(ylo, y), yhi = std::max(yhi, y);
    }
  const bool has_data = xlo <= xhi;
  const int T = y0 + kCharH + 16, B = y0 + h - (2 * kCharH + 26);
  Axis ax, ay;
  ay.log = p.log_y;
  if (has_data) {
    if (xlo == xhi) xlo -= 1, xhi += 1;
    ax.lo = xlo, ax.hi = xhi;
    // markers (eval points) often sit on the last step: a little room keeps them whole
    if (std::any_of(p.series.begin(), p.series.end(), [](const Series& s) { return s.markers; })) {
      const double m = 0.01 * (xhi - xlo);
      ax.lo -= m, ax.hi += m;
    }
    const double pad = yhi > ylo ? 0.05 * (yhi - ylo) : std::max(std::fabs(ylo) * 0.1, p.log_y ? 0.1 : 1e-3);
    ay.lo = ylo - pad, ay.hi = yhi + pad;
    if (!p.log_y && ylo >= 0 && ay.lo < 0) ay.lo = 0;  // non-negative data: axis starts at 0, not below
    // fixed limits that make no sense on this axis (NaN, or <= 0 on a log axis) are ignored
    if (p.y_min && std::isfinite(plotted(*p.y_min, p.log_y))) ay.lo = plotted(*p.y_min, p.log_y);
    if (p.y_max && std::isfinite(plotted(*p.y_max, p.log_y))) ay.hi = plotted(*p.y_max, p.log_y);
    if (!(ay.hi > ay.lo)) ay.hi = ay.lo + 1;
    if (!std::isfinite(ay.hi - ay.lo)) ay.lo = ylo, ay.hi = yhi > ylo ? yhi : ylo + 1;  // overflowed padding
    make_ticks(ay, std::max(2, (B - T) / 45));
  }
  int label_w = 0;
  for (const auto& l : ay.labels) label_w = std::max(label_w, text_width(l, kScale));
  const int L = x0 + 8 + kCharH + 10 + label_w + 8, R = x0 + w - 24;

  // ---- title, frame, labels ----
  cv.reset_clip();
  cv.text(L + (R - L - text_width(p.title, kScale)) / 2, y0 + 8, p.title, kAxisText, kScale);
  cv.text_up(x0 + 8, (T + B) / 2 + text_width(p.y_label, kScale) / 2, p.y_label, kAxisText, kScale);
  cv.text(L + (R - L - text_width(p.x_label, kScale)) / 2, B + kCharH + 18, p.x_label, kAxisText, kScale);
  if (!has_data || R - L < 20 || B - T < 20) {
    cv.frame(L, T, R, B, kBlack);
    cv.text(L + (R - L - text_width(p.empty_note, kScale)) / 2, (T + B) / 2 - kCharH / 2, p.empty_note, kNote,
            kScale);
    return;
  }
  // x ticks: as many as fit without the labels touching
  for (int target = 10; target >= 2; --target) {
    make_ticks(ax, target);
    int total = 0;
    for (const auto& l : ax.labels) total += text_width(l, kScale) + 24;
    if (total <= R - L) break;
  }
  auto X = [&](double x) { return L + (x - ax.lo) / (ax.hi - ax.lo) * (R - L); };
  auto Y = [&](double y) { return B - (plotted(y, p.log_y) - ay.lo) / (ay.hi - ay.lo) * (B - T); };
  auto Yp = [&](double t) { return B - (t - ay.lo) / (ay.hi - ay.lo) * (B - T); };  // plotted units

  for (size_t i = 0; i < ax.ticks.size(); ++i) {
    const int x = static_cast<int>(std::lround(X(ax.ticks[i])));
    cv.fill(x, T + 1, x, B - 1, kGrid);
    cv.fill(x, B, x, B + 5, kBlack);
    cv.text(x - text_width(ax.labels[i], kScale) / 2, B + 9, ax.labels[i], kAxisText, kScale);
  }
  for (size_t i = 0; i < ay.ticks.size(); ++i) {
    const int y = static_cast<int>(std::lround(Yp(ay.ticks[i])));
    if (y < T || y > B) continue;
    cv.fill(L + 1, y, R - 1, y, kGrid);
    cv.fill(L - 5, y, L, y, kBlack);
    cv.text(L - 9 - text_width(ay.labels[i], kScale), y - kCharH / 2, ay.labels[i], kAxisText, kScale);
  }

  // ---- contents, clipped to the plot rectangle ----
  cv.clip(L + 1, T + 1, R - 1, B - 1);
  for (double v : p.vlines) {
    double dash = 0;
    cv.line(X(v), T, X(v), B, kStageLine, 1, &dash);
  }
  for (const Series& s : p.series) {
    const size_t n = std::min(s.x.size(), s.y.size());
    if (s.markers) {
      for (size_t i = 0; i < n; ++i)
        if (std::isfinite(s.x[i]) && std::isfinite(plotted(s.y[i], p.log_y))) cv.disc(X(s.x[i]), Y(s.y[i]), 4, s.color);
      continue;
    }
    double dash = 0;
    bool prev = false;
    double px = 0, py = 0;
    for (size_t i = 0; i < n; ++i) {
      const bool ok = std::isfinite(s.x[i]) && std::isfinite(plotted(s.y[i], p.log_y));
      if (!ok) {
        prev = false;
        continue;
      }
      const double cx = X(s.x[i]), cy = Y(s.y[i]);
      if (prev) cv.line(px, py, cx, cy, s.color, 2, s.dashed ? &dash : nullptr);
      else if (i + 1 >= n || !std::isfinite(plotted(s.y[i + 1], p.log_y)))
        cv.disc(cx, cy, 1, s.color);  // an isolated point stays visible
      px = cx, py = cy, prev = true;
    }
  }
  cv.reset_clip();
  cv.frame(L, T, R, B, kBlack);

  // ---- legend (top right, inside) ----
  std::vector<const Series*> entries;
  for (const Series& s : p.series) {
    if (!s.in_legend) continue;
    bool any = false;
    for (size_t i = 0; i < s.x.size() && i < s.y.size() && !any; ++i)
      any = std::isfinite(s.x[i]) && std::isfinite(plotted(s.y[i], p.log_y));
    if (any) entries.push_back(&s);
  }
  if (entries.empty()) return;
  constexpr size_t kMaxEntries = 12;
  const size_t shown = entries.size() > kMaxEntries ? kMaxEntries - 1 : entries.size();
  const std::string more = entries.size() > shown ? fmt::format("+{} more", entries.size() - shown) : "";
  int lw = text_width(more, kScale);
  for (size_t i = 0; i < shown; ++i) lw = std::max(lw, text_width(entries[i]->label, kScale));
  const int rows = static_cast<int>(shown) + (more.empty() ? 0 : 1);
  const int bw = 10 + 28 + 8 + lw + 10, bh = 8 + rows * (kCharH + 6) + 2;
  const int bx = R - 8 - bw, by = T + 8;
  cv.fill(bx, by, bx + bw, by + bh, kWhite);
  cv.frame(bx, by, bx + bw, by + bh, kLegendBorder);
  for (size_t i = 0; i < shown; ++i) {
    const Series& s = *entries[i];
    const int ry = by + 8 + static_cast<int>(i) * (kCharH + 6), cy = ry + kCharH / 2;
    if (s.markers) {
      cv.disc(bx + 10 + 14, cy, 4, s.color);
    } else {
      double dash = 0;
      cv.line(bx + 10, cy, bx + 38, cy, s.color, 3, s.dashed ? &dash : nullptr);
    }
    cv.text(bx + 46, ry, s.label, kAxisText, kScale);
  }
  if (!more.empty()) cv.text(bx + 46, by + 8 + static_cast<int>(shown) * (kCharH + 6), more, kNote, kScale);
}

// ---------------------------------------------------------------------------------------------
// metrics

// Bare NaN / Infinity / -Infinity tokens (Python's json.dumps writes them) become null; strings
// are left alone.
std::string nonfinite_to_null(std::string_view s) {
  std::string r;
  r.reserve(s.size());
  bool in_str = false, esc = false;
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (in_str) {
      r += c, ++i;
      if (esc) esc = false;
      else if (c == '\\') esc = true;
      else if (c == '"') in_str = false;
      continue;
    }
    if (c == '"') {
      in_str = true, r += c, ++i;
      continue;
    }
    bool replaced = false;
    for (std::string_view w : {"-Infinity", "Infinity", "NaN"})
      if (s.substr(i, w.size()) == w) {
        r += "null", i += w.size(), replaced = true;
        break;
      }
    if (!replaced) r += c, ++i;
  }
  return r;
}

std::string snippet(std::string_view s) {
  return s.size() <= 60 ? std::string(s) : std::string(s.substr(0, 57)) + "...";
}

// A field's value as a number: numbers as they are, null / "nan" / "inf" strings as NaN / ±Inf.
double number(const io::json& v, const MetricsLog& log, const MetricsRow& row, const std::string& key) {
  if (v.is_number()) return v.get<double>();
  if (v.is_null()) return kNaN;
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (s == "nan") return kNaN;
    if (s == "inf" || s == "+inf" || s == "infinity") return INFINITY;
    if (s == "-inf" || s == "-infinity") return -INFINITY;
  }
  fail("{}:{}: field '{}' must be a number (or an array of numbers), got {}", log.path, row.line, key, v.type_name());
}

// A run's metrics file is always metrics.jsonl, so the run folder names the series.
std::string file_label(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string dir = p.parent_path().filename().string();
  return p.stem() == "metrics" && !dir.empty() && dir != "." ? dir : p.stem().string();
}

// Centred moving average over `n` points of the finite values; non-finite points stay gaps. Near
// the ends the window shrinks symmetrically, so the curve keeps its first and last values instead
// of being pulled towards its interior.
std::vector<double> smooth(const std::vector<double>& y, int n) {
  if (n <= 1) return y;
  std::vector<double> sum(y.size() + 1, 0.0), cnt(y.size() + 1, 0.0);
  for (size_t i = 0; i < y.size(); ++i) {
    const bool ok = std::isfinite(y[i]);
    sum[i + 1] = sum[i] + (ok ? y[i] : 0.0);
    cnt[i + 1] = cnt[i] + (ok ? 1.0 : 0.0);
  }
  std::vector<double> r(y.size(), kNaN);
  const auto half = static_cast<int64_t>(n / 2), sz = static_cast<int64_t>(y.size());
  for (int64_t i = 0; i < sz; ++i) {
    if (!std::isfinite(y[static_cast<size_t>(i)])) continue;
    const int64_t h = std::min({half, i, sz - 1 - i});
    const int64_t a = i - h, b = i + h + 1;
    const double c = cnt[static_cast<size_t>(b)] - cnt[static_cast<size_t>(a)];
    r[static_cast<size_t>(i)] = (sum[static_cast<size_t>(b)] - sum[static_cast<size_t>(a)]) / c;
  }
  return r;
}

double reduce(std::vector<double> v, const std::string& how) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return kNaN;
  if (how == "max") return *std::max_element(v.begin(), v.end());
  if (how == "mean") {
    double s = 0;
    for (double x : v) s += x;
    return s / static_cast<double>(v.size());
  }
  std::sort(v.begin(), v.end());  // median
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// One field of one file: x values (the row's x field, or the last one seen for rows without it)
// and the field's value per row that has it (scalars), or its entries (arrays).
struct Column {
  std::vector<double> x;
  std::vector<std::vector<double>> vals;  // per row: one value (scalar) or the array's entries
  bool array = false;
  size_t width = 0;  // longest array
};

Column column(const MetricsLog& log, const std::string& key, const std::string& xkey) {
  Column c;
  double last_x = kNaN;
  for (const MetricsRow& row : log.rows) {
    const io::json& o = row.obj;
    if (o.contains(xkey)) last_x = number(o[xkey], log, row, xkey);
    if (!o.contains(key) || !std::isfinite(last_x)) continue;
    const io::json& v = o[key];
    std::vector<double> vals;
    if (v.is_array()) {
      c.array = true;
      for (const auto& e : v) vals.push_back(number(e, log, row, key));
      c.width = std::max(c.width, vals.size());
    } else {
      vals.push_back(number(v, log, row, key));
    }
    c.x.push_back(last_x);
    c.vals.push_back(std::move(vals));
  }
  return c;
}

std::string pretty_title(const std::string& key) {
  if (key == "maxvio") return "MaxVio per MoE layer";
  if (key == "loss") return "loss";
  return key;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// public API

const std::vector<Rgb>& palette() {
  static const std::vector<Rgb> p = {{31, 119, 180}, {255, 127, 14},  {44, 160, 44},  {214, 39, 40},
                                     {148, 103, 189}, {140, 86, 75},  {227, 119, 194}, {127, 127, 127},
                                     {188, 189, 34},  {23, 190, 207}};
  return p;
}

Rgb Image::at(int x, int y) const {
  LM_CHECK(x >= 0 && y >= 0 && x < width && y < height, "pixel ({}, {}) outside a {}x{} image", x, y, width, height);
  const size_t i = (static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)) * 3;
  return {rgb[i], rgb[i + 1], rgb[i + 2]};
}

int text_width(std::string_view s, int scale) {
  return s.empty() ? 0 : (static_cast<int>(s.size()) * kAdvance - 1) * scale;
}

MetricsLog parse_metrics(std::string_view text, const std::string& label) {
  MetricsLog log;
  log.path = label;
  size_t pos = 0;
  int64_t line = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    const bool terminated = end != std::string_view::npos;
    if (!terminated) end = text.size();
    std::string_view ln = text.substr(pos, end - pos);
    pos = end + 1;
    ++line;
    while (!ln.empty() && (ln.back() == '\r' || ln.back() == ' ' || ln.back() == '\t')) ln.remove_suffix(1);
    while (!ln.empty() && (ln.front() == ' ' || ln.front() == '\t')) ln.remove_prefix(1);
    if (ln.empty()) continue;
    io::json j;
    try {
      j = io::json::parse(nonfinite_to_null(ln));
    } catch (const io::json::parse_error& e) {
      if (!terminated) break;  // the last line of a run still writing it
      std::string why = e.what();
      if (auto k = why.find("parse error"); k != std::string::npos) why = why.substr(k);
      fail("{}:{}: malformed metrics line ({}): {}", label, line, why, snippet(ln));
    }
    LM_CHECK(j.is_object(), "{}:{}: a metrics line must be a JSON object, got {}: {}", label, line, j.type_name(),
             snippet(ln));
    LM_CHECK(!j.contains("step") || j["step"].is_number(), "{}:{}: field 'step' must be a number, got {}", label,
             line, j["step"].type_name());
    log.rows.push_back({line, std::move(j)});
  }
  return log;
}

MetricsLog read_metrics(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LM_CHECK(in.good(), "cannot open metrics file '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  LM_CHECK(!in.bad(), "error reading metrics file '{}'", path);
  return parse_metrics(ss.str(), path);
}

Image render(const std::vector<Panel>& panels, int width, int height, const std::string& title) {
  LM_CHECK(width >= 200 && height >= 100 && width <= 16384 && height <= 16384,
           "plot size {}x{} out of range (200..16384 x 100..16384)", width, height);
  LM_CHECK(!panels.empty(), "nothing to plot");
  Canvas cv(width, height, kWhite);
  int top = 0;
  if (!title.empty()) {
    cv.text((width - text_width(title, kScale)) / 2, 10, title, kBlack, kScale);
    top = kCharH + 16;
  }
  const int n = static_cast<int>(panels.size());
  const int ph = (height - top) / n;
  for (int i = 0; i < n; ++i) draw_panel(cv, panels[static_cast<size_t>(i)], 0, top + i * ph, width, ph);
  Image img;
  img.width = width, img.height = height;
  img.rgb = std::move(cv.pixels());
  return img;
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

std::vector<Panel> build_panels(const std::vector<MetricsLog>& logs, const PlotOptions& o) {
  static const std::set<std::string> modes = {"auto", "all", "median", "max", "mean", "median+max"};
  LM_CHECK(modes.count(o.layers), "--layers must be one of auto, all, median, max, mean, median+max; got '{}'",
           o.layers);
  LM_CHECK(o.smooth >= 0, "--smooth must be >= 0, got {}", o.smooth);
  LM_CHECK(!o.log_y || ((!o.y_min || *o.y_min > 0) && (!o.y_max || *o.y_max > 0)),
           "with --log-y the y limits must be > 0");
  LM_CHECK(!logs.empty(), "no metrics files to plot");
  const bool defaults = o.ys.empty();
  const std::vector<std::string> keys = defaults ? std::vector<std::string>{"loss", "maxvio"} : o.ys;
  const size_t nf = logs.size();
  std::vector<std::string> names;
  for (const auto& l : logs) names.push_back(file_label(l.path));
  if (std::set<std::string>(names.begin(), names.end()).size() != names.size())
    for (size_t f = 0; f < nf; ++f) names[f] = logs[f].path;  // same stems: full paths tell them apart
  const auto& pal = palette();

  // Curriculum stage changes (x of the first row of each new stage), from every file.
  std::set<double> stage_x;
  for (const auto& log : logs) {
    double last = kNaN, x = kNaN;
    for (const auto& row : log.rows) {
      if (row.obj.contains(o.x)) x = number(row.obj[o.x], log, row, o.x);
      if (!row.obj.contains("stage")) continue;
      const double s = number(row.obj["stage"], log, row, "stage");
      if (std::isfinite(last) && s != last && std::isfinite(x)) stage_x.insert(x);
      last = s;
    }
  }

  std::vector<Panel> panels;
  for (const std::string& key : keys) {
    Panel p;
    p.title = pretty_title(key);
    p.x_label = o.x;
    p.y_label = key;
    p.log_y = o.log_y;
    p.y_min = o.y_min, p.y_max = o.y_max;
    p.vlines.assign(stage_x.begin(), stage_x.end());
    p.empty_note = fmt::format("no '{}' values in the metrics", key);
    std::vector<Series> lines, points;
    for (size_t f = 0; f < nf; ++f) {
      const std::string prefix = nf > 1 ? names[f] + " " : "";
      const Column c = column(logs[f], key, o.x);
      if (c.x.empty()) continue;
      if (!c.array) {
        Series s;
        s.label = nf > 1 ? names[f] : key;
        s.color = pal[f % pal.size()];
        s.x = c.x;
        for (const auto& v : c.vals) s.y.push_back(v.empty() ? kNaN : v[0]);
        lines.push_back(std::move(s));
      } else {
        std::string mode = o.layers;
        if (mode == "auto") mode = nf == 1 ? (c.width <= 8 ? "all" : "median+max") : "median";
        const std::string item = key == "maxvio" ? "layer " : key + " ";
        if (mode == "all") {
          for (size_t j = 0; j < c.width; ++j) {
            Series s;
            s.label = prefix + item + std::to_string(j);
            s.color = pal[(f * c.width + j) % pal.size()];
            s.x = c.x;
            for (const auto& v : c.vals) s.y.push_back(j < v.size() ? v[j] : kNaN);
            lines.push_back(std::move(s));
          }
        } else {
          std::vector<std::string> hows = {mode};
          if (mode == "median+max") hows = {"median", "max"};
          for (const auto& how : hows) {
            Series s;
            s.label = prefix + how + (key == "maxvio" ? " over layers" : "");
            s.color = pal[f % pal.size()];
            s.dashed = how == "max" && hows.size() > 1;
            s.x = c.x;
            for (const auto& v : c.vals) s.y.push_back(reduce(v, how));
            lines.push_back(std::move(s));
          }
        }
      }
      if (key == "loss") {  // held-out loss as points on the loss panel
        const Column e = column(logs[f], "eval_loss", o.x);
        if (!e.x.empty() && !e.array) {
          Series s;
          s.label = prefix + "eval_loss";
          s.color = nf > 1 ? pal[f % pal.size()] : pal[3];
          s.markers = true;
          s.x = e.x;
          for (const auto& v : e.vals) s.y.push_back(v.empty() ? kNaN : v[0]);
          points.push_back(std::move(s));
        }
      }
    }
    for (Series& s : lines) {
      if (o.smooth > 1) {
        Series raw = s;
        raw.color = faint(s.color);
        raw.in_legend = false;
        s.y = smooth(s.y, o.smooth);
        p.series.push_back(std::move(raw));
      }
    }
    // raw (faint) curves first so the smoothed ones and the points draw on top
    for (Series& s : lines) p.series.push_back(std::move(s));
    for (Series& s : points) p.series.push_back(std::move(s));
    if (defaults && key == "maxvio" && p.series.empty()) continue;  // a run without MoE layers
    panels.push_back(std::move(p));
  }
  return panels;
}

void plot_metrics(const std::vector<std::string>& files, const std::string& out, const PlotOptions& o) {
  LM_CHECK(!files.empty(), "plot: no metrics files given");
  LM_CHECK(!out.empty(), "plot: no output file given (--out FILE.png)");
  std::vector<MetricsLog> logs;
  for (const auto& f : files) logs.push_back(read_metrics(f));
  const std::vector<Panel> panels = build_panels(logs, o);
  std::string title = o.title;
  if (title.empty())
    for (size_t i = 0; i < files.size(); ++i)
      title += (i ? ", " : "") + std::filesystem::path(files[i]).filename().string();
  const int height = o.height > 0 ? o.height : 420 * static_cast<int>(panels.size()) + kCharH + 16;
  write_png(out, render(panels, o.width, height, title));
}

}  // namespace lm::train
