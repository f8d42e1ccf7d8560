// `longmoe plot`'s library: JSONL reading (errors with line numbers, NaN tolerance), panels from
// metrics, and a real PNG whose pixels contain the series colours.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "plot/canvas.hpp"
#include "plot/chart.hpp"
#include "plot/font.hpp"
#include "plot/panels.hpp"

#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#include <stb/stb_image.h>

namespace lm::plot {
namespace {

// A synthetic run: 300 steps, loss decaying with noise, 4 MoE layers' MaxVio falling below 0.2,
// eval lines every 100 steps, a stage change at step 150, one NaN loss.
std::string synthetic_metrics(double loss_scale = 1.0) {
  std::ostringstream s;
  for (int step = 1; step <= 300; ++step) {
    const double noise = 0.08 * std::sin(step * 1.7) + 0.05 * std::cos(step * 0.31);
    const double loss = loss_scale * (2.8 + 5.5 * std::exp(-step / 60.0) + noise);
    s << "{\"step\": " << step << ", \"tokens\": " << step * 4096 << ", \"loss\": ";
    if (step == 77) s << "NaN";
    else s << loss;
    s << ", \"lr\": " << 3e-4 * std::min(1.0, step / 10.0) << ", \"grad_norm\": 1.1, \"maxvio\": [";
    for (int l = 0; l < 4; ++l)
      s << (l ? ", " : "") << loss_scale * 0.1 + (0.8 + 0.2 * l) * std::exp(-step / (15.0 + 5 * l)) + 0.02 * std::sin(step + l);
    s << "], \"stage\": " << (step <= 150 ? 0 : 1) << "}\n";
    if (step % 100 == 0)
      s << "{\"step\": " << step << ", \"eval_loss\": " << loss_scale * (3.0 + 5.0 * std::exp(-step / 60.0))
        << ", \"eval_ppl\": 100}\n";
  }
  return s.str();
}

std::string write_tmp(const std::string& name, const std::string& text) {
  const std::string p = ::testing::TempDir() + "/" + name;
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

int count_color(const Image& img, Rgb c) {
  int n = 0;
  for (int y = 0; y < img.height; ++y)
    for (int x = 0; x < img.width; ++x) n += img.at(x, y) == c;
  return n;
}

TEST(Plot, ParsesMetricsAndRejectsMalformedLinesWithTheirNumber) {
  const MetricsLog log = parse_metrics(
      "{\"step\": 1, \"loss\": 5.0}\n\n{\"step\": 2, \"loss\": NaN, \"maxvio\": [0.1, Infinity]}\r\n"
      "{\"step\": 3, \"note\": \"NaN stays a string\"}\n",
      "m.jsonl");
  ASSERT_EQ(log.rows.size(), 3u);
  EXPECT_EQ(log.rows[1].line, 3);
  EXPECT_TRUE(log.rows[1].obj["loss"].is_null());
  EXPECT_EQ(log.rows[2].obj["note"], "NaN stays a string");

  auto error_of = [](const std::string& text) {
    try {
      parse_metrics(text, "run/metrics.jsonl");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string e1 = error_of("{\"step\": 1, \"loss\": 5}\n{\"step\": 2, \"loss\": \n{\"step\": 3}\n");
  EXPECT_NE(e1.find("run/metrics.jsonl:2:"), std::string::npos) << e1;
  const std::string e2 = error_of("{\"step\": 1}\n[1, 2]\n");
  EXPECT_NE(e2.find("run/metrics.jsonl:2:"), std::string::npos) << e2;
  EXPECT_NE(e2.find("object"), std::string::npos) << e2;
  const std::string e3 = error_of("{\"step\": 1}\n{\"step\": 2}\n{\"step\": \"three\"}\n");
  EXPECT_NE(e3.find(":3:"), std::string::npos) << e3;
  // an unterminated last line is a run still writing: ignored
  EXPECT_EQ(parse_metrics("{\"step\": 1}\n{\"step\": 2, \"lo", "live").rows.size(), 1u);
  // a non-numeric plotted field names file, line and field
  const MetricsLog bad = parse_metrics("{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": \"high\"}\n", "b.jsonl");
  try {
    build_panels({bad}, PlotOptions{});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("b.jsonl:2: field 'loss'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_metrics(::testing::TempDir() + "/does_not_exist.jsonl"), Error);
}

TEST(Plot, PanelsFromMetrics) {
  const MetricsLog log = parse_metrics(synthetic_metrics(), "run.jsonl");
  const auto panels = build_panels({log}, PlotOptions{});
  ASSERT_EQ(panels.size(), 2u);
  // loss: one line + eval points; NaN kept as a gap
  ASSERT_EQ(panels[0].series.size(), 2u);
  EXPECT_EQ(panels[0].series[0].x.size(), 300u);
  EXPECT_TRUE(std::isnan(panels[0].series[0].y[76]));
  EXPECT_TRUE(panels[0].series[1].markers);
  EXPECT_EQ(panels[0].series[1].x, (std::vector<double>{100, 200, 300}));
  ASSERT_EQ(panels[0].vlines.size(), 1u);
  EXPECT_EQ(panels[0].vlines[0], 151);
  // maxvio: 4 layers -> one series per layer
  ASSERT_EQ(panels[1].series.size(), 4u);
  EXPECT_EQ(panels[1].series[2].label, "layer 2");

  PlotOptions o;
  o.ys = {"maxvio", "lr"};
  o.layers = "median+max";
  o.x = "tokens";
  o.smooth = 5;
  const auto p2 = build_panels({log, parse_metrics(synthetic_metrics(1.1), "other.jsonl")}, o);
  ASSERT_EQ(p2.size(), 2u);
  // 2 files × (median, max), each with a faint raw copy under the smoothed line
  EXPECT_EQ(p2[0].series.size(), 8u);
  EXPECT_EQ(p2[0].series[4].label, "run median over layers");
  EXPECT_TRUE(p2[0].series[5].dashed);
  EXPECT_EQ(p2[0].series[4].x.back(), 300 * 4096);
  // a field nobody logged: an empty panel with a note, not an error
  o.ys = {"missing_field"};
  const auto p3 = build_panels({log}, o);
  ASSERT_EQ(p3.size(), 1u);
  EXPECT_TRUE(p3[0].series.empty());
  EXPECT_NE(p3[0].empty_note.find("missing_field"), std::string::npos);
  // default panels of a dense run (no maxvio): only the loss panel
  EXPECT_EQ(build_panels({parse_metrics("{\"step\": 1, \"loss\": 3}\n", "d")}, PlotOptions{}).size(), 1u);
  o.layers = "sometimes";
  EXPECT_THROW(build_panels({log}, o), Error);
}

TEST(Plot, WritesAValidPngWithTheSeriesColours) {
  const std::string a = write_tmp("run_a.jsonl", synthetic_metrics());
  const std::string b = write_tmp("run_b.jsonl", synthetic_metrics(1.15));
  const std::string out = ::testing::TempDir() + "/curves.png";
  std::filesystem::remove(out);
  PlotOptions o;
  plot_metrics({a, b}, out, o);

  std::ifstream in(out, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  ASSERT_GT(bytes.size(), 8u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  int w = 0, h = 0, ch = 0;
  unsigned char* px = stbi_load_from_memory(reinterpret_cast<const unsigned char*>(bytes.data()),
                                            static_cast<int>(bytes.size()), &w, &h, &ch, 3);
  ASSERT_NE(px, nullptr) << stbi_failure_reason();
  EXPECT_EQ(w, 1200);
  EXPECT_EQ(h, 2 * 420 + 30);
  Image img;
  img.width = w, img.height = h;
  img.rgb.assign(px, px + static_cast<size_t>(w) * h * 3);
  stbi_image_free(px);
  // both files' colours appear well beyond the legend swatches (each draws a loss curve and MaxVio)
  EXPECT_GT(count_color(img, palette()[0]), 1500);
  EXPECT_GT(count_color(img, palette()[1]), 1500);
  EXPECT_EQ(count_color(img, palette()[5]), 0);  // no third series
  // the loss curve's colour sits inside the top panel's plot area, MaxVio's inside the bottom one
  int top = 0, bottom = 0;
  for (int y = 0; y < h; ++y)
    for (int x = 150; x < w - 30; ++x)
      if (img.at(x, y) == palette()[0]) (y < h / 2 ? top : bottom)++;
  EXPECT_GT(top, 500);
  EXPECT_GT(bottom, 500);

  // log-y, one panel, single file: still a PNG, line present
  o.ys = {"loss"};
  o.log_y = true;
  o.smooth = 9;
  plot_metrics({a}, out, o);
  EXPECT_GT(std::filesystem::file_size(out), 1000u);
}

TEST(Plot, LogXPlacesDecadesEvenly) {
  Panel p;
  p.x_label = "length";
  Series s;
  s.label = "passkey";
  s.color = {200, 0, 200};
  s.markers = true;
  s.x = {10, 100, 1000, 0};  // (0 has no place on a log axis: left out)
  s.y = {0.5, 0.7, 0.9, 1.0};
  p.series.push_back(s);
  const auto centres = [&](const Panel& panel) {  // mean x of the colour in each run of columns
    const Image img = render({panel}, 600, 300);
    std::vector<double> c;
    double sum = 0;
    int n = 0;
    for (int x = 0; x <= img.width; ++x) {
      bool any = false;
      for (int y = 0; y < img.height && x < img.width; ++y) any = any || img.at(x, y) == s.color;
      if (any) sum += x, ++n;
      else if (n) c.push_back(sum / n), sum = 0, n = 0;
    }
    return c;
  };
  p.series[0].in_legend = false;
  p.log_x = true;
  const auto logc = centres(p);
  ASSERT_EQ(logc.size(), 3u);
  EXPECT_NEAR(logc[1] - logc[0], logc[2] - logc[1], 2.0);
  p.log_x = false;
  const auto lin = centres(p);
  ASSERT_GE(lin.size(), 3u);
  EXPECT_GT(lin.back() - lin[lin.size() - 2], 5 * (lin[lin.size() - 2] - lin[0]));
}

TEST(Plot, RendererDrawsLinesTextAndHandlesDegenerateData) {
  Panel p;
  p.title = "flat";
  p.x_label = "step";
  Series s;
  s.label = "const";
  s.color = {200, 0, 200};
  s.x = {0, 1, 2, 3};
  s.y = {5, 5, 5, 5};  // zero range: must not divide by zero
  p.series.push_back(s);
  Series huge = s;
  huge.color = {0, 200, 200};
  huge.x = {0, 1e300, NAN, 3};
  huge.y = {1e300, -1e300, 1, INFINITY};  // far outside: clipped, no hang
  Panel q = p;
  q.series = {huge};
  const Image img = render({p, q}, 400, 600, "title");
  EXPECT_GT(count_color(img, {200, 0, 200}), 100);
  EXPECT_GT(count_color(img, {0, 0, 0}), 500);  // frame, ticks and title text
  Panel extreme = q;  // a range that overflows a double, nonsense limits on a log axis
  extreme.series[0].y = {-1.7e308, 1.7e308, 3, 4};
  Panel logp = p;
  logp.log_y = true;
  logp.y_min = -1.0;
  logp.y_max = NAN;
  logp.series[0].y = {1e-300, 0, -5, 1e300};
  EXPECT_NO_THROW(render({extreme, logp}, 400, 400));
  Panel empty;
  empty.empty_note = "no data";
  const Image e = render({empty}, 300, 200);
  EXPECT_EQ(encode_png(e).substr(1, 3), "PNG");
  EXPECT_THROW(render({}, 300, 200), Error);
  EXPECT_THROW(render({p}, 10, 10), Error);
  EXPECT_EQ(text_width("abc", 2), (3 * 6 - 1) * 2);
}

}  // namespace
}  // namespace lm::plot
