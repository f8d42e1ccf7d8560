// Issue 24: the server through the official OpenAI Node SDK (tests/serve/openai_sdk.mjs) on 127.0.0.1.
// The SDK (npm `openai`, major 6, which runs on Node 20) is installed once into <build>/openai-sdk (git-ignored);
// without node, npm or the registry the test skips and says why, or fails with LONGMOE_REQUIRE_NODE_SDK=1 (CI, where
// scripts/deps.sh installs node and npm).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/env.hpp"
#include "tests/serve/harness.hpp"

using namespace lm;
using namespace lm::serve_test;
namespace fs = std::filesystem;

namespace {
int shell(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return rc == -1 ? -1 : WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
}
std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
}  // namespace

// Skips, or fails when CI requires the test to run.
#define SDK_MISSING(why)                                                          \
  do {                                                                            \
    if (env::require_node_sdk()) FAIL() << why << " (LONGMOE_REQUIRE_NODE_SDK=1)"; \
    GTEST_SKIP() << why;                                                          \
  } while (0)

TEST(OpenAISdk, OfficialNodeClient) {
  if (shell("command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1") != 0)
    SDK_MISSING("node and npm are not installed: the OpenAI Node SDK test needs them (scripts/deps.sh)");
  const fs::path dir = fs::path(LONGMOE_BINARY).parent_path() / "openai-sdk";
  fs::create_directories(dir);
  if (!fs::exists(dir / "node_modules" / "openai" / "package.json")) {
    std::ofstream(dir / "package.json") << R"({"private": true, "description": "longmoe test: the OpenAI SDK"})" << "\n";
    const std::string cmd = "cd '" + dir.string() +
                            "' && timeout 300 npm install --no-audit --no-fund --loglevel=error openai@6 "
                            "> npm-install.log 2>&1";
    if (shell(cmd) != 0)
      SDK_MISSING("npm could not install the openai package (offline?): " << slurp(dir / "npm-install.log"));
  }
  fs::copy_file(fs::path(LONGMOE_SOURCE_DIR) / "tests" / "serve" / "openai_sdk.mjs", dir / "openai_sdk.mjs",
                fs::copy_options::overwrite_existing);
  serve::ServerOptions o = opts();
  o.api_key = "sk-longmoe-sdk-test";
  Harness h(o);
  const std::string cmd = "cd '" + dir.string() + "' && LONGMOE_BASE_URL=http://127.0.0.1:" + std::to_string(h.port) +
                          "/v1 LONGMOE_TEST_KEY=" + o.api_key + " LONGMOE_MODEL=" + o.model_name +
                          " timeout 120 node openai_sdk.mjs > sdk-run.log 2>&1";
  const int rc = shell(cmd);
  const std::string out = slurp(dir / "sdk-run.log");
  std::printf("%s", out.c_str());
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out.find("FAIL"), std::string::npos);
}
