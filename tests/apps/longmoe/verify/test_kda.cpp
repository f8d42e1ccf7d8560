// The whole fused operator (L2 norm, gate, β sigmoid, core, and back) against the golden op files,
// through the same code path `longmoe verify` uses, for every core path.
#include <gtest/gtest.h>

#include <filesystem>

#include "io/safetensors.hpp"
#include "apps/longmoe/verify/kda.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::kda;
using namespace lm::app;

namespace {
std::vector<std::string> golden_files(const std::string& dir) {
  std::vector<std::string> r;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/kda"))
    if (e.path().extension() == ".safetensors") r.push_back(e.path().string());
  std::sort(r.begin(), r.end());
  return r;
}
}  // namespace

TEST(KdaFused, EveryGoldenFilePassesEveryPath) {
  LM_REQUIRE_GOLDEN(dir);
  const auto files = golden_files(dir);
  ASSERT_FALSE(files.empty());
  const std::vector<std::string> expected{"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0"};
  for (const auto& path : files) {
    const auto f = io::SafeTensorsFile::open(path);
    ASSERT_TRUE(is_kda_golden(f)) << path;
    const bool bounded_gate = f.metadata().at("lower_bound") != "none";
    for (CorePath core : {CorePath::Chunked, CorePath::Reference}) {
      for (DiagPath diag : {DiagPath::Auto, DiagPath::Exact, DiagPath::Bounded}) {
        if (core == CorePath::Reference && diag != DiagPath::Auto) continue;
        VerifyOptions opt;
        opt.core = core;
        opt.diag = diag;
        if (diag == DiagPath::Bounded && !bounded_gate) {
          EXPECT_THROW(verify_golden(f, opt, nullptr), Error) << path;
          continue;
        }
        const auto rows = verify_golden(f, opt, nullptr);
        ASSERT_EQ(rows.size(), expected.size()) << path;
        for (size_t i = 0; i < rows.size(); ++i) {
          EXPECT_EQ(rows[i].name, expected[i]);
          EXPECT_LT(rows[i].err, 1e-4) << path << " " << rows[i].name << " path " << diag_path_name(diag);
        }
        // float64 through the same chunked code: far tighter.
        opt.f64 = true;
        for (const auto& r : verify_golden(f, opt, nullptr)) EXPECT_LT(r.err, 1e-6) << path << " f64 " << r.name;
      }
    }
  }
}

TEST(KdaFused, VerifyRejectsInconsistentFiles) {
  // A file whose v disagrees with q in T: a clear error, not a crash.
  const std::string path = ::testing::TempDir() + "/kda_bad.safetensors";
  io::NamedTensors t;
  for (const char* n : {"q", "k", "g"}) t.emplace_back(n, Tensor::zeros({1, 4, 1, 8}));
  t.emplace_back("v", Tensor::zeros({1, 5, 1, 8}));
  t.emplace_back("beta", Tensor::zeros({1, 4, 1}));
  t.emplace_back("A_log", Tensor::zeros({1}));
  t.emplace_back("dt_bias", Tensor::zeros({8}));
  io::save_safetensors(path, t, {{"lower_bound", "-5.0"}});
  const auto f = io::SafeTensorsFile::open(path);
  ASSERT_TRUE(is_kda_golden(f));
  try {
    verify_golden(f, VerifyOptions{}, nullptr);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("v must be"), std::string::npos) << e.what();
  }
  io::save_safetensors(path, t, {{"lower_bound", "banana"}});
  EXPECT_THROW(verify_golden(io::SafeTensorsFile::open(path), VerifyOptions{}, nullptr), Error);
}
