#pragma once
// Training curves to PNG: reads the trainer's metrics JSONL, turns fields into line series and
// renders them with a small built-in rasteriser (axes, ticks, a 5×7 bitmap font, legend) into an
// RGB image, encoded by stb_image_write and written atomically.
//
// Metrics JSONL: one JSON object per line, e.g.
//   {"step": 10, "tokens": 40960, "loss": 5.12, "lr": 3e-4, "grad_norm": 1.3, "tok_per_s": 1800,
//    "maxvio": [0.21, 0.18], "stage": 0}            (train line; maxvio: one entry per MoE layer)
//   {"step": 200, "eval_loss": 4.8, "eval_ppl": 121.5}   (eval line)
// Blank lines are skipped; NaN / Infinity literals and null read as missing values (gaps); a line
// that is not a JSON object is an error naming the file and line, except an unterminated last line
// (a run still writing it), which is ignored.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/json.hpp"

namespace lm::train {

// ---- metrics ---------------------------------------------------------------------------------

struct MetricsRow {
  int64_t line = 0;  // 1-based line number in the file
  io::json obj;
};

struct MetricsLog {
  std::string path;  // label for messages and legends
  std::vector<MetricsRow> rows;
};

MetricsLog parse_metrics(std::string_view text, const std::string& label);
MetricsLog read_metrics(const std::string& path);

// ---- rendering -------------------------------------------------------------------------------

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};
const std::vector<Rgb>& palette();  // series colours, in order

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
  bool log_y = false;
  std::optional<double> y_min, y_max;  // fixed limits (else from the data)
  std::vector<Series> series;
  std::vector<double> vlines;  // x positions of dashed vertical markers (curriculum stage changes)
  std::string empty_note;      // shown when no series has a finite point
};

struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // row-major, 3 bytes per pixel
  Rgb at(int x, int y) const;
};

// Panels stacked vertically; `title` (optional) on top.
Image render(const std::vector<Panel>& panels, int width, int height, const std::string& title = "");
std::string encode_png(const Image& img);
void write_png(const std::string& path, const Image& img);  // atomic

// Pixel width of `s` drawn with the built-in font at `scale`.
int text_width(std::string_view s, int scale);

// ---- metrics -> panels ---------------------------------------------------------------------

struct PlotOptions {
  std::vector<std::string> ys;  // one panel per field; empty: loss (+ eval_loss) and maxvio
  std::string x = "step";       // x field: "step" or "tokens" (any numeric field)
  bool log_y = false;
  int smooth = 0;               // centred moving average over N points (even N: N + 1; 0/1: none)
  std::string layers = "auto";  // array fields: "all" (one series per entry), "median", "max",
                                // "mean", "median+max"; auto: all for ≤ 8 entries and one file
  std::optional<double> y_min, y_max;
  int width = 1200, height = 0;  // height 0: 420 per panel
  std::string title;            // default: the file names
};

// Throws naming file and line when a plotted field has a non-numeric value.
std::vector<Panel> build_panels(const std::vector<MetricsLog>& logs, const PlotOptions& o);
// read_metrics + build_panels + render + write_png.
void plot_metrics(const std::vector<std::string>& files, const std::string& out, const PlotOptions& o);

}  // namespace lm::train
