// OpenAI-compatible server (see server.hpp): the connection layer (one thread per connection, whole-request
// deadlines, a connection cap), the door (Host, Origin, API key, content type, body limits), request parsing
// and validation, the scheduler thread (admission, chunked prefill, one batched decode step per iteration),
// SSE streaming, timeouts, disconnects and shutdown.
#include "serve/server.hpp"

#include <arpa/inet.h>
#include <httplib.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <list>
#include <span>
#include <sstream>
#include <vector>

#include "core/error.hpp"
#include "io/data_url.hpp"
#include "io/json.hpp"

namespace lm::serve {

using json = io::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kMaxHeadBytes = int64_t(64) << 10;  // request line + headers
constexpr int kPollSliceMs = 100;                      // blocking waits wake this often to see deadlines and stop
constexpr double kLingerS = 3;                         // draining an unread body before closing

int64_t ms_until(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
}
Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.pop_back();
  size_t i = 0;
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t')) ++i;
  return s.substr(i);
}

// Equal strings, in time that depends only on the lengths (the key's, and the given one's).
bool constant_time_equal(const std::string& given, const std::string& key) {
  volatile unsigned diff = given.size() == key.size() ? 0u : 1u;
  for (size_t i = 0; i < given.size(); ++i)
    diff = diff | (static_cast<unsigned char>(given[i]) ^ static_cast<unsigned char>(key[i % key.size()]));
  return diff == 0;
}

std::string addr_string(const sockaddr_storage& ss, int* port) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, buf, sizeof(buf));
    if (port) *port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof(buf));
    if (port) *port = ntohs(a->sin6_port);
  }
  return buf;
}

int64_t proc_status_kb(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') return std::atoll(line.c_str() + n + 1);
  return -1;
}

// ---- memory budget -------------------------------------------------------------------------------------

class Budget {
 public:
  explicit Budget(int64_t cap) : cap_(cap) {}
  bool take(int64_t n) {
    int64_t cur = used_.load();
    do {
      if (cur + n > cap_) return false;
    } while (!used_.compare_exchange_weak(cur, cur + n));
    return true;
  }
  void give(int64_t n) { used_ -= n; }
  int64_t used() const { return used_.load(); }

 private:
  const int64_t cap_;
  std::atomic<int64_t> used_{0};
};

// A request's share of the budget; returned when the last owner lets go.
class Hold {
 public:
  explicit Hold(Budget& b) : b_(b) {}
  ~Hold() { b_.give(n_); }
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;
  bool resize(int64_t n) {
    if (n > n_ && !b_.take(n - n_)) return false;
    if (n < n_) b_.give(n_ - n);
    n_ = n;
    return true;
  }
  int64_t bytes() const { return n_; }

 private:
  Budget& b_;
  int64_t n_ = 0;
};

// ---- connections ---------------------------------------------------------------------------------------

enum class Phase : int { Idle, Head, Body, Handling };

// One client connection, owned by its thread; other threads read `phase`/`since` (eviction) under the
// table's mutex.
struct Conn {
  int fd = -1;
  std::string remote;
  std::atomic<int> phase{static_cast<int>(Phase::Idle)};
  std::atomic<int64_t> since{0};  // steady-clock ns when the phase began
  Clock::time_point start, deadline;
  int64_t head_bytes = 0, bytes_in = 0, bytes_out = 0;
  bool close_after = false, drain = false, timed_out = false, has_body = false;
  std::vector<char> buf = std::vector<char>(16384);
  size_t off = 0, len = 0;
  json log = json::object();  // extra fields for this request's access-log line

  void set_phase(Phase p) {
    phase = static_cast<int>(p);
    since = Clock::now().time_since_epoch().count();
  }
  Phase get_phase() const { return static_cast<Phase>(phase.load()); }
};

thread_local Conn* t_conn = nullptr;  // the connection this handler thread serves

// The peer closed its side (or the socket failed): nobody will read an answer.
bool peer_gone(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) < 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

class ConnTable {
 public:
  explicit ConnTable(size_t cap) : cap_(cap) {}
  // Adds `c`; at the cap it first shuts the connection that has waited longest for a request (idle or
  // still sending its head). False when every connection is busy with a request.
  bool add(Conn* c, bool* evicted) {
    std::lock_guard<std::mutex> lk(mu_);
    *evicted = false;
    if (conns_.size() >= cap_) {
      Conn* victim = nullptr;
      for (Conn* o : conns_) {
        const Phase p = o->get_phase();
        if ((p == Phase::Idle || p == Phase::Head) && (!victim || o->since.load() < victim->since.load())) victim = o;
      }
      if (!victim) return false;
      ::shutdown(victim->fd, SHUT_RDWR);  // its thread sees EOF and leaves; the fd stays open until remove()
      victim->set_phase(Phase::Handling);  // not picked twice
      *evicted = true;
    }
    conns_.push_back(c);
    return true;
  }
  void remove(Conn* c) {
    std::lock_guard<std::mutex> lk(mu_);
    std::erase(conns_, c);
  }
  int64_t size() const {
    std::lock_guard<std::mutex> lk(mu_);
    return static_cast<int64_t>(conns_.size());
  }

 private:
  const size_t cap_;
  mutable std::mutex mu_;
  std::vector<Conn*> conns_;
};

// httplib's Stream over a connection: buffered reads that give up at the request's deadline (head and body
// together), when the head grows past kMaxHeadBytes, or when the server stops; writes with a timeout.
class ConnStream : public httplib::Stream {
 public:
  ConnStream(Conn& c, const std::atomic<bool>& stopping, double io_timeout_s)
      : c_(c), stopping_(stopping), io_timeout_(seconds(io_timeout_s)) {}

  bool is_readable() const override { return c_.off < c_.len || wait(POLLIN); }
  bool is_writable() const override {
    if (peer_gone(c_.fd)) return false;
    pollfd p{c_.fd, POLLOUT, 0};
    return ::poll(&p, 1, static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(io_timeout_).count())) >
               0 &&
           (p.revents & POLLOUT) && !(p.revents & (POLLERR | POLLHUP));
  }
  ssize_t read(char* ptr, size_t size) override {
    if (c_.off >= c_.len) {
      if (!wait(POLLIN)) return -1;
      ssize_t n;
      do n = ::recv(c_.fd, c_.buf.data(), c_.buf.size(), 0);
      while (n < 0 && errno == EINTR);
      if (n <= 0) return n < 0 ? -1 : 0;
      c_.off = 0;
      c_.len = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, c_.len - c_.off);
    std::memcpy(ptr, c_.buf.data() + c_.off, n);
    c_.off += n;
    c_.bytes_in += static_cast<int64_t>(n);
    if (c_.get_phase() == Phase::Head && (c_.head_bytes += static_cast<int64_t>(n)) > kMaxHeadBytes) return -1;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    size_t done = 0;
    while (done < size) {
      pollfd p{c_.fd, POLLOUT, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(io_timeout_).count()));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0 || (p.revents & (POLLERR | POLLHUP | POLLNVAL))) return -1;
      const ssize_t n = ::send(c_.fd, ptr + done, size - done, MSG_NOSIGNAL);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) return -1;
      done += static_cast<size_t>(n);
    }
    c_.bytes_out += static_cast<int64_t>(size);
    return static_cast<ssize_t>(size);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    port = 0;
    if (::getpeername(c_.fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) ip = addr_string(ss, &port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    port = 0;
    if (::getsockname(c_.fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) ip = addr_string(ss, &port);
  }
  int socket() const override { return c_.fd; }

 private:
  // Waits for `ev` until the request's deadline (while its head or body is arriving; else the I/O timeout).
  bool wait(short ev) const {
    const Phase ph = c_.get_phase();
    const bool arriving = ph == Phase::Head || ph == Phase::Body;
    const auto until = arriving ? c_.deadline : Clock::now() + io_timeout_;
    while (true) {
      if (stopping_.load()) return false;
      const int64_t left = ms_until(until);
      if (left <= 0) {
        if (arriving) c_.timed_out = true;
        return false;
      }
      pollfd p{c_.fd, ev, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, kPollSliceMs)));
      if (r < 0 && errno != EINTR) return false;
      if (r > 0) return true;  // readable, or an error / hang-up that the read reports
    }
  }
  Conn& c_;
  const std::atomic<bool>& stopping_;
  const Clock::duration io_timeout_;
};

// A thread per connection, created when no idle one is left, up to `max` (then tasks wait).
class ConnPool : public httplib::TaskQueue {
 public:
  explicit ConnPool(size_t max) : max_(max) {}
  void enqueue(std::function<void()> fn) override {
    std::lock_guard<std::mutex> lk(mu_);
    jobs_.push_back(std::move(fn));
    if (jobs_.size() > idle_ && threads_.size() < max_) threads_.emplace_back([this] { work(); });
    cv_.notify_one();
  }
  void shutdown() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  void work() {
    while (true) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lk(mu_);
        ++idle_;
        cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
        --idle_;
        if (jobs_.empty()) return;
        fn = std::move(jobs_.front());
        jobs_.pop_front();
      }
      fn();
    }
  }
  const size_t max_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stop_ = false;
};

// ---- request errors ------------------------------------------------------------------------------------

