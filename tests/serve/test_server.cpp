// The HTTP server in-process on an ephemeral loopback port: health and models, completions and chat
// completions (plain and SSE), every 400 case, concurrent clients batched together and answered exactly
// like sequential ones, timeouts, and shutdown with requests in flight; OpenAI compatibility (issue 24:
// max_completion_tokens, content parts, the developer role, logprobs, echo, /v1/models/{id}, 404
// model_not_found, standard finish reasons, 400 naming unsupported fields, tiny top_p /
// repetition_penalty). Limits, the door and the SDK test are in the other files of this folder.
#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <thread>

#include "infer/generate.hpp"
#include "io/json.hpp"
#include "serve/server.hpp"
#include "tests/serve/harness.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::serve_test;

TEST(Server, HealthAndModels) {
  Harness h(opts());
  auto c = h.client();
  auto r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  const json hj = json::parse(r->body);
  EXPECT_EQ(hj["status"], "ok");
  // Resident memory (not only the heap figure): what a flood would grow.
  EXPECT_GT(hj["resident_bytes"].get<int64_t>(), int64_t(1) << 20);
  EXPECT_GE(hj["peak_resident_bytes"].get<int64_t>(), hj["resident_bytes"].get<int64_t>());
  EXPECT_EQ(hj["inflight_bytes"], 0);
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
  std::string finish, detail;
  sse_text(r->body, false, &finish, &detail);
  EXPECT_EQ(finish, "length");  // a standard finish_reason; what cut it short is in finish_detail
  EXPECT_EQ(detail, "timeout");
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
  std::string finish, detail;
  sse_text(body, false, &finish, &detail);
  EXPECT_EQ(finish, "length");
  EXPECT_EQ(detail, "shutdown");
  EXPECT_FALSE(h->server.running() && false);
  h.reset();  // run() returned: the destructor joins it
}

// ---- OpenAI compatibility (issue 24) -------------------------------------------------------------------

namespace {
json post_json(Harness& h, const std::string& path, const json& body, int* status = nullptr) {
  auto r = h.post(path, body.dump());
  if (!r) return json();
  if (status) *status = r->status;
  return json::parse(r->body, nullptr, false);
}
json user(const std::string& text) { return json::array({{{"role", "user"}, {"content", text}}}); }
}  // namespace

TEST(OpenAI, ModelByIdAndUnknownModelIs404) {
  Harness h(opts());
  auto c = h.client();
  auto r = c.Get("/v1/models/tiny");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body)["id"], "tiny");
  EXPECT_EQ(json::parse(r->body)["object"], "model");
  r = c.Get("/v1/models/gpt-9");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "model_not_found");
  int st = 0;
  const json e = post_json(h, "/v1/completions", {{"prompt", "x"}, {"model", "gpt-9"}}, &st);
  EXPECT_EQ(st, 404);
  EXPECT_EQ(e["error"]["code"], "model_not_found");
  EXPECT_EQ(e["error"]["param"], "model");
  const json ec = post_json(h, "/v1/chat/completions", {{"messages", user("hi")}, {"model", "gpt-9"}}, &st);
  EXPECT_EQ(st, 404);
  EXPECT_EQ(ec["error"]["code"], "model_not_found");
}

TEST(OpenAI, MaxCompletionTokens) {
  Harness h(opts());
  int st = 0;
  json j = post_json(h, "/v1/chat/completions",
                     {{"messages", user("river")}, {"max_completion_tokens", 5}, {"temperature", 0}}, &st);
  ASSERT_EQ(st, 200) << j;
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  j = post_json(h, "/v1/completions", {{"prompt", "river"}, {"max_completion_tokens", 3}}, &st);
  ASSERT_EQ(st, 200) << j;
  EXPECT_EQ(j["usage"]["completion_tokens"], 3);
  j = post_json(h, "/v1/chat/completions",
                {{"messages", user("river")}, {"max_completion_tokens", 5}, {"max_tokens", 6}}, &st);
  EXPECT_EQ(st, 400);
  EXPECT_EQ(j["error"]["param"], "max_completion_tokens");
}

