// Chunked-prefill attention on the GPU (attention_forward_block, attention_merge, attention_merge_finish in
// src/ops/attention/cuda) against the whole causal attention_forward of the same sequence (GPU, and the CPU fp32
// path for the small case), and single blocks against a float64 naive reference. Skips without a CUDA device.
//
// Legend: T tokens of the sequence, H query heads, Hkv kv heads, Dk/Dv head dims, Tq queries of a chunk at
//         positions [q_pos0, q_pos0 + Tq), Tk keys of a block at [k_pos0, k_pos0 + Tk).
// GPU inputs are bf16; references get the same rounded values. Outputs are poisoned (NaN) before each run, so an
// entry never written fails the comparison.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/error_type.hpp"
#include "cuda_testing.hpp"
#include "ops/attention/attention.hpp"
#include "ops/attention/cuda/attention_cuda.hpp"

using namespace lm;
using namespace lm::cuda_testing;  // Dev, copies, REQUIRE_GPU, kc / oc, tolerances

namespace {

// Element offsets into device buffers of bf16 or fp32.
const void* at_bf16(const Dev& d, int64_t off) { return static_cast<const uint16_t*>(d.p) + off; }
void* at_bf16_mut(const Dev& d, int64_t off) { return static_cast<uint16_t*>(d.p) + off; }
float* at_f32(const Dev& d, int64_t off) { return static_cast<float*>(d.p) + off; }

struct Seq {  // one random sequence: q [T, H, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] (bf16-exact), on host and device
  int64_t T, H, Hkv, Dk, Dv;
  Vec q, k, v;
  Dev gq, gk, gv;
  Seq(int64_t T_, int64_t H_, int64_t Hkv_, int64_t Dk_, int64_t Dv_, uint64_t seed)
      : T(T_), H(H_), Hkv(Hkv_), Dk(Dk_), Dv(Dv_),
        // Scores of order a few units (q·k·scale ~ N(0, 1.5²)): a peaked but not one-hot softmax.
        q(round_bf16(lm::testing::randn<float>(size_t(T * H * Dk), seed * 8 + 1, 1.5))),
        k(round_bf16(lm::testing::randn<float>(size_t(T * Hkv * Dk), seed * 8 + 2))),
        v(round_bf16(lm::testing::randn<float>(size_t(T * Hkv * Dv), seed * 8 + 3))),
        gq(q.size() * 2),
        gk(k.size() * 2),
        gv(v.size() * 2) {
    up_bf16(gq, q), up_bf16(gk, k), up_bf16(gv, v);
  }
  oc::BlockShape block(int64_t q0, int64_t Tq, int64_t k0, int64_t Tk) const {
    oc::BlockShape s;
    s.Tq = Tq, s.Tk = Tk, s.q_pos0 = q0, s.k_pos0 = k0, s.H = H, s.Hkv = Hkv, s.Dk = Dk, s.Dv = Dv;
    return s;
  }
  // attention_forward_block of queries [q0, q0 + Tq) against keys [k0, k0 + Tk) of this sequence.
  void run_block(const oc::BlockShape& s, const Dev& o, const Dev& lse) const {
    oc::attention_forward_block(s, at_bf16(gq, s.q_pos0 * H * Dk), at_bf16(gk, s.k_pos0 * Hkv * Dk),
                                at_bf16(gv, s.k_pos0 * Hkv * Dv), o.p, lse.f());
  }
};

// Key blocks [k0, k0 + Tk) that together cover the keys [0, c1) visible to the chunk [c0, c1).
enum class Split {
  BeforeThenOwn,  // blocks of `bk` keys over [0, c0), then the chunk's own causal block [c0, c1)
  Aligned,        // blocks of `bk` keys from 0 over [0, c1): blocks straddle c0, some rows see nothing in one
  OneCall,        // one block [0, c1) (a whole chunk in one launch)
};
const char* name(Split s) {
  return s == Split::BeforeThenOwn ? "before+own" : s == Split::Aligned ? "aligned" : "one call";
}
std::vector<std::pair<int64_t, int64_t>> key_blocks(Split sp, int64_t c0, int64_t c1, int64_t bk) {
  std::vector<std::pair<int64_t, int64_t>> b;
  const int64_t end = sp == Split::BeforeThenOwn ? c0 : sp == Split::Aligned ? c1 : 0;
  for (int64_t k0 = 0; k0 < end; k0 += bk) b.push_back({k0, std::min(bk, end - k0)});
  if (sp == Split::BeforeThenOwn) b.push_back({c0, c1 - c0});
  if (sp == Split::OneCall) b.push_back({0, c1});
  return b;
}

// The sequence's queries in chunks of `chunk`, each against its key blocks merged by log-sum-exp, against the
// whole causal attention_forward (GPU; and the CPU path when cpu_ref).
void check_chunked(int64_t T, int64_t H, int64_t Hkv, int64_t Dk, uint64_t seed, bool cpu_ref) {
  const int64_t Dv = 128;
  char title[96];
  std::snprintf(title, sizeof title, "T%lld H%lld Hkv%lld Dk%lld", (long long)T, (long long)H, (long long)Hkv,
                (long long)Dk);
  SCOPED_TRACE(title);
  const Seq sq(T, H, Hkv, Dk, Dv, seed);
  const size_t no = size_t(T * H * Dv), nl = size_t(T * H);

  Dev go_ref(no * 2), glse_ref(nl * 4);
  oc::AttnShape full;
  full.B = 1, full.T = T, full.H = H, full.Hkv = Hkv, full.Dk = Dk, full.Dv = Dv;
  oc::attention_forward(full, sq.gq.p, sq.gk.p, sq.gv.p, go_ref.p, glse_ref.f());
  kc::synchronize();
  const Vec o_ref = down_bf16(go_ref, no), lse_ref = down<float>(glse_ref, nl);
  Vec o_cpu, lse_cpu;
  if (cpu_ref) {
    o_cpu.resize(no), lse_cpu.resize(nl);
    ops::AttnDims d;
    d.B = 1, d.T = T, d.H = H, d.Hkv = Hkv, d.Dk = Dk, d.Dv = Dv;
    ops::attention_forward(sq.q.data(), sq.k.data(), sq.v.data(), o_cpu.data(), lse_cpu.data(), d,
                           float(1.0 / std::sqrt(double(Dk))));
  }

  for (const int64_t chunk : {int64_t(384), int64_t(333)})
    for (const int64_t bk : {int64_t(512), int64_t(257)})
      for (const Split sp : {Split::BeforeThenOwn, Split::Aligned, Split::OneCall}) {
        if (sp == Split::OneCall && bk != 512) continue;  // bk unused
        Dev go(no * 2), glse(nl * 4);                      // poisoned; every chunk writes its rows
        Dev gpart(size_t(chunk * H * Dv) * 2), glpart(size_t(chunk * H) * 4), gacc(size_t(chunk * H * Dv) * 4);
        int launches = 0;
        for (int64_t c0 = 0; c0 < T; c0 += chunk) {
          const int64_t c1 = std::min(T, c0 + chunk), Tq = c1 - c0;
          float* lse_acc = at_f32(glse, c0 * H);  // the merged lse is the final one
          bool first = true;
          for (const auto& [k0, Tk] : key_blocks(sp, c0, c1, bk)) {
            sq.run_block(sq.block(c0, Tq, k0, Tk), gpart, glpart);
            oc::attention_merge(Tq, H, Dv, gpart.p, glpart.f(), gacc.f(), lse_acc, first);
            first = false, ++launches;
          }
          oc::attention_merge_finish(Tq, H, Dv, gacc.f(), at_bf16_mut(go, c0 * H * Dv));
        }
        kc::synchronize();
        const Vec o = down_bf16(go, no), lse = down<float>(glse, nl);
        const double eo = err(o_ref, o), el = err(lse_ref, lse);
        const double eo_cpu = cpu_ref ? err(o_cpu, o) : 0.0, el_cpu = cpu_ref ? err(lse_cpu, lse) : 0.0;
        std::printf("%s chunk %lld keys %lld %s (%d blocks): o %.2e lse %.2e", title, (long long)chunk, (long long)bk,
                    name(sp), launches, eo, el);
        if (cpu_ref) std::printf(" | vs CPU o %.2e lse %.2e", eo_cpu, el_cpu);
        std::printf("\n");
        const std::string where = "chunk " + std::to_string(chunk) + " keys " + std::to_string(bk) + " " + name(sp);
        EXPECT_LE(eo, 1e-2) << where;
        EXPECT_LE(el, 1e-3) << where;
        EXPECT_LE(eo_cpu, 1e-2) << where;
        EXPECT_LE(el_cpu, 1e-3) << where;
      }
}

// float64 attention of one block with the position rule (o = 0, lse = −inf for a row that sees no key).
void block_reference(const Seq& sq, const oc::BlockShape& s, Vec& o, Vec& lse) {
  const int64_t H = sq.H, Dk = sq.Dk, Dv = sq.Dv, G = sq.H / sq.Hkv;
  const double scale = 1.0 / std::sqrt(double(Dk));
  o.assign(size_t(s.Tq * H * Dv), 0.f), lse.assign(size_t(s.Tq * H), -INFINITY);
  std::vector<double> sc(static_cast<size_t>(s.Tk)), acc(static_cast<size_t>(Dv));
  for (int64_t i = 0; i < s.Tq; ++i)
    for (int64_t h = 0; h < H; ++h) {
      const float* qi = &sq.q[size_t(((s.q_pos0 + i) * H + h) * Dk)];
      const int64_t nvis = std::clamp<int64_t>(s.q_pos0 + i - s.k_pos0 + 1, 0, s.Tk);  // keys [0, nvis) visible
      if (nvis == 0) continue;
      double m = -INFINITY;
      for (int64_t j = 0; j < nvis; ++j) {
        const float* kj = &sq.k[size_t(((s.k_pos0 + j) * sq.Hkv + h / G) * Dk)];
        double d = 0;
        for (int64_t c = 0; c < Dk; ++c) d += double(qi[c]) * kj[c];
        sc[size_t(j)] = d * scale, m = std::max(m, d * scale);
      }
      double l = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < nvis; ++j) {
        const double p = std::exp(sc[size_t(j)] - m);
        l += p;
        const float* vj = &sq.v[size_t(((s.k_pos0 + j) * sq.Hkv + h / G) * Dv)];
        for (int64_t c = 0; c < Dv; ++c) acc[size_t(c)] += p * vj[c];
      }
      for (int64_t c = 0; c < Dv; ++c) o[size_t((i * H + h) * Dv + c)] = float(acc[size_t(c)] / l);
      lse[size_t(i * H + h)] = float(m + std::log(l));
    }
}

}  // namespace

