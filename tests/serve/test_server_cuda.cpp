// Serving on the GPU: the GPU engine (infer/engine.hpp, GpuEngine over GpuModel's slots) and the server over it.
// Sequences decoded in any subset and order (which moves them between slots) give the logits of each sequence
// decoded by itself; latent-pool reservations admit and refuse; concurrent requests through the server give the
// greedy text of the engine alone, and requests beyond the pool wait instead of failing. Skips without a GPU.
//
// Legend: M sequences the engine holds, G decode steps, V vocabulary.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "harness.hpp"
#include "images.hpp"
#include "infer/engine.hpp"
#include "infer/generate.hpp"
#include "io/chat.hpp"
#include "model/cuda/gpu_model.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::serve_test;

#define REQUIRE_GPU() \
  if (!lm::model::cuda::available()) GTEST_SKIP() << "no CUDA device"

namespace {

// Small, with K3's head dims (the GPU attention kernels': MLA 192/128 with R 512, Dr 64; KDA 128): KDA, MLA, KDA, MLA; sparse latent MoE after
// a dense first layer; AttnRes blocks of 2.
model::ModelConfig gpu_config(int64_t vocab) {
  const std::string s = R"({"model_type": "kimi_linear", "vocab_size": )" + std::to_string(vocab) + R"(,
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": true, "mla_use_output_gate": true,
    "linear_attn_config": {"num_heads": 2, "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": false,
       "gate_lower_bound": -5.0, "kda_layers": [1, 3], "full_attn_layers": [2, 4]},
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "intermediate_size": 512, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 8,
    "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 64,
    "routed_expert_hidden_size": 128, "moe_router_activation_func": "sigmoid", "moe_renormalize": true,
    "routed_scaling_factor": 1.0, "attn_res_block_size": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})";
  return model::ModelConfig::from_json(io::json::parse(s), "gpu serve test config");
}

// Random weights whose stop tokens never win (as in Harness), on the host and uploaded to a GPU model.
struct GpuModelFixture {
  model::Model<float> m;
  model::cuda::GpuModel g;
  GpuModelFixture() : m(gpu_config(tokenizer().vocab_size())), g(m.config(), model::cuda::GpuModel::Inference{}) {
    m.params().init(7);
    never_stop(m);
    g.upload(m.params());
  }
};

// The server over `e` on a free loopback port, running until destroyed.
struct Running {
  serve::Server server;
  int port;
  std::thread th;
  explicit Running(infer::Engine& e)
      : server(e, tokenizer(), [] {
          serve::ServerOptions o = opts();
          o.port = 0;
          return o;
        }()),
        port(server.bind()),
        th([this] { server.run(); }) {}
  ~Running() {
    server.stop();
    th.join();
  }
  httplib::Result complete(const json& req) const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);
    return c.Post("/v1/completions", req.dump(), "application/json");
  }
};

infer::GpuEngineOptions engine_options(int64_t M, int64_t context, int64_t chunk = 64, int64_t pool = 0) {
  infer::GpuEngineOptions o;
  o.max_sequences = M, o.context = context, o.prefill_chunk = chunk, o.pool_tokens = pool;
  return o;
}

std::vector<int32_t> tokens(int64_t n, int64_t V, uint64_t seed) {
  Rng r{seed, 3};
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>(r.bits(i).v[0] % V));
  return t;
}

}  // namespace

