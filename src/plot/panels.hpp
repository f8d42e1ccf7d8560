#pragma once
// `longmoe plot`: training curves from the trainer's metrics JSONL. Reads the files, turns fields into
// panels of series (chart.hpp) and writes them as one PNG (canvas.hpp).
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
#include "plot/chart.hpp"

namespace lm::plot {

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

// ---- metrics -> panels ---------------------------------------------------------------------

struct PlotOptions {
  std::vector<std::string> ys;  // one panel per field; empty: loss (+ eval_loss) and maxvio
  std::string x = "step";       // x field: "step" or "tokens" (any numeric field)
  bool log_x = false, log_y = false;
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

}  // namespace lm::plot
