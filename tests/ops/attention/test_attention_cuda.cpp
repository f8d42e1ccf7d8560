// Causal attention and absorbed MLA decode on the GPU (src/ops/attention/cuda) against the CPU fp32 path
// (lm::ops::attention_forward / attention_backward / mla_decode_absorbed). Skips without a CUDA device.
//
// Legend: B batch, T tokens, H query heads, Hkv kv heads, Dk/Dv head dims, N sequences (varlen), Tc cached
//         positions, R latent rank, Dr rope dims.
// GPU inputs are bf16; the CPU reference gets the same rounded values in fp32, so the comparison measures the
// kernels' own precision. Outputs are poisoned (NaN) before each run so unwritten entries fail.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_testing.hpp"
#include "ops/attention/attention.hpp"
#include "ops/attention/cuda/attention_cuda.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

namespace {

Vec down_f32(const Dev& d, size_t n) {
  Vec r(n);
  kc::copy_to_host(r.data(), d.p, n * 4);
  return r;
}
double rms(const Vec& x) {
  double s = 0;
  for (float v : x) s += double(v) * v;
  return x.empty() ? 0.0 : std::sqrt(s / double(x.size()));
}
// RMS(x − ref) / max(RMS(ref), floor): a gradient that is zero in exact arithmetic (dq, dk when every row sees
// one key: P = 1 and dS = P·(dP − D) = 0) is compared on the scale of the other gradients.
double err_floor(const Vec& ref, const Vec& x, double floor) {
  Vec d(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) d[i] = x[i] - ref[i];
  return rms(d) / std::max(rms(ref), floor);
}

struct Case {
  int64_t B = 1, T = 64, H = 2, Hkv = 0, Dk = 192, Dv = 128;
  std::vector<int64_t> cu;
  uint64_t seed = 1;
  std::string name() const {
    char b[160];
    std::snprintf(b, sizeof b, "B%lld T%lld H%lld Hkv%lld Dk%lld Dv%lld%s", (long long)B, (long long)T, (long long)H,
                  (long long)(Hkv ? Hkv : H), (long long)Dk, (long long)Dv, cu.empty() ? "" : " varlen");
    return b;
  }
};

void check_case(const Case& c) {
  SCOPED_TRACE(c.name());
  const int64_t Hkv = c.Hkv ? c.Hkv : c.H, rows = c.B * c.T;
  const size_t nq = size_t(rows * c.H * c.Dk), nk = size_t(rows * Hkv * c.Dk), nv = size_t(rows * Hkv * c.Dv),
               no = size_t(rows * c.H * c.Dv), nl = size_t(rows * c.H);
  // Scores of order a few units (q·k ~ N(0, Dk) · scale² ~ N(0, 1)·1.5): a peaked but not one-hot softmax.
  const Vec q = round_bf16(lm::testing::randn<float>(nq, c.seed * 8 + 1, 1.5));
  const Vec k = round_bf16(lm::testing::randn<float>(nk, c.seed * 8 + 2));
  const Vec v = round_bf16(lm::testing::randn<float>(nv, c.seed * 8 + 3));
  const Vec dO = round_bf16(lm::testing::randn<float>(no, c.seed * 8 + 4));
  ops::AttnDims d;
  d.B = c.B, d.T = c.T, d.H = c.H, d.Hkv = c.Hkv, d.Dk = c.Dk, d.Dv = c.Dv;
  if (!c.cu.empty()) d.cu_seqlens = c.cu.data(), d.N = int64_t(c.cu.size()) - 1;
  const float scale = float(1.0 / std::sqrt(double(c.Dk)));

  Vec o_ref(no), lse_ref(nl), dq_ref(nq), dk_ref(nk), dv_ref(nv);
  ops::attention_forward(q.data(), k.data(), v.data(), o_ref.data(), lse_ref.data(), d, scale);
  ops::attention_backward(q.data(), k.data(), v.data(), o_ref.data(), lse_ref.data(), dO.data(), dq_ref.data(),
                          dk_ref.data(), dv_ref.data(), d, scale);

  Dev gq(nq * 2), gk(nk * 2), gv(nv * 2), gdo(no * 2);
  up_bf16(gq, q), up_bf16(gk, k), up_bf16(gv, v), up_bf16(gdo, dO);
  const double floor = 1e-3 * rms(dv_ref);
  // Forward / backward kernel pairs: the defaults (wgmma forward, 128-key wgmma backward) and the mma.sync pair.
  struct Pair {
    oc::FwdKernel f;
    oc::BwdKernel b;
    const char* name;
  };
  for (const Pair pr : {Pair{oc::FwdKernel::Auto, oc::BwdKernel::Auto, "default"},
                        Pair{oc::FwdKernel::Mma, oc::BwdKernel::Mma, "mma.sync"}}) {
    const oc::FwdKernel fk = pr.f;
    Dev go(no * 2), glse(nl * 4), gdq(nq * 2), gdk(nk * 2), gdv(nv * 2);  // poisoned
    oc::AttnShape s;
    s.B = c.B, s.T = c.T, s.H = c.H, s.Hkv = c.Hkv, s.Dk = c.Dk, s.Dv = c.Dv, s.fwd_kernel = fk;
    s.bwd_kernel = pr.b;
    if (!c.cu.empty()) s.cu_seqlens = c.cu.data(), s.N = int64_t(c.cu.size()) - 1;
    oc::attention_forward(s, gq.p, gk.p, gv.p, go.p, glse.f());
    oc::attention_backward(s, gq.p, gk.p, gv.p, go.p, glse.f(), gdo.p, gdq.p, gdk.p, gdv.p);
    kc::synchronize();
    const double eo = err(o_ref, down_bf16(go, no)), el = err(lse_ref, down_f32(glse, nl));
    const double eq = err_floor(dq_ref, down_bf16(gdq, nq), floor), ek = err_floor(dk_ref, down_bf16(gdk, nk), floor),
                 ev = err_floor(dv_ref, down_bf16(gdv, nv), floor);
    const char* kn = pr.name;
    std::printf("%s [%s]: o %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", c.name().c_str(), kn, eo, el, eq, ek, ev);
    EXPECT_LE(eo, 5e-3) << kn;
    EXPECT_LE(el, 1e-3) << kn;
    EXPECT_LE(eq, 8e-3) << kn;
    EXPECT_LE(ek, 8e-3) << kn;
    EXPECT_LE(ev, 8e-3) << kn;
  }
}

}  // namespace

