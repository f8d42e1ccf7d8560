// Issue 24: the `serve` verb's values are range-checked with clear errors (never a libgomp segfault or a
// silently different value): --threads, --context, --port, --http-threads, --default-max-tokens, ...; and
// a busy port is an error; SIGTERM while loading ends the process. Runs the longmoe binary beside the tests (skips when it is not built).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "io/file.hpp"
#include "model/cuda/gpu_model.hpp"
#include "tests/serve/harness.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::serve_test;
namespace fs = std::filesystem;

namespace {

using lm::testing::CliRun;

CliRun longmoe(const std::string& args) { return lm::testing::run_longmoe(args, "LONGMOE_NO_REEXEC=1 timeout 60 "); }

// A config and tokenizer for `serve --init-config` (a random tiny model).
struct Files {
  fs::path dir = fs::temp_directory_path() / ("longmoe_cli_" + std::to_string(getpid()));
  std::string cfg, tok;
  Files() {
    fs::create_directories(dir);
    cfg = (dir / "config.json").string();
    tok = (dir / "tokenizer.model").string();
    std::ofstream(tok, std::ios::binary) << tokenizer().model_bytes();
    std::ofstream(cfg) << small_config(tokenizer().vocab_size()).to_json().dump();
  }
  ~Files() { fs::remove_all(dir); }
  std::string model() const { return "--init-config '" + cfg + "' --tokenizer '" + tok + "'"; }
};

}  // namespace

TEST(ServeCli, BadValuesAreClearErrors) {
  if (!fs::exists(LONGMOE_BINARY)) GTEST_SKIP() << LONGMOE_BINARY << " is not built";
  Files f;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--threads 0 serve " + f.model(), "--threads"},
      {"--threads -3 serve " + f.model(), "--threads"},
      {"--threads 100000 serve " + f.model(), "--threads"},
      {"serve --port 70000 " + f.model(), "--port"},
      {"serve --port -1 " + f.model(), "--port"},
      {"serve --context -5 " + f.model(), "--context"},
      {"serve --context 0 " + f.model(), "--context"},
      {"serve --http-threads 0 " + f.model(), "--http-threads"},
      {"serve --http-threads 100000 " + f.model(), "--http-threads"},
      {"serve --default-max-tokens 0 " + f.model(), "--default-max-tokens"},
      {"serve --max-batch 0 " + f.model(), "--max-batch"},
      {"serve --timeout -1 " + f.model(), "--timeout"},
      {"serve --prefill-chunk 0 " + f.model(), "--prefill-chunk"},
      {"serve --cors https://x.example/ " + f.model(), "CORS origin"},
      {"serve --context 256 --default-max-tokens 300 " + f.model(), "--default-max-tokens"},
      {"serve --device tpu " + f.model(), "--device"},
      {"generate --device gpu --prompt x " + f.model(), "--device"},
  };
  for (const auto& [args, what] : cases) {
    const CliRun r = longmoe(args);
    EXPECT_GT(r.rc, 0) << args << " was accepted:\n" << r.out;  // CLI11's codes (100+) or longmoe's 2
    EXPECT_LT(r.rc, 128) << args << " crashed:\n" << r.out;
    EXPECT_NE(r.out.find(what), std::string::npos) << args << ":\n" << r.out;
  }
}

TEST(ServeCli, BusyPortIsAnError) {
  if (!fs::exists(LONGMOE_BINARY)) GTEST_SKIP() << LONGMOE_BINARY << " is not built";
  Files f;
  Harness h(opts());
  const CliRun r = longmoe("serve --port " + std::to_string(h.port) + " " + f.model());
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find(std::to_string(h.port)), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("in use"), std::string::npos) << r.out;
}

// --device cuda where no GPU can be used (CI): every inference verb says so before loading the model.
TEST(ServeCli, InferenceVerbsOnTheGpuWithoutOne) {
  if (!fs::exists(LONGMOE_BINARY)) GTEST_SKIP() << LONGMOE_BINARY << " is not built";
  if (model::cuda::available()) GTEST_SKIP() << "a GPU is usable here";
  Files f;
  for (const std::string verb : {"generate --prompt x", "chat", "eval --passkey 256", "serve"}) {
    const CliRun r = longmoe(verb + " --device cuda " + f.model());
    EXPECT_GT(r.rc, 0) << verb << " was accepted:\n" << r.out;
    EXPECT_LT(r.rc, 128) << verb << " crashed:\n" << r.out;
    EXPECT_NE(r.out.find("no usable CUDA device"), std::string::npos) << verb << ":\n" << r.out;
  }
}

// SIGTERM while the model loads ends the process at once (it once waited for the load, then served): the model here
// (a dense FFN of 2^20 hidden units, 100M parameters) takes seconds to initialise; the signal goes out as soon as the
// process blocks SIGTERM for its signal thread, the first thing `serve` does.
TEST(ServeCli, SigtermWhileLoadingEndsTheProcess) {
  if (!fs::exists(LONGMOE_BINARY)) GTEST_SKIP() << LONGMOE_BINARY << " is not built";
  Files f;
  io::json big = small_config(tokenizer().vocab_size()).to_json();
  big["intermediate_size"] = 1 << 20;
  std::ofstream(f.cfg) << big.dump();
  const std::string log = (f.dir / "serve.log").string();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::string cmd = "LONGMOE_NO_REEXEC=1 exec '" + std::string(LONGMOE_BINARY) + "' serve --port 0 " +
                            f.model() + " > '" + log + "' 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // SigBlk of /proc/<pid>/status is a hex mask: SIGTERM (15) is bit 14.
  auto blocks_sigterm = [&] {
    std::ifstream st("/proc/" + std::to_string(pid) + "/status");
    for (std::string line; std::getline(st, line);)
      if (line.rfind("SigBlk:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> 14) & 1;
    return 0ull;
  };
  const auto t0 = Clock::now();
  while (!blocks_sigterm() && Clock::now() - t0 < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ::kill(pid, SIGTERM);
  const auto t1 = Clock::now();
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() - t1 < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (done == 0) {
    ::kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t1).count();
  const std::string out = io::read_file(log);
  std::printf("[ measure  ] SIGTERM while loading: exit after %.0f ms\n", ms);
  ASSERT_EQ(done, pid) << "still running 10 s after SIGTERM:\n" << out;
  EXPECT_LT(ms, 2000);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM) << out;
  EXPECT_NE(out.find("while loading"), std::string::npos) << out;
  EXPECT_EQ(out.find("http://"), std::string::npos) << out;  // it never served
}