// Four sequences decoded G steps each, in random subsets and orders (the engine moves them into slots [0, S) for
// each step), against the same prompts and fed tokens decoded one sequence at a time by an engine of one slot: every
// step's logits within 1e-2 relative RMS (batched GEMM rows round differently), and the moves happened.
TEST(GpuEngine, AnySubsetInAnyOrderEqualsDecodingAlone) {
  REQUIRE_GPU();
  GpuModelFixture a, b;
  const int64_t V = a.m.config().vocab_size, M = 4, G = 24;
  infer::GpuEngine many(a.g, engine_options(M, 512)), one(b.g, engine_options(1, 512));
  // The warm-up captured the step of every batch size 1..M once, after sizing every buffer.
  const int64_t captured = a.g.decode_captures();
  EXPECT_EQ(captured, M);
  std::vector<std::vector<int32_t>> prompt, fed;
  for (int64_t i = 0; i < M; ++i) prompt.push_back(tokens(20 + 37 * i, V, 10 + uint64_t(i))), fed.push_back(tokens(G, V, 50 + uint64_t(i)));
  // The references: each sequence alone.
  std::vector<std::vector<std::vector<float>>> ref(M);
  for (int64_t i = 0; i < M; ++i) {
    const infer::Engine::Id id = one.open();
    one.prefill(id, prompt[size_t(i)]);
    for (int64_t k = 0; k < G; ++k) ref[size_t(i)].push_back(one.decode(std::span(&id, 1), std::span(&fed[size_t(i)][size_t(k)], 1)));
    one.close(id);
  }
  std::vector<infer::Engine::Id> ids;
  for (int64_t i = 0; i < M; ++i) ids.push_back(many.open()), many.prefill(ids.back(), prompt[size_t(i)]);
  std::vector<int64_t> step(size_t(M), 0);
  Rng r{99, 1};
  double worst = 0;
  int64_t off = 0, compared = 0;
  for (uint64_t round = 0; *std::min_element(step.begin(), step.end()) < G; ++round) {
    std::vector<int64_t> order;  // a random subset of the unfinished ones, in random order
    for (int64_t i = 0; i < M; ++i)
      if (step[size_t(i)] < G && r.bits(round * 16 + uint64_t(i)).v[0] % 3 != 0) order.push_back(i);
    if (order.empty()) continue;
    for (size_t j = order.size(); j > 1; --j) std::swap(order[j - 1], order[r.bits(round * 16 + 8 + j).v[1] % j]);
    std::vector<infer::Engine::Id> sel;
    std::vector<int32_t> t;
    for (int64_t i : order) sel.push_back(ids[size_t(i)]), t.push_back(fed[size_t(i)][size_t(step[size_t(i)])]);
    const std::vector<float> lg = many.decode(sel, t);
    for (size_t j = 0; j < order.size(); ++j) {
      const int64_t i = order[j];
      const std::vector<float> got(lg.begin() + int64_t(j) * V, lg.begin() + int64_t(j + 1) * V);
      const double e = lm::testing::rel_rms_vec(ref[size_t(i)][size_t(step[size_t(i)])], got);
      worst = std::max(worst, e);
      off += e > 1e-2;
      ++compared;
      ++step[size_t(i)];
    }
  }
  for (int64_t i = 0; i < M; ++i) EXPECT_EQ(many.pos(ids[size_t(i)]), int64_t(prompt[size_t(i)].size()) + G);
  std::printf("[ measure  ] %lld steps compared, %lld beyond 1e-2, worst %.2e; %lld slot moves, %lld decode graphs "
              "captured\n",
              static_cast<long long>(compared), static_cast<long long>(off), worst,
              static_cast<long long>(many.moves()), static_cast<long long>(a.g.decode_captures()));
  EXPECT_EQ(off, 0);
  EXPECT_GT(many.moves(), 0);
  // A bad call changes nothing: an unknown id, a sequence asked for twice, an empty one.
  const infer::Engine::Id empty = [&] {
    many.close(ids[0]);
    return many.open();
  }();
  const int32_t tok = 1;
  const std::vector<int32_t> two = {1, 2};
  const std::vector<infer::Engine::Id> twice = {ids[1], ids[1]};
  EXPECT_THROW(many.decode(std::vector<infer::Engine::Id>{12345}, std::span(&tok, 1)), Error);
  EXPECT_THROW(many.decode(twice, two), Error);
  EXPECT_THROW(many.decode(std::span(&empty, 1), std::span(&tok, 1)), Error);
  EXPECT_EQ(many.pos(ids[1]), int64_t(prompt[1].size()) + G);
}

