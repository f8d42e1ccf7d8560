// `longmoe plot`'s metrics side (panels.hpp): JSONL reading, and fields -> series -> panels.
#include "plot/panels.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "core/error.hpp"

namespace lm::plot {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

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
    p.log_x = o.log_x;
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

}  // namespace lm::plot
