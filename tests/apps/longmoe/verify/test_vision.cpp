// `longmoe verify DIR` on the vision golden: passes in fp32, float64 and with the float64 definition, and fails
// (without crashing) when an expectation is wrong or the inputs are inconsistent.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>

#include "apps/longmoe/verify/vision.hpp"
#include "core/error.hpp"
#include "io/safetensors.hpp"
#include "testing.hpp"

using namespace lm;
namespace fs = std::filesystem;

namespace {
// A copy of the golden folder with `file` rewritten by `edit`.
std::string edited_copy(const std::string& src, const std::string& name, const std::string& file,
                        const std::function<void(io::NamedTensors&)>& edit) {
  const fs::path dst = fs::path(::testing::TempDir()) / name;
  fs::remove_all(dst);
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(src)) fs::copy_file(e.path(), dst / e.path().filename());
  const auto f = io::SafeTensorsFile::open(src + "/" + file);
  io::NamedTensors t;
  for (const auto& n : f.names()) {
    Tensor copy = Tensor::empty(f.info(n).shape, f.info(n).dtype);  // owned: the mapped file stays untouched
    copy.copy_from(f.get(n));
    t.emplace_back(n, copy);
  }
  edit(t);
  fs::remove(dst / file);
  io::save_safetensors((dst / file).string(), t, {});
  return dst.string();
}
}  // namespace

TEST(VerifyVision, GoldenPasses) {
  LM_REQUIRE_GOLDEN(dir);
  const std::string d = dir + "/vision/moonvit-tiny";
  ASSERT_TRUE(app::is_vision_dir(d));
  EXPECT_FALSE(app::is_vision_dir(dir + "/model/k3-tiny"));
  EXPECT_EQ(app::verify_vision_dir(d, 0, false), 0);
  EXPECT_EQ(app::verify_vision_dir(d, 1e-6, true), 0);        // float64: far inside the fp32 tolerance
  EXPECT_EQ(app::verify_vision_dir(d, 1e-6, true, true), 0);  // the float64 definition
}

TEST(VerifyVision, WrongExpectationsAndInputsFail) {
  LM_REQUIRE_GOLDEN(dir);
  const std::string d = dir + "/vision/moonvit-tiny";
  const std::string bad = edited_copy(d, "vision_bad_expected", "expected.safetensors", [](io::NamedTensors& t) {
    for (auto& [n, x] : t)
      if (n == "features") x.data<float>()[5] += 0.5f;
  });
  EXPECT_EQ(app::verify_vision_dir(bad, 0, false), 1);
  const std::string bad_in = edited_copy(d, "vision_bad_inputs", "inputs.safetensors", [](io::NamedTensors& t) {
    for (auto& [n, x] : t)
      if (n == "grid_thws") x.data<int32_t>()[2] = 6;  // (1, 4, 6): no longer 112 patches
  });
  try {
    app::verify_vision_dir(bad_in, 0, false);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("grid_thws"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("pixel_values has 112 rows"), std::string::npos) << e.what();
  }
}
