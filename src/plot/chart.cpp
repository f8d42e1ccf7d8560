// Charts (chart.hpp): ticks and labels, one panel's axes, series and legend, and the stacked image.
#include "plot/chart.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.hpp"

namespace lm::plot {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGrid{228, 228, 228}, kAxisText{40, 40, 40},
    kStageLine{150, 150, 150}, kLegendBorder{170, 170, 170}, kNote{120, 120, 120};

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
      if (m != 1.0 && decades > 3.0) continue;  // (1-2-5 up to three decades: at least three labels)
      if (m == 1.0 && decades > 3.0 && (k - k0) % stride != 0) continue;
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
      const double x = plotted(s.x[i], p.log_x), y = plotted(s.y[i], p.log_y);
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      xlo = std::min(xlo, x), xhi = std::max(xhi, x);
      ylo = std::min(ylo, y), yhi = std::max(yhi, y);
    }
  const bool has_data = xlo <= xhi;
  const int T = y0 + kCharH + 16, B = y0 + h - (2 * kCharH + 26);
  Axis ax, ay;
  ax.log = p.log_x;
  ay.log = p.log_y;
  if (has_data) {
    if (xlo == xhi) xlo -= p.log_x ? 0.1 : 1, xhi += p.log_x ? 0.1 : 1;
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
  auto Xp = [&](double t) { return L + (t - ax.lo) / (ax.hi - ax.lo) * (R - L); };  // plotted units
  auto X = [&](double x) { return Xp(plotted(x, p.log_x)); };
  auto Y = [&](double y) { return B - (plotted(y, p.log_y) - ay.lo) / (ay.hi - ay.lo) * (B - T); };
  auto Yp = [&](double t) { return B - (t - ay.lo) / (ay.hi - ay.lo) * (B - T); };  // plotted units

  for (size_t i = 0; i < ax.ticks.size(); ++i) {
    const int x = static_cast<int>(std::lround(Xp(ax.ticks[i])));
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
        if (std::isfinite(plotted(s.x[i], p.log_x)) && std::isfinite(plotted(s.y[i], p.log_y))) cv.disc(X(s.x[i]), Y(s.y[i]), 4, s.color);
      continue;
    }
    double dash = 0;
    bool prev = false;
    double px = 0, py = 0;
    for (size_t i = 0; i < n; ++i) {
      const bool ok = std::isfinite(plotted(s.x[i], p.log_x)) && std::isfinite(plotted(s.y[i], p.log_y));
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
      any = std::isfinite(plotted(s.x[i], p.log_x)) && std::isfinite(plotted(s.y[i], p.log_y));
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

}  // namespace

const std::vector<Rgb>& palette() {
  static const std::vector<Rgb> p = {{31, 119, 180}, {255, 127, 14},  {44, 160, 44},  {214, 39, 40},
                                     {148, 103, 189}, {140, 86, 75},  {227, 119, 194}, {127, 127, 127},
                                     {188, 189, 34},  {23, 190, 207}};
  return p;
}

Rgb faint(Rgb c) {  // 65% towards white: raw curves under their smoothed version
  auto f = [](uint8_t v) { return static_cast<uint8_t>(v + (255 - v) * 65 / 100); };
  return {f(c.r), f(c.g), f(c.b)};
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
  return cv.take();
}

}  // namespace lm::plot
