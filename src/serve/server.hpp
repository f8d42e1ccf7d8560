#pragma once
// OpenAI-compatible HTTP server over one infer::Engine (the CPU Session or the GPU model; cpp-httplib):
//   GET  /health                 {"status": "ok", memory, request counts, the engine and its time in decode
//                                steps and prefill chunks}                     (open without the API key)
//   GET  /v1/models              the one served model
//   GET  /v1/models/{id}         that model, or 404 model_not_found
//   POST /v1/completions         {"prompt": "...", ...}             (optionally SSE-streamed)
//   POST /v1/chat/completions    {"messages": [{role, content}], ...} (optionally SSE-streamed)
//   OPTIONS *                    CORS preflight (when --cors allows the origin)
// Request fields: model (must name the served model: else 404 model_not_found), max_tokens or
// max_completion_tokens, temperature, top_p, top_k, repetition_penalty, seed, stop (string or array),
// stream, stream_options.include_usage, n (1), user (written to the access log); chat: messages with roles
// system, developer (= system), user, assistant and content as a string or an array of text parts (joined
// with "\n"), logprobs + top_logprobs; completions: prompt (a string, one string in an array, or token ids),
// logprobs (0..20 alternatives), echo. Neutral values of presence/frequency_penalty, logit_bias,
// response_format, tool_choice, best_of, suffix, store, ... are accepted; anything else (tools, image
// parts, an unknown field) gets 400 naming the field instead of being ignored.
// Errors: {"error": {"message", "type", "param", "code"}} with 400 (invalid), 401 (API key), 403 (Host or
// Origin refused), 404 (route or model), 405, 408 (request did not arrive in time), 411 (POST without a
// length), 413 (body too large), 415 (not application/json), 503 + Retry-After (memory budget or
// connections exhausted, shutting down), 504 (non-streaming request past its timeout).
// finish_reason is "stop" or "length"; a request cut short by its timeout, a shutdown or an error reports
// "length" (streams) and says which in "finish_detail".
// Log-probabilities are of the distribution each token was drawn from (see infer/sampler.hpp).
//
// Plain text only: user, system and assistant text and completion prompts are tokenized by
// Tokenizer::encode_text, so "<|end|>" in them is seven characters, never the control token. (A prompt
// given as token ids may hold any id.)
//
// Bounded requests: a body larger than max_body_bytes gets 413 whatever its transfer encoding (the body is
// read through a counting receiver, chunked included; compressed bodies are refused with 415); the head
// (request line and headers) is limited to 64 KiB; a prompt is checked against the context from its size
// (bytes / longest piece) and then tokenized incrementally, stopping once it exceeds the context; bodies
// being read and requests being parsed or served hold a share of max_inflight_bytes, and a request that
// does not fit gets 503 with Retry-After.
// No starvation: each connection has its own thread (created on demand) up to http_threads; at that cap a
// new connection closes the one that has waited longest for its request (idle keep-alive or still sending
// its head), else it gets 503. A request's head and body must arrive within header_timeout_s in all (not
// per line). A client that disconnects cancels its request (streaming or not), as does the request timeout.
// The scheduler prefills long prompts in rounds bounded in time (prefill_slice_s): each round's pieces are whole
// chunks (Engine::prefill_chunk, on the engine's absolute grid, so on the CPU the result is bit for bit that of one
// prefill call), as many as the prompt's measured speed fits in the slice, at least one. New requests' first
// chunks run before the round's decode step, continued prompts after it, shortest remaining first (with ageing;
// one passed over twice goes first); while sequences decode, a prompt past its first chunk gets at most half of
// the time. A new request thus waits at most for the slice or chunk in flight (`serve` uses 8-token chunks on the
// CPU, 2048 on the GPU).
// Admission: a request reserves the cache for its prompt plus max_tokens (Engine::open); on the GPU, whose
// latent pool is fixed, requests wait in the queue, first come first served, until the pool can hold them,
// and one that could never fit gets 400 at once.
// A closed door by default: with an API key (ServerOptions::api_key; `serve --api-key` or LONGMOE_API_KEY)
// every route but /health needs "Authorization: Bearer <key>" (compared in constant time); on a loopback
// bind the Host header must be localhost, 127.0.0.1 or [::1] (any port) or one of allowed_hosts (DNS
// rebinding); a request with an Origin header is refused unless cors_origins allows that origin (then it
// gets Access-Control-Allow-Origin, and OPTIONS answers preflights); POST bodies must be application/json;
// the port must be free (no SO_REUSEPORT sharing); an optional access log writes one JSON line per request.
//
// Concurrency: HTTP handler threads parse and validate, then hand the request to one scheduler thread, the
// only one that calls the engine. Each scheduler iteration admits waiting requests (up to max_batch sequences
// prefilling or decoding), runs a prefill round and one decode step over every decoding sequence
// (continuous batching). Text flows back through a per-request event queue; a streaming handler turns
// events into SSE `data: {...}` lines and ends with `data: [DONE]`.
// stop() (e.g. on SIGTERM): new requests get 503, running ones end (finish_detail "shutdown"), their
// handlers flush, then the listener closes and run() returns.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "infer/generate.hpp"
#include "infer/session.hpp"
#include "io/tokenizer.hpp"

