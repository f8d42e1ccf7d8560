// IDX files (io/idx.hpp): a small generated file read back plain and gzip-compressed, every malformation a clear
// error naming the file, and Debian's Fashion-MNIST when it is installed.
#include <gtest/gtest.h>

#include <zlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include "core/error.hpp"
#include "io/file.hpp"
#include "io/idx.hpp"
#include "testing.hpp"

using namespace lm;
namespace fs = std::filesystem;

namespace {

std::string idx_bytes(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& data, uint8_t type = 0x08) {
  std::string s = {0, 0, static_cast<char>(type), static_cast<char>(dims.size())};
  for (uint32_t d : dims)
    for (int k = 3; k >= 0; --k) s.push_back(static_cast<char>((d >> (8 * k)) & 0xFF));
  s.append(data.begin(), data.end());
  return s;
}

struct Dir {
  fs::path p = fs::temp_directory_path() / ("longmoe-idx-" + std::to_string(::getpid()));
  Dir() { fs::create_directories(p); }
  ~Dir() { fs::remove_all(p); }
  std::string gz(const std::string& name, const std::string& bytes) const {
    const std::string path = (p / name).string();
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
    return path;
  }
  std::string plain(const std::string& name, const std::string& bytes) const {
    const std::string path = (p / name).string();
    io::write_file_atomic(path, bytes);
    return path;
  }
};

using lm::testing::error_of;

std::vector<uint8_t> ramp(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 7 + 3);
  return v;
}

}  // namespace

TEST(Idx, ReadsPlainAndGzip) {
  Dir d;
  const auto px = ramp(5 * 4 * 3);
  const std::string b = idx_bytes({5, 4, 3}, px);
  for (const std::string& path : {d.gz("a.gz", b), d.plain("a.idx", b)}) {
    const io::IdxArray a = io::read_idx(path);
    EXPECT_EQ(a.dims, (std::vector<int64_t>{5, 4, 3})) << path;
    EXPECT_EQ(a.data, px) << path;
  }
}

TEST(Idx, MalformedFilesAreClearErrors) {
  Dir d;
  const auto px = ramp(24);
  EXPECT_NE(error_of([&] { io::parse_idx("\0\0", "x"); }).find("too short"), std::string::npos);
  EXPECT_NE(error_of([&] { io::parse_idx(idx_bytes({24}, px, 0x0D), "x"); }).find("element type 0x0d"),
            std::string::npos);
  std::string magic = idx_bytes({24}, px);
  magic[0] = 1;
  EXPECT_NE(error_of([&] { io::parse_idx(magic, "x"); }).find("not an IDX file"), std::string::npos);
  EXPECT_NE(error_of([&] { io::parse_idx(idx_bytes({}, {}), "x"); }).find("no dimensions"), std::string::npos);
  EXPECT_NE(error_of([&] { io::parse_idx(idx_bytes({4, 0}, {}), "x"); }).find("dimension 1 is zero"),
            std::string::npos);
  const std::string whole = idx_bytes({4, 6}, px);
  EXPECT_NE(error_of([&] { io::parse_idx(whole.substr(0, whole.size() - 1), "x"); }).find("truncated"),
            std::string::npos);
  EXPECT_NE(error_of([&] { io::parse_idx(whole + "z", "x"); }).find("trailing"), std::string::npos);
  EXPECT_NE(error_of([&] { io::parse_idx(whole.substr(0, 9), "x"); }).find("truncated IDX header"), std::string::npos);
  // A gzip stream cut short, and garbage after a gzip magic.
  const std::string gz = d.gz("b.gz", idx_bytes({600}, ramp(600)));
  const std::string bytes = io::read_file(gz);
  const std::string cut = d.plain("cut.gz", bytes.substr(0, bytes.size() / 2));
  const std::string e1 = error_of([&] { io::read_idx(cut); });
  EXPECT_NE(e1.find("cut.gz"), std::string::npos) << e1;
  EXPECT_TRUE(e1.find("gzip") != std::string::npos || e1.find("truncated") != std::string::npos) << e1;
  const std::string junk = d.plain("junk.gz", std::string("\x1f\x8b\x08\x00garbage-garbage-garbage", 27));
  EXPECT_NE(error_of([&] { io::read_idx(junk); }).find("junk.gz"), std::string::npos);
  EXPECT_NE(error_of([&] { io::read_idx((d.p / "none.gz").string()); }).find("no such file"), std::string::npos);
  EXPECT_NE(error_of([&] { io::read_idx(gz, 100); }).find("more than 100 bytes"), std::string::npos);
}

// The Fashion-MNIST layout from a generated pair of files: sizes, labels and the errors of a broken pair.
TEST(Idx, FashionMnistPairs) {
  Dir d;
  d.gz("train-images-idx3-ubyte.gz", idx_bytes({3, 2, 2}, ramp(12)));
  d.gz("train-labels-idx1-ubyte.gz", idx_bytes({3}, {9, 0, 7}));
  const io::LabelledImages t = io::read_fashion_mnist(d.p.string(), "train");
  EXPECT_EQ(t.n, 3);
  EXPECT_EQ(t.rows, 2);
  EXPECT_EQ(t.cols, 2);
  EXPECT_EQ(t.labels, (std::vector<uint8_t>{9, 0, 7}));
  EXPECT_EQ(t.image(2)[0], ramp(12)[8]);
  EXPECT_EQ(io::fashion_mnist_classes()[t.labels[2]], "sneaker");
  d.gz("t10k-images-idx3-ubyte.gz", idx_bytes({3, 2, 2}, ramp(12)));
  d.gz("t10k-labels-idx1-ubyte.gz", idx_bytes({2}, {1, 2}));
  EXPECT_NE(error_of([&] { io::read_fashion_mnist(d.p.string(), "t10k"); }).find("3 images but"), std::string::npos);
  d.gz("t10k-labels-idx1-ubyte.gz", idx_bytes({3}, {1, 12, 2}));
  EXPECT_NE(error_of([&] { io::read_fashion_mnist(d.p.string(), "t10k"); }).find("label 12 of item 1"),
            std::string::npos);
  d.gz("t10k-labels-idx1-ubyte.gz", idx_bytes({3, 1}, {1, 1, 2}));
  EXPECT_NE(error_of([&] { io::read_fashion_mnist(d.p.string(), "t10k"); }).find("labels are [N]"), std::string::npos);
  EXPECT_NE(error_of([&] { io::read_fashion_mnist(d.p.string(), "test"); }).find("not train or t10k"),
            std::string::npos);
  EXPECT_NE(error_of([&] { io::read_fashion_mnist((d.p / "nope").string(), "train"); }).find("dataset-fashion-mnist"),
            std::string::npos);
}

TEST(Idx, DebianFashionMnist) {
  const std::string dir(io::kFashionMnistDir);
  if (!fs::exists(dir + "/t10k-labels-idx1-ubyte.gz")) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  const io::LabelledImages t = io::read_fashion_mnist(dir, "t10k");
  EXPECT_EQ(t.n, 10000);
  EXPECT_EQ(t.rows, 28);
  EXPECT_EQ(t.cols, 28);
  std::vector<int> per(10);
  for (uint8_t l : t.labels) ++per[l];
  for (int c : per) EXPECT_EQ(c, 1000);  // the test split is balanced
}