// Each sequence holds its reservation of the latent pool (64-token blocks) until it closes: a pool of 4 blocks
// admits two sequences of up to 128 tokens, then nothing more until one closes; M caps the count; a reservation past
// the context or the whole pool can never fit.
TEST(GpuEngine, ReservationsOfTheLatentPoolAdmitAndRefuse) {
  REQUIRE_GPU();
  GpuModelFixture f;
  infer::GpuEngine e(f.g, engine_options(3, 200, 64, 256));
  EXPECT_EQ(e.pool_tokens(), 256);
  EXPECT_FALSE(e.can_ever_fit(201));  // past the context
  EXPECT_TRUE(e.can_ever_fit(200));
  const infer::Engine::Id x = e.open({}, 128);
  EXPECT_TRUE(e.fits(128));
  EXPECT_FALSE(e.fits(129));  // 3 blocks; 2 are free
  const infer::Engine::Id y = e.open({}, 100);
  EXPECT_FALSE(e.fits(1));
  EXPECT_THROW(e.open({}, 1), Error);
  e.close(x);
  EXPECT_TRUE(e.fits(128));
  const infer::Engine::Id z = e.open({}, 64);  // y's 2 blocks, z's 1, and one free
  EXPECT_TRUE(e.fits(64));
  const infer::Engine::Id w = e.open({}, 64);
  EXPECT_THROW(e.open({}, 64), Error);
  e.close(y), e.close(z), e.close(w);
  EXPECT_TRUE(e.fits(0));  // (0: the whole context, 4 blocks)
  // M caps the sequences whatever the pool holds (`e` is done with: `two` reserves the model's caches anew).
  infer::GpuEngine two(f.g, engine_options(2, 200, 64, 1024));
  two.open({}, 64), two.open({}, 64);
  EXPECT_FALSE(two.fits(64));
  EXPECT_THROW(two.open({}, 64), Error);
}

// Twelve concurrent greedy requests (streamed and not) through the server over a GPU engine of 8 sequences: each text
// equals the engine's own generation of that prompt alone (a batched step's rounding may flip a near-tie, so one in
// six may differ); the steps were batched and the sequences moved between slots.
TEST(GpuServer, ConcurrentRequestsGiveTheEnginesTextAlone) {
  REQUIRE_GPU();
  GpuModelFixture f;
  infer::GpuEngine e(f.g, engine_options(8, 512));
  const std::vector<std::string> prompts = {"alpha", "beta gamma", "river stone light", "cloud", "seven green alpha"};
  std::vector<std::string> expect;
  infer::SamplingParams sp;
  sp.temperature = 0, sp.max_tokens = 20;
  for (const auto& p : prompts) {
    infer::EngineSequence seq(e);
    std::vector<int32_t> ids;
    if (tokenizer().bos() >= 0) ids.push_back(tokenizer().bos());
    const auto t = tokenizer().encode_text(p);
    ids.insert(ids.end(), t.begin(), t.end());
    expect.push_back(as_json_text(infer::generate(seq, tokenizer(), ids, sp, [](const std::string&) {}).text()));
  }
  Running run(e);
  const int N = 12;
  std::vector<std::string> got(N);
  std::vector<int> status(N, 0);
  std::vector<std::thread> th;
  for (int i = 0; i < N; ++i)
    th.emplace_back([&, i] {
      auto r = run.complete({{"prompt", prompts[size_t(i) % prompts.size()]}, {"max_tokens", 20}, {"temperature", 0},
                             {"stream", i % 2 == 0}});
      if (!r) return;
      status[size_t(i)] = r->status;
      got[size_t(i)] = r->status != 200 ? r->body
                       : i % 2 == 0       ? sse_text(r->body, false)
                                          : json::parse(r->body)["choices"][0]["text"].get<std::string>();
    });
  for (auto& t : th) t.join();
  const serve::ServerStats st = run.server.stats();
  int same = 0;
  for (int i = 0; i < N; ++i) {
    EXPECT_EQ(status[size_t(i)], 200) << i << ": " << got[size_t(i)];
    same += got[size_t(i)] == expect[size_t(i) % prompts.size()];
  }
  std::printf("[ measure  ] %d of %d texts equal the engine's alone; largest batch %lld, %lld slot moves, %lld decode "
              "graphs captured\n", same, N, static_cast<long long>(st.max_batch_seen), static_cast<long long>(e.moves()),
              static_cast<long long>(f.g.decode_captures()));
  EXPECT_EQ(f.g.decode_captures(), 8);  // (the warm-up's, one per batch size)
  EXPECT_GE(same, N - N / 6);
  EXPECT_GT(st.max_batch_seen, 1);
}

