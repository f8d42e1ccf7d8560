// OpenAI-compatible server (see server.hpp): request parsing and validation, the scheduler thread
// (admission + one batched decode step per iteration), SSE streaming, timeouts and shutdown.
#include "serve/server.hpp"

#include <httplib.h>
#include <malloc.h>
#include <sys/socket.h>
#include <netinet/in.h>

#include <chrono>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "io/json.hpp"

namespace lm::serve {

using json = io::json;
using Clock = std::chrono::steady_clock;

struct Request {
  uint64_t id = 0;
  bool chat = false, stream = false;
  std::vector<int32_t> prompt;
  infer::SamplingParams sp;
  Clock::time_point deadline;
  int64_t created = 0;
  std::atomic<bool> cancelled{false};
  // Handler side: released text and the end of the request, under mu.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> pieces;
  bool done = false;
  std::string finish_reason, error;
  int64_t completion_tokens = 0;
  // Scheduler side only.
  infer::Sequence seq;
  std::unique_ptr<infer::Generation> gen;
  int32_t next_token = -1;
};

namespace {

// A 400 with the offending field.
struct BadRequest {
  std::string message, param;
};

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json error_body(const std::string& message, const std::string& type, const std::string& param = "") {
  return json{{"error",
               {{"message", message}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", nullptr}}}};
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double get_number(const json& j, const char* key, double def, double lo, double hi, bool lo_open = false) {
  if (!j.contains(key) || j[key].is_null()) return def;
  const json& v = j[key];
  if (!v.is_number()) throw BadRequest{fmt::format("'{}' must be a number", key), key};
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || (lo_open && x == lo) || x > hi)
    throw BadRequest{fmt::format("'{}' = {} is out of range {}{}, {}]", key, x, lo_open ? "(" : "[", lo, hi), key};
  return x;
}

int64_t get_int(const json& j, const char* key, int64_t def, int64_t lo, int64_t hi) {
  if (!j.contains(key) || j[key].is_null()) return def;
  const json& v = j[key];
  if (!v.is_number_integer()) throw BadRequest{fmt::format("'{}' must be an integer", key), key};
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    throw BadRequest{fmt::format("'{}' is out of range [{}, {}]", key, lo, hi), key};
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) throw BadRequest{fmt::format("'{}' = {} is out of range [{}, {}]", key, x, lo, hi), key};
  return x;
}

}  // namespace

struct Server::Impl {
  infer::Session& session;
  const io::Tokenizer& tok;
  ServerOptions o;
  httplib::Server http;
  std::thread sched;
  std::mutex qmu;
  std::condition_variable qcv;
  std::deque<std::shared_ptr<Request>> queue;
  bool stopping = false;
  std::atomic<int64_t> open{0};  // streams not yet finished
  std::atomic<int64_t> n_active{0};
  std::mutex stop_mu;            // serialises stop()
  std::atomic<uint64_t> next_id{1};
  mutable std::mutex smu;
  ServerStats st;
  std::vector<std::shared_ptr<Request>> active;  // scheduler thread only
  std::vector<int32_t> chat_stops, completion_stops;

  Impl(infer::Session& s, const io::Tokenizer& t, ServerOptions opt) : session(s), tok(t), o(std::move(opt)) {
    LM_CHECK(t.vocab_size() <= s.vocab_size(), "server: tokenizer vocabulary {} exceeds the model's {}", t.vocab_size(),
             s.vocab_size());
    LM_CHECK(o.max_batch >= 1 && o.http_threads >= 2 && o.request_timeout_s > 0, "server: bad options");
    if (tok.eos() >= 0) completion_stops.push_back(tok.eos()), chat_stops.push_back(tok.eos());
    chat_stops.push_back(tok.special("<|end|>"));
  }

  void count(int64_t ServerStats::*f, int64_t n = 1) {
    std::lock_guard<std::mutex> lk(smu);
    st.*f += n;
  }

  // ---- parsing -----------------------------------------------------------------------------------------
  std::shared_ptr<Request> parse(const std::string& body, bool chat) {
    const json j = json::parse(body, nullptr, false);
    if (j.is_discarded()) throw BadRequest{"malformed JSON in the request body", ""};
    if (!j.is_object()) throw BadRequest{"the request body must be a JSON object", ""};
    auto r = std::make_shared<Request>();
    r->chat = chat;
    if (j.contains("model") && !j["model"].is_null()) {
      if (!j["model"].is_string()) throw BadRequest{"'model' must be a string", "model"};
      if (j["model"].get<std::string>() != o.model_name)
        throw BadRequest{fmt::format("model '{}' does not exist (this server has '{}')", j["model"].get<std::string>(),
                                     o.model_name),
                         "model"};
    }
    if (j.contains("stream") && !j["stream"].is_null() && !j["stream"].is_boolean())
      throw BadRequest{"'stream' must be a boolean", "stream"};
    r->stream = j.value("stream", false) == true;
    get_int(j, "n", 1, 1, 1);
    const int64_t ctx = session.max_context();
    auto& sp = r->sp;
    sp.max_tokens = get_int(j, "max_tokens", o.default_max_tokens, 1, ctx);
    sp.temperature = static_cast<float>(get_number(j, "temperature", 1.0, 0.0, 2.0));
    sp.top_p = static_cast<float>(get_number(j, "top_p", 1.0, 0.0, 1.0, true));
    sp.top_k = get_int(j, "top_k", 0, 0, session.vocab_size());
    sp.repetition_penalty = static_cast<float>(get_number(j, "repetition_penalty", 1.0, 0.0, 10.0, true));
    sp.seed = static_cast<uint64_t>(get_int(j, "seed", 0, 0, INT64_MAX));
    if (j.contains("stop") && !j["stop"].is_null()) {
      const json& s = j["stop"];
      if (s.is_string()) {
        sp.stop.push_back(s.get<std::string>());
      } else if (s.is_array()) {
        for (const auto& x : s) {
          if (!x.is_string()) throw BadRequest{"'stop' must be a string or an array of strings", "stop"};
          sp.stop.push_back(x.get<std::string>());
        }
      } else {
        throw BadRequest{"'stop' must be a string or an array of strings", "stop"};
      }
      if (sp.stop.size() > 4) throw BadRequest{"'stop' holds at most 4 strings", "stop"};
      for (const auto& x : sp.stop)
        if (x.empty()) throw BadRequest{"'stop' strings must not be empty", "stop"};
    }
    sp.stop_tokens = chat ? chat_stops : completion_stops;
    const char* what = chat ? "messages" : "prompt";
    try {
      if (chat) {
        if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty())
          throw BadRequest{"'messages' must be a non-empty array", "messages"};
        std::vector<infer::ChatMessage> msgs;
        for (const auto& m : j["messages"]) {
          if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
              !m["content"].is_string())
            throw BadRequest{"each message must be an object with string 'role' and 'content'", "messages"};
          const std::string role = m["role"].get<std::string>();
          if (role != "system" && role != "user" && role != "assistant")
            throw BadRequest{fmt::format("message role '{}' must be system, user or assistant", role), "messages"};
          msgs.push_back({role, m["content"].get<std::string>()});
        }
        r->prompt = infer::chat_tokens(tok, msgs, true);
      } else {
        if (!j.contains("prompt")) throw BadRequest{"'prompt' is required", "prompt"};
        const json& p = j["prompt"];
        if (tok.bos() >= 0) r->prompt.push_back(tok.bos());
        if (p.is_string()) {
          const auto ids = tok.encode(p.get<std::string>());
          r->prompt.insert(r->prompt.end(), ids.begin(), ids.end());
        } else if (p.is_array() && !p.empty() && p.size() <= static_cast<size_t>(ctx)) {
          for (const auto& x : p) {
            if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= tok.vocab_size())
              throw BadRequest{fmt::format("'prompt' token ids must be integers in [0, {})", tok.vocab_size()),
                               "prompt"};
            r->prompt.push_back(static_cast<int32_t>(x.get<int64_t>()));
          }
        } else {
          throw BadRequest{"'prompt' must be a string or a non-empty array of token ids", "prompt"};
        }
        if (r->prompt.empty()) throw BadRequest{"'prompt' is empty", "prompt"};
      }
    } catch (const Error& e) {
      throw BadRequest{e.what(), what};
    }
    if (static_cast<int64_t>(r->prompt.size()) >= ctx)
      throw BadRequest{fmt::format("the prompt has {} tokens; the context limit is {} (prompt plus at least one "
                                   "generated token)",
                                   r->prompt.size(), ctx),
                       what};
    r->id = next_id++;
    r->created = unix_now();
    r->deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(o.request_timeout_s));
    return r;
  }

  // ---- scheduler ---------------------------------------------------------------------------------------
  void push_text(Request& r, const std::string& text) {
    if (text.empty()) return;
    std::lock_guard<std::mutex> lk(r.mu);
    r.pieces.push_back(text);
    r.cv.notify_all();
  }

  // `reason` by value: callers pass the Generation's own finish_reason, and the Generation is freed here.
  void finish(Request& r, std::string reason, const std::string& error = "") {
    std::string tail;
    if (r.gen) tail = r.gen->finish(reason);
    {
      std::lock_guard<std::mutex> lk(r.mu);
      if (r.done) return;
      if (!tail.empty()) r.pieces.push_back(tail);
      r.done = true;
      r.finish_reason = r.gen && r.gen->done() ? r.gen->finish_reason() : reason;
      r.error = error;
      r.completion_tokens = r.gen ? static_cast<int64_t>(r.gen->generated().size()) : 0;
      // Counted before the handler can see `done`: a client holding its answer finds it in the stats.
      if (reason == "timeout") count(&ServerStats::timeouts);
      else if (reason == "cancelled") count(&ServerStats::cancelled);
      count(&ServerStats::completed);
      r.cv.notify_all();
    }
    r.seq = infer::Sequence{};  // release the caches now, not when the last handler lets go
    r.gen.reset();
  }

  // Feeds logits to the request's generation; returns true while it goes on.
  bool step(Request& r, const float* logits) {
    const infer::Generation::Step s = r.gen->next(logits, session.vocab_size());
    push_text(r, s.text);
    if (s.done) {
      finish(r, r.gen->finish_reason());
      return false;
    }
    r.next_token = s.token;
    if (r.seq.pos() >= session.max_context()) {
      finish(r, "length");
      return false;
    }
    return true;
  }

  bool expired(Request& r, Clock::time_point now) {
    if (r.cancelled.load()) {
      finish(r, "cancelled");
      return true;
    }
    if (now > r.deadline) {
      finish(r, "timeout");
      return true;
    }
    return false;
  }

  void loop() {
    while (true) {
      std::vector<std::shared_ptr<Request>> admit;
      {
        std::unique_lock<std::mutex> lk(qmu);
        if (!stopping && active.empty() && queue.empty()) qcv.wait_for(lk, std::chrono::milliseconds(100));
        if (stopping) break;
        const auto now = Clock::now();
        for (auto it = queue.begin(); it != queue.end();)
          if (expired(**it, now)) it = queue.erase(it);
          else ++it;
        while (!queue.empty() && static_cast<int64_t>(active.size() + admit.size()) < o.max_batch) {
          admit.push_back(std::move(queue.front()));
          queue.pop_front();
        }
      }
      for (auto& r : admit) {
        if (expired(*r, Clock::now())) continue;
        try {
          r->seq = session.new_sequence();
          const std::vector<float> logits = session.prefill(r->seq, r->prompt);
          count(&ServerStats::prompt_tokens, static_cast<int64_t>(r->prompt.size()));
          r->gen = std::make_unique<infer::Generation>(&tok, r->sp, r->prompt, r->id);
          if (step(*r, logits.data())) active.push_back(r);
        } catch (const std::exception& e) {
          finish(*r, "error", e.what());
        }
      }
      const auto now = Clock::now();
      std::erase_if(active, [&](const std::shared_ptr<Request>& r) { return expired(*r, now); });
      n_active = static_cast<int64_t>(active.size());
      if (active.empty()) continue;
      std::vector<infer::Sequence*> seqs;
      std::vector<int32_t> toks;
      for (auto& r : active) seqs.push_back(&r->seq), toks.push_back(r->next_token);
      try {
        const std::vector<float> logits = session.decode(seqs, toks);
        {
          std::lock_guard<std::mutex> lk(smu);
          ++st.decode_steps;
          st.decode_tokens += static_cast<int64_t>(seqs.size());
          st.max_batch_seen = std::max<int64_t>(st.max_batch_seen, static_cast<int64_t>(seqs.size()));
        }
        std::vector<std::shared_ptr<Request>> keep;
        for (size_t i = 0; i < active.size(); ++i)
          if (step(*active[i], logits.data() + i * static_cast<size_t>(session.vocab_size())))
            keep.push_back(active[i]);
        active.swap(keep);
      } catch (const std::exception& e) {
        for (auto& r : active) finish(*r, "error", e.what());
        active.clear();
      }
    }
    // Shutdown: end everything that is running or waiting.
    for (auto& r : active) finish(*r, "shutdown");
    active.clear();
    std::lock_guard<std::mutex> lk(qmu);
    for (auto& r : queue) finish(*r, "shutdown");
    queue.clear();
  }

  // ---- responses ---------------------------------------------------------------------------------------
  json usage(const Request& r) const {
    const auto p = static_cast<int64_t>(r.prompt.size());
    return json{{"prompt_tokens", p}, {"completion_tokens", r.completion_tokens},
                {"total_tokens", p + r.completion_tokens}};
  }
  std::string rid(const Request& r) const { return (r.chat ? "chatcmpl-" : "cmpl-") + std::to_string(r.id); }

  json chunk(const Request& r, const std::string& text, const json& finish, bool role = false) const {
    json choice = {{"index", 0}, {"finish_reason", finish}};
    if (r.chat) {
      json delta = json::object();
      if (role) delta["role"] = "assistant";
      if (!text.empty() || role) delta["content"] = text;
      choice["delta"] = delta;
    } else {
      choice["text"] = text;
      choice["logprobs"] = nullptr;
    }
    return json{{"id", rid(r)},
                {"object", r.chat ? "chat.completion.chunk" : "text_completion"},
                {"created", r.created},
                {"model", o.model_name},
                {"choices", json::array({choice})}};
  }

  void respond_error(httplib::Response& res, int status, const std::string& msg, const std::string& type,
                     const std::string& param = "") {
    res.status = status;
    res.set_content(dump(error_body(msg, type, param)), "application/json");
  }

  void handle(const httplib::Request& req, httplib::Response& res, bool chat) {
    count(&ServerStats::requests);
    std::shared_ptr<Request> r;
    try {
      r = parse(req.body, chat);
    } catch (const BadRequest& e) {
      count(&ServerStats::bad_requests);
      return respond_error(res, 400, e.message, "invalid_request_error", e.param);
    }
    {
      std::lock_guard<std::mutex> lk(qmu);
      if (stopping) return respond_error(res, 503, "the server is shutting down", "server_error");
      queue.push_back(r);
    }
    qcv.notify_all();
    if (!r->stream) {
      std::unique_lock<std::mutex> lk(r->mu);
      r->cv.wait(lk, [&] { return r->done; });
      std::string text;
      for (auto& p : r->pieces) text += p;
      if (!r->error.empty()) return respond_error(res, 500, r->error, "server_error");
      if (r->finish_reason == "timeout")
        return respond_error(res, 504, fmt::format("the request did not finish within {} s", o.request_timeout_s),
                             "timeout");
      if (r->finish_reason == "shutdown") return respond_error(res, 503, "the server is shutting down", "server_error");
      json choice = {{"index", 0}, {"finish_reason", r->finish_reason}};
      if (chat) choice["message"] = {{"role", "assistant"}, {"content", text}};
      else choice["text"] = text, choice["logprobs"] = nullptr;
      const json body = {{"id", rid(*r)},
                         {"object", chat ? "chat.completion" : "text_completion"},
                         {"created", r->created},
                         {"model", o.model_name},
                         {"choices", json::array({choice})},
                         {"usage", usage(*r)}};
      res.set_content(dump(body), "application/json");
      return;
    }
    // SSE: one `data:` event per released piece, a final event with the finish reason, then [DONE].
    ++open;
    res.set_header("Cache-Control", "no-cache");
    auto first = std::make_shared<bool>(true);
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, r, first](size_t, httplib::DataSink& sink) {
          std::deque<std::string> pieces;
          bool done;
          {
            std::unique_lock<std::mutex> lk(r->mu);
            r->cv.wait_for(lk, std::chrono::milliseconds(200), [&] { return !r->pieces.empty() || r->done; });
            pieces.swap(r->pieces);
            done = r->done;
          }
          std::string out;
          if (*first && r->chat) out += "data: " + dump(chunk(*r, "", nullptr, true)) + "\n\n";
          *first = false;
          for (auto& p : pieces) out += "data: " + dump(chunk(*r, p, nullptr)) + "\n\n";
          if (done) {
            json last = chunk(*r, "", r->finish_reason);
            last["usage"] = usage(*r);
            if (!r->error.empty()) last["error"] = error_body(r->error, "server_error")["error"];
            out += "data: " + dump(last) + "\n\ndata: [DONE]\n\n";
          }
          if (!out.empty() && !sink.write(out.data(), out.size())) {
            r->cancelled = true;
            return false;
          }
          if (done) sink.done();
          else if (!sink.is_writable()) {
            r->cancelled = true;
            return false;
          }
          return true;
        },
        [this, r](bool ok) {
          if (!ok) r->cancelled = true;
          --open;
        });
  }
};

