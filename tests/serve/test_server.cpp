// The HTTP server in-process on an ephemeral loopback port: health and models, completions and chat
// completions (plain and SSE), every 400 case, concurrent clients batched together and answered exactly
// like sequential ones, timeouts, and shutdown with requests in flight.
#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <thread>

#include "infer/generate.hpp"
#include "io/json.hpp"
#include "serve/server.hpp"
#include "testing.hpp"

using namespace lm;
using json = io::json;

namespace {

std::shared_ptr<io::Tokenizer> g_tok;

std::string corpus_text(int i) {
  static const char* w[] = {"alpha", "beta", "gamma", "delta", "river", "stone", "light", "cloud", "seven", "green"};
  std::string s;
  for (int k = 0; k < 200; ++k) s += std::string(w[(k * 7 + i) % 10]) + (k % 9 == 8 ? ".\n" : " ");
  return s;
}

const io::Tokenizer& tokenizer() {
  if (!g_tok) {
    const auto dir = std::filesystem::temp_directory_path() / ("longmoe_serve_test_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir);
    std::vector<std::string> texts;
    for (int i = 0; i < 40; ++i) texts.push_back(corpus_text(i));
    io::Tokenizer::TrainOptions o;
    o.vocab_size = 320;
    g_tok = std::make_shared<io::Tokenizer>(io::Tokenizer::train(texts, (dir / "tok.model").string(), o));
  }
  return *g_tok;
}

model::ModelConfig small_config(int64_t vocab) {
  const std::string s = R"({"model_type": "kimi_linear", "vocab_size": )" + std::to_string(vocab) + R"(,
    "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
    "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "mla_use_nope": true, "mla_use_output_gate": true,
    "linear_attn_config": {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "use_full_rank_gate": true,
       "gate_lower_bound": -5.0, "kda_layers": [1, 2], "full_attn_layers": [3]},
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "intermediate_size": 40, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 4,
    "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 16,
    "routed_expert_hidden_size": 24, "moe_router_activation_func": "sigmoid", "moe_renormalize": true,
    "routed_scaling_factor": 1.0, "num_expert_group": 1, "topk_group": 1, "attn_res_block_size": 2,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": false})";
  return model::ModelConfig::from_json(io::json::parse(s), "serve test config");
}

// A running server on a free port, with its own model and session.
struct Harness {
  model::Model<float> m;
  infer::Session s;
  serve::Server server;
  int port;
  std::thread th;
  Harness(serve::ServerOptions o, int64_t context = 256)
      : m(small_config(tokenizer().vocab_size())),
        s(m, infer::SessionOptions{64, context, int64_t(16) << 20}),
        server(s, tokenizer(), (o.port = 0, o)),
        port(0) {
    m.params().init(7);
    // Random weights would stop at <|end|> / </s> whenever they like; make those logits 0 and every other
    // one large, so generations run to max_tokens (timeouts and shutdown need long requests).
    auto& head = m.params().at("lm_head.weight");
    const int64_t d = m.config().hidden_size;
    for (int64_t v = 0; v < m.config().vocab_size; ++v) {
      const bool stop = v == tokenizer().eos() || v == tokenizer().special("<|end|>");
      for (int64_t c = 0; c < d; ++c) head.w()[v * d + c] *= stop ? 0.0f : 50.0f;
    }
    port = server.bind();
    th = std::thread([this] { server.run(); });
  }
  ~Harness() {
    server.stop();
    th.join();
  }
  httplib::Client client() {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);
    return c;
  }
  httplib::Result post(const std::string& path, const std::string& body) {
    return client().Post(path.c_str(), body, "application/json");
  }
};

serve::ServerOptions opts() {
  serve::ServerOptions o;
  o.model_name = "tiny";
  o.max_batch = 8;
  o.request_timeout_s = 60;
  o.http_threads = 48;
  return o;
}

// The `data:` payloads of an SSE body, in order; checks the framing.
std::vector<std::string> sse_events(const std::string& body) {
  std::vector<std::string> ev;
  size_t at = 0;
  while (at < body.size()) {
    const size_t end = body.find("\n\n", at);
    EXPECT_NE(end, std::string::npos) << "unterminated event";
    if (end == std::string::npos) break;
    const std::string e = body.substr(at, end - at);
    EXPECT_EQ(e.rfind("data: ", 0), 0u) << e;
    ev.push_back(e.substr(6));
    at = end + 2;
  }
  return ev;
}

// Concatenated text of a streamed response; checks the final event and [DONE].
std::string sse_text(const std::string& body, bool chat, std::string* finish = nullptr) {
  const auto ev = sse_events(body);
  EXPECT_GE(ev.size(), 2u);
  if (ev.size() < 2) return {};
  EXPECT_EQ(ev.back(), "[DONE]");
  std::string text;
  for (size_t i = 0; i + 1 < ev.size(); ++i) {
    const json j = json::parse(ev[i]);
    EXPECT_EQ(j["object"], chat ? "chat.completion.chunk" : "text_completion");
    const json& c = j["choices"][0];
    if (chat) {
      if (c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
    } else {
      text += c["text"].get<std::string>();
    }
    if (i + 2 == ev.size()) {
      EXPECT_FALSE(c["finish_reason"].is_null());
      if (finish) *finish = c["finish_reason"].get<std::string>();
    } else {
      EXPECT_TRUE(c["finish_reason"].is_null());
    }
  }
  return text;
}

// JSON carries text as UTF-8: a random model's invalid bytes arrive as U+FFFD.
std::string as_json_text(const std::string& s) {
  return json::parse(json(s).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
}

// What the engine generates for `prompt` without the server (greedy), as JSON text.
std::string direct_completion(Harness& h, const std::string& prompt, int64_t max_tokens) {
  const auto& tok = tokenizer();
  std::vector<int32_t> ids = {tok.bos()};
  const auto e = tok.encode(prompt);
  ids.insert(ids.end(), e.begin(), e.end());
  infer::SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = max_tokens;
  sp.stop_tokens = {tok.eos()};
  infer::Session s(h.m, infer::SessionOptions{64, 256, 0});
  infer::Sequence seq = s.new_sequence();
  return as_json_text(infer::generate(s, seq, tok, ids, sp, [](const std::string&) {}).text());
}

}  // namespace

TEST(Server, HealthAndModels) {
  Harness h(opts());
  auto c = h.client();
  auto r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body)["status"], "ok");
  r = c.Get("/v1/models");
  ASSERT_TRUE(r);
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "list");
  EXPECT_EQ(j["data"][0]["id"], "tiny");
  r = c.Get("/nope");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_TRUE(json::parse(r->body).contains("error"));
}

