// `longmoe serve --model DIR [--port N]`: the OpenAI-compatible server (src/serve). SIGTERM or SIGINT
// shuts it down cleanly: running requests end with finish_reason "shutdown", then the listener closes.
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <cstdio>
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
};

int run(Args a) {
  // Signals go to one waiting thread (blocked everywhere else: set before
  // any thread exists, so OpenMP's, OpenBLAS's and the server's threads inherit the mask).
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // A long-running server must not creep: main() keeps every freed block in the heap (right for training
  // steps of one size), but requests of every size on ~100 threads then spread free memory over many
  // arenas. Two arenas, large blocks mapped and unmapped, and the heap top trimmed keep RSS flat.
  mallopt(M_ARENA_MAX, 2);
  mallopt(M_MMAP_THRESHOLD, 128 << 10);
  mallopt(M_TRIM_THRESHOLD, 8 << 20);
  infer::LoadedModel m = a.load();
  infer::Session s(*m.model, a.session_options());
  if (a.so.model_name.empty()) a.so.model_name = m.name;
  serve::Server server(s, *m.tokenizer, a.so);
  const int port = server.bind();
  std::fprintf(stderr, "longmoe serve: model '%s' (%s) on http://%s:%d, context %ld, batch %ld\n",
               a.so.model_name.c_str(), m.dir.c_str(), a.so.host.c_str(), port, static_cast<long>(s.max_context()),
               static_cast<long>(a.so.max_batch));
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&set, &sig);
    if (sig == SIGTERM || sig == SIGINT) std::fprintf(stderr, "longmoe serve: signal %d, shutting down\n", sig);
    server.stop();
  });
  server.run();
  pthread_kill(waiter.native_handle(), SIGTERM);  // wakes the waiter if run() ended another way
  waiter.join();
  const serve::ServerStats st = server.stats();
  std::fprintf(stderr, "longmoe serve: stopped after %ld requests (%ld bad, %ld timeouts, %ld cancelled)\n",
               static_cast<long>(st.requests), static_cast<long>(st.bad_requests), static_cast<long>(st.timeouts),
               static_cast<long>(st.cancelled));
  return 0;
}

app::Register reg({"serve", "OpenAI-compatible HTTP server (completions, chat completions, SSE streaming)",
                   [](CLI::App& sub) {
                     auto a = std::make_shared<Args>();
                     a->add_model(sub);
                     a->so.model_name.clear();
                     sub.add_option("--host", a->so.host, "listen address (default 127.0.0.1)");
                     sub.add_option("--port", a->so.port, "listen port (0: any free port)");
                     sub.add_option("--name", a->so.model_name, "model name clients use (default: directory name)");
                     sub.add_option("--max-batch", a->so.max_batch, "sequences decoded together");
                     sub.add_option("--timeout", a->so.request_timeout_s, "seconds a request may take");
                     sub.add_option("--http-threads", a->so.http_threads, "concurrent connections");
                     sub.add_option("--default-max-tokens", a->so.default_max_tokens, "max_tokens when absent");
                     return [a] { return run(*a); };
                   }});

}  // namespace
