#pragma once
// Shared helpers for the test executables (header only: tests/<folder>/ each build one binary).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/tensor.hpp"

namespace lm::testing {

// A folder of one test's own under gtest's temp dir, named `name` and the process id: two suites at once on one
// machine (a local run beside CI) would otherwise remove each other's runs. Empty at the start; removed at the end
// unless the test failed (then kept to look at). Not for MPI tests, whose ranks share one folder.
struct ScratchDir {
  std::filesystem::path path;
  explicit ScratchDir(const std::string& name)
      : path(std::filesystem::path(::testing::TempDir()) / (name + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!::testing::Test::HasFailure()) std::filesystem::remove_all(path, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
};

// `longmoe ARGS` (the built binary, after `prefix`: environment, a timeout): its stdout and stderr together and its
// exit status (128 + the signal when one ended it).
struct CliRun {
  int rc = -1;
  std::string out;
};
inline CliRun run_longmoe(const std::string& args, const std::string& prefix = "") {
  CliRun r;
  FILE* p = ::popen((prefix + "'" + std::string(LONGMOE_BINARY) + "' " + args + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int st = ::pclose(p);
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  return r;
}

// The message of the lm::Error that f throws; "" when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// ../shared/golden, or $LONGMOE_GOLDEN_DIR. Empty string when absent (tests then GTEST_SKIP).
inline std::string golden_dir() {
  if (std::string e = env::golden_dir(""); !e.empty()) return e;
  return std::filesystem::exists(LONGMOE_GOLDEN_DIR) ? std::string(LONGMOE_GOLDEN_DIR) : std::string();
}

#define LM_REQUIRE_GOLDEN(dir)                                                          \
  const std::string dir = ::lm::testing::golden_dir();                                  \
  if (dir.empty()) GTEST_SKIP() << "golden files not found (set LONGMOE_GOLDEN_DIR)"

// n draws of N(0, sd) (or U(lo, hi)) from a named stream: deterministic and platform-independent.
template <class F = double>
std::vector<F> randn(size_t n, uint64_t seed, double sd = 1.0) {
  Rng r{seed, 0};
  std::vector<F> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<F>(sd * r.normal_f64(i));
  return v;
}
template <class F = double>
std::vector<F> randu(size_t n, uint64_t seed, double lo, double hi) {
  Rng r{seed, 1};
  std::vector<F> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<F>(lo + (hi - lo) * r.uniform_f64(i));
  return v;
}

template <class F>
double rel_rms_vec(const std::vector<F>& ref, const std::vector<F>& x) {
  EXPECT_EQ(ref.size(), x.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size() && i < x.size(); ++i) {
    const double d = static_cast<double>(ref[i]) - static_cast<double>(x[i]);
    num += d * d;
    den += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  return den == 0 ? (num == 0 ? 0.0 : INFINITY) : std::sqrt(num / den);
}

// Central finite differences in float64 of the scalar loss `f` w.r.t. `x` at `n_probe` coordinates
// spread over x, compared to the analytic gradient `grad`. Returns the relative RMS error over the
// probed coordinates (numerator: |fd - grad|, denominator: |fd|).
inline double fd_check(std::vector<double>& x, const std::vector<double>& grad, const std::function<double()>& f,
                       int n_probe = 24, double h = 1e-6) {
  EXPECT_EQ(x.size(), grad.size());
  if (x.empty()) return 0.0;
  double num = 0, den = 0;
  const size_t n = x.size();
  const size_t step = std::max<size_t>(1, n / static_cast<size_t>(n_probe));
  for (size_t i = (n > 1 ? 1 : 0) % n; i < n; i += step) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f();
    x[i] = x0 - h;
    const double fm = f();
    x[i] = x0;
    const double fd = (fp - fm) / (2 * h);
    num += (fd - grad[i]) * (fd - grad[i]);
    den += fd * fd;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

template <class F>
double dot(const std::vector<F>& a, const std::vector<F>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return s;
}

}  // namespace lm::testing
