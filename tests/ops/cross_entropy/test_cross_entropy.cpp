// Chunked LM head + cross-entropy vs a naive full-logits version in float64 (chunk sizes that do and
// do not divide the vocabulary, both parallel modes), finite differences, ignored targets, extreme
// logits, float vs double, errors. DISABLED_Timing measures the two parallel modes (run it with
// --gtest_also_run_disabled_tests).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/cross_entropy/cross_entropy.hpp"
#include "tests/testing.hpp"

using namespace lm;
using namespace lm::ops;
using lm::testing::fd_check;
using lm::testing::randn;
using lm::testing::rel_rms_vec;

namespace {

// CPU seconds of all threads of the process: on a loaded machine this tracks the work done (with
// OMP_WAIT_POLICY=passive, so idle threads do not spin), where wall time mostly tracks the neighbours.
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Naive {
  double mean = 0;
  int64_t n_valid = 0;
  std::vector<double> lse, token_loss, dh, dW;
};

// Full [T, V] logits, textbook log-softmax, gradients of the mean loss.
Naive naive_ce(const std::vector<double>& h, const std::vector<double>& W, const std::vector<int32_t>& tg, int64_t T,
               int64_t d, int64_t V) {
  Naive n;
  n.lse.assign(T, 0.0);
  n.token_loss.assign(T, 0.0);
  n.dh.assign(T * d, 0.0);
  n.dW.assign(V * d, 0.0);
  std::vector<double> L(T * V);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < V; ++v) {
      double s = 0;
      for (int64_t c = 0; c < d; ++c) s += h[t * d + c] * W[v * d + c];
      L[t * V + v] = s;
    }
  double sum = 0;
  for (int64_t t = 0; t < T; ++t) {
    double mx = L[t * V];
    for (int64_t v = 1; v < V; ++v) mx = std::max(mx, L[t * V + v]);
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(L[t * V + v] - mx);
    n.lse[t] = mx + std::log(s);
    if (tg[t] >= 0) {
      n.token_loss[t] = n.lse[t] - L[t * V + tg[t]];
      sum += n.token_loss[t];
      ++n.n_valid;
    }
  }
  n.mean = n.n_valid ? sum / n.n_valid : 0.0;
  for (int64_t t = 0; t < T; ++t) {
    if (tg[t] < 0) continue;
    for (int64_t v = 0; v < V; ++v) {
      const double g = (std::exp(L[t * V + v] - n.lse[t]) - (v == tg[t] ? 1.0 : 0.0)) / n.n_valid;
      for (int64_t c = 0; c < d; ++c) {
        n.dh[t * d + c] += g * W[v * d + c];
        n.dW[v * d + c] += g * h[t * d + c];
      }
    }
  }
  return n;
}

std::vector<int32_t> make_targets(int64_t T, int64_t V, uint64_t seed, bool with_ignored) {
  const auto u = lm::testing::randu(T, seed, 0.0, 1.0);
  std::vector<int32_t> tg(T);
  for (int64_t t = 0; t < T; ++t) {
    tg[t] = static_cast<int32_t>(std::min<double>(V - 1, std::floor(u[t] * V)));
    if (with_ignored && t % 5 == 2) tg[t] = (t % 2) ? -100 : -1;  // -100 (HF ignore_index) and any negative
  }
  tg[0] = static_cast<int32_t>(V - 1);  // the last vocabulary row (last, possibly partial, chunk)
  return tg;
}

const char* mode_name(CeParallel p) {
  return p == CeParallel::Blas ? "blas" : (p == CeParallel::TokenBlocks ? "token-blocks" : "auto");
}

}  // namespace