Server::Server(infer::Session& session, const io::Tokenizer& tok, ServerOptions o)
    : impl_(std::make_unique<Impl>(session, tok, std::move(o))) {
  Impl& I = *impl_;
  auto& h = I.http;
  const int threads = I.o.http_threads;
  h.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  h.set_payload_max_length(static_cast<size_t>(I.o.max_body_bytes));
  h.set_read_timeout(30, 0);
  h.set_write_timeout(30, 0);
  h.set_keep_alive_max_count(1000);
  h.Get("/health", [&I](const httplib::Request&, httplib::Response& res) {
    const ServerStats s = [&] {
      std::lock_guard<std::mutex> lk(I.smu);
      ServerStats c = I.st;
      c.active = I.n_active.load();
      return c;
    }();
    const auto mi = mallinfo2();  // heap bytes in use: tells a leak (growing) from fragmentation (flat)
    res.set_content(dump(json{{"status", "ok"}, {"model", I.o.model_name}, {"requests", s.requests},
                              {"completed", s.completed}, {"active", s.active},
                              {"heap_in_use_bytes", mi.uordblks + mi.hblkhd}}),
                    "application/json");
  });
  h.Get("/v1/models", [&I](const httplib::Request&, httplib::Response& res) {
    const json m = {{"id", I.o.model_name}, {"object", "model"}, {"created", 0}, {"owned_by", "longmoe"},
                    {"context_length", I.session.max_context()}};
    res.set_content(dump(json{{"object", "list"}, {"data", json::array({m})}}), "application/json");
  });
  h.Post("/v1/completions", [&I](const httplib::Request& q, httplib::Response& r) { I.handle(q, r, false); });
  h.Post("/v1/chat/completions", [&I](const httplib::Request& q, httplib::Response& r) { I.handle(q, r, true); });
  h.set_error_handler([&I](const httplib::Request& q, httplib::Response& res) {
    if (res.status == 404)
      I.respond_error(res, 404, fmt::format("no route {} {}", q.method, q.path), "invalid_request_error");
    else if (res.body.empty())
      I.respond_error(res, res.status, fmt::format("HTTP {}", res.status), "invalid_request_error");
  });
  h.set_exception_handler([&I](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    I.respond_error(res, 500, what, "server_error");
  });
}

