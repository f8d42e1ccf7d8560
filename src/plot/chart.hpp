#pragma once
// Charts: panels of line and point series with axes, ticks (linear or logarithmic), a legend and dashed
// vertical markers, stacked into one image on the raster layer (canvas.hpp). Knows nothing about metrics
// files (panels.hpp builds the panels from them).
//
// Layout of a panel (pixels): title strip on top, y tick labels and the rotated y label on the left,
// x tick labels and the x label below; the plot rectangle [L, R] × [T, B] clips every series.
#include <optional>
#include <string>
#include <vector>

#include "plot/canvas.hpp"
#include "plot/font.hpp"

namespace lm::plot {

inline constexpr int kScale = 2;                 // font scale for all text
inline constexpr int kCharH = kGlyphH * kScale;  // 14 px

const std::vector<Rgb>& palette();  // series colours, in order
Rgb faint(Rgb c);                   // 65% towards white: raw curves under their smoothed version

struct Series {
  std::string label;
  std::vector<double> x, y;  // non-finite y (or x) leaves a gap
  Rgb color;
  bool markers = false;      // points (e.g. eval loss) instead of a line
  bool dashed = false;
  bool in_legend = true;
};

struct Panel {
  std::string title, x_label, y_label;
  bool log_x = false, log_y = false;  // log axes leave out values <= 0
  std::optional<double> y_min, y_max;  // fixed limits (else from the data)
  std::vector<Series> series;
  std::vector<double> vlines;  // x positions of dashed vertical markers (curriculum stage changes)
  std::string empty_note;      // shown when no series has a finite point
};

// Panels stacked vertically; `title` (optional) on top.
Image render(const std::vector<Panel>& panels, int width, int height, const std::string& title = "");

}  // namespace lm::plot