TEST(CrossEntropy, ChunkedMatchesNaiveFullLogits) {
  const int64_t T = 37, d = 19, V = 257;  // V prime: no chunk size > 1 divides it
  const auto h = randn(T * d, 1, 1.0), W = randn(V * d, 2, 0.7);
  const auto tg = make_targets(T, V, 3, true);
  const Naive ref = naive_ce(h, W, tg, T, d, V);
  ASSERT_EQ(ref.n_valid, 30);
  double worst = 0;
  for (const CeParallel mode : {CeParallel::Blas, CeParallel::TokenBlocks, CeParallel::Auto})
    for (const int64_t vc : {1, 7, 64, 100, 256, 257, 1000})
      for (const int64_t bt : {0, 1, 5, 64}) {
        const CeOptions opt{vc, bt, mode};
        std::vector<double> lse(T), tl(T), dh(T * d, 123.0), dW(V * d, 0.5);
        const CeStats st = cross_entropy_forward(h.data(), W.data(), tg.data(), T, d, V, lse.data(), tl.data(), opt);
        EXPECT_EQ(st.n_valid, ref.n_valid);
        EXPECT_NEAR(st.mean(), ref.mean, 1e-13 * ref.mean) << mode_name(mode) << " vc=" << vc << " bt=" << bt;
        cross_entropy_backward(h.data(), W.data(), tg.data(), lse.data(), T, d, V, 1.0 / st.n_valid, dh.data(),
                               dW.data(), opt);
        for (auto& x : dW) x -= 0.5;  // dW accumulates
        double e = std::max({rel_rms_vec(ref.lse, lse), rel_rms_vec(ref.token_loss, tl), rel_rms_vec(ref.dh, dh),
                             rel_rms_vec(ref.dW, dW)});
        for (int64_t t = 0; t < T; ++t)
          if (tg[t] < 0) {
            EXPECT_EQ(tl[t], 0.0);
            for (int64_t c = 0; c < d; ++c) EXPECT_EQ(dh[t * d + c], 0.0);
          }
        // The one-call training entry (fused sweep in TokenBlocks mode).
        std::fill(dh.begin(), dh.end(), 123.0);
        std::fill(dW.begin(), dW.end(), 0.5);
        const CeStats st2 = cross_entropy_forward_backward(h.data(), W.data(), tg.data(), T, d, V, 1.0 / ref.n_valid,
                                                           dh.data(), dW.data(), lse.data(), tl.data(), opt);
        for (auto& x : dW) x -= 0.5;
        EXPECT_EQ(st2.n_valid, ref.n_valid);
        EXPECT_NEAR(st2.mean(), ref.mean, 1e-13 * ref.mean);
        e = std::max({e, rel_rms_vec(ref.lse, lse), rel_rms_vec(ref.token_loss, tl), rel_rms_vec(ref.dh, dh),
                      rel_rms_vec(ref.dW, dW)});
        EXPECT_LT(e, 1e-13) << mode_name(mode) << " vc=" << vc << " bt=" << bt;
        worst = std::max(worst, e);
      }
  std::printf("chunked CE vs naive (f64, 84 configs x 2 entry points): worst rel err %.2e\n", worst);
}

TEST(CrossEntropy, MeanForwardBackwardMatchesFiniteDifferences) {
  const int64_t T = 9, d = 6, V = 23;
  auto h = randn(T * d, 4), W = randn(V * d, 5);
  const auto tg = make_targets(T, V, 6, true);
  for (const CeParallel mode : {CeParallel::Blas, CeParallel::TokenBlocks}) {
    const CeOptions opt{5, 4, mode};
    std::vector<double> dh(T * d), dW(V * d, 0.0);
    cross_entropy_mean_forward_backward(h.data(), W.data(), tg.data(), T, d, V, dh.data(), dW.data(), opt);
    auto loss = [&] {
      return cross_entropy_forward(h.data(), W.data(), tg.data(), T, d, V, static_cast<double*>(nullptr),
                                   static_cast<double*>(nullptr), opt)
          .mean();
    };
    const double eh = fd_check(h, dh, loss, 54), ew = fd_check(W, dW, loss, 138);
    EXPECT_LT(eh, 1e-8) << mode_name(mode);
    EXPECT_LT(ew, 1e-8) << mode_name(mode);
    std::printf("CE fd err (%s): dh %.2e dW %.2e\n", mode_name(mode), eh, ew);
  }
}

