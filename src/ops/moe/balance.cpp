// Quantile Balancing (exact and histogram estimators), DeepSeek sign update, Switch-style aux loss.
// Legend: m tokens, n experts, k experts per token, q = m·k/n.
#include "ops/moe/balance.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/moe/topk.hpp"

namespace lm::ops {
namespace {

template <class F>
inline F sigmoid(F x) {
  return F(1) / (F(1) + std::exp(-x));
}

// Column work (per expert) reads s row by row through a tile of experts: 16 floats = one cache
// line, so each task streams over the tokens with contiguous reads and owns its output rows.
// Rows are n·sizeof(F) apart, usually more than the hardware prefetcher follows across pages, so
// the tile loops prefetch a fixed distance ahead themselves.
constexpr int64_t kExpertTile = 16;
constexpr int64_t kPrefetchRows = 16;

template <class F>
inline void prefetch_row(const F* s, int64_t i, int64_t m, int64_t n, int64_t j0) {
  if (i + kPrefetchRows < m) __builtin_prefetch(s + (i + kPrefetchRows) * n + j0);
}

void check_qb(int64_t m, int64_t n, int64_t k) {
  LM_CHECK(m >= 1, "QB: needs at least one token (m = {})", m);
  LM_CHECK(n >= 2 && n <= std::numeric_limits<int32_t>::max(), "QB: n = {} experts out of range", n);
  LM_CHECK(k >= 1 && k < n, "QB: k = {} must be in [1, n = {}) (α_i is the (k+1)-th largest)", k, n);
}

// α from the caller, or computed into buf.
template <class F>
const F* alpha_or_compute(const F* s, const F* b, const F* alpha, int64_t m, int64_t n, int64_t k,
                          std::vector<F>& buf) {
  if (alpha) return alpha;
  buf.resize(static_cast<size_t>(m));
  qb_admission_cutoff(s, b, buf.data(), m, n, k);
  return buf.data();
}

// Slot geometry (balance.hpp): per side `half` regular bins, plus one unbounded overflow bin for
// Uniform; the x == 0 slot sits at `center`. E(u) is the |x| where side bin u starts.
struct HistGeom {
  bool uniform;
  int64_t half, side, center;
  double w, inv_w, scale;
  explicit HistGeom(const QbHistogram& h)
      : uniform(h.layout == QbHistLayout::Uniform), half(h.bins / 2), side(half + (uniform ? 1 : 0)), center(side),
        w(h.range / static_cast<double>(half)), inv_w(static_cast<double>(half) / h.range), scale(h.scale) {}