Server::~Server() { stop(); }

namespace {
// cpp-httplib listens with a backlog of 5 (a compile-time constant of the packaged library); a burst of
// clients then overflows the accept queue and connections get reset. Calling listen() again on the bound
// socket raises the backlog: find it as the listening socket bound to our port.
void raise_backlog(int port) {
  for (int fd = 3; fd < 4096; ++fd) {
    int acc = 0;
    socklen_t len = sizeof(acc);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &len) != 0 || !acc) continue;
    sockaddr_storage ss{};
    socklen_t sl = sizeof(ss);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl) != 0) continue;
    int p = -1;
    if (ss.ss_family == AF_INET) p = ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    else if (ss.ss_family == AF_INET6) p = ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
    if (p == port) ::listen(fd, SOMAXCONN);
  }
}
}  // namespace

int Server::bind() {
  Impl& I = *impl_;
  if (I.o.port == 0) {
    const int p = I.http.bind_to_any_port(I.o.host.c_str());
    LM_CHECK(p > 0, "server: cannot bind {}:<any>", I.o.host);
    I.o.port = p;
  } else {
    LM_CHECK(I.http.bind_to_port(I.o.host.c_str(), I.o.port), "server: cannot bind {}:{}", I.o.host, I.o.port);
  }
  raise_backlog(I.o.port);
  return I.o.port;
}

void Server::run() {
  Impl& I = *impl_;
  running_ = true;
  I.sched = std::thread([&I] { I.loop(); });
  I.http.listen_after_bind();
  running_ = false;
  stop();
}

void Server::stop() {
  Impl& I = *impl_;
  std::lock_guard<std::mutex> stop_lock(I.stop_mu);
  {
    std::lock_guard<std::mutex> lk(I.qmu);
    I.stopping = true;
  }
  I.qcv.notify_all();
  if (I.sched.joinable()) I.sched.join();  // every request has ended
  // Let the streams flush their last events before the listener closes.
  for (int i = 0; i < 100 && I.open.load() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  I.http.stop();
}

ServerStats Server::stats() const {
  std::lock_guard<std::mutex> lk(impl_->smu);
  ServerStats s = impl_->st;
  s.active = impl_->n_active.load();
  return s;
}

}  // namespace lm::serve