// Per-row scales (signed, as RL's per-token weights are): the gradient of sum_t row_scale_t * loss_t against finite
// differences of that weighted loss, in both parallel modes.
TEST(CrossEntropy, RowScaledBackwardMatchesFiniteDifferences) {
  const int64_t T = 9, d = 6, V = 23;
  auto h = randn(T * d, 14), W = randn(V * d, 15);
  const auto tg = make_targets(T, V, 16, true);
  const auto rs = randn(T, 17, 1.5);  // both signs
  for (const CeParallel mode : {CeParallel::Blas, CeParallel::TokenBlocks}) {
    const CeOptions opt{5, 4, mode};
    auto loss = [&] {
      std::vector<double> tl(T);
      cross_entropy_forward(h.data(), W.data(), tg.data(), T, d, V, static_cast<double*>(nullptr), tl.data(), opt);
      double s = 0;
      for (int64_t t = 0; t < T; ++t) s += 0.5 * rs[t] * tl[t];
      return s;
    };
    std::vector<double> lse(T), dh(T * d), dW(V * d, 0.0);
    cross_entropy_forward(h.data(), W.data(), tg.data(), T, d, V, lse.data(), static_cast<double*>(nullptr), opt);
    cross_entropy_backward(h.data(), W.data(), tg.data(), lse.data(), T, d, V, 0.5, dh.data(), dW.data(), opt,
                           rs.data());
    const double eh = fd_check(h, dh, loss, 54), ew = fd_check(W, dW, loss, 138);
    EXPECT_LT(eh, 1e-8) << mode_name(mode);
    EXPECT_LT(ew, 1e-8) << mode_name(mode);
  }
}

TEST(CrossEntropy, AllIgnoredGivesZero) {
  const int64_t T = 4, d = 3, V = 10;
  const auto h = randn(T * d, 7), W = randn(V * d, 8);
  const std::vector<int32_t> tg(T, -100);
  std::vector<double> dh(T * d, 9.0), dW(V * d, 1.0);
  const CeStats st = cross_entropy_mean_forward_backward(h.data(), W.data(), tg.data(), T, d, V, dh.data(), dW.data());
  EXPECT_EQ(st.n_valid, 0);
  EXPECT_EQ(st.mean(), 0.0);
  for (double x : dh) EXPECT_EQ(x, 0.0);
  for (double x : dW) EXPECT_EQ(x, 1.0);
}

TEST(CrossEntropy, ExtremeLogitsStayFinite) {
  // Logits of several hundred (fp32 exp overflows at 88.7): the online max keeps everything finite.
  const int64_t T = 16, d = 8, V = 300;
  const auto h = randn(T * d, 9, 30.0), W = randn(V * d, 10, 3.0);
  const auto tg = make_targets(T, V, 11, false);
  const Naive ref = naive_ce(h, W, tg, T, d, V);
  ASSERT_GT(*std::max_element(ref.lse.begin(), ref.lse.end()), 200.0);
  const std::vector<float> hf(h.begin(), h.end()), Wf(W.begin(), W.end());
  for (const CeParallel mode : {CeParallel::Blas, CeParallel::TokenBlocks}) {
    std::vector<float> dh(T * d), dW(V * d, 0.0f);
    const CeOptions opt{64, 8, mode};  // several chunks: the running max jumps between them
    const CeStats st =
        cross_entropy_mean_forward_backward(hf.data(), Wf.data(), tg.data(), T, d, V, dh.data(), dW.data(), opt);
    EXPECT_TRUE(std::isfinite(st.loss_sum));
    EXPECT_NEAR(st.mean(), ref.mean, 1e-5 * ref.mean) << mode_name(mode);
    EXPECT_LT(rel_rms_vec(ref.dh, std::vector<double>(dh.begin(), dh.end())), 1e-4) << mode_name(mode);
    EXPECT_LT(rel_rms_vec(ref.dW, std::vector<double>(dW.begin(), dW.end())), 1e-4) << mode_name(mode);
  }
}