TEST(AttentionBlockCuda, ChunkedPrefillMatchesCausalShort) {
  REQUIRE_GPU();
  check_chunked(1000, 4, 4, 192, 11, true);
  check_chunked(1000, 4, 4, 128, 12, true);
  check_chunked(1000, 4, 2, 128, 13, true);  // grouped kv heads
}

TEST(AttentionBlockCuda, ChunkedPrefillMatchesCausalLong) {
  REQUIRE_GPU();
  check_chunked(3000, 16, 16, 192, 14, false);
  check_chunked(3000, 16, 16, 128, 15, false);
}

// Single blocks at offsets: fully visible, diagonal crossing a tile at an odd offset, Tk > Tq, Tk < a tile, Tq < a
// tile, and blocks that hide themselves from the first rows (whole query tiles of 128 rows see nothing).
TEST(AttentionBlockCuda, BlocksMatchNaiveReference) {
  REQUIRE_GPU();
  for (const int64_t Dk : {int64_t(192), int64_t(128)}) {
    const Seq sq(900, 2, 2, Dk, 128, uint64_t(20 + Dk));
    struct B {
      int64_t q0, Tq, k0, Tk;
    };
    for (const B b : {B{600, 300, 0, 600}, B{600, 300, 100, 437}, B{500, 300, 500, 300}, B{333, 171, 200, 400},
                      B{700, 50, 0, 77}, B{700, 1, 650, 51}, B{100, 300, 250, 500}, B{0, 300, 283, 17},
                      B{0, 900, 0, 900}}) {
      const oc::BlockShape s = sq.block(b.q0, b.Tq, b.k0, b.Tk);
      char title[128];
      std::snprintf(title, sizeof title, "Dk %lld: queries [%lld, %lld) keys [%lld, %lld)", (long long)Dk,
                    (long long)b.q0, (long long)(b.q0 + b.Tq), (long long)b.k0, (long long)(b.k0 + b.Tk));
      SCOPED_TRACE(title);
      const size_t no = size_t(b.Tq * sq.H * sq.Dv), nl = size_t(b.Tq * sq.H);
      Dev go(no * 2), glse(nl * 4);
      sq.run_block(s, go, glse);
      kc::synchronize();
      Vec o_ref, lse_ref;
      block_reference(sq, s, o_ref, lse_ref);
      const Vec o = down_bf16(go, no), lse = down<float>(glse, nl);
      // Rows that see nothing must be exactly o = 0, lse = −inf; the others are compared by relative RMS.
      Vec lse_vis_ref, lse_vis;
      size_t empty_rows = 0, bad_empty = 0;
      for (size_t r = 0; r < nl; ++r) {
        if (std::isinf(lse_ref[r])) {
          ++empty_rows;
          bool ok = std::isinf(lse[r]) && lse[r] < 0;
          for (int64_t c = 0; c < sq.Dv; ++c) ok = ok && o[r * size_t(sq.Dv) + size_t(c)] == 0.f;
          bad_empty += !ok;
        } else {
          lse_vis_ref.push_back(lse_ref[r]), lse_vis.push_back(lse[r]);
        }
      }
      const double eo = err(o_ref, o), el = err(lse_vis_ref, lse_vis);
      std::printf("%s: o %.2e lse %.2e, %zu of %zu rows see nothing\n", title, eo, el, empty_rows, nl);
      EXPECT_EQ(bad_empty, 0u);
      EXPECT_LE(eo, 1e-2);
      EXPECT_LE(el, 1e-3);
    }
  }
}

