// Serving on the GPU: the GPU engine (infer/engine.hpp, GpuEngine over GpuModel's slots) and the server over it.
// Sequences decoded in any subset and order (which moves them between slots) give the logits of each sequence
// decoded by itself; latent-pool reservations admit and refuse; concurrent requests through the server give the
// greedy text of the engine alone, and requests beyond the pool wait instead of failing. Skips without a GPU.
//
// Legend: M sequences the engine holds, G decode steps, V vocabulary.
#include <algorithm>
#include <cstdio>
#include <map>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "harness.hpp"
#include "infer/engine.hpp"
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