// A pool of 8 blocks (512 tokens) and requests that reserve 2 blocks each (prompt + max_tokens <= 128): at most four
// run at once, the others wait in the queue and all twelve complete; one that needs more than the pool gets 400.
TEST(GpuServer, RequestsBeyondTheLatentPoolWaitTheirTurn) {
  REQUIRE_GPU();
  GpuModelFixture f;
  infer::GpuEngine e(f.g, engine_options(8, 1024, 64, 512));
  Running run(e);
  const int N = 12;
  std::vector<int> status(N, 0);
  std::vector<std::thread> th;
  for (int i = 0; i < N; ++i)
    th.emplace_back([&, i] {
      auto r = run.complete({{"prompt", "alpha beta"}, {"max_tokens", 100}});
      if (r) status[size_t(i)] = r->status;
    });
  for (auto& t : th) t.join();
  auto big = run.complete({{"prompt", "alpha"}, {"max_tokens", 900}});
  const serve::ServerStats st = run.server.stats();
  for (int i = 0; i < N; ++i) EXPECT_EQ(status[size_t(i)], 200) << i;
  EXPECT_LE(st.max_batch_seen, 4);
  EXPECT_GE(st.max_batch_seen, 2);
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 400) << big->body;
  EXPECT_NE(big->body.find("max_tokens"), std::string::npos) << big->body;
}

// ---- the GPU prefix cache ------------------------------------------------------------------------------
namespace {

// Bit for bit: the same floats (on a difference, how far apart they are).
::testing::AssertionResult same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "sizes " << a.size() << " and " << b.size() << ", relative RMS "
                                       << (a.size() == b.size() ? lm::testing::rel_rms_vec(a, b) : -1.0);
}

// A sequence opened on `prompt` (resumed from a stored prefix where the engine has one), prefilled as the server
// does (pieces ending on the grid) or in one call, then G greedy steps: the logits after the prompt and after each
// step. The sequence stays open when `keep` is given.
std::vector<std::vector<float>> greedy(infer::Engine& e, const std::vector<int32_t>& prompt, int64_t G,
                                       bool pieces = false, infer::Engine::Id* keep = nullptr) {
  const infer::Engine::Id id = e.open(prompt);
  const int64_t n = static_cast<int64_t>(prompt.size()), Cp = e.prefill_chunk();
  std::vector<std::vector<float>> out;
  std::vector<float> lg;
  for (int64_t p = e.pos(id); p < n; p = e.pos(id)) {
    const int64_t piece = pieces ? std::min(n - p, Cp - p % Cp) : n - p;
    lg = e.prefill(id, std::span(prompt).subspan(size_t(p), size_t(piece)), nullptr, p + piece == n / Cp * Cp || !pieces);
  }
  out.push_back(lg);
  for (int64_t k = 0; k < G; ++k) {
    const int32_t t = static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
    lg = e.decode(std::span(&id, 1), std::span(&t, 1));
    out.push_back(lg);
  }
  if (keep) *keep = id;
  else e.close(id);
  return out;
}

::testing::AssertionResult same_run(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " and " << b.size() << " steps";
  for (size_t k = 0; k < a.size(); ++k)
    if (auto r = same_bits(a[k], b[k]); !r) return r << " at step " << k;
  return ::testing::AssertionSuccess();
}

