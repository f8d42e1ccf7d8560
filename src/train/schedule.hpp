#pragma once
// Learning-rate schedules as a factor in [0, 1] of the peak learning rate, per optimiser step.
//
// Legend: s = 0-based index of the step being taken, T = total steps, W = warm-up steps,
//         r = min_lr_ratio, p = progress of the decay phase in (0, 1].
//   warm-up   s < W:  factor (s + 1) / W             (the first step already moves the weights)
//   cosine    s ≥ W:  p = (s − W + 1) / (T − W),     r + (1 − r)·½(1 + cos πp)
//   wsd       stable 1 until D = T − round(decay_fraction·T), then p = (s − D + 1) / (T − D) and
//             linear 1 − (1 − r)p, 1-sqrt r + (1 − r)(1 − √p), or cosine as above
//   constant  1 after warm-up
// Every decaying schedule reaches r exactly at the last step s = T − 1 and stays there afterwards.
// peak q (default 1) scales the whole curve: a stage that extends the context of a trained model
// continues at a fraction of the optimiser's learning rate instead of warming up to all of it again.
// K3's recipe: cosine, 1% warm-up, (weight decay 0.1 lives in OptimConfig).
//
// JSON: {"kind": "cosine" | "wsd" | "constant", "warmup": 0.01, "min_lr_ratio": 0.1,
//        "decay_fraction": 0.2, "decay_shape": "linear" | "1-sqrt" | "cosine", "peak": 1}
// "warmup" below 1 is a fraction of T; 1 or more is a whole number of steps.
#include <cstdint>
#include <string>

#include "io/json.hpp"

namespace lm::train {

struct ScheduleConfig {
  std::string kind = "cosine";
  double warmup = 0.01;
  double min_lr_ratio = 0.1;
  double decay_fraction = 0.2;       // wsd only
  std::string decay_shape = "linear";  // wsd only
  double peak = 1.0;                   // q in (0, 1]

  // Strict: unknown fields and out-of-range values are errors naming `ctx` and the field.
  static ScheduleConfig from_json(const io::json& j, const std::string& ctx);
  io::json to_json() const;
  void validate(const std::string& ctx = "schedule") const;
};

class Schedule {
 public:
  // `total_steps` optimiser steps; `peak_lr` only scales lr_at().
  Schedule(const ScheduleConfig& c, int64_t total_steps, double peak_lr = 1.0);

  double factor_at(int64_t step) const;  // in [0, q]
  double lr_at(int64_t step) const { return peak_lr_ * factor_at(step); }

  int64_t warmup_steps() const { return warmup_; }
  int64_t decay_start() const { return decay_start_; }  // first step of the decay phase
  int64_t total_steps() const { return total_; }
  const ScheduleConfig& config() const { return c_; }

 private:
  double shape_at(int64_t step) const;  // the curve before q, in [0, 1]

  ScheduleConfig c_;
  int64_t total_ = 0, warmup_ = 0, decay_start_ = 0;
  double peak_lr_ = 1.0;
};

}  // namespace lm::train
