// `longmoe serve --model DIR [--port N] [--api-key KEY | LONGMOE_API_KEY=KEY] [--cors ORIGIN]
// [--access-log FILE] ...`: the OpenAI-compatible server (src/serve; its header says what each option
// guards). Every value is range-checked before the model loads. SIGTERM or SIGINT shuts it down cleanly:
// running requests end (finish_detail "shutdown"), then the listener closes.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>

#include "apps/longmoe/commands.hpp"
#include "apps/longmoe/infer_common.hpp"
#include "core/error.hpp"
#include "serve/server.hpp"

namespace {

using namespace lm;

struct Args : app::InferArgs {
  serve::ServerOptions so;
  bool default_max_tokens_given = false;
};

// The thread that takes SIGTERM / SIGINT, from before the model loads: a signal while loading ends the
// process at once (serving writes nothing), afterwards it stops the server.
struct SignalWaiter {
  sigset_t set;
  std::atomic<serve::Server*> server{nullptr};
  std::atomic<bool> finished{false};
  std::thread t;
  explicit SignalWaiter(const sigset_t& s) : set(s) {
    t = std::thread([this] {
      int sig = 0;
      sigwait(&set, &sig);
      if (finished.load()) return;
      if (serve::Server* sv = server.load()) {
        std::fprintf(stderr, "longmoe serve: signal %d, shutting down\n", sig);
        sv->stop();
      } else {
        std::fprintf(stderr, "longmoe serve: signal %d while loading, exiting\n", sig);
        std::_Exit(128 + sig);
      }
    });
  }
  void finish() {
    if (!t.joinable()) return;
    finished = true;
    pthread_kill(t.native_handle(), SIGTERM);  // wakes the waiter if run() ended another way
    t.join();
  }
  ~SignalWaiter() { finish(); }
};

int run(Args a) {
  // Signals go to one waiting thread (blocked everywhere else: set before
  // any thread exists, so OpenMP's, OpenBLAS's and the server's threads inherit the mask).
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  SignalWaiter waiter(set);
  // A long-running server must not creep: main() keeps every freed block in the heap (right for training
  // steps of one size), but requests of every size on ~100 threads then spread free memory over many
  // arenas. Two arenas, large blocks mapped and unmapped, and the heap top trimmed keep RSS flat.
  mallopt(M_ARENA_MAX, 2);
  mallopt(M_MMAP_THRESHOLD, 128 << 10);
  mallopt(M_TRIM_THRESHOLD, 8 << 20);
  infer::LoadedModel m = a.load();
  // On the GPU, every sequence of a batch has a slot (KDA states) and a share of the latent pool.
  infer::OwnedEngine engine = a.engine(m, a.so.max_batch);
  infer::Engine& s = *engine;
  // (The built-in default is capped at the context per request; a value given explicitly must fit.)
  LM_CHECK(!a.default_max_tokens_given || a.so.default_max_tokens <= s.max_context(),
           "--default-max-tokens {} exceeds the context limit of {} tokens", a.so.default_max_tokens, s.max_context());
  if (a.so.model_name.empty()) a.so.model_name = m.name;
  // A multimodal model takes image_url parts (on either device: the engines run the tower).
  if (m.config.vision && m.tokenizer && m.tokenizer->has_special("<|image|>")) {
    infer::image_token(m.config, *m.tokenizer);
    a.so.vision = *m.config.vision;
  }
  serve::Server server(s, *m.tokenizer, a.so);
  const int port = server.bind();
  std::fprintf(stderr, "longmoe serve: model '%s' (%s) on http://%s:%d, context %ld, batch %ld, %s%s\n",
               a.so.model_name.c_str(), m.dir.c_str(), a.so.host.c_str(), port, static_cast<long>(s.max_context()),
               static_cast<long>(a.so.max_batch), s.describe().c_str(),
               a.so.api_key.empty() ? "" : ", API key required");
  waiter.server = &server;
  server.run();
  waiter.finish();
  const serve::ServerStats st = server.stats();
  std::fprintf(stderr, "longmoe serve: stopped after %ld requests (%ld bad, %ld timeouts, %ld cancelled)\n",
               static_cast<long>(st.requests), static_cast<long>(st.bad_requests), static_cast<long>(st.timeouts),
               static_cast<long>(st.cancelled));
  return 0;
}

app::Register reg({"serve", "OpenAI-compatible HTTP server (completions, chat completions, SSE streaming)",
                   [](CLI::App& sub) {
                     auto a = std::make_shared<Args>();
                     // The scheduler prefills in rounds of whole chunks (--prefill-slice-ms) between other requests'
                     // tokens, and a chunk cannot be cut: on the CPU a small chunk bounds how long a short request
                     // waits behind a long prompt. 2 busy cores, a 4-layer k3-small, a 60K-token prompt: short
                     // requests' p99 6.6x unloaded with 8 (3.4x at --threads 1), 8.8x with 16, ~19x with 128
                     // (README, attack table), for about half the prefill speed of 128 early in a prompt.
                     a->cpu_chunk = 8;
                     // The GPU's GEMMs want thousands of rows; its chunks still interleave with decode steps.
                     a->gpu_chunk = 2048;
                     a->add_model(sub);
                     a->so.model_name.clear();
                     auto& so = a->so;
                     sub.add_option("--host", so.host, "listen address (default 127.0.0.1; a loopback address checks Host)");
                     sub.add_option("--port", so.port, "listen port in [0, 65535] (0: any free port)")
                         ->check(CLI::Range(0, 65535));
                     sub.add_option("--name", so.model_name, "model name clients use (default: directory name)");
                     sub.add_option("--max-batch", so.max_batch, "sequences prefilling or decoding together")
                         ->check(CLI::Range(int64_t(1), int64_t(4096)));
                     sub.add_option("--timeout", so.request_timeout_s, "seconds a request may take")
                         ->check(CLI::Range(1e-3, 1e7));
                     sub.add_option("--http-threads", so.http_threads,
                                    "connections served at once, one thread each (default 256)")
                         ->check(CLI::Range(2, 1000));
                     CLI::Option* dmt = sub.add_option("--default-max-tokens", so.default_max_tokens,
                                    "max_tokens when a request has none (at most the context)")
                         ->check(CLI::Range(int64_t(1), int64_t(1) << 26));
                     sub.add_option("--api-key", so.api_key,
                                    "require 'Authorization: Bearer KEY' on every route but /health (prefer the "
                                    "environment variable: a command line is visible to other users)")
                         ->envname("LONGMOE_API_KEY");
                     sub.add_option("--cors", so.cors_origins,
                                    "allow browser requests from this origin (scheme://host[:port], or *); repeatable")
                         ->take_all();
                     sub.add_option("--allowed-host", so.allowed_hosts,
                                    "accept this Host header besides localhost/127.0.0.1/[::1]; repeatable")
                         ->take_all();
                     sub.add_option("--access-log", so.access_log, "append one JSON line per request to FILE");
                     app::InferArgs::add_image_limits(sub, so.image_limits);
                     auto body_mb = std::make_shared<double>(8), inflight_mb = std::make_shared<double>(512);
                     sub.add_option("--max-body-mb", *body_mb, "largest request body in MiB (default 8)")
                         ->check(CLI::Range(0.001, 1024.0));
                     sub.add_option("--max-inflight-mb", *inflight_mb,
                                    "memory for request bodies and prompts in flight, MiB (default 512; then 503)")
                         ->check(CLI::Range(0.001, 1048576.0));
                     sub.add_option("--header-timeout", so.header_timeout_s,
                                    "seconds a request's head and body may take to arrive, in all (default 10)")
                         ->check(CLI::Range(1e-3, 3600.0));
                     sub.add_option("--keep-alive", so.keep_alive_s, "seconds an idle connection stays open (default 5)")
                         ->check(CLI::Range(1e-3, 3600.0));
                     auto slice_ms = std::make_shared<double>(so.prefill_slice_s * 1e3);
                     sub.add_option("--prefill-slice-ms", *slice_ms,
                                    "prefill work per scheduler round between decode steps, ms (default 3; whole "
                                    "--prefill-chunk units, at least one)")
                         ->check(CLI::Range(0.1, 60000.0));
                     auto nice = std::make_shared<int>(-1);
                     sub.add_option("--compute-nice", *nice,
                                    "the engine's threads run this much nicer than the HTTP threads, 0-19 (default "
                                    "10 on the CPU: a request is taken in without waiting behind a prefill for a "
                                    "time slice; 0 on the GPU)")
                         ->check(CLI::Range(0, 19));
                     return [a, body_mb, inflight_mb, dmt, slice_ms, nice] {
                       a->so.prefill_slice_s = *slice_ms * 1e-3;
                       a->so.compute_nice = *nice >= 0 ? *nice : a->device == "cpu" ? 10 : 0;
                       a->default_max_tokens_given = dmt->count() > 0;
                       a->so.max_body_bytes = static_cast<int64_t>(*body_mb * 1048576.0);
                       a->so.max_inflight_bytes = static_cast<int64_t>(*inflight_mb * 1048576.0);
                       a->so.validate();  // before loading the model: a bad option fails at once
                       return run(*a);
                     };
                   }});

}  // namespace