TEST(AttentionBlockCuda, BlockAfterQueriesSeesNothing) {
  REQUIRE_GPU();
  const Seq sq(700, 3, 3, 192, 128, 31);
  for (const int64_t k0 : {int64_t(300), int64_t(301), int64_t(450)}) {  // queries [100, 300): keys all later
    const oc::BlockShape s = sq.block(100, 200, k0, 250);
    const size_t no = size_t(200 * 3 * 128), nl = size_t(200 * 3);
    Dev go(no * 2), glse(nl * 4);
    sq.run_block(s, go, glse);
    kc::synchronize();
    const Vec o = down_bf16(go, no), lse = down<float>(glse, nl);
    size_t bad_o = 0, bad_l = 0;
    for (float x : o) bad_o += x != 0.f;  // NaN (unwritten) counts as bad too
    for (float x : lse) bad_l += !(std::isinf(x) && x < 0);
    EXPECT_EQ(bad_o, 0u) << "k_pos0 " << k0;
    EXPECT_EQ(bad_l, 0u) << "k_pos0 " << k0;
  }
}

// −inf partials merge without NaN: empty + empty stays (0, −inf); empty + a real block is that block.
TEST(AttentionBlockCuda, MergeHandlesEmptyPartials) {
  REQUIRE_GPU();
  const Seq sq(600, 2, 2, 128, 128, 41);
  const int64_t q0 = 200, Tq = 150, H = 2, Dv = 128;
  const size_t no = size_t(Tq * H * Dv), nl = size_t(Tq * H);
  Dev gpart(no * 2), glpart(nl * 4), gacc(no * 4), glacc(nl * 4), go(no * 2);
  sq.run_block(sq.block(q0, Tq, 400, 100), gpart, glpart);  // nothing visible
  oc::attention_merge(Tq, H, Dv, gpart.p, glpart.f(), gacc.f(), glacc.f(), true);
  sq.run_block(sq.block(q0, Tq, 360, 40), gpart, glpart);  // nothing visible either
  oc::attention_merge(Tq, H, Dv, gpart.p, glpart.f(), gacc.f(), glacc.f(), false);
  oc::attention_merge_finish(Tq, H, Dv, gacc.f(), go.p);
  kc::synchronize();
  {
    const Vec o = down_bf16(go, no), l = down<float>(glacc, nl);
    size_t bad = 0;
    for (float x : o) bad += x != 0.f;
    for (float x : l) bad += !(std::isinf(x) && x < 0);
    EXPECT_EQ(bad, 0u) << "empty + empty";
  }
  // Row i (position 200 + i) sees keys [0, min(201 + i, 300)).
  const oc::BlockShape real = sq.block(q0, Tq, 0, 300);
  sq.run_block(real, gpart, glpart);
  oc::attention_merge(Tq, H, Dv, gpart.p, glpart.f(), gacc.f(), glacc.f(), false);
  sq.run_block(sq.block(q0, Tq, 500, 50), gpart, glpart);  // empty again, after the real one
  oc::attention_merge(Tq, H, Dv, gpart.p, glpart.f(), gacc.f(), glacc.f(), false);
  oc::attention_merge_finish(Tq, H, Dv, gacc.f(), go.p);
  kc::synchronize();
  Vec o_ref, lse_ref;
  block_reference(sq, real, o_ref, lse_ref);
  const double eo = err(o_ref, down_bf16(go, no)), el = err(lse_ref, down<float>(glacc, nl));
  std::printf("empty + empty + block + empty: o %.2e lse %.2e\n", eo, el);
  EXPECT_LE(eo, 1e-2);
  EXPECT_LE(el, 1e-3);
}