namespace lm::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                 // 0: an ephemeral port (bind() returns it); must lie in [0, 65535]
  std::string model_name = "longmoe";
  int64_t max_batch = 32;          // sequences prefilling or decoding together
  double request_timeout_s = 600;  // whole request, queueing included
  int http_threads = 256;          // connections served at once, one thread each (created on demand)
  int64_t default_max_tokens = 128;
  int64_t max_body_bytes = int64_t(8) << 20;
  int64_t max_inflight_bytes = int64_t(512) << 20;  // bodies, parsing and prompts of all requests together
  double header_timeout_s = 10;    // a request's line, headers and body must arrive within this, in all
  double keep_alive_s = 5;         // an idle keep-alive connection closes after this
  double prefill_slice_s = 0.003;  // prefill work per scheduler round (whole grid units; at least one)
  // The scheduler thread, which does the engine's work (and the OpenMP team it starts, which inherits it), runs this
  // much nicer than the HTTP threads, in [0, 19]: on a busy CPU a request's hand-over then need not wait for a time
  // slice behind a prefill. `serve` sets 10 on the CPU, 0 on the GPU (whose scheduler thread feeds the device).
  int compute_nice = 0;
  std::string api_key;             // non-empty: required as "Authorization: Bearer <key>" (not for /health)
  std::vector<std::string> cors_origins;   // browser origins allowed ("*": any); empty: none
  std::vector<std::string> allowed_hosts;  // Host names accepted besides the loopback names
  std::string access_log;          // file to append one JSON line per request to; empty: none
  // The model's tower (a multimodal model on an engine that takes images): chat user messages may then hold
  // image_url parts with base64 data URLs, decoded within `image_limits`. Unset: image parts are refused.
  std::optional<model::VisionConfig> vision;
  infer::ImageLimits image_limits;
  void validate() const;           // throws lm::Error naming the bad option
};

struct ServerStats {
  int64_t requests = 0, bad_requests = 0, completed = 0, timeouts = 0, cancelled = 0, active = 0, queued = 0;
  int64_t prefilling = 0, prefill_chunks = 0;
  int64_t prefill_tokens = 0;  // prompt tokens prefilled, over all pieces (prompt_tokens counts prompts that ended)
  int64_t preemptions = 0;   // times new requests ran between two sublayers of another prompt's prefill piece
  int64_t decode_steps = 0, decode_tokens = 0, prompt_tokens = 0, max_batch_seen = 0;
  int64_t rejected = 0;      // 401 / 403 / 405 / 413 / 415 at the door
  int64_t busy = 0;          // 503: memory budget or connections
  int64_t evicted = 0;       // connections closed to make room
  int64_t connections = 0;   // open now
  int64_t inflight_bytes = 0;
  double decode_s = 0, prefill_s = 0;  // seconds in the engine's decode steps and prefill chunks
  infer::PrefixStats prefix;           // the engine's prefix cache after the last prefill
};

// Resident and peak resident memory of this process in bytes (/proc/self/statm, /proc/self/status).
int64_t resident_bytes();
int64_t peak_resident_bytes();

struct Request;  // one generation request, shared by its handler and the scheduler

class Server {
 public:
  Server(infer::Engine& engine, const io::Tokenizer& tok, ServerOptions o);  // the engine outlives the server
  Server(infer::Session& session, const io::Tokenizer& tok, ServerOptions o);  // over a CpuEngine of the session
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int bind();  // binds the listening socket; returns the port. Throws when the port is taken or invalid.
  void run();  // serves until stop(); starts the scheduler thread (call bind() first)
  void stop();  // thread-safe, idempotent
  bool running() const { return running_.load(); }
  ServerStats stats() const;

  struct Impl;

 private:
  Server(std::unique_ptr<infer::Engine> own, infer::Engine* engine, const io::Tokenizer& tok, ServerOptions o);
  std::unique_ptr<Impl> impl_;
  std::atomic<bool> running_{false};
};

}  // namespace lm::serve