TEST(CrossEntropy, FloatMatchesDouble) {
  const int64_t T = 300, d = 64, V = 3001;
  const auto h = randn(T * d, 12, 1.0), W = randn(V * d, 13, 0.2);
  const auto tg = make_targets(T, V, 14, true);
  const std::vector<float> hf(h.begin(), h.end()), Wf(W.begin(), W.end());
  std::vector<double> dhd(T * d), dWd(V * d, 0.0);
  const CeStats sd = cross_entropy_mean_forward_backward(h.data(), W.data(), tg.data(), T, d, V, dhd.data(), dWd.data(),
                                                         CeOptions{512, 0, CeParallel::Blas});
  for (const CeParallel mode : {CeParallel::Blas, CeParallel::TokenBlocks}) {
    std::vector<float> dhf(T * d), dWf(V * d, 0.0f);
    const CeStats sf = cross_entropy_mean_forward_backward(hf.data(), Wf.data(), tg.data(), T, d, V, dhf.data(),
                                                           dWf.data(), CeOptions{1000, 0, mode});
    const double el = std::fabs(sf.mean() - sd.mean()) / sd.mean();
    const double eh = rel_rms_vec(dhd, std::vector<double>(dhf.begin(), dhf.end()));
    const double ew = rel_rms_vec(dWd, std::vector<double>(dWf.begin(), dWf.end()));
    EXPECT_LT(el, 1e-6) << mode_name(mode);
    EXPECT_LT(eh, 1e-5) << mode_name(mode);
    EXPECT_LT(ew, 1e-5) << mode_name(mode);
    std::printf("CE f32 vs f64 (%s): loss %.2e dh %.2e dW %.2e\n", mode_name(mode), el, eh, ew);
  }
}

TEST(CrossEntropy, LogitsForInference) {
  const int64_t rows = 3, d = 5, V = 11;
  const auto h = randn(rows * d, 15), W = randn(V * d, 16);
  std::vector<double> logits(rows * V);
  lm_head_logits(h.data(), W.data(), rows, d, V, logits.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t v = 0; v < V; ++v) {
      double s = 0;
      for (int64_t c = 0; c < d; ++c) s += h[r * d + c] * W[v * d + c];
      EXPECT_NEAR(logits[r * V + v], s, 1e-14);
    }
}

TEST(CrossEntropy, RejectsOutOfVocabularyTargetsAndBadOptions) {
  const int64_t T = 3, d = 2, V = 4;
  const std::vector<double> h(T * d, 0.1), W(V * d, 0.2);
  std::vector<double> lse(T);
  const std::vector<int32_t> bad{0, 4, 1};
  try {
    cross_entropy_forward(h.data(), W.data(), bad.data(), T, d, V, lse.data());
    FAIL() << "expected lm::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("position 1"), std::string::npos) << e.what();
  }
  const std::vector<int32_t> ok{0, 3, -100};
  EXPECT_THROW(cross_entropy_forward(h.data(), W.data(), ok.data(), T, d, V, lse.data(), static_cast<double*>(nullptr),
                                     CeOptions{0, 0, CeParallel::Blas}),
               Error);
  EXPECT_NO_THROW(cross_entropy_forward(h.data(), W.data(), ok.data(), T, d, V, lse.data()));
}

