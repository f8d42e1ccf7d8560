// `longmoe plot METRICS.jsonl... --out FILE.png`: training curves (loss with held-out points, MaxVio
// per MoE layer, or any numeric field) rendered to a PNG without Python or a plotting library.
#include <cstdio>
#include <memory>

#include "apps/longmoe/commands.hpp"
#include "plot/panels.hpp"

namespace {

struct Options {
  std::vector<std::string> files;
  std::string out;
  lm::plot::PlotOptions plot;
  double y_min = 0, y_max = 0;
};

lm::app::Register reg({"plot", "Render training metrics (JSONL) to a PNG chart", [](CLI::App& sub) {
  auto o = std::make_shared<Options>();
  sub.add_option("metrics", o->files, "Metrics JSONL files written by `longmoe train` (one series each)")
      ->required()
      ->check(CLI::ExistingFile);
  sub.add_option("--out,-o", o->out, "Output PNG file (written atomically)")->required();
  sub.add_option("--y", o->plot.ys,
                 "Field to plot, one panel each (repeatable): loss, maxvio, lr, grad_norm, tok_per_s, eval_ppl, "
                 "... Default: loss (with eval_loss points) above maxvio")
      ->allow_extra_args(false);
  sub.add_option("--x", o->plot.x, "Field for the x axis: step or tokens")->capture_default_str();
  sub.add_flag("--log-x", o->plot.log_x, "Logarithmic x axis (e.g. retrieval accuracy against context length)");
  sub.add_flag("--log-y", o->plot.log_y, "Logarithmic y axis");
  sub.add_option("--smooth", o->plot.smooth, "Centred moving average over N points (raw curve drawn faint)")
      ->check(CLI::NonNegativeNumber);
  sub.add_option("--layers", o->plot.layers,
                 "Array fields such as maxvio: all | median | max | mean | median+max | auto (all for up to 8 "
                 "layers and one file)")
      ->capture_default_str();
  auto* ymin = sub.add_option("--y-min", o->y_min, "Lower y limit");
  auto* ymax = sub.add_option("--y-max", o->y_max, "Upper y limit");
  sub.add_option("--width", o->plot.width, "Image width in pixels")->capture_default_str();
  sub.add_option("--height", o->plot.height, "Image height in pixels (default: 420 per panel)");
  sub.add_option("--title", o->plot.title, "Title (default: the file names)");
  return [o, ymin, ymax] {
    if (*ymin) o->plot.y_min = o->y_min;
    if (*ymax) o->plot.y_max = o->y_max;
    lm::plot::plot_metrics(o->files, o->out, o->plot);
    std::printf("wrote %s\n", o->out.c_str());
    return 0;
  };
}});

}  // namespace