TEST(AttentionCuda, MlaHeadDims) {
  REQUIRE_GPU();
  Case c;
  c.B = 2, c.T = 200, c.H = 3, c.seed = 1;  // T not a multiple of either tile
  check_case(c);
}

TEST(AttentionCuda, HeadDim128) {
  REQUIRE_GPU();
  Case c;
  c.B = 1, c.T = 300, c.H = 2, c.Dk = 128, c.Dv = 128, c.seed = 2;
  check_case(c);
}

TEST(AttentionCuda, LongerSequence) {
  REQUIRE_GPU();
  Case c;
  c.B = 1, c.T = 1100, c.H = 2, c.seed = 3;
  check_case(c);
}

TEST(AttentionCuda, Varlen) {
  REQUIRE_GPU();
  Case c;
  c.B = 1, c.T = 400, c.H = 2, c.cu = {0, 1, 65, 65, 200, 329, 400}, c.seed = 4;
  check_case(c);
  c.Dk = 128, c.seed = 5;
  check_case(c);
}

TEST(AttentionCuda, SingleToken) {
  REQUIRE_GPU();
  Case c;
  c.B = 3, c.T = 1, c.H = 2, c.seed = 6;
  check_case(c);
}

TEST(AttentionCuda, GroupedKvHeads) {
  REQUIRE_GPU();
  Case c;
  c.B = 2, c.T = 150, c.H = 4, c.Hkv = 2, c.Dk = 128, c.Dv = 128, c.seed = 7;
  check_case(c);
}

TEST(AttentionCuda, RejectsUnsupportedHeadDims) {
  REQUIRE_GPU();
  oc::AttnShape s;
  s.T = 4, s.Dk = 64, s.Dv = 64;
  EXPECT_THROW(oc::attention_forward(s, nullptr, nullptr, nullptr, nullptr, nullptr), std::exception);
}

TEST(AttentionCuda, MlaDecodeAbsorbed) {
  REQUIRE_GPU();
  struct DC {
    int64_t H, Tc;
    int splits;
  };
  for (const DC dc : {DC{8, 1000, 0}, DC{40, 777, 0}, DC{64, 130, 1}, DC{16, 1, 0}, DC{32, 4100, 5},
                      DC{16, 70400, 1100}, DC{100, 2049, 0}}) {
    const int64_t R = 512, Dr = 64, ld = R + Dr;
    const uint64_t sd = uint64_t(dc.H * 7 + dc.Tc);
    const Vec ql = round_bf16(lm::testing::randn<float>(size_t(dc.H * R), sd + 1, 0.5));
    const Vec qr = round_bf16(lm::testing::randn<float>(size_t(dc.H * Dr), sd + 2, 0.5));
    const Vec cache = round_bf16(lm::testing::randn<float>(size_t(dc.Tc * ld), sd + 3));
    const float scale = float(1.0 / std::sqrt(192.0));
    Vec o_ref(size_t(dc.H * R)), lse_ref(size_t(dc.H));
    ops::DecodeDims dd;
    dd.H = dc.H, dd.Tc = dc.Tc, dd.R = R, dd.Dr = Dr, dd.ldc = ld, dd.ldkr = ld;
    ops::mla_decode_absorbed(ql.data(), qr.data(), cache.data(), cache.data() + R, o_ref.data(), lse_ref.data(), dd,
                             scale);
    Dev gql(ql.size() * 2), gqr(qr.size() * 2), gc(cache.size() * 2), go(o_ref.size() * 2), gl(lse_ref.size() * 4);
    up_bf16(gql, ql), up_bf16(gqr, qr), up_bf16(gc, cache);
    oc::DecodeShape s;
    s.H = dc.H, s.Tc = dc.Tc, s.splits = dc.splits;
    oc::mla_decode(s, gql.p, gqr.p, gc.p, go.p, gl.f());
    kc::synchronize();
    const double eo = err(o_ref, down_bf16(go, o_ref.size())), el = err(lse_ref, down_f32(gl, lse_ref.size()));
    std::printf("decode H%lld Tc%lld splits %d: o %.2e lse %.2e\n", (long long)dc.H, (long long)dc.Tc, dc.splits, eo, el);
    EXPECT_LE(eo, 5e-3) << "H " << dc.H << " Tc " << dc.Tc;
    EXPECT_LE(el, 1e-3) << "H " << dc.H << " Tc " << dc.Tc;
  }
}