// The CE chunking measurement of the brief: T=4096, d=256, vocab=8192, fp32, forward + backward.
TEST(CrossEntropy, DISABLED_Timing) {
  const int64_t T = 4096, d = 256, V = 8192;
  const auto h = randn<float>(T * d, 20, 1.0), W = randn<float>(V * d, 21, 0.06);
  const auto tg = make_targets(T, V, 22, false);
  std::vector<float> lse(T), dh(T * d), dW(V * d, 0.0f);
  const double gflop_f = 2.0 * T * V * d * 1e-9;
  std::printf("threads %d; forward %.1f GFLOP\n", num_threads(), gflop_f);
  {  // Baselines: the bare logits GEMM (one full [T, V] product, 512 MB never held by the op) and the exps.
    std::vector<float> L(static_cast<size_t>(T * V));
    double best = 1e30, best_exp = 1e30, cpu_gemm = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = cpu_seconds();
      lm_head_logits(h.data(), W.data(), T, d, V, L.data());
      cpu_gemm = std::min(cpu_gemm, cpu_seconds() - c0);
      const auto t1 = std::chrono::steady_clock::now();
      parallel_for(T, [&](int64_t t) {
        float* r = L.data() + t * V;
        float s = 0;
        for (int64_t v = 0; v < V; ++v) s += std::exp(r[v] - 1.0f);
        r[0] = s;
      });
      const auto t2 = std::chrono::steady_clock::now();
      best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
      best_exp = std::min(best_exp, std::chrono::duration<double>(t2 - t1).count());
    }
    std::printf("baseline: one logits GEMM %.1f ms wall (%.1f GFLOP/s), %.1f ms cpu; T*V std::exp %.1f ms\n",
                best * 1e3, gflop_f / best, cpu_gemm * 1e3, best_exp * 1e3);
  }
  struct Cfg {
    CeParallel mode;
    int64_t vc, bt;
  };
  for (const Cfg c : {Cfg{CeParallel::Blas, 4096, 1024}, Cfg{CeParallel::Blas, 2048, 2048},
                      Cfg{CeParallel::TokenBlocks, 4096, 128}, Cfg{CeParallel::TokenBlocks, 2048, 256}}) {
    const CeOptions opt{c.vc, c.bt, c.mode};
    double best_f = 1e30, best_b = 1e30, best_fb = 1e30, cpu_f = 1e30, cpu_b = 1e30, cpu_fb = 1e30;
    for (int rep = 0; rep < 4; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = cpu_seconds();
      cross_entropy_forward(h.data(), W.data(), tg.data(), T, d, V, lse.data(), static_cast<float*>(nullptr), opt);
      const auto t1 = std::chrono::steady_clock::now();
      const double c1 = cpu_seconds();
      cross_entropy_backward(h.data(), W.data(), tg.data(), lse.data(), T, d, V, 1.0f / T, dh.data(), dW.data(), opt);
      const auto t2 = std::chrono::steady_clock::now();
      const double c2 = cpu_seconds();
      cross_entropy_forward_backward(h.data(), W.data(), tg.data(), T, d, V, 1.0f / T, dh.data(), dW.data(),
                                     static_cast<float*>(nullptr), static_cast<float*>(nullptr), opt);
      const auto t3 = std::chrono::steady_clock::now();
      const double c3 = cpu_seconds();
      best_f = std::min(best_f, std::chrono::duration<double>(t1 - t0).count());
      best_b = std::min(best_b, std::chrono::duration<double>(t2 - t1).count());
      best_fb = std::min(best_fb, std::chrono::duration<double>(t3 - t2).count());
      cpu_f = std::min(cpu_f, c1 - c0);
      cpu_b = std::min(cpu_b, c2 - c1);
      cpu_fb = std::min(cpu_fb, c3 - c2);
    }
    std::printf(
        "%-12s Vc=%5ld Bt=%5ld  wall: fwd %6.1f bwd %6.1f forward_backward %6.1f ms (%4.1f GFLOP/s) | "
        "cpu: fwd %6.1f bwd %6.1f forward_backward %6.1f ms\n",
        mode_name(c.mode), long(c.vc), long(c.bt), best_f * 1e3, best_b * 1e3, best_fb * 1e3, 4 * gflop_f / best_fb,
        cpu_f * 1e3, cpu_b * 1e3, cpu_fb * 1e3);
  }
}