  double E(int64_t u) const {
    if (u >= side) return std::numeric_limits<double>::infinity();
    if (uniform) return static_cast<double>(u) * w;
    const double phi = static_cast<double>(u) / static_cast<double>(half);
    return scale * phi / (1.0 - phi);  // inverse of φ = x / (x + scale)
  }
  // Slot of x, branch-free so a tile's slots vectorise: u is the signed side-bin coordinate,
  // truncation toward zero gives the side bin of either sign, sgn(x) steps over the zero slot.
  // The clamps are written as selects (max/min instructions); a NaN x (possible only with a
  // caller-supplied α and NaN scores) still gets a valid slot.
  template <bool Uniform>
  int64_t slot_of(double x) const {
    const double lim = static_cast<double>(side - 1);
    double u = Uniform ? x * inv_w : x / (std::fabs(x) + scale) * static_cast<double>(half);
    u = u > -lim ? u : -lim;
    u = u < lim ? u : lim;
    return center + static_cast<int64_t>(x > 0) - static_cast<int64_t>(x < 0) + static_cast<int64_t>(u);
  }
  // [lo, hi] of slot t.
  void range(int64_t t, double& lo, double& hi) const {
    if (t == center) {
      lo = hi = 0.0;
    } else if (t > center) {
      lo = E(t - center - 1);
      hi = E(t - center);
    } else {
      lo = -E(center - t);
      hi = -E(center - 1 - t);
    }
  }
};

}  // namespace

// ---- QB --------------------------------------------------------------------------------------

template <class F>
void qb_admission_cutoff(const F* s, const F* b, F* alpha, int64_t m, int64_t n, int64_t k) {
  check_qb(m, n, k);
  LM_CHECK(s && b && alpha, "qb_admission_cutoff: null argument");
  parallel_for(
      m,
      [&](int64_t i) {
        F val[65];
        int32_t idx[65];
        std::vector<F> vb(k + 1 > 65 ? static_cast<size_t>(k + 1) : 0);
        std::vector<int32_t> ib(vb.size());
        F* v = vb.empty() ? val : vb.data();
        int32_t* ix = ib.empty() ? idx : ib.data();
        LM_CHECK(moe_detail::top_ranked(s + i * n, b, n, k + 1, v, ix), "qb_admission_cutoff: NaN in token {}", i);
        alpha[i] = v[k];
      },
      256);
}

// Exact selection without sorting or transposing m·n margins: per tile of experts, pass 1 counts
// r_ij in fixed uniform buckets over the range r can take, which locates the bucket(s) holding
// ranks Q+1 and Q+2; pass 2 collects just those buckets' values, and nth_element finishes on a
// handful of elements. Buckets are a monotone function of r (a subtraction, a positive scale
// and a truncation, each rounding monotonically), so bucket order never contradicts value order
// and the result is the exact order statistic, ties included.
template <class F>
void qb_beta_exact(const F* s, const F* b, const F* alpha, F* beta, int64_t m, int64_t n, int64_t k) {
  check_qb(m, n, k);
  LM_CHECK(s && b && beta, "qb_beta_exact: null argument");
  std::vector<F> alpha_buf;
  const F* al = alpha_or_compute(s, b, alpha, m, n, k, alpha_buf);
  // r = s − α with s ∈ [0, 1] and α ∈ [min b, 1 + max b]; values outside (rounding, or scores that
  // are not sigmoids) clamp into the end buckets, which keeps the order.
  const auto [bmin, bmax] = std::minmax_element(b, b + n);
  const double lo = -1.0 - static_cast<double>(*bmax), hi = 1.0 - static_cast<double>(*bmin);
  constexpr int64_t kBuckets = 4096;
  const double inv_w = static_cast<double>(kBuckets) / (hi - lo);
  const double top = static_cast<double>(kBuckets - 1);
  auto bucket = [lo, inv_w, top](F r) {
    double u = (static_cast<double>(r) - lo) * inv_w;
    u = u > 0.0 ? u : 0.0;
    return static_cast<int32_t>(u < top ? u : top);
  };
  // q = Q + f exactly: Q = floor(m·k/n), f = ((m·k) mod n) / n. Ranks are 1-based, descending.
  const int64_t Q = (m * k) / n;
  const double f = static_cast<double>((m * k) % n) / static_cast<double>(n);
  const int64_t R1 = Q + 1, R2 = std::min(Q + 2, m);  // r_(m+1) := r_(m)
  const int64_t tiles = (n + kExpertTile - 1) / kExpertTile;
  parallel_for(tiles, [&](int64_t tile) {
    const int64_t j0 = tile * kExpertTile, tw = std::min(n - j0, kExpertTile);
    std::vector<int32_t> cnt(static_cast<size_t>(kExpertTile * kBuckets), 0);
    int32_t bk[kExpertTile];
    int64_t nans = 0;  // a NaN would break nth_element's ordering below
    for (int64_t i = 0; i < m; ++i) {
      prefetch_row(s, i, m, n, j0);
      const F a = al[i];
      const F* row = s + i * n + j0;
      for (int64_t jj = 0; jj < tw; ++jj) {
        const F r = row[jj] - a;
        nans += (r != r);
        bk[jj] = bucket(r);
      }
      for (int64_t jj = 0; jj < tw; ++jj) ++cnt[static_cast<size_t>(jj * kBuckets + bk[jj])];
    }
    LM_CHECK(nans == 0, "qb_beta_exact: NaN score or cutoff among experts {}..{}", j0, j0 + tw - 1);
    // Buckets [t_lo, t_hi] hold ranks R1..R2; `above` values lie in higher buckets.
    int32_t t_hi[kExpertTile], t_lo[kExpertTile];
    int64_t above[kExpertTile];
    for (int64_t jj = 0; jj < tw; ++jj) {
      const int32_t* c = cnt.data() + jj * kBuckets;
      int64_t cum = 0;
      int32_t t = kBuckets - 1;
      while (cum + c[t] < R1) cum += c[t--];
      t_hi[jj] = t;
      above[jj] = cum;
      while (cum + c[t] < R2) cum += c[t--];
      t_lo[jj] = t;
    }
    std::vector<std::vector<F>> cand(static_cast<size_t>(tw));
    for (int64_t i = 0; i < m; ++i) {
      prefetch_row(s, i, m, n, j0);
      const F a = al[i];
      const F* row = s + i * n + j0;
      for (int64_t jj = 0; jj < tw; ++jj) bk[jj] = bucket(row[jj] - a);  // bit-identical to pass 1
      for (int64_t jj = 0; jj < tw; ++jj)
        if (bk[jj] <= t_hi[jj] && bk[jj] >= t_lo[jj]) [[unlikely]] cand[jj].push_back(row[jj] - a);
    }
    for (int64_t jj = 0; jj < tw; ++jj) {
      std::vector<F>& v = cand[jj];
      const auto p = v.begin() + (R1 - above[jj] - 1);
      std::nth_element(v.begin(), p, v.end(), std::greater<F>());  // *p = r_(Q+1), later ones <= it
      const F r1 = *p;
      const F r2 = p + 1 < v.end() ? *std::max_element(p + 1, v.end()) : r1;  // r_(Q+2)
      beta[j0 + jj] = f == 0.0 ? r1 : static_cast<F>((1.0 - f) * static_cast<double>(r1) + f * static_cast<double>(r2));
    }
  });
}

template <class F>
void qb_bias_from_beta(const F* beta, F* b_new, int64_t n) {
  LM_CHECK(n >= 1 && beta && b_new, "qb_bias_from_beta: bad arguments");
  double mean = 0;
  for (int64_t j = 0; j < n; ++j) mean += static_cast<double>(beta[j]);
  mean /= static_cast<double>(n);
  for (int64_t j = 0; j < n; ++j) b_new[j] = static_cast<F>(mean - static_cast<double>(beta[j]));
}

template <class F>
void qb_update_exact(const F* s, const F* b, const F* alpha, F* b_new, int64_t m, int64_t n, int64_t k) {
  std::vector<F> beta(static_cast<size_t>(std::max<int64_t>(n, 0)));
  qb_beta_exact(s, b, alpha, beta.data(), m, n, k);
  qb_bias_from_beta(beta.data(), b_new, n);
}

int64_t qb_hist_slots(const QbHistogram& h) {
  return h.layout == QbHistLayout::Uniform ? h.bins + 3 : h.bins + 1;
}

void qb_hist_check(const QbHistogram& h) {
  LM_CHECK(h.bins >= 2 && h.bins <= (int64_t{1} << 30) && h.bins % 2 == 0,
           "QB histogram: bins = {} must be even and in [2, 2^30]", h.bins);
  if (h.layout == QbHistLayout::Uniform)
    LM_CHECK(std::isfinite(h.range) && h.range > 0, "QB histogram: uniform range {} must be > 0", h.range);
  else
    LM_CHECK(std::isfinite(h.scale) && h.scale > 0, "QB histogram: rational scale {} must be > 0", h.scale);
}

template <class F>
QbHistogram qb_hist_cover(const F* b, int64_t n, int64_t bins) {
  LM_CHECK(b && n >= 1, "qb_hist_cover: bad arguments");
  const auto [mn, mx] = std::minmax_element(b, b + n);
  // x = s_ij + b_j − α_i with s ∈ [0, 1] and α_i ∈ [min b, 1 + max b]: |x| <= 1 + (max b − min b).
  // A little slack keeps x == ±R (and float rounding of it) inside the regular bins.
  const double R = (1.0 + static_cast<double>(*mx) - static_cast<double>(*mn)) * (1.0 + 1e-6) + 1e-6;
  QbHistogram h;
  h.layout = QbHistLayout::Uniform;
  h.bins = bins;
  h.range = R;
  qb_hist_check(h);
  return h;
}

template <class F>
void qb_hist_accumulate(const F* s, const F* b, const F* alpha, int64_t m, int64_t n, int64_t k,
                        const QbHistogram& h, int64_t* counts) {
  check_qb(m, n, k);
  qb_hist_check(h);
  LM_CHECK(s && b && counts, "qb_hist_accumulate: null argument");
  std::vector<F> alpha_buf;
  const F* al = alpha_or_compute(s, b, alpha, m, n, k, alpha_buf);
  const int64_t slots = qb_hist_slots(h);
  const HistGeom geom(h);
  const int64_t tiles = (n + kExpertTile - 1) / kExpertTile;
  auto run = [&]<bool Uniform>() {
    parallel_for(tiles, [&](int64_t tile) {
      const int64_t j0 = tile * kExpertTile, tw = std::min(n - j0, kExpertTile);
      int64_t* c0 = counts + j0 * slots;
      int64_t sl[kExpertTile];
      for (int64_t i = 0; i < m; ++i) {
        prefetch_row(s, i, m, n, j0);
        const F a = al[i];
        const F* row = s + i * n + j0;
        const F* bj = b + j0;
        // The biased margin, computed exactly as the router ranks: (s + b) − α, > 0 iff selected.
        for (int64_t jj = 0; jj < tw; ++jj)
          sl[jj] = geom.template slot_of<Uniform>(static_cast<double>((row[jj] + bj[jj]) - a));
        for (int64_t jj = 0; jj < tw; ++jj) ++c0[jj * slots + sl[jj]];
      }
    });
  };
  if (geom.uniform)
    run.template operator()<true>();
  else
    run.template operator()<false>();
}

template <class F>
void qb_beta_from_hist(const int64_t* counts, const F* b, F* beta, int64_t n, int64_t k, const QbHistogram& h) {
  LM_CHECK(n >= 2 && k >= 1 && k < n, "qb_beta_from_hist: need 1 <= k = {} < n = {}", k, n);
  LM_CHECK(counts && b && beta, "qb_beta_from_hist: null argument");
  qb_hist_check(h);
  const int64_t slots = qb_hist_slots(h);
  const HistGeom geom(h);
  parallel_for(n, [&](int64_t j) {
    const int64_t* c = counts + j * slots;
    int64_t total = 0;
    for (int64_t t = 0; t < slots; ++t) {
      LM_CHECK(c[t] >= 0, "qb_beta_from_hist: negative count (expert {}, slot {})", j, t);
      total += c[t];
    }
    LM_CHECK(total > 0, "qb_beta_from_hist: expert {} has no counts", j);
    // The point with q + 1/2 counts above it (see balance.hpp), q = M·k/n.
    const double target =
        static_cast<double>(total) * static_cast<double>(k) / static_cast<double>(n) + 0.5;
    double above = 0;
    int64_t t = slots - 1;
    int64_t lowest = -1;
    for (; t >= 0; --t) {
      if (c[t] == 0) continue;
      lowest = t;
      if (above + static_cast<double>(c[t]) >= target) break;
      above += static_cast<double>(c[t]);
    }
    double frac = 1.0;  // target beyond the total (tiny M): the bottom of the lowest bin
    if (t < 0) {
      t = lowest;
      above -= static_cast<double>(c[t]);
    } else {
      frac = (target - above) / static_cast<double>(c[t]);
    }
    double e_lo, e_hi;
    geom.range(t, e_lo, e_hi);
    double x;
    if (!std::isfinite(e_hi)) x = e_lo;       // overflow slot: clamp to its finite edge
    else if (!std::isfinite(e_lo)) x = e_hi;  // underflow slot
    else x = e_hi - frac * (e_hi - e_lo);     // counts spread evenly over the bin (0 wide: x = 0)
    beta[j] = static_cast<F>(x - static_cast<double>(b[j]));  // undo the per-expert edge shift
  });
}

template <class F>
void qb_update_hist(const F* s, const F* b, const F* alpha, F* b_new, int64_t m, int64_t n, int64_t k,
                    const QbHistogram& h) {
  check_qb(m, n, k);
  qb_hist_check(h);
  std::vector<int64_t> counts(static_cast<size_t>(n * qb_hist_slots(h)), 0);
  qb_hist_accumulate(s, b, alpha, m, n, k, h, counts.data());
  std::vector<F> beta(static_cast<size_t>(n));
  qb_beta_from_hist(counts.data(), b, beta.data(), n, k, h);
  qb_bias_from_beta(beta.data(), b_new, n);
}

// ---- baselines and metrics -------------------------------------------------------------------

void expert_loads(const int32_t* topk_idx, int64_t m, int64_t k, int64_t n, int64_t* loads) {
  LM_CHECK(m >= 0 && k >= 1 && n >= 1, "expert_loads: bad sizes m = {}, k = {}, n = {}", m, k, n);
  LM_CHECK(loads && (topk_idx || m == 0), "expert_loads: null argument");
  std::fill(loads, loads + n, int64_t{0});
  for (int64_t a = 0; a < m * k; ++a) {
    const int32_t j = topk_idx[a];
    LM_CHECK(j >= 0 && j < n, "expert_loads: topk_idx[{}] = {} out of [0, {})", a, j, n);
    ++loads[j];
  }
}

double max_violation(const int64_t* loads, int64_t n) {
  LM_CHECK(loads && n >= 1, "max_violation: bad arguments");
  int64_t total = 0, mx = 0;
  for (int64_t j = 0; j < n; ++j) {
    total += loads[j];
    mx = std::max(mx, loads[j]);
  }
  if (total == 0) return 0.0;
  return static_cast<double>(mx) * static_cast<double>(n) / static_cast<double>(total) - 1.0;
}

template <class F>
void bias_sign_update(const int64_t* loads, F* b, int64_t n, F gamma) {
  LM_CHECK(loads && b && n >= 1, "bias_sign_update: bad arguments");
  int64_t total = 0;
  for (int64_t j = 0; j < n; ++j) total += loads[j];
  // Compare n·load_j with the total instead of load_j with a fractional mean: exact in integers.
  for (int64_t j = 0; j < n; ++j) {
    const int64_t d = total - n * loads[j];
    b[j] += d > 0 ? gamma : d < 0 ? -gamma : F(0);
  }
}

template <class F>
double aux_loss_forward(const F* logits, const int32_t* topk_idx, int64_t m, int64_t n, int64_t k, double coef) {
  LM_CHECK(m >= 1 && n >= 1 && k >= 1 && k <= n, "aux_loss_forward: bad sizes m = {}, n = {}, k = {}", m, n, k);
  LM_CHECK(logits && topk_idx, "aux_loss_forward: null argument");
  std::vector<int64_t> loads(static_cast<size_t>(n));
  expert_loads(topk_idx, m, k, n, loads.data());
  // L = coef·n/(m·k·m) · Σ_i Σ_j load_j ŝ_ij; per-token terms summed in token order afterwards.
  std::vector<double> per_token(static_cast<size_t>(m));
  parallel_for(
      m,
      [&](int64_t i) {
        const F* x = logits + i * n;
        double S = 0, dot = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double s = static_cast<double>(sigmoid(x[j]));
          S += s;
          dot += static_cast<double>(loads[j]) * s;
        }
        per_token[i] = dot / S;
      },
      64);
  double sum = 0;
  for (double v : per_token) sum += v;
  const double md = static_cast<double>(m);
  return coef * static_cast<double>(n) / (md * static_cast<double>(k) * md) * sum;
}