TEST(Server, CompletionsMatchTheEngine) {
  Harness h(opts());
  const std::string prompt = "alpha beta gamma";
  const std::string expect = direct_completion(h, prompt, 12);
  auto r = h.post("/v1/completions",
                  json{{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0}}.dump());
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], expect);
  EXPECT_EQ(j["usage"]["completion_tokens"].get<int64_t>() + j["usage"]["prompt_tokens"].get<int64_t>(),
            j["usage"]["total_tokens"].get<int64_t>());
  // The same request streamed gives the same text, framed as SSE.
  r = h.post("/v1/completions",
             json{{"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0}, {"stream", true}}.dump());
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  std::string finish;
  EXPECT_EQ(sse_text(r->body, false, &finish), expect);
  EXPECT_TRUE(finish == "length" || finish == "stop");
  // Seeded sampling is reproducible through the server.
  const std::string body =
      json{{"prompt", prompt}, {"max_tokens", 10}, {"temperature", 0.9}, {"top_p", 0.9}, {"seed", 5}}.dump();
  auto a = h.post("/v1/completions", body), b = h.post("/v1/completions", body);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(json::parse(a->body)["choices"][0]["text"], json::parse(b->body)["choices"][0]["text"]);
}

TEST(Server, ChatCompletions) {
  Harness h(opts());
  const json req = {{"model", "tiny"},
                    {"messages", json::array({{{"role", "system"}, {"content", "be brief"}},
                                              {{"role", "user"}, {"content", "river stone"}}})},
                    {"max_tokens", 8},
                    {"temperature", 0}};
  auto r = h.post("/v1/chat/completions", req.dump());
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  const std::string text = j["choices"][0]["message"]["content"];
  json sreq = req;
  sreq["stream"] = true;
  r = h.post("/v1/chat/completions", sreq.dump());
  ASSERT_TRUE(r);
  const auto ev = sse_events(r->body);
  ASSERT_GE(ev.size(), 3u);
  EXPECT_EQ(json::parse(ev[0])["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(sse_text(r->body, true), text);
}

TEST(Server, InvalidRequestsGet400AndTheServerKeepsServing) {
  Harness h(opts(), 64);
  const std::string long_prompt(2000, 'a');
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"/v1/completions", "{not json"},
      {"/v1/completions", "[1, 2]"},
      {"/v1/completions", R"({"prompt": 5})"},
      {"/v1/completions", R"({"max_tokens": 4})"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": "many"})"},
      {"/v1/completions", R"({"prompt": "x", "temperature": "hot"})"},
      {"/v1/completions", R"({"prompt": "x", "stream": "yes"})"},
      {"/v1/completions", R"({"prompt": "x", "stop": 3})"},
      {"/v1/completions", R"({"prompt": "x", "model": "gpt-9"})"},
      {"/v1/completions", R"({"prompt": "x", "model": 1})"},
      {"/v1/completions", json{{"prompt", long_prompt}}.dump()},
      {"/v1/completions", R"({"prompt": "x", "temperature": 5})"},
      {"/v1/completions", R"({"prompt": "x", "top_p": 0})"},
      {"/v1/completions", R"({"prompt": "x", "top_k": -1})"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 0})"},
      {"/v1/completions", R"({"prompt": "x", "max_tokens": 100000})"},
      {"/v1/completions", R"({"prompt": "x", "repetition_penalty": 0})"},
      {"/v1/completions", R"({"prompt": "x", "n": 2})"},
      {"/v1/completions", R"({"prompt": "x", "seed": -1})"},
      {"/v1/completions", R"({"prompt": [1, 99999]})"},
      {"/v1/chat/completions", R"({"messages": []})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "wizard", "content": "hi"}]})"},
      {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": 7}]})"},
      {"/v1/chat/completions", R"({"messages": "hello"})"},
  };
  for (const auto& [path, body] : bad) {
    auto r = h.post(path, body);
    ASSERT_TRUE(r) << body;
    EXPECT_EQ(r->status, 400) << body << " -> " << r->body;
    const json j = json::parse(r->body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r->body;
    EXPECT_EQ(j["error"]["type"], "invalid_request_error") << r->body;
    EXPECT_TRUE(j["error"]["message"].is_string());
  }
  auto r = h.post("/v1/completions", R"({"prompt": "alpha", "max_tokens": 3})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(h.server.stats().bad_requests, static_cast<int64_t>(bad.size()));
}

TEST(Server, ConcurrentClientsAreBatchedAndExact) {
  Harness h(opts());
  const std::vector<std::string> prompts = {"alpha", "beta gamma", "river stone light", "cloud", "seven green alpha"};
  std::vector<std::string> expect;
  for (const auto& p : prompts) expect.push_back(direct_completion(h, p, 20));
  const int N = 12;
  std::vector<std::string> got(N);
  std::vector<int> status(N, 0);
  std::vector<std::thread> th;
  for (int i = 0; i < N; ++i)
    th.emplace_back([&, i] {
      const json req = {{"prompt", prompts[i % prompts.size()]}, {"max_tokens", 20}, {"temperature", 0},
                        {"stream", i % 2 == 0}};
      auto r = h.post("/v1/completions", req.dump());
      if (!r) return;
      status[i] = r->status;
      got[i] = i % 2 == 0 ? sse_text(r->body, false) : json::parse(r->body)["choices"][0]["text"].get<std::string>();
    });
  for (auto& t : th) t.join();
  for (int i = 0; i < N; ++i) {
    EXPECT_EQ(status[i], 200) << i;
    EXPECT_EQ(got[i], expect[i % prompts.size()]) << i;
  }
  EXPECT_GT(h.server.stats().max_batch_seen, 1);
}

TEST(Server, TimeoutEndsTheRequest) {
  serve::ServerOptions o = opts();
  o.request_timeout_s = 0.05;
  Harness h(o, 4096);
  auto r = h.post("/v1/completions", R"({"prompt": "alpha", "max_tokens": 4000, "temperature": 0})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 504) << r->body;
  r = h.post("/v1/completions", R"({"prompt": "alpha", "max_tokens": 4000, "stream": true})");
  ASSERT_TRUE(r);
  std::string finish;
  sse_text(r->body, false, &finish);
  EXPECT_EQ(finish, "timeout");
  EXPECT_GE(h.server.stats().timeouts, 2);
}

TEST(Server, ShutdownWithRequestsInFlight) {
  auto h = std::make_unique<Harness>(opts(), 8192);
  std::string body;
  std::thread client([&] {
    auto r = h->post("/v1/completions", R"({"prompt": "alpha", "max_tokens": 8000, "stream": true})");
    if (r) body = r->body;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  h->server.stop();
  client.join();
  std::string finish;
  sse_text(body, false, &finish);
  EXPECT_EQ(finish, "shutdown");
  EXPECT_FALSE(h->server.running() && false);
  h.reset();  // run() returned: the destructor joins it
}