// An error answer naming the offending field: 400 unless said otherwise.
struct BadRequest {
  BadRequest(std::string m, std::string p, int s = 400, std::string c = "")
      : message(std::move(m)), param(std::move(p)), status(s), code(std::move(c)) {}
  std::string message, param;
  int status;
  std::string code;
};

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json error_body(const std::string& message, const std::string& type, const std::string& param = "",
                const std::string& code = "") {
  return json{{"error",
               {{"message", message}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string iso_time_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[40];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03d}Z", buf, static_cast<int>(ms));
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

bool get_bool(const json& j, const char* key, bool def) {
  if (!j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_boolean()) throw BadRequest{fmt::format("'{}' must be a boolean", key), key};
  return j[key].get<bool>();
}

// Fields accepted only with a neutral value (null, or the value that changes nothing).
bool neutral(const std::string& key, const json& v) {
  if (v.is_null()) return true;
  if (key == "presence_penalty" || key == "frequency_penalty") return v.is_number() && v.get<double>() == 0.0;
  if (key == "logit_bias" || key == "metadata") return v.is_object() && v.empty();
  if (key == "response_format") return v.is_object() && v.size() == 1 && v.value("type", "") == "text";
  if (key == "tool_choice") return v == "none";
  if (key == "parallel_tool_calls") return v.is_boolean();
  if (key == "best_of") return v == 1;
  if (key == "suffix") return v == "";
  if (key == "store") return v == false;
  if (key == "service_tier") return v == "auto" || v == "default";
  if (key == "modalities") return v == json::array({"text"});
  return false;  // tools, functions, function_call, audio, prediction, reasoning_effort, web_search_options
}

// A finish reason clients know: the engine's own ones ("timeout", "shutdown", "error", "cancelled") mean
// the output was cut short, i.e. "length"; the detail goes in "finish_detail".
std::string standard_finish(const std::string& r) { return r == "stop" ? "stop" : "length"; }

}  // namespace

// ---- memory figures ------------------------------------------------------------------------------------

int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) return -1;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int64_t peak_resident_bytes() {
  const int64_t kb = proc_status_kb("VmHWM");
  return kb < 0 ? -1 : kb * 1024;
}

void ServerOptions::validate() const {
  LM_CHECK(port >= 0 && port <= 65535, "port {} is outside [0, 65535]", port);
  LM_CHECK(max_batch >= 1 && max_batch <= 4096, "max batch {} is outside [1, 4096]", max_batch);
  LM_CHECK(std::isfinite(request_timeout_s) && request_timeout_s > 0 && request_timeout_s <= 1e7,
           "request timeout {} s is outside (0, 1e7]", request_timeout_s);
  // httplib 0.11 (Debian) polls sockets with select(): descriptors must stay below FD_SETSIZE.
  LM_CHECK(http_threads >= 2 && http_threads <= 1000, "http threads (connections) {} is outside [2, 1000]",
           http_threads);
  LM_CHECK(default_max_tokens >= 1, "default max tokens {} must be >= 1", default_max_tokens);
  LM_CHECK(max_body_bytes >= 1024 && max_body_bytes <= (int64_t(1) << 30), "max body bytes {} is outside [1 KiB, 1 GiB]",
           max_body_bytes);
  LM_CHECK(max_inflight_bytes >= 1, "max in-flight bytes {} must be >= 1", max_inflight_bytes);
  LM_CHECK(std::isfinite(header_timeout_s) && header_timeout_s > 0 && header_timeout_s <= 3600,
           "header timeout {} s is outside (0, 3600]", header_timeout_s);
  LM_CHECK(std::isfinite(keep_alive_s) && keep_alive_s > 0 && keep_alive_s <= 3600, "keep-alive {} s is outside (0, 3600]",
           keep_alive_s);
  LM_CHECK(std::isfinite(prefill_slice_s) && prefill_slice_s > 0 && prefill_slice_s <= 60,
           "prefill slice {} s is outside (0, 60]", prefill_slice_s);
  LM_CHECK(compute_nice >= 0 && compute_nice <= 19, "compute nice {} is outside [0, 19]", compute_nice);
  for (const char c : api_key)
    LM_CHECK(c > ' ' && c < 127, "the API key must be printable ASCII without spaces");
  for (const auto& o : cors_origins)
    LM_CHECK(o == "*" || (o.find("://") != std::string::npos && o.find_first_of(" ,\t") == std::string::npos &&
                          o.back() != '/'),
             "CORS origin '{}' must be '*' or scheme://host[:port] (no path, no trailing slash)", o);
  for (const auto& h : allowed_hosts)
    LM_CHECK(!h.empty() && h.find_first_of(" ,\t/") == std::string::npos, "allowed host '{}' is not a host name", h);
}

// ---- requests ------------------------------------------------------------------------------------------

struct Piece {
  std::string text;
  std::vector<infer::TokenLogprobs> lps;  // of the tokens generated since the previous piece
};

struct Request {
  uint64_t id = 0;
  bool chat = false, stream = false, include_usage = false, echo = false;
  int64_t logprobs = -1;  // alternatives per token (-1: none)
  std::vector<int32_t> prompt;
  std::vector<model::Media<float>> media;  // chat images in placeholder order (attached when the sequence opens)
  std::string echo_text;  // completions with echo: the prompt's text
  infer::SamplingParams sp;
  Clock::time_point deadline;
  int64_t created = 0;
  std::atomic<bool> cancelled{false};
  std::shared_ptr<Hold> hold;  // this request's share of the memory budget
  // Handler side: released text and the end of the request, under mu.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Piece> pieces;
  bool done = false;
  std::string finish_reason, error;
  int64_t completion_tokens = 0;
  int64_t reserve = 0;  // tokens of cache it may grow to: prompt + max_tokens, at most the context
  // Scheduler side only.
  infer::Engine::Id seq = 0;  // its sequence in the engine (0: none)
  std::unique_ptr<infer::Generation> gen;
  int32_t next_token = -1;
  int64_t skipped = 0;  // scheduler iterations this prefill was passed over (ageing)
  int64_t prefill_pieces = 0;  // prefill pieces done
  double s_per_token = 0;      // seconds per token of its last prefill piece
};

struct Server::Impl {
  // httplib's server with our connection handling (httplib's own reads headers line by line with a
  // per-line timeout, keeps idle connections in a polling loop and queues connections behind busy workers).
  class Http : public httplib::Server {
   public:
    explicit Http(Impl& I) : I_(I) {}

   private:
    bool process_and_close_socket(int sock) override { return I_.serve_connection(*this, sock); }
    Impl& I_;
    friend struct Impl;
  };

  std::unique_ptr<infer::Engine> own_engine;  // (a Server made over a Session)
  infer::Engine& engine;
  const io::Tokenizer& tok;
  ServerOptions o;
  Http http;
  std::thread sched;
  std::mutex qmu;
  std::condition_variable qcv;
  std::deque<std::shared_ptr<Request>> queue;
  bool stopping = false;
  std::atomic<bool> net_stopping{false};
  std::atomic<int64_t> open{0};  // streams not yet finished
  std::atomic<int64_t> n_active{0}, n_prefilling{0};
  std::mutex stop_mu;  // serialises stop()
  std::atomic<uint64_t> next_id{1};
  mutable std::mutex smu;
  ServerStats st;
  std::vector<std::shared_ptr<Request>> active, prefilling;  // scheduler thread only
  double prefill_debt_s = 0;  // continued-prefill time not yet matched by decode time (scheduler thread)
  bool preemptible = false;   // a continued piece is in the engine: preempt() may run new requests
  double preempted_s = 0;     // seconds spent in preempt() (scheduler thread), kept out of the pieces' times
  Clock::time_point piece_t0;  // when the continued piece in the engine started
  double piece_preempted0 = 0;  // preempted_s then
  std::vector<int32_t> chat_stops, completion_stops;
  int32_t placeholder = -1;  // the media placeholder (with o.vision)
  Budget budget;
  ConnTable conns;
  bool check_host = false;
  std::mutex log_mu;
  std::FILE* log_file = nullptr;

  Impl(std::unique_ptr<infer::Engine> own, infer::Engine& e, const io::Tokenizer& t, ServerOptions opt)
      : own_engine(std::move(own)), engine(e), tok(t), o(std::move(opt)), http(*this), budget(o.max_inflight_bytes),
        conns(static_cast<size_t>(o.http_threads)) {
    o.validate();
    LM_CHECK(e.max_sequences() == 0 || o.max_batch <= e.max_sequences(),
             "server: --max-batch {} exceeds the {} sequences the engine holds ({})", o.max_batch, e.max_sequences(),
             e.describe());
    LM_CHECK(t.vocab_size() <= e.vocab_size(), "server: tokenizer vocabulary {} exceeds the model's {}", t.vocab_size(),
             e.vocab_size());
    if (tok.eos() >= 0) completion_stops.push_back(tok.eos()), chat_stops.push_back(tok.eos());
    chat_stops.push_back(tok.special("<|end|>"));
    if (o.vision) {  // the placeholder is an input: a reply that would write one ends instead
      LM_CHECK(o.vision->media_placeholder_token_id && tok.has_special("<|image|>") &&
                   tok.special("<|image|>") == *o.vision->media_placeholder_token_id,
               "serve: images need the tokenizer's <|image|> to be the model's media_placeholder_token_id");
      placeholder = tok.special("<|image|>");
      chat_stops.push_back(placeholder);
    }
    const std::string h = lower(o.host);
    check_host = h == "localhost" || h == "::1" || h == "[::1]" || h.rfind("127.", 0) == 0 || !o.allowed_hosts.empty();
    if (!o.access_log.empty()) {
      log_file = std::fopen(o.access_log.c_str(), "a");
      LM_CHECK(log_file != nullptr, "cannot open the access log {}: {}", o.access_log, std::strerror(errno));
    }
  }
  ~Impl() {
    if (log_file) std::fclose(log_file);
  }

  void count(int64_t ServerStats::*f, int64_t n = 1) {
    std::lock_guard<std::mutex> lk(smu);
    st.*f += n;
  }

  // ---- connections -------------------------------------------------------------------------------------
  bool serve_connection(Http& h, int sock) {
    int one = 1;
    ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // SSE events go out at once
    Conn c;
    c.fd = sock;
    {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      int port = 0;
      if (::getpeername(sock, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
        const std::string ip = addr_string(ss, &port);
        c.remote = fmt::format("{}:{}", ip, port);
      }
    }
    c.set_phase(Phase::Idle);
    bool evicted = false;
    if (!conns.add(&c, &evicted)) {
      count(&ServerStats::busy);
      const std::string body = dump(error_body("too many connections; retry later", "server_error", "", "overloaded"));
      const std::string resp = fmt::format(
          "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\nContent-Length: "
          "{}\r\nConnection: close\r\n\r\n{}",
          body.size(), body);
      ::send(sock, resp.data(), resp.size(), MSG_NOSIGNAL);
      ::shutdown(sock, SHUT_RDWR);
      ::close(sock);
      return false;
    }
    if (evicted) count(&ServerStats::evicted);
    t_conn = &c;
    bool ok = true;
    for (int left = 1000; left > 0; --left) {
      c.set_phase(Phase::Idle);
      if (!wait_for_request(c)) break;
      c.set_phase(Phase::Head);
      c.start = Clock::now();
      c.deadline = c.start + seconds(o.header_timeout_s);
      c.head_bytes = c.bytes_in = c.bytes_out = 0;
      c.timed_out = c.has_body = false;
      c.log = json::object();
      ConnStream strm(c, net_stopping, 30);
      bool closed = false;
      ok = h.process_request(strm, left == 1 || net_stopping.load(), closed,
                             [&c](httplib::Request&) { c.set_phase(Phase::Body); });
      if (!ok || closed || c.close_after || c.timed_out) break;
    }
    t_conn = nullptr;
    if (c.drain) linger(c);
    conns.remove(&c);
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }

  // Idle keep-alive: true when a request starts arriving.
  bool wait_for_request(Conn& c) {
    if (c.off < c.len) return true;
    const auto until = Clock::now() + seconds(o.keep_alive_s);
    while (!net_stopping.load()) {
      const int64_t left = ms_until(until);
      if (left <= 0) return false;
      pollfd p{c.fd, POLLIN, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, kPollSliceMs)));
      if (r < 0 && errno != EINTR) return false;
      if (r > 0) return (p.revents & POLLIN) != 0;
    }
    return false;
  }

  // After answering a request whose body was not read: let the client finish sending (bounded in time)
  // so that closing does not reset the connection before it reads the answer.
  void linger(Conn& c) {
    ::shutdown(c.fd, SHUT_WR);
    const auto until = Clock::now() + seconds(kLingerS);
    char buf[16384];
    while (!net_stopping.load()) {
      const int64_t left = ms_until(until);
      if (left <= 0) break;
      pollfd p{c.fd, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, kPollSliceMs))) <= 0) continue;
      if (::recv(c.fd, buf, sizeof(buf), 0) <= 0) break;
    }
  }

  // ---- the door ----------------------------------------------------------------------------------------
  bool host_allowed(const std::string& host_header) const {
    if (!check_host || host_header.empty()) return true;  // browsers always send Host
    const std::string h = lower(trim(host_header));
    std::string name = h, port;
    if (!h.empty() && h[0] == '[') {
      const size_t e = h.find(']');
      if (e == std::string::npos) return false;
      name = h.substr(0, e + 1), port = h.substr(e + 1);
    } else if (const size_t colon = h.rfind(':'); colon != std::string::npos) {
      name = h.substr(0, colon), port = h.substr(colon);
    }
    if (!port.empty()) {
      if (port.size() < 2 || port.size() > 6 || port[0] != ':') return false;
      for (size_t i = 1; i < port.size(); ++i)
        if (!std::isdigit(static_cast<unsigned char>(port[i]))) return false;
    }
    if (name == "localhost" || name == "127.0.0.1" || name == "[::1]") return true;
    for (const auto& a : o.allowed_hosts)
      if (lower(a) == name) return true;
    return false;
  }

  bool origin_allowed(const std::string& origin) const {
    for (const auto& a : o.cors_origins)
      if (a == "*" || a == origin) return true;
    return false;
  }

  static bool is_generation_route(const std::string& path) {
    return path == "/v1/completions" || path == "/v1/chat/completions";
  }
  static bool is_known_route(const std::string& path) {
    return is_generation_route(path) || path == "/health" || path == "/v1/models" || path.rfind("/v1/models/", 0) == 0;
  }

  void respond_error(httplib::Response& res, int status, const std::string& msg, const std::string& type,
                     const std::string& param = "", const std::string& code = "") {
    res.status = status;
    res.set_content(dump(error_body(msg, type, param, code)), "application/json");
  }
  void respond_busy(httplib::Response& res, const std::string& why) {
    count(&ServerStats::busy);
    res.set_header("Retry-After", "1");
    respond_error(res, 503, why, "server_error", "", "overloaded");
  }
  // An answer after which the connection closes: the request's body (if any) was not read.
  void refuse(httplib::Response& res, int status, const std::string& msg, const std::string& type,
              const std::string& param = "", const std::string& code = "") {
    count(&ServerStats::rejected);
    respond_error(res, status, msg, type, param, code);
    close_unread(res);
  }
  static void close_unread(httplib::Response& res) {
    res.set_header("Connection", "close");
    if (t_conn) t_conn->close_after = true, t_conn->drain = t_conn->has_body;
  }

  // Runs before httplib reads a body: every check that needs only the head.
  httplib::Server::HandlerResponse gate(const httplib::Request& req, httplib::Response& res) {
    using HR = httplib::Server::HandlerResponse;
    const bool gen = is_generation_route(req.path);
    const bool has_body = req.has_header("Transfer-Encoding") ||
                          (req.has_header("Content-Length") && req.get_header_value("Content-Length") != "0");
    if (t_conn) t_conn->has_body = has_body;
    if (t_conn && !(gen && req.method == "POST")) t_conn->set_phase(Phase::Handling);
    if (!host_allowed(req.get_header_value("Host"))) {
      refuse(res, 403,
             fmt::format("Host '{}' is not accepted by this server (a loopback server answers localhost, 127.0.0.1 "
                         "and [::1]; add names with --allowed-host)",
                         req.get_header_value("Host")),
             "invalid_request_error", "", "host_not_allowed");
      return HR::Handled;
    }
    if (req.has_header("Origin")) {
      const std::string origin = req.get_header_value("Origin");
      if (!origin_allowed(origin)) {
        refuse(res, 403,
               fmt::format("cross-origin requests from '{}' are not allowed (start the server with --cors ORIGIN)",
                           origin),
               "invalid_request_error", "", "origin_not_allowed");
        return HR::Handled;
      }
      const bool any = std::find(o.cors_origins.begin(), o.cors_origins.end(), "*") != o.cors_origins.end();
      res.set_header("Access-Control-Allow-Origin", any ? "*" : origin);
      res.set_header("Vary", "Origin");
    }
    if (req.method == "OPTIONS") {
      // A preflight (or a plain OPTIONS): what a browser may send here. No body is read.
      res.status = 204;
      res.set_header("Allow", "GET, POST, OPTIONS");
      if (req.has_header("Origin")) {
        res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        std::string asked = req.get_header_value("Access-Control-Request-Headers");
        const bool plain = std::all_of(asked.begin(), asked.end(), [](char ch) {
          return std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == ',' || ch == ' ';
        });
        res.set_header("Access-Control-Allow-Headers", plain && !asked.empty() ? asked : "Authorization, Content-Type");
        res.set_header("Access-Control-Max-Age", "600");
      }
      if (req.has_header("Content-Length") || req.has_header("Transfer-Encoding")) close_unread(res);
      return HR::Handled;
    }
    if (!o.api_key.empty() && req.path != "/health") {
      const std::string auth = trim(req.get_header_value("Authorization"));
      const bool bearer = auth.size() > 7 && lower(auth.substr(0, 7)) == "bearer ";
      if (!bearer || !constant_time_equal(trim(auth.substr(7)), o.api_key)) {
        res.set_header("WWW-Authenticate", "Bearer");
        refuse(res, 401,
               bearer ? "incorrect API key provided" : "an API key is required (header 'Authorization: Bearer <key>')",
               "invalid_request_error", "", "invalid_api_key");
        return HR::Handled;
      }
    }
    if (gen && req.method != "POST") {
      res.set_header("Allow", "POST, OPTIONS");
      refuse(res, 405, fmt::format("{} {} is not allowed (use POST)", req.method, req.path), "invalid_request_error");
      return HR::Handled;
    }
    if (!gen) {
      if (has_body || (req.method != "GET" && req.method != "HEAD")) {
        if (is_known_route(req.path)) {
          res.set_header("Allow", "GET, OPTIONS");
          refuse(res, 405, fmt::format("{} {} is not allowed (use GET)", req.method, req.path), "invalid_request_error");
        } else {
          refuse(res, 404, fmt::format("no route {} {}", req.method, req.path), "invalid_request_error", "",
                 "not_found");
        }
        return HR::Handled;
      }
      return HR::Unhandled;
    }
    // POST to a generation route: a JSON body of bounded size, in a form we read ourselves.
    if (!req.has_header("Content-Length") && !req.has_header("Transfer-Encoding")) {
      // (httplib would read such a body until the client closes.)
      refuse(res, 411, "a POST needs Content-Length or Transfer-Encoding: chunked", "invalid_request_error");
      return HR::Handled;
    }
    if (req.has_header("Transfer-Encoding") && lower(trim(req.get_header_value("Transfer-Encoding"))) != "chunked") {
      refuse(res, 501, fmt::format("Transfer-Encoding '{}' is not supported (only chunked)",
                                   req.get_header_value("Transfer-Encoding")),
             "invalid_request_error");
      return HR::Handled;
    }
    if (req.has_header("Content-Encoding") && lower(trim(req.get_header_value("Content-Encoding"))) != "identity") {
      refuse(res, 415, fmt::format("Content-Encoding '{}' is not supported (send the JSON uncompressed)",
                                   req.get_header_value("Content-Encoding")),
             "invalid_request_error");
      return HR::Handled;
    }
    const std::string ctype = lower(trim(req.get_header_value("Content-Type")));
    const std::string media = trim(ctype.substr(0, ctype.find(';')));
    if (media != "application/json") {
      refuse(res, 415,
             fmt::format("the request body must be JSON with 'Content-Type: application/json' (got '{}')",
                         req.get_header_value("Content-Type")),
             "invalid_request_error");
      return HR::Handled;
    }
    if (req.has_header("Content-Length")) {
      const std::string cl = trim(req.get_header_value("Content-Length"));
      const bool digits = !cl.empty() && cl.size() <= 18 &&
                          std::all_of(cl.begin(), cl.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); });
      if (!digits) {
        refuse(res, 400, fmt::format("Content-Length '{}' is not a number", cl), "invalid_request_error");
        return HR::Handled;
      }
      if (std::stoll(cl) > o.max_body_bytes) {
        refuse(res, 413, fmt::format("the request body of {} bytes exceeds the limit of {} bytes", cl, o.max_body_bytes),
               "invalid_request_error", "", "request_too_large");
        return HR::Handled;
      }
    }
    return HR::Unhandled;
  }

  // ---- parsing -----------------------------------------------------------------------------------------
  // A text prompt's ids (plain text, after `prefix`), or a 400 when it cannot fit the context: first from
  // its size alone, then while tokenizing (which stops once the limit is passed).
  std::vector<int32_t> prompt_ids(const std::string& text, std::vector<int32_t> prefix, const char* field) const {
    const int64_t limit = engine.max_context() - 1;
    const int64_t room = limit - static_cast<int64_t>(prefix.size());
    if (static_cast<int64_t>(text.size()) > room * tok.max_piece_bytes())
      throw too_long(fmt::format("at least {}", (static_cast<int64_t>(text.size()) + tok.max_piece_bytes() - 1) /
                                                    tok.max_piece_bytes() + static_cast<int64_t>(prefix.size())),
                     field);
    const auto ids = tok.encode_text(text, room);
    if (static_cast<int64_t>(ids.size()) > room)
      throw too_long(fmt::format("more than {}", limit), field);
    prefix.insert(prefix.end(), ids.begin(), ids.end());
    return prefix;
  }
  BadRequest too_long(const std::string& n, const std::string& field) const {
    return BadRequest{fmt::format("the prompt has {} tokens; the context limit is {} (prompt plus at least one "
                                  "generated token)",
                                  n, engine.max_context()),
                      field, 400, "context_length_exceeded"};
  }

  // The text of a message's content: a string, or an array of text parts (joined with "\n"). With `images` (a user
  // message to a model that takes them) also image_url parts, whose data URLs' bytes are appended in order.
  static std::string content_text(const json& c, const std::string& where, std::vector<std::string>* images = nullptr,
                                  bool takes_images = false) {
    if (c.is_string()) return c.get<std::string>();
    if (!c.is_array())
      throw BadRequest{fmt::format("'{}' must be a string or an array of content parts", where), where};
    std::string out;
    int64_t texts = 0;
    for (size_t k = 0; k < c.size(); ++k) {
      const json& p = c[k];
      const std::string pw = fmt::format("{}[{}]", where, k);
      if (!p.is_object() || !p.contains("type") || !p["type"].is_string())
        throw BadRequest{fmt::format("'{}' must be an object with a string 'type'", pw), pw};
      const std::string type = p["type"].get<std::string>();
      if (type == "image_url" && images) {
        for (const auto& [key, v] : p.items())
          if (key != "type" && key != "image_url")
            throw BadRequest{fmt::format("'{}.{}' is not supported", pw, key), pw + "." + key};
        const json* u = p.contains("image_url") ? &p["image_url"] : nullptr;
        if (u && u->is_object()) {
          for (const auto& [key, v] : u->items())
            if (key != "url" && key != "detail")
              throw BadRequest{fmt::format("'{}.image_url.{}' is not supported", pw, key), pw + ".image_url." + key};
          u = u->contains("url") ? &(*u)["url"] : nullptr;
        }
        if (!u || !u->is_string())
          throw BadRequest{fmt::format("'{}.image_url' must be {{\"url\": \"data:image/...;base64,...\"}}", pw),
                           pw + ".image_url"};
        try {
          images->push_back(io::parse_data_url(u->get<std::string>(), pw + ".image_url.url").bytes);
        } catch (const Error& e) {
          throw BadRequest{e.what(), pw + ".image_url.url"};
        }
        continue;
      }
      if (type == "image_url" && takes_images)
        throw BadRequest{fmt::format("'{}': images go in user messages only", pw), pw + ".type"};
      if (type != "text")
        throw BadRequest{fmt::format("'{}' has type '{}': only text parts are supported (this model has no {} input)",
                                     pw, type, type == "image_url" ? "image" : type == "input_audio" ? "audio" : type),
                         pw + ".type"};
      for (const auto& [key, v] : p.items())
        if (key != "type" && key != "text")
          throw BadRequest{fmt::format("'{}.{}' is not supported", pw, key), pw + "." + key};
      if (!p.contains("text") || !p["text"].is_string())
        throw BadRequest{fmt::format("'{}.text' must be a string", pw), pw + ".text"};
      if (texts++ > 0) out += "\n";
      out += p["text"].get<std::string>();
    }
    return out;
  }

  std::shared_ptr<Request> parse(const std::string& body, bool chat) {
    json::parser_callback_t depth_limit = [](int depth, json::parse_event_t, json&) {
      if (depth > 64) throw BadRequest{"the request body nests deeper than 64 levels", ""};
      return true;
    };
    json j;
    try {
      j = json::parse(body, depth_limit, true);
    } catch (const json::exception& e) {  // e.g. "syntax error ...", "number overflow parsing '1e400'"
      throw BadRequest{fmt::format("malformed JSON in the request body: {}", e.what()), ""};
    }
    if (!j.is_object()) throw BadRequest{"the request body must be a JSON object", ""};
    static const std::vector<std::string> common = {"model", "stream", "stream_options", "n", "max_tokens",
                                                    "max_completion_tokens", "temperature", "top_p", "top_k",
                                                    "repetition_penalty", "seed", "stop", "user", "logprobs"};
    static const std::vector<std::string> chat_only = {"messages", "top_logprobs"};
    static const std::vector<std::string> completion_only = {"prompt", "echo"};
    static const std::vector<std::string> neutral_only = {
        "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools", "tool_choice",
        "functions", "function_call", "parallel_tool_calls", "best_of", "suffix", "store", "metadata",
        "service_tier", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options"};
    auto in = [](const std::vector<std::string>& v, const std::string& k) {
      return std::find(v.begin(), v.end(), k) != v.end();
    };
    for (const auto& [key, v] : j.items()) {
      if (in(common, key) || in(chat ? chat_only : completion_only, key)) continue;
      if (in(neutral_only, key)) {
        if (neutral(key, v)) continue;
        if (key == "tools" || key == "functions" || key == "tool_choice" || key == "function_call")
          throw BadRequest{fmt::format("'{}' is not supported yet (tool calling is not implemented)", key), key};
        throw BadRequest{fmt::format("'{}' is not supported (only its neutral value is accepted)", key), key};
      }
      throw BadRequest{fmt::format("unrecognized request argument '{}'", key), key};
    }
    auto r = std::make_shared<Request>();
    r->chat = chat;
    if (j.contains("model") && !j["model"].is_null()) {
      if (!j["model"].is_string()) throw BadRequest{"'model' must be a string", "model"};
      if (j["model"].get<std::string>() != o.model_name)
        throw BadRequest{fmt::format("the model '{}' does not exist (this server has '{}')",
                                     j["model"].get<std::string>(), o.model_name),
                         "model", 404, "model_not_found"};
    }
    r->stream = get_bool(j, "stream", false);
    if (j.contains("stream_options") && !j["stream_options"].is_null()) {
      const json& so = j["stream_options"];
      if (!r->stream) throw BadRequest{"'stream_options' is only allowed with 'stream': true", "stream_options"};
      if (!so.is_object()) throw BadRequest{"'stream_options' must be an object", "stream_options"};
      for (const auto& [key, v] : so.items())
        if (key != "include_usage")
          throw BadRequest{fmt::format("'stream_options.{}' is not supported", key), "stream_options." + key};
      r->include_usage = get_bool(so, "include_usage", false);
    }
    get_int(j, "n", 1, 1, 1);
    if (j.contains("user") && !j["user"].is_null() && !j["user"].is_string())
      throw BadRequest{"'user' must be a string", "user"};
    const int64_t ctx = engine.max_context();
    auto& sp = r->sp;
    const int64_t mt = get_int(j, "max_tokens", -1, 1, ctx);
    const int64_t mct = get_int(j, "max_completion_tokens", -1, 1, ctx);
    if (mt > 0 && mct > 0 && mt != mct)
      throw BadRequest{fmt::format("'max_tokens' ({}) and 'max_completion_tokens' ({}) disagree", mt, mct),
                       "max_completion_tokens"};
    sp.max_tokens = mct > 0 ? mct : mt > 0 ? mt : std::min(o.default_max_tokens, ctx);
    sp.temperature = static_cast<float>(get_number(j, "temperature", 1.0, 0.0, 2.0));
    // Below the smallest float a nucleus keeps the most likely token alone, as FLT_MIN does.
    sp.top_p = std::max(static_cast<float>(get_number(j, "top_p", 1.0, 0.0, 1.0, true)), FLT_MIN);
    sp.top_k = get_int(j, "top_k", 0, 0, engine.vocab_size());
    sp.repetition_penalty = static_cast<float>(get_number(j, "repetition_penalty", 1.0, 0.01, 10.0));
    sp.seed = static_cast<uint64_t>(get_int(j, "seed", 0, 0, INT64_MAX));
    if (chat) {
      const bool lp = get_bool(j, "logprobs", false);
      const int64_t top = get_int(j, "top_logprobs", -1, 0, 20);
      if (top >= 0 && !lp) throw BadRequest{"'top_logprobs' needs 'logprobs': true", "top_logprobs"};
      r->logprobs = lp ? std::max<int64_t>(top, 0) : -1;
    } else {
      r->logprobs = get_int(j, "logprobs", -1, 0, 20);
      r->echo = get_bool(j, "echo", false);
      if (r->echo && r->logprobs >= 0)
        throw BadRequest{"'echo' together with 'logprobs' (log-probabilities of the prompt) is not supported", "echo"};
    }
    sp.top_logprobs = r->logprobs;
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
    try {
      sp.validate();
    } catch (const Error& e) {
      throw BadRequest{e.what(), ""};
    }
    const char* what = chat ? "messages" : "prompt";
    try {
      if (chat) {
        if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty())
          throw BadRequest{"'messages' must be a non-empty array", "messages"};
        std::vector<io::ChatMessage> msgs;
        std::vector<size_t> image_at;  // the message of each image in r->media
        int64_t bytes = 0;
        for (size_t i = 0; i < j["messages"].size(); ++i) {
          const json& m = j["messages"][i];
          const std::string where = fmt::format("messages[{}]", i);
          if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
            throw BadRequest{fmt::format("'{}' must be an object with a string 'role'", where), where};
          std::string role = m["role"].get<std::string>();
          if (role == "developer") role = "system";
          if (role == "tool" || role == "function")
            throw BadRequest{fmt::format("'{}.role' '{}' is not supported yet (tool calling is not implemented)",
                                         where, role),
                             where + ".role"};
          if (role != "system" && role != "user" && role != "assistant")
            throw BadRequest{fmt::format("'{}.role' '{}' must be system, developer, user or assistant", where, role),
                             where + ".role"};
          for (const auto& [key, v] : m.items()) {
            if (key == "role" || key == "content") continue;
            if ((key == "refusal" || key == "tool_calls" || key == "function_call" || key == "audio") && v.is_null())
              continue;
            throw BadRequest{fmt::format("'{}.{}' is not supported", where, key), where + "." + key};
          }
          if (!m.contains("content")) throw BadRequest{fmt::format("'{}.content' is required", where), where + ".content"};
          std::vector<std::string> images;
          msgs.push_back({role, content_text(m["content"], where + ".content",
                                             o.vision && role == "user" ? &images : nullptr, o.vision.has_value())});
          for (size_t k = 0; k < images.size(); ++k) {
            const std::string iw = fmt::format("{}.content (image {})", where, k);
            try {
              r->media.push_back(infer::image_media(images[k], iw, *o.vision, o.image_limits));
            } catch (const Error& e) {
              throw BadRequest{e.what(), where + ".content"};
            }
            image_at.push_back(msgs.size() - 1);
          }
          bytes += static_cast<int64_t>(msgs.back().content.size());
        }
        const int64_t limit = ctx - 1;
        if (bytes > limit * tok.max_piece_bytes())
          throw too_long(fmt::format("at least {}", (bytes + tok.max_piece_bytes() - 1) / tok.max_piece_bytes()), what);
        r->prompt = io::chat_tokens(tok, msgs, true, true, limit);
        if (static_cast<int64_t>(r->prompt.size()) > limit) throw too_long(fmt::format("more than {}", limit), what);
        if (!r->media.empty()) {
          // A message's images open its turn (after its <|user|>), one placeholder per feature row: the template is
          // a concatenation, so the turn starts where the earlier messages' rendering ends.
          std::vector<int32_t> ids;
          size_t from = 0;
          for (size_t i = 0; i < image_at.size(); ++i) {
            const io::Conversation before(msgs.begin(), msgs.begin() + static_cast<ptrdiff_t>(image_at[i]));
            const size_t at = io::chat_tokens(tok, before, false, true).size() + 1;
            ids.insert(ids.end(), r->prompt.begin() + static_cast<ptrdiff_t>(from),
                       r->prompt.begin() + static_cast<ptrdiff_t>(std::max(from, at)));
            ids.insert(ids.end(), static_cast<size_t>(infer::media_rows(*o.vision, r->media[i])), placeholder);
            from = std::max(from, at);
          }
          ids.insert(ids.end(), r->prompt.begin() + static_cast<ptrdiff_t>(from), r->prompt.end());
          r->prompt = std::move(ids);
          if (static_cast<int64_t>(r->prompt.size()) > limit)
            throw too_long(fmt::format("{} (with its images' feature rows)", r->prompt.size()), what);
        }
      } else {
        if (!j.contains("prompt")) throw BadRequest{"'prompt' is required", "prompt"};
        const json* p = &j["prompt"];
        if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) p = &(*p)[0];
        std::vector<int32_t> start;
        if (tok.bos() >= 0) start.push_back(tok.bos());
        if (p->is_string()) {
          r->prompt = prompt_ids(p->get<std::string>(), start, "prompt");
          if (r->echo) r->echo_text = p->get<std::string>();
        } else if (p->is_array() && !p->empty() && (*p)[0].is_number()) {
          if (p->size() > static_cast<size_t>(ctx - 1)) throw too_long(std::to_string(p->size()), "prompt");
          for (const auto& x : *p) {
            if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= tok.vocab_size())
              throw BadRequest{fmt::format("'prompt' token ids must be integers in [0, {})", tok.vocab_size()),
                               "prompt"};
            r->prompt.push_back(static_cast<int32_t>(x.get<int64_t>()));
          }
          if (r->echo) r->echo_text = tok.decode(r->prompt);
        } else if (p->is_array() && !p->empty()) {
          throw BadRequest{"'prompt' holds several prompts: send one per request", "prompt"};
        } else {
          throw BadRequest{"'prompt' must be a string or a non-empty array of token ids", "prompt"};
        }
        if (r->prompt.empty()) throw BadRequest{"'prompt' is empty", "prompt"};
      }
    } catch (const Error& e) {
      throw BadRequest{e.what(), what};
    }
    if (static_cast<int64_t>(r->prompt.size()) >= ctx) throw too_long(std::to_string(r->prompt.size()), what);
    if (t_conn) {
      if (j.contains("user") && j["user"].is_string()) t_conn->log["user"] = j["user"];
    }
    r->id = next_id++;
    r->created = unix_now();
    r->deadline = Clock::now() + seconds(o.request_timeout_s);
    return r;
  }

  // ---- scheduler ---------------------------------------------------------------------------------------
  void push_piece(Request& r, Piece p) {
    if (p.text.empty() && p.lps.empty()) return;
    std::lock_guard<std::mutex> lk(r.mu);
    r.pieces.push_back(std::move(p));
    r.cv.notify_all();
  }

  // `reason` by value: callers pass the Generation's own finish_reason, and the Generation is freed here.
  void finish(Request& r, std::string reason, const std::string& error = "") {
    std::string tail;
    if (r.gen) tail = r.gen->finish(reason);
    {
      std::lock_guard<std::mutex> lk(r.mu);
      if (r.done) return;
      if (!tail.empty()) r.pieces.push_back(Piece{tail, {}});
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
    if (r.seq) engine.close(r.seq), r.seq = 0;  // release the caches now, not when the last handler lets go
    r.gen.reset();
  }

  // Feeds logits to the request's generation; returns true while it goes on.
  bool step(Request& r, const float* logits) {
    infer::Generation::Step s = r.gen->next(logits, engine.vocab_size());
    Piece p{std::move(s.text), {}};
    if (r.logprobs >= 0 && s.emitted >= 0) p.lps.push_back(std::move(s.lp));
    push_piece(r, std::move(p));
    if (s.done) {
      finish(r, r.gen->finish_reason());
      return false;
    }
    r.next_token = s.token;
    if (engine.pos(r.seq) >= engine.max_context()) {
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

  // A new sequence for an admitted request, resumed from the longest stored prefix of its prompt.
  // Its images go to the sequence first: their features fill the prompt's placeholders as the prefill reaches them.
  void start(Request& r) {
    r.seq = engine.open(r.prompt, r.reserve);
    for (const auto& m : r.media) engine.attach_media(r.seq, m);
    r.media.clear();
  }

  // One round of prefill, bounded in time by prefill_slice_s: pieces of whole grid units (they end on the engine's
  // grid, so the caches equal one prefill call's), sized from the seconds per token each prompt's last piece took.
  // A new request's first piece (one unit: all of a short prompt) never waits: those run before the round's decode
  // step, the continued pieces after it. Prompts past their first piece go shortest remaining first (ageing by one
  // unit per round passed over); one passed over twice goes first (the most passed over first), so a flood of short
  // prompts cannot hold a long one back. The first of them runs at least one unit; later ones only while the slice
  // has room for a unit. While sequences are decoding,
  // a prompt past its first piece continues only when the decode steps since have taken as long as its pieces did
  // (prefill_debt_s): running streams keep at least half of the time. A new request thus waits for at most one
  // slice (or one unit, when a unit takes longer) of another prompt's prefill.
  // `fresh`: only new requests' first pieces (they run before the round's decode step, so a short request's first
  // tokens never wait behind another prompt's continued piece); else only continued pieces.
  void prefill_round(bool fresh) {
    if (prefilling.empty()) return;
    if (active.empty()) prefill_debt_s = 0;
    const int64_t Cp = engine.prefill_chunk();
    auto key = [&](const Request& r) {
      return static_cast<int64_t>(r.prompt.size()) - engine.pos(r.seq) - r.skipped * Cp;
    };
    std::vector<std::shared_ptr<Request>> order = prefilling;
    std::stable_sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
      const bool na = a->prefill_pieces == 0, nb = b->prefill_pieces == 0;
      if (na != nb) return na;
      const bool fa = a->skipped >= 2, fb = b->skipped >= 2;
      if (fa != fb) return fa;
      return fa ? a->skipped > b->skipped : key(*a) < key(*b);
    });
    const auto round0 = Clock::now();
    bool first = true;  // no continued piece has run in this round yet
    std::vector<Request*> ended;
    for (auto& rp : order) {
      Request& r = *rp;
      const int64_t n = static_cast<int64_t>(r.prompt.size()), p = engine.pos(r.seq);
      const int64_t unit = std::min(n - p, Cp - p % Cp);  // to the next grid point
      int64_t piece = unit;
      if ((r.prefill_pieces == 0) != fresh) continue;
      if (r.prefill_pieces > 0) {
        if (prefill_debt_s > 0) continue;
        const double room = o.prefill_slice_s - std::chrono::duration<double>(Clock::now() - round0).count();
        const double unit_s = r.s_per_token * static_cast<double>(Cp);
        if (!first && r.skipped < 2 && room < unit_s) {
          ++r.skipped;
          continue;
        }
        first = false;
        const auto more = static_cast<int64_t>(std::max(0.0, room / std::max(unit_s, 1e-9) - 1));
        piece = std::min(n - p, unit + std::min<int64_t>(more, n) * Cp);
      }
      r.skipped = 0;
      const auto t0 = Clock::now();
      const double preempted0 = preempted_s;
      try {
        // Only the prompt's last grid point is worth a prefix-cache snapshot (as in one prefill call).
        const bool store = p + piece >= n / Cp * Cp;
        // A fresh piece (also one run inside preempt()) keeps the outer piece's clock: that piece's share is measured
        // from its own start.
        preemptible = !fresh;
        if (!fresh) piece_t0 = t0, piece_preempted0 = preempted0;
        struct Off {
          bool& b;
          ~Off() { b = false; }
        } off{preemptible};
        const std::vector<float> logits =
            engine.prefill(r.seq, std::span<const int32_t>(r.prompt).subspan(static_cast<size_t>(p),
                                                                              static_cast<size_t>(piece)),
                            nullptr, store);
        const double took =
            std::chrono::duration<double>(Clock::now() - t0).count() - (preempted_s - preempted0);
        r.s_per_token = took / static_cast<double>(piece);
        {
          std::lock_guard<std::mutex> lk(smu);
          ++st.prefill_chunks;
          st.prefill_tokens += piece;
          st.prefill_s += took;
          st.prefix = engine.prefix_stats();
        }
        if (r.prefill_pieces++ > 0 && !active.empty()) prefill_debt_s += took;
        if (engine.pos(r.seq) == n) {
          count(&ServerStats::prompt_tokens, n);
          r.gen = std::make_unique<infer::Generation>(&tok, r.sp, r.prompt, r.id);
          if (step(r, logits.data())) active.push_back(rp);
          ended.push_back(&r);
        }
      } catch (const std::exception& e) {
        finish(r, "error", e.what());
        ended.push_back(&r);
      }
    }
    std::erase_if(prefilling, [&](const auto& r) { return std::find(ended.begin(), ended.end(), r.get()) != ended.end(); });
  }

  void decode_round() {
    if (active.empty()) return;
    const auto t0 = Clock::now();
    struct Repay {
      double& debt;
      Clock::time_point t0;
      ~Repay() { debt = std::max(0.0, debt - std::chrono::duration<double>(Clock::now() - t0).count()); }
    } repay{prefill_debt_s, t0};
    std::vector<infer::Engine::Id> seqs;
    std::vector<int32_t> toks;
    for (auto& r : active) seqs.push_back(r->seq), toks.push_back(r->next_token);
    try {
      const std::vector<float>& logits = engine.decode(seqs, toks);
      {
        std::lock_guard<std::mutex> lk(smu);
        st.decode_s += std::chrono::duration<double>(Clock::now() - t0).count();
        ++st.decode_steps;
        st.decode_tokens += static_cast<int64_t>(seqs.size());
        st.max_batch_seen = std::max<int64_t>(st.max_batch_seen, static_cast<int64_t>(seqs.size()));
      }
      std::vector<std::shared_ptr<Request>> keep;
      for (size_t i = 0; i < active.size(); ++i)
        if (step(*active[i], logits.data() + i * static_cast<size_t>(engine.vocab_size()))) keep.push_back(active[i]);
      active.swap(keep);
    } catch (const std::exception& e) {
      for (auto& r : active) finish(*r, "error", e.what());
      active.clear();
    }
  }

  // Moves queued requests that are still in time into `admit` while the batch has room (qmu held).
  void take_queued(std::vector<std::shared_ptr<Request>>& admit) {
    const auto now = Clock::now();
    for (auto it = queue.begin(); it != queue.end();)
      if (expired(**it, now)) it = queue.erase(it);
      else ++it;
    while (!queue.empty() && static_cast<int64_t>(active.size() + prefilling.size() + admit.size()) < o.max_batch) {
      admit.push_back(std::move(queue.front()));
      queue.pop_front();
    }
  }

  // First come, first served while the engine can hold the next one to its limit (the GPU's latent pool);
  // the rest go back to the head of the queue, in order.
  void start_admitted(std::vector<std::shared_ptr<Request>>& admit) {
    size_t started = 0;
    for (; started < admit.size(); ++started) {
      Request& r = *admit[started];
      if (expired(r, Clock::now())) continue;
      if (!engine.fits(r.reserve)) break;
      try {
        start(r);
        prefilling.push_back(admit[started]);
      } catch (const std::exception& e) {
        finish(r, "error", e.what());
      }
    }
    if (started < admit.size()) {
      std::lock_guard<std::mutex> lk(qmu);
      queue.insert(queue.begin(), admit.begin() + static_cast<std::ptrdiff_t>(started), admit.end());
    }
    n_prefilling = static_cast<int64_t>(prefilling.size());
  }

  // Between two sublayers of a continued prefill piece (Engine::set_prefill_yield): requests that arrived meanwhile
  // get their first piece and a decode step now, not after the piece, while the piece has had at least as much time
  // as the requests run inside it (a flood of short requests cannot stop a long prompt). The piece's own sequence
  // is not touched, so its bits are those of an uninterrupted prefill.
  void preempt() {
    if (!preemptible) return;
    const double inside = preempted_s - piece_preempted0;
    if (inside > std::chrono::duration<double>(Clock::now() - piece_t0).count() - inside) return;
    std::vector<std::shared_ptr<Request>> admit;
    {
      std::lock_guard<std::mutex> lk(qmu);
      if (queue.empty() || stopping) return;
      take_queued(admit);
    }
    if (admit.empty()) return;
    const auto t0 = Clock::now();
    preemptible = false;  // (restored below: the requests started here run whole)
    start_admitted(admit);
    prefill_round(true);
    decode_round();
    preemptible = true;
    preempted_s += std::chrono::duration<double>(Clock::now() - t0).count();
    std::lock_guard<std::mutex> lk(smu);
    ++st.preemptions;
  }

  void loop() {
    if (o.compute_nice > 0) {  // (a thread may always lower its own priority)
      const auto tid = static_cast<id_t>(gettid());
      errno = 0;
      const int now = getpriority(PRIO_PROCESS, tid);
      if (errno == 0) setpriority(PRIO_PROCESS, tid, std::min(19, now + o.compute_nice));
    }
    engine.set_prefill_yield([this] { preempt(); });
    struct Unhook {
      infer::Engine& e;
      ~Unhook() { e.set_prefill_yield({}); }
    } unhook{engine};
    while (true) {
      std::vector<std::shared_ptr<Request>> admit;
      {
        std::unique_lock<std::mutex> lk(qmu);
        if (!stopping && active.empty() && prefilling.empty() && queue.empty())
          qcv.wait_for(lk, std::chrono::milliseconds(100));
        if (stopping) break;
        take_queued(admit);
      }
      start_admitted(admit);
      const auto now = Clock::now();
      std::erase_if(prefilling, [&](const std::shared_ptr<Request>& r) { return expired(*r, now); });
      std::erase_if(active, [&](const std::shared_ptr<Request>& r) { return expired(*r, now); });
      prefill_round(true);
      decode_round();
      prefill_round(false);
      n_active = static_cast<int64_t>(active.size());
      n_prefilling = static_cast<int64_t>(prefilling.size());
    }
    // Shutdown: end everything that is running or waiting.
    for (auto& r : active) finish(*r, "shutdown");
    for (auto& r : prefilling) finish(*r, "shutdown");
    active.clear();
    prefilling.clear();
    n_active = 0;
    n_prefilling = 0;
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

  static double finite_lp(double x) { return std::isfinite(x) ? x : -9999.0; }
  json token_bytes(int32_t id) const {
    json b = json::array();
    for (const unsigned char ch : tok.piece_bytes(id)) b.push_back(static_cast<int>(ch));
    return b;
  }
  // Chat: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}.
  json chat_logprobs(const std::vector<infer::TokenLogprobs>& lps) const {
    json content = json::array();
    for (const auto& lp : lps) {
      json top = json::array();
      for (const auto& [id, v] : lp.top)
        top.push_back({{"token", tok.piece_bytes(id)}, {"logprob", finite_lp(v)}, {"bytes", token_bytes(id)}});
      content.push_back({{"token", tok.piece_bytes(lp.token)},
                         {"logprob", finite_lp(lp.logprob)},
                         {"bytes", token_bytes(lp.token)},
                         {"top_logprobs", top}});
    }
    return json{{"content", content}, {"refusal", nullptr}};
  }
  // Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; offsets count from `offset`.
  json completion_logprobs(const std::vector<infer::TokenLogprobs>& lps, int64_t offset) const {
    json tokens = json::array(), lp = json::array(), top = json::array(), off = json::array();
    for (const auto& t : lps) {
      tokens.push_back(tok.piece_bytes(t.token));
      lp.push_back(finite_lp(t.logprob));
      json alt = json::object();
      for (const auto& [id, v] : t.top) alt[tok.piece_bytes(id)] = finite_lp(v);
      top.push_back(alt);
      off.push_back(offset);
      offset += static_cast<int64_t>(tok.piece_bytes(t.token).size());
    }
    return json{{"tokens", tokens}, {"token_logprobs", lp}, {"top_logprobs", top}, {"text_offset", off}};
  }

  json chunk(const Request& r, const std::string& text, const json& finish, bool role = false) const {
    json choice = {{"index", 0}, {"finish_reason", finish}};
    if (r.chat) {
      json delta = json::object();
      if (role) delta["role"] = "assistant";
      if (!text.empty() || role) delta["content"] = text;
      choice["delta"] = delta;
      choice["logprobs"] = nullptr;
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

  void handle(const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader, bool chat) {
    count(&ServerStats::requests);
    Conn* c = t_conn;
    // The body, counted as it arrives (chunked or not) against the size limit and the memory budget.
    auto hold = std::make_shared<Hold>(budget);
    std::string body;
    int fail = 0;
    {
      const int64_t declared = req.has_header("Content-Length") ? std::stoll(req.get_header_value("Content-Length")) : 0;
      if (declared > 0 && !hold->resize(declared)) {
        close_unread(res);
        return respond_busy(res, "the server is out of memory for requests in flight; retry later");
      }
      if (declared > 0) body.reserve(static_cast<size_t>(declared));
    }
    const bool ok = reader([&](const char* d, size_t n) {
      if (static_cast<int64_t>(body.size() + n) > o.max_body_bytes) {
        fail = 413;
        return false;
      }
      if (static_cast<int64_t>(body.size() + n) > hold->bytes() && !hold->resize(static_cast<int64_t>(body.size() + n))) {
        fail = 503;
        return false;
      }
      body.append(d, n);
      return true;
    });
    if (!ok) {
      close_unread(res);
      body = std::string();
      if (fail == 413) {
        count(&ServerStats::rejected);
        return respond_error(res, 413, fmt::format("the request body exceeds the limit of {} bytes", o.max_body_bytes),
                             "invalid_request_error", "", "request_too_large");
      }
      if (fail == 503) return respond_busy(res, "the server is out of memory for requests in flight; retry later");
      if (c && c->timed_out)
        return respond_error(res, 408, fmt::format("the request did not arrive within {} s", o.header_timeout_s),
                             "invalid_request_error", "", "request_timeout");
      return respond_error(res, 400, "the request body could not be read", "invalid_request_error");
    }
    if (c) c->set_phase(Phase::Handling);
    // Parsing holds the text, the JSON tree and the prompt's ids: a few times the body.
    if (!hold->resize(static_cast<int64_t>(body.size()) * 4 + 4096))
      return respond_busy(res, "the server is out of memory for requests in flight; retry later");
    std::shared_ptr<Request> r;
    try {
      r = parse(body, chat);
    } catch (const BadRequest& e) {
      count(&ServerStats::bad_requests);
      return respond_error(res, e.status, e.message, "invalid_request_error", e.param, e.code);
    }
    body = std::string();
    r->reserve = std::min(engine.max_context(), static_cast<int64_t>(r->prompt.size()) + r->sp.max_tokens);
    if (!engine.can_ever_fit(r->reserve)) {
      count(&ServerStats::bad_requests);
      return respond_error(res, 400,
                           fmt::format("the prompt ({} tokens) and max_tokens ({}) need more cache than this server "
                                       "holds for one request ({}); ask for fewer tokens",
                                       r->prompt.size(), r->sp.max_tokens, engine.describe()),
                           "invalid_request_error", "max_tokens", "context_length_exceeded");
    }
    // While it runs: the prompt's ids and echo text, and the text and log-probabilities it may produce.
    const int64_t running = static_cast<int64_t>(r->prompt.size()) * 4 + static_cast<int64_t>(r->echo_text.size()) +
                            r->sp.max_tokens * (r->logprobs >= 0 ? 64 + 16 * r->logprobs : 16) + 4096;
    if (!hold->resize(running)) return respond_busy(res, "the server is out of memory for requests in flight; retry later");
    r->hold = hold;
    if (c) c->log["id"] = rid(*r);
    {
      std::lock_guard<std::mutex> lk(qmu);
      if (stopping) return respond_busy(res, "the server is shutting down");
      queue.push_back(r);
    }
    qcv.notify_all();
    if (!r->stream) return answer(res, r, c);
    stream(res, r);
  }

  void log_request(const Request& r) {
    if (!t_conn) return;
    t_conn->log["prompt_tokens"] = r.prompt.size();
    t_conn->log["completion_tokens"] = r.completion_tokens;
    t_conn->log["finish_reason"] = r.finish_reason;
  }

  // Non-streaming: waits for the end, cancelling the request if the client goes away meanwhile.
  void answer(httplib::Response& res, const std::shared_ptr<Request>& r, Conn* c) {
    std::unique_lock<std::mutex> lk(r->mu);
    while (!r->done) {
      r->cv.wait_for(lk, std::chrono::milliseconds(kPollSliceMs));
      if (!r->done && c && !r->cancelled.load() && peer_gone(c->fd)) {
        r->cancelled = true;
        qcv.notify_all();
      }
    }
    std::string text = r->echo_text;
    std::vector<infer::TokenLogprobs> lps;
    for (auto& p : r->pieces) {
      text += p.text;
      for (auto& l : p.lps) lps.push_back(std::move(l));
    }
    log_request(*r);
    if (!r->error.empty()) return respond_error(res, 500, r->error, "server_error");
    if (r->finish_reason == "timeout")
      return respond_error(res, 504, fmt::format("the request did not finish within {} s", o.request_timeout_s),
                           "server_error", "", "timeout");
    if (r->finish_reason == "shutdown") return respond_busy(res, "the server is shutting down");
    json choice = {{"index", 0}, {"finish_reason", standard_finish(r->finish_reason)}};
    if (r->chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}, {"refusal", nullptr}};
      choice["logprobs"] = r->logprobs >= 0 ? chat_logprobs(lps) : json(nullptr);
    } else {
      choice["text"] = text;
      choice["logprobs"] =
          r->logprobs >= 0 ? completion_logprobs(lps, static_cast<int64_t>(r->echo_text.size())) : json(nullptr);
    }
    const json body = {{"id", rid(*r)},
                       {"object", r->chat ? "chat.completion" : "text_completion"},
                       {"created", r->created},
                       {"model", o.model_name},
                       {"choices", json::array({choice})},
                       {"usage", usage(*r)}};
    res.set_content(dump(body), "application/json");
  }

  // SSE: one `data:` event per released piece, a final event with the finish reason (and usage), an
  // extra usage event when stream_options.include_usage asks for it, then [DONE].
  void stream(httplib::Response& res, const std::shared_ptr<Request>& r) {
    ++open;
    res.set_header("Cache-Control", "no-cache");
    struct State {
      bool first = true;
      int64_t offset = 0;
    };
    auto state = std::make_shared<State>();
    state->offset = static_cast<int64_t>(r->echo_text.size());
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, r, state](size_t, httplib::DataSink& sink) {
          std::deque<Piece> pieces;
          bool done;
          {
            std::unique_lock<std::mutex> lk(r->mu);
            r->cv.wait_for(lk, std::chrono::milliseconds(200), [&] { return !r->pieces.empty() || r->done; });
            pieces.swap(r->pieces);
            done = r->done;
          }
          std::string out;
          if (state->first) {
            if (r->chat) out += "data: " + dump(chunk(*r, "", nullptr, true)) + "\n\n";
            else if (!r->echo_text.empty()) out += "data: " + dump(chunk(*r, r->echo_text, nullptr)) + "\n\n";
          }
          state->first = false;
          for (auto& p : pieces) {
            json ev = chunk(*r, p.text, nullptr);
            if (!p.lps.empty()) {
              ev["choices"][0]["logprobs"] = r->chat ? chat_logprobs(p.lps) : completion_logprobs(p.lps, state->offset);
            }
            state->offset += static_cast<int64_t>(p.text.size());
            out += "data: " + dump(ev) + "\n\n";
          }
          if (done) {
            json last = chunk(*r, "", standard_finish(r->finish_reason));
            if (r->finish_reason != "stop" && r->finish_reason != "length")
              last["choices"][0]["finish_detail"] = r->finish_reason;
            last["usage"] = usage(*r);
            if (!r->error.empty()) last["error"] = error_body(r->error, "server_error")["error"];
            out += "data: " + dump(last) + "\n\n";
            if (r->include_usage) {
              json u = chunk(*r, "", nullptr);
              u["choices"] = json::array();
              u["usage"] = usage(*r);
              out += "data: " + dump(u) + "\n\n";
            }
            out += "data: [DONE]\n\n";
            log_request(*r);
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

  json model_object() const {
    return json{{"id", o.model_name}, {"object", "model"}, {"created", 0}, {"owned_by", "longmoe"},
                {"context_length", engine.max_context()}};
  }

  void access_log(const httplib::Request& req, const httplib::Response& res) {
    if (!log_file) return;
    json line = {{"time", iso_time_now()}, {"method", req.method}, {"path", req.path}, {"status", res.status}};
    if (t_conn) {
      line["remote"] = t_conn->remote;
      line["ms"] = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t_conn->start).count() / 1000.0;
      line["bytes_in"] = t_conn->bytes_in;
      line["bytes_out"] = t_conn->bytes_out;
      for (const auto& [k, v] : t_conn->log.items()) line[k] = v;
    }
    const std::string s = dump(line) + "\n";
    std::lock_guard<std::mutex> lk(log_mu);
    std::fwrite(s.data(), 1, s.size(), log_file);
    std::fflush(log_file);
  }
};

Server::Server(infer::Session& session, const io::Tokenizer& tok, ServerOptions o)
    : Server(std::make_unique<infer::CpuEngine>(session), nullptr, tok, std::move(o)) {}

Server::Server(infer::Engine& engine, const io::Tokenizer& tok, ServerOptions o)
    : Server(nullptr, &engine, tok, std::move(o)) {}

Server::Server(std::unique_ptr<infer::Engine> own, infer::Engine* engine, const io::Tokenizer& tok, ServerOptions o) {
  infer::Engine& served = engine ? *engine : *own;
  impl_ = std::make_unique<Impl>(std::move(own), served, tok, std::move(o));
  Impl& I = *impl_;
  auto& h = I.http;
  // A thread per connection up to the cap, and a few more to answer 503 when every one is busy.
  const size_t threads = static_cast<size_t>(I.o.http_threads) + 16;
  h.new_task_queue = [threads] { return new ConnPool(threads); };
  // httplib's default sets SO_REUSEPORT: a second server on the same port would start and share requests.
  h.set_socket_options([](int s) {
    int yes = 1;
    ::setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  h.set_payload_max_length(static_cast<size_t>(I.o.max_body_bytes));
  h.set_read_timeout(30, 0);
  h.set_write_timeout(30, 0);
  h.set_keep_alive_max_count(1000);
  h.set_keep_alive_timeout(static_cast<time_t>(std::ceil(I.o.keep_alive_s)));
  h.set_pre_routing_handler([&I](const httplib::Request& q, httplib::Response& r) { return I.gate(q, r); });
  h.Get("/health", [&I](const httplib::Request&, httplib::Response& res) {
    const ServerStats s = [&] {
      std::lock_guard<std::mutex> lk(I.smu);
      ServerStats c = I.st;
      c.active = I.n_active.load();
      c.prefilling = I.n_prefilling.load();
      return c;
    }();
    const auto mi = mallinfo2();  // heap bytes in use: tells a leak (growing) from fragmentation (flat)
    res.set_content(dump(json{{"status", "ok"},
                              {"model", I.o.model_name},
                              {"requests", s.requests},
                              {"completed", s.completed},
                              {"active", s.active},
                              {"prefilling", s.prefilling},
                              {"engine", I.engine.describe()},
                              {"decode_steps", s.decode_steps},
                              {"decode_tokens", s.decode_tokens},
                              {"decode_seconds", s.decode_s},
                              {"prefill_chunks", s.prefill_chunks},
                              {"prefill_tokens", s.prefill_tokens},
                              {"preemptions", s.preemptions},
                              {"prompt_tokens", s.prompt_tokens},
                              {"prefill_seconds", s.prefill_s},
                              {"prefix_cache", json{{"entries", s.prefix.entries},
                                                    {"bytes", s.prefix.bytes},
                                                    {"hits", s.prefix.hits},
                                                    {"misses", s.prefix.misses},
                                                    {"tokens_reused", s.prefix.tokens_reused}}},
                              {"connections", I.conns.size()},
                              {"inflight_bytes", I.budget.used()},
                              {"resident_bytes", resident_bytes()},
                              {"peak_resident_bytes", peak_resident_bytes()},
                              {"heap_in_use_bytes", mi.uordblks + mi.hblkhd}}),
                    "application/json");
  });
  h.Get("/v1/models", [&I](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump(json{{"object", "list"}, {"data", json::array({I.model_object()})}}), "application/json");
  });
  h.Get(R"(/v1/models/(.+))", [&I](const httplib::Request& q, httplib::Response& res) {
    const std::string id = q.matches[1];
    if (id != I.o.model_name)
      return I.respond_error(res, 404, fmt::format("the model '{}' does not exist (this server has '{}')", id,
                                                   I.o.model_name),
                             "invalid_request_error", "model", "model_not_found");
    res.set_content(dump(I.model_object()), "application/json");
  });
  h.Post("/v1/completions", [&I](const httplib::Request& q, httplib::Response& r, const httplib::ContentReader& c) {
    I.handle(q, r, c, false);
  });
  h.Post("/v1/chat/completions", [&I](const httplib::Request& q, httplib::Response& r, const httplib::ContentReader& c) {
    I.handle(q, r, c, true);
  });
  h.set_error_handler([&I](const httplib::Request& q, httplib::Response& res) {
    if (res.status == 404 && res.body.empty())
      I.respond_error(res, 404, fmt::format("no route {} {}", q.method, q.path), "invalid_request_error", "",
                      "not_found");
    else if (res.body.empty())
      I.respond_error(res, res.status, fmt::format("HTTP {}", res.status), "invalid_request_error");
  });
  h.set_exception_handler([&I](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const BadRequest& e) {
      what = e.message;
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    I.respond_error(res, 500, what, "server_error");
  });
  h.set_logger([&I](const httplib::Request& q, const httplib::Response& r) { I.access_log(q, r); });
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
    addr_string(ss, &p);
    if (p == port) ::listen(fd, SOMAXCONN);
  }
}
}  // namespace

int Server::bind() {
  Impl& I = *impl_;
  LM_CHECK(I.o.port >= 0 && I.o.port <= 65535, "server: port {} is outside [0, 65535]", I.o.port);
  if (I.o.port == 0) {
    const int p = I.http.bind_to_any_port(I.o.host.c_str());
    LM_CHECK(p > 0, "server: cannot bind {}:<any>: {}", I.o.host, std::strerror(errno));
    I.o.port = p;
  } else {
    errno = 0;
    const bool ok = I.http.bind_to_port(I.o.host.c_str(), I.o.port);
    const int err = errno;
    LM_CHECK(ok, "server: cannot listen on {}:{}: {}{}", I.o.host, I.o.port, err ? std::strerror(err) : "bind failed",
             err == EADDRINUSE ? " (another server holds the port)" : "");
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
  I.net_stopping = true;  // idle and half-sent connections end
  I.http.stop();
}

ServerStats Server::stats() const {
  int64_t queued = 0;
  {
    std::lock_guard<std::mutex> q(impl_->qmu);  // before smu: the scheduler takes qmu, then smu
    queued = static_cast<int64_t>(impl_->queue.size());
  }
  std::lock_guard<std::mutex> lk(impl_->smu);
  ServerStats s = impl_->st;
  s.queued = queued;
  s.active = impl_->n_active.load();
  s.prefilling = impl_->n_prefilling.load();
  s.connections = impl_->conns.size();
  s.inflight_bytes = impl_->budget.used();
  return s;
}

}  // namespace lm::serve
