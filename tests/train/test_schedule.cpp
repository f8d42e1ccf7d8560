// LR schedules: values at the key steps (warm-up end, midpoint, last step) and JSON parsing.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "core/error.hpp"
#include "train/schedule.hpp"

namespace lm::train {
namespace {

ScheduleConfig cfg(const char* json) { return ScheduleConfig::from_json(io::json::parse(json), "test"); }

TEST(Schedule, CosineK3Recipe) {
  // 1% of 1000 steps = 10 warm-up steps, decay to 0.1 over the remaining 990.
  Schedule s(cfg(R"({"kind": "cosine", "warmup": 0.01, "min_lr_ratio": 0.1})"), 1000, 3e-4);
  EXPECT_EQ(s.warmup_steps(), 10);
  EXPECT_DOUBLE_EQ(s.factor_at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.factor_at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.factor_at(9), 1.0);
  // first decay step: p = 1/990
  EXPECT_NEAR(s.factor_at(10), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi / 990)), 1e-15);
  EXPECT_LT(s.factor_at(10), 1.0);
  // halfway through the decay (p = 0.5): midpoint between 1 and 0.1
  EXPECT_NEAR(s.factor_at(10 + 495 - 1), 0.55, 1e-12);
  EXPECT_DOUBLE_EQ(s.factor_at(999), 0.1);
  EXPECT_DOUBLE_EQ(s.factor_at(5000), 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(9), 3e-4);
  EXPECT_DOUBLE_EQ(s.lr_at(999), 3e-5);
  for (int64_t t = 10; t < 999; ++t) EXPECT_GE(s.factor_at(t), s.factor_at(t + 1)) << t;  // monotone decay
}

TEST(Schedule, WarmupInSteps) {
  Schedule s(cfg(R"({"kind": "cosine", "warmup": 20, "min_lr_ratio": 0})"), 100);
  EXPECT_EQ(s.warmup_steps(), 20);
  EXPECT_DOUBLE_EQ(s.factor_at(19), 1.0);
  EXPECT_DOUBLE_EQ(s.factor_at(99), 0.0);
  // tiny fraction of a short run still gives one warm-up step
  Schedule t(cfg(R"({"warmup": 0.001})"), 50);
  EXPECT_EQ(t.warmup_steps(), 1);
  EXPECT_DOUBLE_EQ(t.factor_at(0), 1.0);
}

TEST(Schedule, WsdLinearAnd1Sqrt) {
  // 100 steps, warm-up 10, decay over the last 20 (steps 80..99)
  Schedule lin(cfg(R"({"kind": "wsd", "warmup": 10, "decay_fraction": 0.2, "min_lr_ratio": 0.0})"), 100);
  EXPECT_EQ(lin.decay_start(), 80);
  EXPECT_DOUBLE_EQ(lin.factor_at(50), 1.0);
  EXPECT_DOUBLE_EQ(lin.factor_at(79), 1.0);
  EXPECT_DOUBLE_EQ(lin.factor_at(80), 1.0 - 1.0 / 20);
  EXPECT_DOUBLE_EQ(lin.factor_at(89), 0.5);
  EXPECT_DOUBLE_EQ(lin.factor_at(99), 0.0);
  Schedule sq(cfg(R"({"kind": "wsd", "warmup": 10, "decay_fraction": 0.2, "min_lr_ratio": 0.1,
                     "decay_shape": "1-sqrt"})"), 100);
  EXPECT_NEAR(sq.factor_at(84), 0.1 + 0.9 * (1 - std::sqrt(0.25)), 1e-15);
  EXPECT_DOUBLE_EQ(sq.factor_at(99), 0.1);
}

TEST(Schedule, Constant) {
  Schedule s(cfg(R"({"kind": "constant", "warmup": 4})"), 10);
  EXPECT_DOUBLE_EQ(s.factor_at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.factor_at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.factor_at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.factor_at(100), 1.0);
  Schedule z(cfg(R"({"kind": "constant", "warmup": 0})"), 10);
  EXPECT_DOUBLE_EQ(z.factor_at(0), 1.0);
}

TEST(Schedule, Errors) {
  EXPECT_THROW(cfg(R"({"kind": "linear"})"), Error);
  EXPECT_THROW(cfg(R"({"kind": "cosine", "warmpu": 0.01})"), Error);  // typo: unknown field
  EXPECT_THROW(cfg(R"({"warmup": 2.5})"), Error);
  EXPECT_THROW(cfg(R"({"warmup": -1})"), Error);
  EXPECT_THROW(cfg(R"({"min_lr_ratio": 1.5})"), Error);
  EXPECT_THROW(cfg(R"({"warmup": "1%"})"), Error);
  EXPECT_THROW(cfg(R"([1, 2])"), Error);
  EXPECT_THROW(Schedule(cfg(R"({"warmup": 200})"), 100), Error);
  EXPECT_THROW(Schedule(cfg(R"({"kind": "wsd", "warmup": 0.5, "decay_fraction": 0.6})"), 100), Error);
  Schedule s(cfg("{}"), 10);
  EXPECT_THROW(s.factor_at(-1), Error);
  try {
    cfg(R"({"kind": "cosine", "warmpu": 0.01})");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("warmpu"), std::string::npos) << e.what();
  }
  // round trip
  const ScheduleConfig c = cfg(R"({"kind": "wsd", "warmup": 5, "decay_shape": "1-sqrt"})");
  const ScheduleConfig d = ScheduleConfig::from_json(c.to_json(), "rt");
  EXPECT_EQ(d.kind, "wsd");
  EXPECT_EQ(d.decay_shape, "1-sqrt");
  EXPECT_EQ(d.warmup, 5);
}

TEST(Schedule, PeakScalesTheWholeCurve) {
  const Schedule full(cfg(R"({"kind": "cosine", "warmup": 3, "min_lr_ratio": 0.2})"), 20);
  const Schedule tenth(cfg(R"({"kind": "cosine", "warmup": 3, "min_lr_ratio": 0.2, "peak": 0.1})"), 20);
  for (int64_t s = 0; s < 25; ++s) EXPECT_DOUBLE_EQ(tenth.factor_at(s), 0.1 * full.factor_at(s)) << s;
  EXPECT_DOUBLE_EQ(tenth.factor_at(19), 0.02);
  EXPECT_EQ(ScheduleConfig::from_json(tenth.config().to_json(), "rt").peak, 0.1);
  for (const char* bad : {R"({"peak": 0})", R"({"peak": 1.5})", R"({"peak": -0.1})"}) {
    try {
      cfg(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("peak"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace lm::train