std::vector<int32_t> join(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

// A grid of 96 tokens (not a multiple of the 64-token latent blocks: a snapshot's last block is shared half full and
// copied on its first write) against an engine without the cache, bit for bit: a prompt that is an exact multiple of
// the grid (its repeat resumes one grid point early, leaving a token to prefill), the same prompt in pieces, a hit
// followed by divergence inside a block, three sequences opened together on one prefix and decoded as one batch, and
// every decode step after a resume (the states are copied as they lie, never transposed).
TEST(GpuPrefixCache, HitsResumeBitForBit) {
  REQUIRE_GPU();
  GpuModelFixture a, b;
  const int64_t V = a.m.config().vocab_size, Cp = 96, G = 12;
  infer::GpuEngineOptions o = engine_options(3, 1024, Cp);
  infer::GpuEngine ref(b.g, o);
  o.prefix_cache_bytes = int64_t(64) << 20;
  infer::GpuEngine e(a.g, o);
  ASSERT_TRUE(e.prefix_cache());
  EXPECT_FALSE(ref.prefix_cache());
  const std::vector<int32_t> x = tokens(3 * Cp, V, 1);  // 288: an exact multiple of the grid
  const auto want_x = greedy(ref, x, G);
  EXPECT_TRUE(same_run(greedy(e, x, G), want_x));     // a miss: stores 192 and 288
  EXPECT_EQ(e.prefix_stats().entries, 2);
  EXPECT_TRUE(same_run(greedy(e, x, G), want_x));     // a hit at 192
  EXPECT_TRUE(same_run(greedy(ref, x, G, true), want_x));  // pieces on the grid: the whole prompt's bits
  EXPECT_EQ(e.prefix_stats().hits, 1);
  EXPECT_EQ(e.prefix_stats().tokens_reused, 2 * Cp);
  // x continued: resumes at 288, where the block of 256..319 is half x's and shared: copied on the first write.
  const std::vector<int32_t> y = join(x, tokens(40, V, 2));
  EXPECT_TRUE(same_run(greedy(e, y, G), greedy(ref, y, G)));
  // Divergence at 250: resumes at 192 (the snapshot at 288 holds x's tokens, not w's).
  const std::vector<int32_t> w = join(std::vector<int32_t>(x.begin(), x.begin() + 250), tokens(70, V, 5));
  EXPECT_TRUE(same_run(greedy(e, w, G), greedy(ref, w, G)));
  EXPECT_EQ(e.prefix_stats().hits, 3);
  // Three at once on x's first 200 tokens: each resumes from 192, they share its blocks; one decode batch.
  std::vector<std::vector<int32_t>> z;
  for (uint64_t i = 0; i < 3; ++i)
    z.push_back(join(std::vector<int32_t>(x.begin(), x.begin() + 200), tokens(30 + 17 * int64_t(i), V, 3 + i)));
  auto together = [&](infer::Engine& en) {
    std::vector<infer::Engine::Id> ids;
    std::vector<std::vector<float>> out;
    std::vector<int32_t> next;
    for (const auto& p : z) {
      ids.push_back(en.open(p));
      const std::vector<float> lg = en.prefill(ids.back(), std::span(p).subspan(size_t(en.pos(ids.back()))));
      out.push_back(lg);
      next.push_back(static_cast<int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin()));
    }
    for (int64_t k = 0; k < G; ++k) {
      const std::vector<float>& lg = en.decode(ids, next);
      out.push_back(lg);
      for (size_t i = 0; i < ids.size(); ++i)
        next[i] = static_cast<int32_t>(std::max_element(lg.begin() + int64_t(i) * V, lg.begin() + int64_t(i + 1) * V) -
                                       (lg.begin() + int64_t(i) * V));
    }
    for (infer::Engine::Id id : ids) en.close(id);
    return out;
  };
  const int64_t hits = e.prefix_stats().hits;
  EXPECT_TRUE(same_run(together(e), together(ref)));
  EXPECT_EQ(e.prefix_stats().hits, hits + 3);
  // The first prompt again, after all that: its snapshots were not disturbed by the sequences that shared them.
  EXPECT_TRUE(same_run(greedy(e, x, G), want_x));
  // An empty sequence prefilled (as EngineSequence does) resumes too.
  {
    infer::EngineSequence seq(e);
    const std::vector<float> lg = seq.prefill(w);
    EXPECT_TRUE(same_bits(lg, greedy(ref, w, 0)[0]));
  }
  EXPECT_EQ(e.prefix_stats().hits, hits + 5);
}