TEST(OpenAI, ContentPartsAndTheDeveloperRole) {
  Harness h(opts());
  const json parts = json::array({{{"type", "text"}, {"text", "river"}}, {{"type", "text"}, {"text", "stone"}}});
  int sa = 0, sb = 0;
  const json a = post_json(h, "/v1/chat/completions",
                           {{"messages", json::array({{{"role", "developer"}, {"content", "be brief"}},
                                                      {{"role", "user"}, {"content", parts}}})},
                            {"max_tokens", 6},
                            {"temperature", 0}},
                           &sa);
  const json b = post_json(h, "/v1/chat/completions",
                           {{"messages", json::array({{{"role", "system"}, {"content", "be brief"}},
                                                      {{"role", "user"}, {"content", "river\nstone"}}})},
                            {"max_tokens", 6},
                            {"temperature", 0}},
                           &sb);
  ASSERT_EQ(sa, 200) << a;
  ASSERT_EQ(sb, 200) << b;
  EXPECT_EQ(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
  EXPECT_EQ(a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]);
  // Image parts wait for vision: a 400 that names the part.
  const json img = json::array({{{"type", "text"}, {"text", "what is this"}},
                                {{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64,AAAA"}}}}});
  const json e = post_json(h, "/v1/chat/completions",
                           {{"messages", json::array({{{"role", "user"}, {"content", img}}})}}, &sa);
  EXPECT_EQ(sa, 400);
  EXPECT_EQ(e["error"]["param"], "messages[0].content[1].type");
  EXPECT_NE(e["error"]["message"].get<std::string>().find("image"), std::string::npos);
}

TEST(OpenAI, UnsupportedFieldsGet400NamingThem) {
  Harness h(opts());
  const json tool = {{"type", "function"}, {"function", {{"name", "f"}, {"parameters", json::object()}}}};
  const std::vector<std::pair<json, std::string>> bad = {
      {{{"messages", user("hi")}, {"tools", json::array({tool})}}, "tools"},
      {{{"messages", user("hi")}, {"tool_choice", "auto"}}, "tool_choice"},
      {{{"messages", user("hi")}, {"frobnicate", 1}}, "frobnicate"},
      {{{"messages", user("hi")}, {"presence_penalty", 0.5}}, "presence_penalty"},
      {{{"messages", user("hi")}, {"response_format", {{"type", "json_object"}}}}, "response_format"},
      {{{"messages", user("hi")}, {"logit_bias", {{"5", 10}}}}, "logit_bias"},
      {{{"messages", user("hi")}, {"top_logprobs", 2}}, "top_logprobs"},
      {{{"messages", user("hi")}, {"echo", true}}, "echo"},
      {{{"messages", json::array({{{"role", "tool"}, {"content", "42"}, {"tool_call_id", "x"}}})}},
       "messages[0].role"},
      {{{"messages", json::array({{{"role", "user"}, {"content", "hi"}, {"name", "bob"}}})}}, "messages[0].name"},
      {{{"messages", user("hi")}, {"stream_options", {{"include_usage", true}}}}, "stream_options"},
      {{{"messages", user("hi")}, {"repetition_penalty", 1e-300}}, "repetition_penalty"},
  };
  for (const auto& [body, param] : bad) {
    int st = 0;
    const json e = post_json(h, "/v1/chat/completions", body, &st);
    EXPECT_EQ(st, 400) << body;
    EXPECT_EQ(e["error"]["param"], param) << body << " -> " << e;
  }
  int st = 0;
  const json cbad = post_json(h, "/v1/completions", {{"prompt", "x"}, {"suffix", "y"}}, &st);
  EXPECT_EQ(st, 400);
  EXPECT_EQ(cbad["error"]["param"], "suffix");
  // Neutral values of those fields are fine.
  const json ok = post_json(h, "/v1/chat/completions",
                            {{"messages", user("hi")},
                             {"max_tokens", 2},
                             {"presence_penalty", 0},
                             {"frequency_penalty", 0},
                             {"logit_bias", json::object()},
                             {"response_format", {{"type", "text"}}},
                             {"tool_choice", "none"},
                             {"user", "someone"}},
                            &st);
  EXPECT_EQ(st, 200) << ok;
}

TEST(OpenAI, TinyTopPAndTemperatureAreHandled) {
  Harness h(opts());
  int st = 0;
  const json greedy = post_json(h, "/v1/completions", {{"prompt", "alpha beta"}, {"max_tokens", 6}, {"temperature", 0}},
                                &st);
  ASSERT_EQ(st, 200) << greedy;
  // top_p 1e-300 keeps only the most likely token: greedy's text, whatever the seed.
  const json tiny = post_json(
      h, "/v1/completions", {{"prompt", "alpha beta"}, {"max_tokens", 6}, {"top_p", 1e-300}, {"seed", 3}}, &st);
  ASSERT_EQ(st, 200) << tiny;
  EXPECT_EQ(tiny["choices"][0]["text"], greedy["choices"][0]["text"]);
  const json cold = post_json(h, "/v1/completions", {{"prompt", "alpha beta"}, {"max_tokens", 6}, {"temperature", 1e-300}},
                              &st);
  ASSERT_EQ(st, 200) << cold;
  EXPECT_EQ(cold["choices"][0]["text"], greedy["choices"][0]["text"]);
  const json rp = post_json(h, "/v1/completions", {{"prompt", "x"}, {"repetition_penalty", 1e-300}}, &st);
  EXPECT_EQ(st, 400);
  EXPECT_EQ(rp["error"]["param"], "repetition_penalty");
}

TEST(OpenAI, LogprobsOfTheSampledDistribution) {
  Harness h(opts());
  int st = 0;
  // Chat, greedy: one entry per generated token, its alternatives sorted, the chosen token first.
  const json j = post_json(h, "/v1/chat/completions",
                           {{"messages", user("river stone")},
                            {"max_tokens", 6},
                            {"temperature", 0},
                            {"logprobs", true},
                            {"top_logprobs", 3}},
                           &st);
  ASSERT_EQ(st, 200) << j;
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 6u) << j;
  std::string bytes;
  for (const auto& t : content) {
    ASSERT_EQ(t["top_logprobs"].size(), 3u);
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    EXPECT_EQ(t["top_logprobs"][0]["token"], t["token"]);  // greedy picks the most likely
    EXPECT_DOUBLE_EQ(t["top_logprobs"][0]["logprob"].get<double>(), t["logprob"].get<double>());
    EXPECT_GE(t["top_logprobs"][0]["logprob"].get<double>(), t["top_logprobs"][1]["logprob"].get<double>());
    for (const auto& b : t["bytes"]) bytes += static_cast<char>(b.get<int>());
  }
  // The text leaves out a partial UTF-8 character at the very end (TextStream::finish); the tokens' bytes hold it.
  EXPECT_EQ(as_json_text(bytes.substr(0, infer::utf8_complete_prefix(bytes))),
            j["choices"][0]["message"]["content"].get<std::string>());
  // Completions, sampled: the drawn token's log-probability is finite and no larger than the best one.
  const json c = post_json(h, "/v1/completions",
                           {{"prompt", "alpha"}, {"max_tokens", 5}, {"temperature", 0.9}, {"seed", 11}, {"logprobs", 2}},
                           &st);
  ASSERT_EQ(st, 200) << c;
  const json& lp = c["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 5u);
  ASSERT_EQ(lp["token_logprobs"].size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const double v = lp["token_logprobs"][i].get<double>();
    EXPECT_LE(v, 0.0);
    EXPECT_GT(v, -1000.0);
    EXPECT_LE(lp["top_logprobs"][i].size(), 2u);
    if (i > 0) {
      EXPECT_GE(lp["text_offset"][i].get<int64_t>(), lp["text_offset"][i - 1].get<int64_t>());
    }
  }
  // Streamed: the entries arrive with the chunks, one per token in all.
  auto r = h.post("/v1/chat/completions", json{{"messages", user("river")},
                                               {"max_tokens", 7},
                                               {"temperature", 0},
                                               {"stream", true},
                                               {"logprobs", true}}
                                              .dump());
  ASSERT_TRUE(r);
  size_t n = 0;
  for (const auto& e : sse_events(r->body)) {
    if (e == "[DONE]") continue;
    const json ev = json::parse(e);
    if (!ev["choices"].empty() && ev["choices"][0]["logprobs"].is_object())
      n += ev["choices"][0]["logprobs"]["content"].size();
  }
  EXPECT_EQ(n, 7u);
}

TEST(OpenAI, EchoAndIncludeUsage) {
  Harness h(opts());
  int st = 0;
  const json plain = post_json(h, "/v1/completions", {{"prompt", "alpha beta"}, {"max_tokens", 4}, {"temperature", 0}},
                               &st);
  const json echo = post_json(
      h, "/v1/completions", {{"prompt", "alpha beta"}, {"max_tokens", 4}, {"temperature", 0}, {"echo", true}}, &st);
  ASSERT_EQ(st, 200) << echo;
  EXPECT_EQ(echo["choices"][0]["text"].get<std::string>(), "alpha beta" + plain["choices"][0]["text"].get<std::string>());
  auto r = h.post("/v1/completions", json{{"prompt", "alpha beta"},
                                          {"max_tokens", 4},
                                          {"temperature", 0},
                                          {"echo", true},
                                          {"stream", true},
                                          {"stream_options", {{"include_usage", true}}}}
                                         .dump());
  ASSERT_TRUE(r);
  EXPECT_EQ(sse_text(r->body, false), echo["choices"][0]["text"].get<std::string>());
  const auto ev = sse_events(r->body);
  ASSERT_GE(ev.size(), 3u);
  const json u = json::parse(ev[ev.size() - 2]);
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["completion_tokens"], 4);
}