template <class F>
void aux_loss_backward(const F* logits, const int32_t* topk_idx, F* d_logits, int64_t m, int64_t n, int64_t k,
                       double coef, bool accumulate) {
  LM_CHECK(m >= 1 && n >= 1 && k >= 1 && k <= n, "aux_loss_backward: bad sizes m = {}, n = {}, k = {}", m, n, k);
  LM_CHECK(logits && topk_idx && d_logits, "aux_loss_backward: null argument");
  std::vector<int64_t> loads(static_cast<size_t>(n));
  expert_loads(topk_idx, m, k, n, loads.data());
  const double md = static_cast<double>(m);
  const double gscale = coef * static_cast<double>(n) / (md * static_cast<double>(k) * md);  // g_j = gscale·load_j
  parallel_for(
      m,
      [&](int64_t i) {
        const F* x = logits + i * n;
        F* dl = d_logits + i * n;
        double S = 0, gs = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double s = static_cast<double>(sigmoid(x[j]));
          S += s;
          gs += static_cast<double>(loads[j]) * s;
        }
        gs *= gscale / S;  // Σ_j g_j ŝ_ij
        for (int64_t j = 0; j < n; ++j) {
          const double s = static_cast<double>(sigmoid(x[j]));
          const double d = (gscale * static_cast<double>(loads[j]) - gs) / S * s * (1.0 - s);
          dl[j] = accumulate ? dl[j] + static_cast<F>(d) : static_cast<F>(d);
        }
      },
      64);
}