// Eviction: a budget of two snapshots keeps the two most recent prefixes (the oldest gives way, and its prompt,
// a miss now, still gives the same bits); a latent pool of one context where a closed sequence's snapshot holds
// blocks that a new sequence needs: the snapshot is evicted and the new sequence runs to its limit.
TEST(GpuPrefixCache, EvictionUnderPressure) {
  REQUIRE_GPU();
  GpuModelFixture a, b;
  const int64_t V = a.m.config().vocab_size, Cp = 64, G = 4;
  infer::GpuEngineOptions o = engine_options(1, 512, Cp, 512);
  infer::GpuEngine ref(b.g, o);
  const int64_t per = static_cast<int64_t>(b.g.snapshot_bytes());
  ASSERT_GT(per, 0);
  o.prefix_cache_bytes = 2 * per;
  infer::GpuEngine e(a.g, o);
  EXPECT_EQ(a.g.snapshot_count(), 2);
  std::vector<std::vector<int32_t>> p;
  for (uint64_t i = 0; i < 3; ++i) p.push_back(tokens(100 + 10 * int64_t(i), V, 20 + i));  // one snapshot each (64)
  std::vector<std::vector<std::vector<float>>> want;
  for (const auto& q : p) want.push_back(greedy(ref, q, G));
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(same_run(greedy(e, p[i], G), want[i])) << i;
  EXPECT_EQ(e.prefix_stats().entries, 2);
  const int64_t misses = e.prefix_stats().misses;
  EXPECT_TRUE(same_run(greedy(e, p[0], G), want[0]));  // evicted: a miss (which stores it again)
  EXPECT_EQ(e.prefix_stats().misses, misses + 1);
  EXPECT_TRUE(same_run(greedy(e, p[2], G), want[2]));  // still there
  EXPECT_EQ(e.prefix_stats().misses, misses + 1);
  // The pool: a 450-token prompt stores its snapshot at 448 (7 of the 8 blocks, kept after the sequence closes); a
  // new prompt of 500 tokens then needs all 8: the snapshots give way.
  const std::vector<int32_t> big = tokens(450, V, 30), other = tokens(500, V, 31);
  EXPECT_TRUE(same_run(greedy(e, big, 2), greedy(ref, big, 2)));
  EXPECT_LE(a.g.free_cache_tokens(), 64);
  EXPECT_TRUE(e.fits(0));  // (reservations count open sequences only)
  EXPECT_TRUE(same_run(greedy(e, other, 8), greedy(ref, other, 8)));
  EXPECT_TRUE(same_run(greedy(e, big, 2), greedy(ref, big, 2)));  // big's snapshot is gone: a miss, same bits
}

// Images through the GPU server (issue 22 item 5 on the GPU): an image_url part reaches the multimodal GPU model as
// the GpuEngine's own prefill of the same image (the same greedy answer and prompt tokens), and a corrupt image is a
// 400 while the server keeps serving.
TEST(GpuServer, ImagePartsReachTheModelAsInTheEngine) {
  REQUIRE_GPU();
  const io::Tokenizer& tok = image_tokenizer();
  model::Model<float> m(multimodal_config(gpu_config(tok.vocab_size())));
  m.params().init(5);
  model::cuda::GpuModel g(m.config(), model::cuda::GpuModel::Inference{});
  g.upload(m.params());
  infer::GpuEngine e(g, engine_options(2, 512));
  serve::ServerOptions o = opts();
  o.port = 0;
  o.max_batch = 2;  // (the engine's sequences)
  o.vision = *m.config().vision;
  serve::Server server(e, tok, o);
  const int port = server.bind();
  std::thread th([&] { server.run(); });
  auto post = [&](const json& content, int* status) {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);
    auto r = c.Post("/v1/chat/completions",
                    json{{"messages", json::array({{{"role", "user"}, {"content", content}}})},
                         {"max_tokens", 8},
                         {"temperature", 0}}
                        .dump(),
                    "application/json");
    *status = r ? r->status : 0;
    return r ? json::parse(r->body, nullptr, false) : json();
  };
  const std::string a = png(60, 40, 3);  // 4 x 2 patches, 2 feature rows
  int st = 0;
  const json got = post(json::array({image_part("data:image/png;base64," + base64(a)),
                                     {{"type", "text"}, {"text", "river stone"}}}),
                        &st);
  int bad = 0;
  const json refused = post(json::array({image_part("data:image/png;base64," + base64(a.substr(0, 40)))}), &bad);
  server.stop();
  th.join();
  ASSERT_EQ(st, 200) << got.dump();
  EXPECT_EQ(bad, 400) << refused.dump();

  infer::EngineSequence seq(e);
  std::vector<int32_t> ids = io::chat_tokens(tok, {{"user", "river stone"}});
  const int32_t ph = infer::image_token(m.config(), tok);
  infer::place_images(ids, tok.special("<|user|>"), ph, 1);
  ids = infer::attach_images(seq, ids, ph, {infer::image_media(a, "a", *m.config().vision)});
  infer::SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 8;
  sp.stop_tokens = {tok.eos(), tok.special("<|end|>"), ph};
  const std::string want = infer::generate(seq, tok, ids, sp, [](const std::string&) {}).text();
  EXPECT_EQ(got["usage"]["prompt_tokens"], static_cast<int64_t>(ids.size()));
  EXPECT_EQ(got["choices"][0]["message"]["content"], as_json_text(want));
}