TEST(AttentionBlockCuda, RejectsBadShapes) {
  REQUIRE_GPU();
  Dev buf(1 << 20);  // valid, aligned pointers for every tensor: only the shape is wrong
  auto expect_error = [&](const oc::BlockShape& s, const std::string& needle) {
    try {
      oc::attention_forward_block(s, buf.p, buf.p, buf.p, buf.p, buf.f());
      ADD_FAILURE() << "no error for a shape that should fail (" << needle << ")";
    } catch (const lm::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  oc::BlockShape ok;
  ok.Tq = 4, ok.Tk = 4, ok.q_pos0 = 8, ok.k_pos0 = 8, ok.H = 2;
  oc::BlockShape s = ok;
  s.Tq = 0;
  expect_error(s, "Tq");
  s = ok, s.Tk = 0;
  expect_error(s, "Tk");
  s = ok, s.Dk = 64, s.Dv = 64;
  expect_error(s, "head dims");
  s = ok, s.Dk = 192, s.Dv = 192;
  expect_error(s, "head dims");
  s = ok, s.q_pos0 = -1;
  expect_error(s, "positions");
  s = ok, s.k_pos0 = -3;
  expect_error(s, "positions");
  s = ok, s.H = 3, s.Hkv = 2;
  expect_error(s, "heads");
  s = ok, s.k_pos0 = 100;  // keys after the queries: allowed (nothing visible)
  EXPECT_NO_THROW(oc::attention_forward_block(s, buf.p, buf.p, buf.p, buf.p, buf.f()));
  EXPECT_THROW(oc::attention_forward_block(ok, buf.p, buf.p, buf.p, buf.p, nullptr), lm::Error);  // lse required
  EXPECT_THROW(oc::attention_merge(4, 2, 6, buf.p, buf.f(), buf.f(), buf.f(), true), lm::Error);  // Dv % 4
  EXPECT_THROW(oc::attention_merge(-1, 2, 128, buf.p, buf.f(), buf.f(), buf.f(), true), lm::Error);
  EXPECT_THROW(oc::attention_merge_finish(4, 0, 128, buf.f(), buf.p), lm::Error);
  kc::synchronize();
}
