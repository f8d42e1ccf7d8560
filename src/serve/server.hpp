#pragma once
// OpenAI-compatible HTTP server over one infer::Session (cpp-httplib):
//   GET  /health                 {"status": "ok", ...}
//   GET  /v1/models              the one served model
//   POST /v1/completions         {"prompt": "...", ...}             (optionally SSE-streamed)
//   POST /v1/chat/completions    {"messages": [{role, content}], ...} (optionally SSE-streamed)
// Sampling fields: max_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop (string or array),
// stream, n (must be 1), model (must name the served model when given).
// Invalid requests get HTTP 400 and {"error": {"message", "type": "invalid_request_error", "param", "code"}}:
// malformed JSON, wrong types, unknown fields' values out of range, an unknown model, a prompt at or over the
// context limit. Unknown routes get 404 in the same shape.
//
// Concurrency: HTTP handler threads parse and validate, then hand the request to one scheduler thread
// that owns the Session. Each scheduler iteration admits waiting requests (prefill, up to max_batch
// active sequences) and runs one decode step over every active sequence together (continuous batching).
// Text flows back through a per-request event queue; a streaming handler turns events into SSE
// `data: {...}` lines and ends with `data: [DONE]`. A request past its timeout ends with finish_reason
// "timeout" (non-streaming: HTTP 504). A client that disconnects cancels its request.
// stop() (e.g. on SIGTERM): new requests get 503, running ones end with finish_reason "shutdown", their
// handlers flush, then the listener closes and run() returns.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "infer/generate.hpp"
#include "infer/session.hpp"
#include "io/tokenizer.hpp"

namespace lm::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                 // 0: an ephemeral port (bind() returns it)
  std::string model_name = "longmoe";
  int64_t max_batch = 32;          // sequences decoded together
  double request_timeout_s = 600;  // whole request, queueing included
  int http_threads = 96;           // concurrent connections served
  int64_t default_max_tokens = 128;
  int64_t max_body_bytes = int64_t(8) << 20;
};

struct ServerStats {
  int64_t requests = 0, bad_requests = 0, completed = 0, timeouts = 0, cancelled = 0, active = 0, queued = 0;
  int64_t decode_steps = 0, decode_tokens = 0, prompt_tokens = 0, max_batch_seen = 0;
};

struct Request;  // one generation request, shared by its handler and the scheduler

class Server {
 public:
  Server(infer::Session& session, const io::Tokenizer& tok, ServerOptions o);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int bind();  // binds the listening socket; returns the port
  void run();  // serves until stop(); starts the scheduler thread (call bind() first)
  void stop();  // thread-safe, idempotent
  bool running() const { return running_.load(); }
  ServerStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> running_{false};
};

}  // namespace lm::serve
