// Sharded HF checkpoints: write -> read round trip, index validation, crash safety of the writer.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "io/checkpoint.hpp"
#include "io/file.hpp"
#include "io/json.hpp"
#include "testing.hpp"

namespace {

using lm::Tensor;
using lm::io::Checkpoint;
using lm::io::json;
using lm::io::NamedTensors;
namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("lm_ckpt_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string str() const { return path.string(); }
};

NamedTensors sample_tensors() {
  NamedTensors t;
  t.emplace_back("model.embed_tokens.weight", Tensor::from_vector(lm::testing::randn<float>(64 * 8, 1), {64, 8}));
  for (int i = 0; i < 4; ++i) {
    t.emplace_back("model.layers." + std::to_string(i) + ".mlp.up_proj.weight",
                   Tensor::from_vector(lm::testing::randn<float>(16 * 8, 10 + i), {16, 8}));
    t.emplace_back("model.layers." + std::to_string(i) + ".input_layernorm.weight",
                   Tensor::from_vector(lm::testing::randn<double>(8, 20 + i), {8}));
  }
  t.emplace_back("ids", Tensor::from_vector(std::vector<int32_t>{1, 2, 3, 4, 5}, {5}));
  t.emplace_back("lm_head.weight", Tensor::from_vector(lm::testing::randn<float>(64 * 8, 2), {64, 8}).to(lm::DType::BF16));
  return t;
}

void expect_same(const Tensor& a, const Tensor& b, const std::string& name) {
  ASSERT_EQ(a.dtype(), b.dtype()) << name;
  ASSERT_EQ(a.shape(), b.shape()) << name;
  ASSERT_EQ(a.nbytes(), b.nbytes()) << name;
  EXPECT_EQ(0, std::memcmp(a.contiguous().raw(), b.contiguous().raw(), a.nbytes())) << name;
}

using lm::testing::error_of;

TEST(Checkpoint, ShardedRoundTrip) {
  TempDir d("rt");
  const NamedTensors ts = sample_tensors();
  const uint64_t limit = 2100;  // embedding (2048 B) alone; smaller tensors packed together
  const auto files = lm::io::save_checkpoint(d.str(), ts, limit, {{"note", "test"}});
  ASSERT_GE(files.size(), 3u);
  EXPECT_EQ(fs::path(files.back()).filename(), lm::io::kIndexFileName);
  EXPECT_FALSE(fs::exists(d.path / lm::io::kSingleFileName));

  const Checkpoint ck = Checkpoint::open(d.str());
  EXPECT_EQ(ck.size(), ts.size());
  EXPECT_EQ(ck.shards().size(), files.size() - 1);
  uint64_t total = 0;
  for (const auto& [name, t] : ts) {
    ASSERT_TRUE(ck.contains(name)) << name;
    expect_same(t, ck.get(name), name);
    total += t.nbytes();
  }
  EXPECT_EQ(ck.total_bytes(), total);
  EXPECT_FALSE(ck.contains("nope"));
  // Shards respect the limit (a tensor larger than the limit would sit alone).
  for (const auto& s : ck.shards()) {
    uint64_t b = 0;
    for (const auto& t : s.tensors()) b += t.end - t.begin;
    EXPECT_TRUE(b <= limit || s.tensors().size() == 1) << s.path();
    EXPECT_EQ(s.metadata().at("note"), "test");
    EXPECT_EQ(s.metadata().at("format"), "pt");
  }
  // The index follows the HF layout.
  const json idx = lm::io::load_json_file((d.path / lm::io::kIndexFileName).string());
  EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_EQ(idx["weight_map"]["lm_head.weight"].get<std::string>(),
            fs::path(ck.file_of("lm_head.weight")).filename().string());
  EXPECT_NE(idx["weight_map"]["ids"].get<std::string>().find("-of-"), std::string::npos);
  // Opening the index file directly gives the same.
  EXPECT_EQ(Checkpoint::open((d.path / lm::io::kIndexFileName).string()).names(), ck.names());
  // get_as converts and checks shapes; errors name the tensor.
  EXPECT_EQ(ck.get_as("lm_head.weight", lm::DType::F32).dtype(), lm::DType::F32);
  const std::string e = error_of([&] { (void)ck.get_as("lm_head.weight", lm::DType::F32, {8, 64}); });
  EXPECT_NE(e.find("lm_head.weight"), std::string::npos) << e;
  const std::string e2 = error_of([&] { (void)ck.get("missing.weight"); });
  EXPECT_NE(e2.find("missing.weight"), std::string::npos) << e2;
}

TEST(Checkpoint, SingleFileWhenItFits) {
  TempDir d("single");
  const NamedTensors ts = sample_tensors();
  const auto files = lm::io::save_checkpoint(d.str(), ts, uint64_t{1} << 30);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(fs::path(files[0]).filename(), lm::io::kSingleFileName);
  EXPECT_FALSE(fs::exists(d.path / lm::io::kIndexFileName));
  const Checkpoint ck = Checkpoint::open(d.str());
  for (const auto& [name, t] : ts) expect_same(t, ck.get(name), name);
  // A path to the .safetensors file works too.
  EXPECT_EQ(Checkpoint::open(files[0]).size(), ts.size());
}

TEST(Checkpoint, ResaveReplacesThePreviousCheckpoint) {
  TempDir d("resave");
  NamedTensors ts = sample_tensors();
  lm::io::save_checkpoint(d.str(), ts, 2100);  // sharded
  ASSERT_TRUE(fs::exists(d.path / lm::io::kIndexFileName));
  NamedTensors small(ts.begin(), ts.begin() + 2);
  lm::io::save_checkpoint(d.str(), small, uint64_t{1} << 30);  // single file now
  EXPECT_FALSE(fs::exists(d.path / lm::io::kIndexFileName));
  EXPECT_EQ(Checkpoint::open(d.str()).size(), 2u);
  lm::io::save_checkpoint(d.str(), ts, 2100);  // and back to shards
  EXPECT_FALSE(fs::exists(d.path / lm::io::kSingleFileName));
  EXPECT_EQ(Checkpoint::open(d.str()).size(), ts.size());
}

TEST(Checkpoint, FailedSaveLeavesNoIndex) {
  TempDir d("crash");
  const NamedTensors ts = sample_tensors();
  lm::io::save_checkpoint(d.str(), ts, 2100);
  // Block the second shard's final name with a non-empty folder: its rename fails mid-save.
  const auto ck = Checkpoint::open(d.str());
  const std::string second = fs::path(ck.shards()[1].path()).filename().string();
  fs::remove(d.path / second);
  fs::create_directories(d.path / second / "blocker");
  EXPECT_THROW(lm::io::save_checkpoint(d.str(), ts, 2100), lm::Error);
  EXPECT_FALSE(fs::exists(d.path / lm::io::kIndexFileName));  // no index pointing at a missing shard
  const std::string e = error_of([&] { (void)Checkpoint::open(d.str()); });
  EXPECT_NE(e.find("holds no checkpoint"), std::string::npos) << e;
}

TEST(Checkpoint, SaveRejectsBadInput) {
  TempDir d("bad");
  NamedTensors ts = sample_tensors();
  EXPECT_THROW(lm::io::save_checkpoint(d.str(), {}, 100), lm::Error);
  EXPECT_THROW(lm::io::save_checkpoint(d.str(), ts, 0), lm::Error);
  ts.push_back(ts[0]);
  const std::string e = error_of([&] { lm::io::save_checkpoint(d.str(), ts, 2100); });
  EXPECT_NE(e.find("model.embed_tokens.weight"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(d.path / lm::io::kIndexFileName));
}

// Writes a sharded checkpoint, then lets `corrupt` edit the index JSON; expects an error with `needles`.
void expect_corrupt(const std::string& tag, const std::function<void(json&, const fs::path&)>& corrupt,
                    std::initializer_list<std::string> needles) {
  TempDir d(tag);
  lm::io::save_checkpoint(d.str(), sample_tensors(), 2100);
  const fs::path ip = d.path / lm::io::kIndexFileName;
  json idx = lm::io::load_json_file(ip.string());
  corrupt(idx, d.path);
  if (!idx.is_null()) lm::io::write_file_atomic(ip.string(), idx.dump());
  const std::string e = error_of([&] { (void)Checkpoint::open(d.str()); });
  ASSERT_FALSE(e.empty()) << tag << ": no error";
  for (const auto& n : needles) EXPECT_NE(e.find(n), std::string::npos) << tag << ": '" << n << "' not in: " << e;
}

TEST(Checkpoint, CorruptIndexErrors) {
  expect_corrupt("missing_shard", [](json& j, const fs::path&) { j["weight_map"]["ids"] = "model-00009-of-00009.safetensors"; },
                 {"ids", "model-00009-of-00009.safetensors", "does not exist"});
  expect_corrupt("deleted_shard",
                 [](json& j, const fs::path& dir) { fs::remove(dir / j["weight_map"]["ids"].get<std::string>()); },
                 {"ids", "does not exist"});
  expect_corrupt("wrong_shard",
                 [](json& j, const fs::path&) {
                   j["weight_map"]["ids"] = j["weight_map"]["model.embed_tokens.weight"];
                 },
                 {"ids", "has no such tensor"});
  expect_corrupt("unlisted", [](json& j, const fs::path&) { j["weight_map"].erase("ids"); },
                 {"ids", "does not list"});
  expect_corrupt("extra_entry", [](json& j, const fs::path&) { j["weight_map"]["ghost.weight"] = j["weight_map"]["ids"]; },
                 {"ghost.weight", "has no such tensor"});
  expect_corrupt("traversal", [](json& j, const fs::path&) { j["weight_map"]["ids"] = "../model.safetensors"; },
                 {"ids", "plain file name"});
  expect_corrupt("not_string", [](json& j, const fs::path&) { j["weight_map"]["ids"] = 3; }, {"ids", "string"});
  expect_corrupt("no_map", [](json& j, const fs::path&) { j.erase("weight_map"); }, {"weight_map"});
  expect_corrupt("map_array", [](json& j, const fs::path&) { j["weight_map"] = json::array(); }, {"weight_map"});
  expect_corrupt("empty_map", [](json& j, const fs::path&) { j["weight_map"] = json::object(); }, {"no tensors"});
  expect_corrupt("truncated",
                 [](json& j, const fs::path& dir) {
                   const std::string s = j.dump();
                   lm::io::write_file_atomic((dir / lm::io::kIndexFileName).string(), s.substr(0, s.size() / 2));
                   j = nullptr;  // keep the truncated file
                 },
                 {lm::io::kIndexFileName, "not valid JSON"});
  expect_corrupt("truncated_shard",
                 [](json& j, const fs::path& dir) {
                   const fs::path s = dir / j["weight_map"]["lm_head.weight"].get<std::string>();
                   fs::resize_file(s, fs::file_size(s) - 7);
                 },
                 {"truncated"});
}

// A run folder whose `latest` a kill left missing or naming a folder renamed aside: resume finds the complete
// checkpoint; `latest` may not point outside the run, and naming nothing complete stays an error.
TEST(Checkpoint, RunFolderWithoutAValidLatest) {
  TempDir d("latest");
  const fs::path run = d.path;
  auto make = [&](const std::string& rel) {
    const fs::path c = run / rel;
    lm::io::save_checkpoint(c.string(), sample_tensors(), uint64_t{1} << 30);
    lm::io::write_file_atomic((c / "config.json").string(), "{}\n");
  };
  make("ckpt/step-00000005");
  make("ckpt/step-00000010");
  // No `latest` (a kill during the first save's last steps): the newest step folder.
  EXPECT_EQ(lm::io::resolve_checkpoint(run.string()), (run / "ckpt/step-00000010").string());
  // `latest` names a folder renamed aside by a same-step save that did not finish: its .old- copy.
  fs::rename(run / "ckpt/step-00000010", run / "ckpt/.old-step-00000010");
  lm::io::write_file_atomic((run / "latest").string(), "ckpt/step-00000010\n");
  EXPECT_EQ(lm::io::resolve_checkpoint(run.string()), (run / "ckpt/.old-step-00000010").string());
  // A valid `latest` wins over newer folders.
  lm::io::write_file_atomic((run / "latest").string(), "ckpt/step-00000005\n");
  EXPECT_EQ(lm::io::resolve_checkpoint(run.string()), (run / "ckpt/step-00000005").string());
  for (const char* bad : {"../elsewhere\n", "/tmp\n", "ckpt/../../x\n"}) {
    lm::io::write_file_atomic((run / "latest").string(), bad);
    EXPECT_NE(error_of([&] { lm::io::resolve_checkpoint(run.string()); }).find("not a folder inside the run"),
              std::string::npos)
        << bad;
  }
  // `latest` naming a folder that is not there (nor aside): an error, not another checkpoint.
  lm::io::write_file_atomic((run / "latest").string(), "ckpt/step-00000007\n");
  EXPECT_NE(error_of([&] { lm::io::resolve_checkpoint(run.string()); }).find("not a checkpoint"), std::string::npos);
}

TEST(Checkpoint, OpenErrors) {
  TempDir d("empty");
  std::string e = error_of([&] { (void)Checkpoint::open(d.str()); });
  EXPECT_NE(e.find("holds no checkpoint"), std::string::npos) << e;
  e = error_of([&] { (void)Checkpoint::open(d.str() + "/absent.safetensors"); });
  EXPECT_NE(e.find("absent.safetensors"), std::string::npos) << e;
}

TEST(Checkpoint, OpensGoldenModel) {
  LM_REQUIRE_GOLDEN(g);
  const Checkpoint ck = Checkpoint::open(g + "/model/k3-tiny");
  EXPECT_TRUE(ck.contains("lm_head.weight"));
  EXPECT_EQ(ck.info("lm_head.weight").dtype, lm::DType::BF16);
  // Re-shard the golden weights and read them back unchanged.
  TempDir d("golden");
  NamedTensors ts;
  for (const auto& n : ck.names()) ts.emplace_back(n, ck.get(n));
  lm::io::save_checkpoint(d.str(), ts, 64 * 1024);
  const Checkpoint back = Checkpoint::open(d.str());
  EXPECT_GT(back.shards().size(), 1u);
  EXPECT_EQ(back.names(), ck.names());
  for (const auto& [n, t] : ts) expect_same(t, back.get(n), n);
}

}  // namespace