// ---- instantiations ----------------------------------------------------------------------------
#define LM_MOE_BALANCE_INSTANTIATE(F)                                                                           \
  template void qb_admission_cutoff<F>(const F*, const F*, F*, int64_t, int64_t, int64_t);                     \
  template void qb_beta_exact<F>(const F*, const F*, const F*, F*, int64_t, int64_t, int64_t);                 \
  template void qb_bias_from_beta<F>(const F*, F*, int64_t);                                                   \
  template void qb_update_exact<F>(const F*, const F*, const F*, F*, int64_t, int64_t, int64_t);               \
  template QbHistogram qb_hist_cover<F>(const F*, int64_t, int64_t);                                           \
  template void qb_hist_accumulate<F>(const F*, const F*, const F*, int64_t, int64_t, int64_t,                 \
                                      const QbHistogram&, int64_t*);                                           \
  template void qb_beta_from_hist<F>(const int64_t*, const F*, F*, int64_t, int64_t, const QbHistogram&);     \
  template void qb_update_hist<F>(const F*, const F*, const F*, F*, int64_t, int64_t, int64_t,                 \
                                  const QbHistogram&);                                                         \
  template void bias_sign_update<F>(const int64_t*, F*, int64_t, F);                                           \
  template double aux_loss_forward<F>(const F*, const int32_t*, int64_t, int64_t, int64_t, double);            \
  template void aux_loss_backward<F>(const F*, const int32_t*, F*, int64_t, int64_t, int64_t, double, bool);
LM_MOE_BALANCE_INSTANTIATE(float)
LM_MOE_BALANCE_INSTANTIATE(double)
#undef LM_MOE_BALANCE_INSTANTIATE

}  // namespace lm::ops
