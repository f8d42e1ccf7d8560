// Learning-rate schedules (formulas in schedule.hpp).
#include "train/schedule.hpp"

#include <cmath>
#include <numbers>
#include <string_view>

#include "core/error.hpp"

namespace lm::train {

ScheduleConfig ScheduleConfig::from_json(const io::json& j, const std::string& ctx) {
  io::check_known_fields(j, {"kind", "warmup", "min_lr_ratio", "decay_fraction", "decay_shape", "peak"}, ctx);
  ScheduleConfig c;
  c.kind = io::get_or<std::string>(j, "kind", c.kind, ctx);
  c.warmup = io::get_or(j, "warmup", c.warmup, ctx);
  c.min_lr_ratio = io::get_or(j, "min_lr_ratio", c.min_lr_ratio, ctx);
  c.decay_fraction = io::get_or(j, "decay_fraction", c.decay_fraction, ctx);
  c.decay_shape = io::get_or<std::string>(j, "decay_shape", c.decay_shape, ctx);
  c.peak = io::get_or(j, "peak", c.peak, ctx);
  c.validate(ctx);
  return c;
}

io::json ScheduleConfig::to_json() const {
  io::json j{{"kind", kind}, {"warmup", warmup}, {"min_lr_ratio", min_lr_ratio}};
  if (kind == "wsd") {
    j["decay_fraction"] = decay_fraction;
    j["decay_shape"] = decay_shape;
  }
  if (peak != 1.0) j["peak"] = peak;
  return j;
}

void ScheduleConfig::validate(const std::string& ctx) const {
  LM_CHECK(kind == "cosine" || kind == "wsd" || kind == "constant",
           "{}: kind must be \"cosine\", \"wsd\" or \"constant\", got \"{}\"", ctx, kind);
  LM_CHECK(std::isfinite(warmup) && warmup >= 0 && (warmup < 1 || warmup == std::floor(warmup)),
           "{}: warmup must be a fraction in [0, 1) or a whole number of steps, got {}", ctx, warmup);
  LM_CHECK(min_lr_ratio >= 0 && min_lr_ratio <= 1, "{}: min_lr_ratio must be in [0, 1], got {}", ctx,
           min_lr_ratio);
  LM_CHECK(decay_fraction >= 0 && decay_fraction <= 1, "{}: decay_fraction must be in [0, 1], got {}", ctx,
           decay_fraction);
  LM_CHECK(decay_shape == "linear" || decay_shape == "1-sqrt" || decay_shape == "cosine",
           "{}: decay_shape must be \"linear\", \"1-sqrt\" or \"cosine\", got \"{}\"", ctx, decay_shape);
  LM_CHECK(std::isfinite(peak) && peak > 0 && peak <= 1, "{}: peak must be in (0, 1], got {}", ctx, peak);
}

Schedule::Schedule(const ScheduleConfig& c, int64_t total_steps, double peak_lr)
    : c_(c), total_(total_steps), peak_lr_(peak_lr) {
  c_.validate();
  LM_CHECK(total_steps >= 1, "schedule: total steps must be >= 1, got {}", total_steps);
  if (c_.warmup < 1) {
    warmup_ = std::llround(c_.warmup * static_cast<double>(total_));
    if (c_.warmup > 0 && warmup_ == 0) warmup_ = 1;  // a requested warm-up never vanishes
  } else {
    warmup_ = static_cast<int64_t>(c_.warmup);
  }
  LM_CHECK(warmup_ <= total_, "schedule: {} warm-up steps exceed the {} total steps", warmup_, total_);
  if (c_.kind == "cosine") {
    decay_start_ = warmup_;
  } else if (c_.kind == "wsd") {
    decay_start_ = total_ - std::llround(c_.decay_fraction * static_cast<double>(total_));
    LM_CHECK(decay_start_ >= warmup_,
             "schedule: warm-up ({} steps) and decay ({} steps) overlap in a run of {} steps", warmup_,
             total_ - decay_start_, total_);
  } else {
    decay_start_ = total_;
  }
}

double Schedule::factor_at(int64_t step) const { return c_.peak * shape_at(step); }

double Schedule::shape_at(int64_t step) const {
  LM_CHECK(step >= 0, "schedule: step must be >= 0, got {}", step);
  if (step < warmup_) return static_cast<double>(step + 1) / static_cast<double>(warmup_);
  if (c_.kind == "constant" || step < decay_start_) return 1.0;
  const double r = c_.min_lr_ratio;
  if (step >= total_ - 1) return r;
  const double p = static_cast<double>(step - decay_start_ + 1) / static_cast<double>(total_ - decay_start_);
  const std::string_view shape = c_.kind == "cosine" ? std::string_view("cosine") : std::string_view(c_.decay_shape);
  if (shape == "linear") return 1.0 - (1.0 - r) * p;
  if (shape == "1-sqrt") return r + (1.0 - r) * (1.0 - std::sqrt(p));
  return r + (1.0 - r) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
}

}  // namespace lm::train
