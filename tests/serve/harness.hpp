#pragma once
// Shared by the server tests: a tiny trained tokenizer, a tiny model, a server on an ephemeral loopback
// port, SSE parsing, and a raw TCP client for what httplib's client will not send (slow heads, bodies
// that are never finished, odd headers, hang-ups).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "infer/generate.hpp"
#include "io/json.hpp"
#include "serve/server.hpp"

namespace lm::serve_test {

using json = io::json;
using Clock = std::chrono::steady_clock;

inline std::string corpus_text(int i) {
  static const char* w[] = {"alpha", "beta", "gamma", "delta", "river", "stone", "light", "cloud", "seven", "green"};
  std::string s;
  for (int k = 0; k < 200; ++k) s += std::string(w[(k * 7 + i) % 10]) + (k % 9 == 8 ? ".\n" : " ");
  return s;
}

inline const io::Tokenizer& tokenizer() {
  static std::shared_ptr<io::Tokenizer> tok = [] {
    const auto dir = std::filesystem::temp_directory_path() / ("longmoe_serve_test_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir);
    std::vector<std::string> texts;
    for (int i = 0; i < 40; ++i) texts.push_back(corpus_text(i));
    io::Tokenizer::TrainOptions o;
    o.vocab_size = 320;
    auto t = std::make_shared<io::Tokenizer>(io::Tokenizer::train(texts, (dir / "tok.model").string(), o));
    std::filesystem::remove_all(dir);
    return t;
  }();
  return *tok;
}

inline model::ModelConfig small_config(int64_t vocab) {
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

// Random weights would stop at <|end|> / </s> whenever they like; make those logits 0 and every other one large, so
// generations run to max_tokens (timeouts and shutdown need long requests).
inline void never_stop(model::Model<float>& m) {
  auto& head = m.params().at("lm_head.weight");
  const int64_t d = m.config().hidden_size;
  for (int64_t v = 0; v < m.config().vocab_size; ++v) {
    const bool stop = v == tokenizer().eos() || v == tokenizer().special("<|end|>");
    for (int64_t c = 0; c < d; ++c) head.w()[v * d + c] *= stop ? 0.0f : 50.0f;
  }
}

inline serve::ServerOptions opts() {
  serve::ServerOptions o;
  o.model_name = "tiny";
  o.max_batch = 8;
  o.request_timeout_s = 60;
  o.http_threads = 48;
  return o;
}

// A running server on a free port, with its own model and session.
struct Harness {
  model::Model<float> m;
  infer::Session s;
  serve::Server server;
  int port;
  std::thread th;
  explicit Harness(serve::ServerOptions o, int64_t context = 256, int64_t prefill_chunk = 64)
      : m(small_config(tokenizer().vocab_size())),
        s(m, infer::SessionOptions{prefill_chunk, context, int64_t(16) << 20}),
        server(s, tokenizer(), (o.port = 0, o)),
        port(0) {
    m.params().init(7);
    never_stop(m);
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
    c.set_tcp_nodelay(true);  // the head and the body go out at once (no Nagle wait for an ACK)
    return c;
  }
  httplib::Result post(const std::string& path, const std::string& body) {
    return client().Post(path.c_str(), body, "application/json");
  }
  json health() {
    auto r = client().Get("/health");
    return r && r->status == 200 ? json::parse(r->body) : json();
  }
};

// The `data:` payloads of an SSE body, in order; checks the framing.
inline std::vector<std::string> sse_events(const std::string& body) {
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

// Concatenated text of a streamed response; checks the final event and [DONE]. `detail`: finish_detail.
inline std::string sse_text(const std::string& body, bool chat, std::string* finish = nullptr,
                            std::string* detail = nullptr) {
  const auto ev = sse_events(body);
  EXPECT_GE(ev.size(), 2u);
  if (ev.size() < 2) return {};
  EXPECT_EQ(ev.back(), "[DONE]");
  std::string text;
  bool finished = false;
  for (size_t i = 0; i + 1 < ev.size(); ++i) {
    const json j = json::parse(ev[i]);
    EXPECT_EQ(j["object"], chat ? "chat.completion.chunk" : "text_completion");
    if (j["choices"].empty()) {  // the include_usage event
      EXPECT_TRUE(j.contains("usage"));
      continue;
    }
    const json& c = j["choices"][0];
    if (chat) {
      if (c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
    } else {
      text += c["text"].get<std::string>();
    }
    if (!c["finish_reason"].is_null()) {
      EXPECT_FALSE(finished) << "two final events";
      finished = true;
      const std::string f = c["finish_reason"];
      EXPECT_TRUE(f == "stop" || f == "length") << f;
      if (finish) *finish = f;
      if (detail) *detail = c.value("finish_detail", "");
    }
  }
  EXPECT_TRUE(finished);
  return text;
}

// JSON carries text as UTF-8: a random model's invalid bytes arrive as U+FFFD.
inline std::string as_json_text(const std::string& s) {
  return json::parse(json(s).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
}

// What the engine generates for `prompt` without the server (greedy), as JSON text.
inline std::string direct_completion(Harness& h, const std::string& prompt, int64_t max_tokens,
                                     int64_t context = 256) {
  const auto& tok = tokenizer();
  std::vector<int32_t> ids = {tok.bos()};
  const auto e = tok.encode(prompt);
  ids.insert(ids.end(), e.begin(), e.end());
  infer::SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = max_tokens;
  sp.stop_tokens = {tok.eos()};
  infer::Session s(h.m, infer::SessionOptions{64, context, 0});
  infer::Sequence seq = s.new_sequence();
  return as_json_text(infer::generate(s, seq, tok, ids, sp, [](const std::string&) {}).text());
}

// A raw TCP connection to the server on 127.0.0.1.
struct Raw {
  int fd = -1;
  explicit Raw(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ~Raw() { close(); }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;
  bool ok() const { return fd >= 0; }
  bool send(const std::string& s) {
    size_t done = 0;
    while (done < s.size()) {
      const ssize_t n = ::send(fd, s.data() + done, s.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  // Everything until the server closes or `timeout_s` passes; `closed` tells which.
  std::string read_all(double timeout_s, bool* closed = nullptr) {
    std::string out;
    const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    if (closed) *closed = false;
    char buf[65536];
    while (Clock::now() < until) {
      pollfd p{fd, POLLIN, 0};
      const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count());
      if (::poll(&p, 1, std::max(1, left)) <= 0) continue;
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) {
        if (closed) *closed = true;
        break;
      }
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }
  // The first response's status line code ("HTTP/1.1 413 ..." -> 413), 0 if none.
  static int status_of(const std::string& resp) {
    if (resp.rfind("HTTP/1.", 0) != 0 || resp.size() < 12) return 0;
    return std::atoi(resp.c_str() + 9);
  }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

// A full HTTP/1.1 request with the given extra headers ("Name: value\r\n" each) and body.
inline std::string http_request(const std::string& method, const std::string& path, const std::string& headers,
                                const std::string& body = "") {
  std::string s = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers;
  if (!body.empty() || method == "POST") s += "Content-Length: " + std::to_string(body.size()) + "\r\n";
  return s + "Connection: close\r\n\r\n" + body;
}

}  // namespace lm::serve_test