// The batched decode over a paged cache (mla_decode_paged): S sequences of different lengths whose 64-row blocks lie
// shuffled in one pool, lengths read on the device (+ len_add), against the float reference per sequence.
TEST(AttentionCuda, MlaDecodePagedBatch) {
  REQUIRE_GPU();
  const int64_t R = 512, Dr = 64, ld = R + Dr, B = 64;
  for (const int64_t H : {16, 64}) {
    const std::vector<int32_t> lens = {1, 63, 64, 65, 700, 3000};  // tokens cached before the step
    const int64_t S = int64_t(lens.size()), max_tokens = 4096, table_ld = max_tokens / B;
    int64_t blocks = 0;
    for (int32_t l : lens) blocks += (l + 1 + B - 1) / B;
    // block ids: a fixed shuffle of the pool
    std::vector<int32_t> ids(static_cast<size_t>(blocks));
    for (int64_t b = 0; b < blocks; ++b) ids[size_t(b)] = int32_t((b * 37 + 11) % blocks);
    std::vector<int32_t> table(size_t(S * table_ld), 0);
    int64_t next = 0;
    for (int64_t s = 0; s < S; ++s)
      for (int64_t j = 0; j < (lens[size_t(s)] + 1 + B - 1) / B; ++j) table[size_t(s * table_ld + j)] = ids[size_t(next++)];
    const Vec pool = round_bf16(lm::testing::randn<float>(size_t(blocks * B * ld), uint64_t(H) + 5));
    const Vec ql = round_bf16(lm::testing::randn<float>(size_t(S * H * R), uint64_t(H) + 6, 0.5));
    const Vec qr = round_bf16(lm::testing::randn<float>(size_t(S * H * Dr), uint64_t(H) + 7, 0.5));
    const float scale = float(1.0 / std::sqrt(192.0));
    Dev gp(pool.size() * 2), gql(ql.size() * 2), gqr(qr.size() * 2), go(ql.size() * 2), gt(table.size() * 4),
        gl(lens.size() * 4);
    up_bf16(gp, pool), up_bf16(gql, ql), up_bf16(gqr, qr), up(gt, table), up(gl, lens);
    oc::PagedDecodeShape ps;
    ps.S = S, ps.H = H, ps.max_tokens = max_tokens, ps.table_ld = table_ld, ps.len_add = 1, ps.scale = scale;
    Dev ws(oc::mla_decode_paged_workspace(ps));
    oc::mla_decode_paged(ps, gql.p, gqr.p, gp.p, gt.i(), gl.i(), go.p, ws.p);
    kc::synchronize();
    const Vec o = down_bf16(go, ql.size());
    for (int64_t s = 0; s < S; ++s) {
      const int64_t Tc = lens[size_t(s)] + 1;
      Vec cache(size_t(Tc * ld));  // the sequence's rows gathered through its table
      for (int64_t t = 0; t < Tc; ++t) {
        const int64_t b = table[size_t(s * table_ld + t / B)];
        std::copy_n(pool.begin() + (b * B + t % B) * ld, ld, cache.begin() + t * ld);
      }
      Vec o_ref(static_cast<size_t>(H * R)), lse_ref(static_cast<size_t>(H));
      ops::DecodeDims dd;
      dd.H = H, dd.Tc = Tc, dd.R = R, dd.Dr = Dr, dd.ldc = ld, dd.ldkr = ld;
      ops::mla_decode_absorbed(ql.data() + s * H * R, qr.data() + s * H * Dr, cache.data(), cache.data() + R,
                               o_ref.data(), lse_ref.data(), dd, scale);
      const double e = err(o_ref, Vec(o.begin() + s * H * R, o.begin() + (s + 1) * H * R));
      EXPECT_LE(e, 5e-3) << "H " << H << " sequence " << s << " of " << Tc << " positions";
    }
  }
}
