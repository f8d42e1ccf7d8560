// safetensors reader/writer: round trips for every dtype, zero-copy and copy paths, every kind of
// malformed file (each must raise lm::Error naming the file and, where there is one, the tensor),
// get_as checks, and the atomic-replace guarantee of the writer.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "io/file.hpp"
#include "io/json.hpp"
#include "io/safetensors.hpp"
#include "testing.hpp"

namespace fs = std::filesystem;
using lm::DType;
using lm::Error;
using lm::Shape;
using lm::Tensor;
using lm::io::NamedTensors;
using lm::io::SafeTensorsFile;
using lm::io::save_safetensors;

namespace {

constexpr DType kAllDtypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64};

// A fresh directory per test, removed (permissions restored first) when the test ends.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "longmoe_st_XXXXXX").string();
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }
  std::set<std::string> entries() const {
    std::set<std::string> r;
    for (const auto& e : fs::directory_iterator(path_)) r.insert(e.path().filename().string());
    return r;
  }

 private:
  fs::path path_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return "<unreadable>";
  std::string s(static_cast<size_t>(in.tellg()), '\0');
  in.seekg(0);
  in.read(s.data(), static_cast<std::streamsize>(s.size()));
  return s;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// Raw safetensors bytes: little-endian header length, the header exactly as given, then `data`.
std::string st_bytes(const std::string& header, const std::string& data = "") {
  std::string out;
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + header + data;
}

std::shared_ptr<const std::vector<char>> as_vec(const std::string& s) {
  return std::make_shared<const std::vector<char>>(s.begin(), s.end());
}

// Deterministic test values representable exactly in every dtype (small integers and halves
// for floats), so a round trip through the file can be compared bit for bit.
Tensor make_tensor(DType dt, const Shape& shape, uint64_t seed) {
  const int64_t n = lm::shape_numel(shape);
  const auto v = lm::testing::randn<double>(static_cast<size_t>(n), seed, 50.0);
  Tensor t = Tensor::empty(shape, DType::F64);
  for (int64_t i = 0; i < n; ++i)
    t.data<double>()[i] = lm::dtype_is_float(dt) ? std::round(v[i] * 2) / 2 : std::round(v[i]);
  return t.to(dt);
}

std::string tensor_bytes(const Tensor& t) {
  const Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.raw()), c.nbytes());
}

void expect_same(const Tensor& want, const Tensor& got, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  EXPECT_EQ(got.dtype(), want.dtype()) << what;
  EXPECT_EQ(got.shape(), want.shape()) << what;
  EXPECT_TRUE(got.is_contiguous()) << what;
  EXPECT_EQ(tensor_bytes(got), tensor_bytes(want)) << what;
}

// f() must throw lm::Error whose message contains every needle (file name, tensor name, ...).
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> needles, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no lm::Error was thrown";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << what << ": message \"" << msg << "\" does not mention '" << n << "'";
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": threw a non-lm::Error exception: " << e.what();
  }
}

// Writes `bytes` as <dir>/<name>.safetensors and expects open() to fail naming the file and
// `needles`; also runs the same bytes through from_bytes(), which must name its label.
void expect_bad_file(const TempDir& dir, const std::string& name, const std::string& bytes,
                     std::initializer_list<std::string> needles) {
  SCOPED_TRACE(name);
  const std::string path = dir.file(name + ".safetensors");
  write_bytes(path, bytes);
  std::vector<std::string> with_path(needles);
  with_path.push_back(path);
  try {
    (void)SafeTensorsFile::open(path);
    ADD_FAILURE() << name << ": open() accepted a malformed file";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& n : with_path)
      EXPECT_NE(msg.find(n), std::string::npos) << name << ": message \"" << msg << "\" does not mention '" << n << "'";
  } catch (const std::exception& e) {
    ADD_FAILURE() << name << ": threw a non-lm::Error exception: " << e.what();
  }
  const std::string label = "<label:" + name + ">";
  expect_error([&] { (void)SafeTensorsFile::from_bytes(as_vec(bytes), label); }, {label}, name + " (from_bytes)");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Round trips

TEST(SafeTensorsRoundTrip, EveryDtypeOpenAndFromBytes) {
  TempDir dir;
  NamedTensors ts;
  uint64_t seed = 1;
  for (DType dt : kAllDtypes) {
    ts.emplace_back(std::string("t_") + std::string(lm::dtype_name(dt)), make_tensor(dt, {3, 5}, seed++));
    ts.emplace_back(std::string("v_") + std::string(lm::dtype_name(dt)), make_tensor(dt, {7}, seed++));
    ts.emplace_back(std::string("s_") + std::string(lm::dtype_name(dt)), make_tensor(dt, {}, seed++));  // scalar
    ts.emplace_back(std::string("c_") + std::string(lm::dtype_name(dt)), make_tensor(dt, {2, 1, 3, 2}, seed++));
  }
  const std::string path = dir.file("all.safetensors");
  save_safetensors(path, ts);

  const std::string bytes = read_bytes(path);
  for (int mode = 0; mode < 2; ++mode) {
    SCOPED_TRACE(mode == 0 ? "open" : "from_bytes");
    const SafeTensorsFile f = mode == 0 ? SafeTensorsFile::open(path) : SafeTensorsFile::from_bytes(as_vec(bytes), "mem");
    EXPECT_EQ(f.path(), mode == 0 ? path : "mem");
    ASSERT_EQ(f.tensors().size(), ts.size());
    EXPECT_TRUE(f.metadata().empty());
    std::vector<std::string> names = f.names();
    EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
    for (const auto& [name, t] : ts) {
      ASSERT_TRUE(f.contains(name)) << name;
      EXPECT_EQ(f.info(name).dtype, t.dtype()) << name;
      EXPECT_EQ(f.info(name).shape, t.shape()) << name;
      EXPECT_EQ(f.info(name).end - f.info(name).begin, t.nbytes()) << name;
      expect_same(t, f.get(name), name);
    }
  }
}

TEST(SafeTensorsRoundTrip, HeaderKeepsDataSectionAlignedAndIsStandardJson) {
  TempDir dir;
  const std::string path = dir.file("a.safetensors");
  save_safetensors(path, {{"x", make_tensor(DType::F32, {3}, 1)}}, {{"format", "pt"}});
  const std::string b = read_bytes(path);
  ASSERT_GE(b.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(b[i]);
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(b.size(), 8 + n + 12);
  const auto h = nlohmann::json::parse(b.substr(8, n));
  EXPECT_EQ(h["x"]["dtype"], "F32");
  EXPECT_EQ(h["x"]["shape"], nlohmann::json::array({3}));
  EXPECT_EQ(h["x"]["data_offsets"], nlohmann::json::array({0, 12}));
  EXPECT_EQ(h["__metadata__"]["format"], "pt");
}

TEST(SafeTensorsRoundTrip, NonContiguousInputsAreSavedInLogicalOrder) {
  TempDir dir;
  NamedTensors ts;
  std::vector<Tensor> want;
  uint64_t seed = 100;
  for (DType dt : kAllDtypes) {
    const Tensor base = make_tensor(dt, {4, 3, 5}, seed++);
    const std::string d(lm::dtype_name(dt));
    const Tensor tr = base.transpose(0, 2);     // [5, 3, 4]
    const Tensor sl = base.slice(1, 1, 3);      // [4, 2, 5]
    const Tensor se = base.select(2, 4);        // [4, 3], stride 15/5
    const Tensor tsl = tr.slice(0, 2, 4).select(1, 0);  // [2, 4]
    ASSERT_FALSE(tr.is_contiguous());
    ASSERT_FALSE(sl.is_contiguous());
    ASSERT_FALSE(se.is_contiguous());
    for (const auto& [n, t] : {std::pair{"tr_", tr}, std::pair{"sl_", sl}, std::pair{"se_", se}, std::pair{"ts_", tsl}}) {
      ts.emplace_back(n + d, t);
      want.push_back(t.clone());
    }
  }
  const std::string path = dir.file("nc.safetensors");
  save_safetensors(path, ts);
  const SafeTensorsFile f = SafeTensorsFile::open(path);
  for (size_t i = 0; i < ts.size(); ++i) {
    ASSERT_TRUE(want[i].is_contiguous());
    expect_same(want[i], f.get(ts[i].first), ts[i].first);
    // Element-wise too, against the strided original (independent of clone()).
    const Tensor got = f.get(ts[i].first);
    for (int64_t e = 0; e < got.numel(); ++e) ASSERT_EQ(got.item(e), ts[i].second.item(e)) << ts[i].first << " @" << e;
  }
}

TEST(SafeTensorsRoundTrip, Metadata) {
  TempDir dir;
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"step", "1200"}, {"empty", ""}, {"unicode", "gr\xC3\xBC\xC3\x9F" "e \xE2\x9C\x93"},
      {"quote\"and\\slash", "line\nbreak\ttab"}};
  const std::string path = dir.file("m.safetensors");
  save_safetensors(path, {{"w", make_tensor(DType::BF16, {2, 2}, 5)}}, meta);
  const SafeTensorsFile f = SafeTensorsFile::open(path);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_EQ(f.names(), std::vector<std::string>{"w"});

  // Metadata only, no tensors.
  const std::string p2 = dir.file("only_meta.safetensors");
  save_safetensors(p2, {}, {{"k", "v"}});
  const SafeTensorsFile g = SafeTensorsFile::open(p2);
  EXPECT_TRUE(g.tensors().empty());
  EXPECT_EQ(g.metadata().at("k"), "v");

  // Nothing at all: still a valid file.
  const std::string p3 = dir.file("nothing.safetensors");
  save_safetensors(p3, {});
  const SafeTensorsFile h = SafeTensorsFile::open(p3);
  EXPECT_TRUE(h.tensors().empty());
  EXPECT_TRUE(h.metadata().empty());
}

TEST(SafeTensorsRoundTrip, EmptyTensors) {
  TempDir dir;
  // Empty tensors placed before, between and after non-empty ones: they share offsets with their
  // neighbours, which must not be mistaken for an overlap (whatever the name order).
  const NamedTensors ts = {{"z_empty_first", Tensor::empty({0}, DType::F32)},
                           {"b_data", make_tensor(DType::F32, {4}, 1)},
                           {"y_empty_mid", Tensor::empty({3, 0, 2}, DType::I64)},
                           {"a_empty_mid", Tensor::empty({0, 5}, DType::BF16)},
                           {"c_data", make_tensor(DType::F64, {2}, 2)},
                           {"x_empty_last", Tensor::empty({2, 0}, DType::F16)}};
  const std::string path = dir.file("e.safetensors");
  save_safetensors(path, ts);
  const SafeTensorsFile f = SafeTensorsFile::open(path);
  ASSERT_EQ(f.tensors().size(), ts.size());
  for (const auto& [name, t] : ts) {
    const Tensor g = f.get(name);
    ASSERT_TRUE(g.defined()) << name;
    EXPECT_EQ(g.shape(), t.shape()) << name;
    EXPECT_EQ(g.dtype(), t.dtype()) << name;
    if (t.numel() == 0) {
      EXPECT_EQ(g.numel(), 0) << name;
      EXPECT_EQ(f.info(name).begin, f.info(name).end) << name;
      EXPECT_EQ(f.get_as(name, lm::dtype_is_float(t.dtype()) ? DType::F64 : DType::I64, t.shape()).numel(), 0) << name;
    } else {
      expect_same(t, g, name);
    }
  }

  // A hand-written file whose empty tensor sits inside another tensor's byte range is fine too.
  const std::string hdr =
      R"({"big":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"a":{"dtype":"F32","shape":[0],"data_offsets":[8,8]},)"
      R"("zz":{"dtype":"F32","shape":[0,7],"data_offsets":[0,0]}})";
  const auto g = SafeTensorsFile::from_bytes(as_vec(st_bytes(hdr, std::string(16, '\0'))), "inner-empty");
  EXPECT_EQ(g.get("a").numel(), 0);
  EXPECT_EQ(g.get("zz").shape(), (Shape{0, 7}));
  EXPECT_EQ(g.get("big").item(3), 0.0);
}

TEST(SafeTensorsRoundTrip, HugeEmptyShapesAreRejectedNotOverflowed) {
  // [0, 2^39, 2^39]: zero elements, but its strides would overflow int64.
  const std::string hdr = R"({"e":{"dtype":"F64","shape":[0,549755813888,549755813888],"data_offsets":[0,0]}})";
  expect_error([&] { (void)SafeTensorsFile::from_bytes(as_vec(st_bytes(hdr)), "huge-empty"); },
               {"huge-empty", "'e'", "absurd shape"}, "huge empty shape");
  // A merely large empty shape is fine.
  const std::string ok = R"({"e":{"dtype":"F64","shape":[0,1024,1024],"data_offsets":[0,0]}})";
  const auto f = SafeTensorsFile::from_bytes(as_vec(st_bytes(ok)), "big-empty");
  EXPECT_EQ(f.get("e").shape(), (Shape{0, 1024, 1024}));
}

// ---------------------------------------------------------------------------------------------
// Zero-copy vs copy

TEST(SafeTensorsGet, AlignedTensorsAreZeroCopyMisalignedOnesAreCopied) {
  TempDir dir;
  // "a" (3 bf16 = 6 bytes) pushes "b" (F32) and "c" (F64) off their natural alignment.
  const Tensor a = make_tensor(DType::BF16, {3}, 1);
  const Tensor b = make_tensor(DType::F32, {5}, 2);
  const Tensor c = make_tensor(DType::F64, {2}, 3);
  const Tensor d = make_tensor(DType::F64, {4}, 4);
  const std::string path = dir.file("z.safetensors");
  save_safetensors(path, {{"a", a}, {"b", b}, {"c", c}, {"d", d}});  // offsets 0, 6, 26, 42
  const SafeTensorsFile f = SafeTensorsFile::open(path);
  EXPECT_EQ(f.info("b").begin, 6u);
  EXPECT_EQ(f.info("c").begin, 26u);

  // Zero-copy: every get() views the same mapped bytes. Copy: each get() owns a fresh buffer.
  EXPECT_EQ(f.get("a").raw(), f.get("a").raw());
  EXPECT_NE(f.get("b").raw(), f.get("b").raw());
  EXPECT_NE(f.get("c").raw(), f.get("c").raw());
  // "d" starts at 42, 2 mod 8: misaligned for F64, so copied as well.
  EXPECT_NE(f.get("d").raw(), f.get("d").raw());
  for (const auto& [n, t] : {std::pair{"a", a}, std::pair{"b", b}, std::pair{"c", c}, std::pair{"d", d}}) {
    const Tensor g = f.get(n);
    expect_same(t, g, n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(g.raw()) % lm::dtype_size(g.dtype()), 0u) << n;
  }

  // An aligned F64 tensor is zero-copy.
  const std::string p2 = dir.file("z2.safetensors");
  save_safetensors(p2, {{"d", d}, {"c", c}});
  const SafeTensorsFile g = SafeTensorsFile::open(p2);
  EXPECT_EQ(g.get("d").raw(), g.get("d").raw());
  EXPECT_EQ(g.get("c").raw(), g.get("c").raw());
  expect_same(d, g.get("d"), "d aligned");
  expect_same(c, g.get("c"), "c aligned");
}

TEST(SafeTensorsGet, OddHeaderLengthForcesCopiesWithCorrectValues) {
  // A writer that does not pad its header (legal) puts the data section at an odd address.
  const Tensor x = make_tensor(DType::F32, {3}, 9);
  const Tensor y = make_tensor(DType::I64, {2}, 10);
  std::string hdr = R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"y":{"dtype":"I64","shape":[2],"data_offsets":[12,28]}})";
  if ((8 + hdr.size()) % 2 == 0) hdr += " ";
  const std::string bytes = st_bytes(hdr, tensor_bytes(x) + tensor_bytes(y));
  TempDir dir;
  const std::string path = dir.file("odd.safetensors");
  write_bytes(path, bytes);
  for (const SafeTensorsFile& f : {SafeTensorsFile::open(path), SafeTensorsFile::from_bytes(as_vec(bytes), "odd")}) {
    EXPECT_NE(f.get("x").raw(), f.get("x").raw());
    expect_same(x, f.get("x"), "x");
    expect_same(y, f.get("y"), "y");
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f.get("y").raw()) % 8, 0u);
  }
}

TEST(SafeTensorsGet, ViewsOutliveTheFileObjectAndWritesDoNotReachTheFile) {
  TempDir dir;
  const Tensor w = make_tensor(DType::F32, {64}, 3);
  const std::string path = dir.file("w.safetensors");
  save_safetensors(path, {{"w", w}});
  const std::string before = read_bytes(path);
  Tensor view;
  {
    const SafeTensorsFile f = SafeTensorsFile::open(path);
    view = f.get("w");
    ASSERT_EQ(view.raw(), f.get("w").raw());  // zero-copy
  }
  expect_same(w, view, "after the file object is gone");
  // Writing into a zero-copy view (e.g. a weight updated in place) must neither crash nor
  // change the file on disk.
  view.fill(7.0);
  EXPECT_EQ(view.item(10), 7.0);
  EXPECT_EQ(read_bytes(path), before);
  expect_same(w, SafeTensorsFile::open(path).get("w"), "reopened");
}

// ---------------------------------------------------------------------------------------------
// get_as

TEST(SafeTensorsGetAs, ConvertsAndChecksShapeAndKind) {
  TempDir dir;
  const Tensor f32 = make_tensor(DType::F32, {2, 3}, 1);
  const Tensor i32 = make_tensor(DType::I32, {4}, 2);
  const Tensor bf = make_tensor(DType::BF16, {3}, 3);
  const std::string path = dir.file("g.safetensors");
  save_safetensors(path, {{"f", f32}, {"i", i32}, {"h", bf}});
  const SafeTensorsFile f = SafeTensorsFile::open(path);

  const Tensor d = f.get_as("f", DType::F64, {2, 3});
  EXPECT_EQ(d.dtype(), DType::F64);
  for (int64_t e = 0; e < 6; ++e) EXPECT_EQ(d.item(e), f32.item(e));
  expect_same(f32, f.get_as("f", DType::F32), "same dtype, any shape");
  EXPECT_EQ(f.get_as("h", DType::F32, {3}).item(2), bf.item(2));
  EXPECT_EQ(f.get_as("f", DType::BF16).dtype(), DType::BF16);
  const Tensor l = f.get_as("i", DType::I64, {4});
  for (int64_t e = 0; e < 4; ++e) EXPECT_EQ(l.item(e), i32.item(e));

  expect_error([&] { (void)f.get_as("f", DType::F32, {3, 2}); }, {path, "'f'", "[2, 3]", "[3, 2]"}, "wrong shape");
  expect_error([&] { (void)f.get_as("f", DType::F32, {6}); }, {path, "'f'"}, "wrong rank");
  expect_error([&] { (void)f.get_as("i", DType::F32); }, {path, "'i'", "I32"}, "int as float");
  expect_error([&] { (void)f.get_as("f", DType::I64); }, {path, "'f'", "F32"}, "float as int");
  expect_error([&] { (void)f.get_as("nope", DType::F32); }, {path, "'nope'"}, "missing tensor");
  expect_error([&] { (void)f.get("nope"); }, {path, "'nope'"}, "missing tensor get");
  expect_error([&] { (void)f.info("nope"); }, {path, "'nope'"}, "missing tensor info");
  EXPECT_FALSE(f.contains("nope"));
}

// ---------------------------------------------------------------------------------------------
// Malformed files

TEST(SafeTensorsReject, CannotOpen) {
  TempDir dir;
  const std::string missing = dir.file("missing.safetensors");
  expect_error([&] { (void)SafeTensorsFile::open(missing); }, {missing}, "missing file");
  expect_error([&] { (void)SafeTensorsFile::open(dir.path().string()); }, {dir.path().string(), "regular"},
               "directory");
  expect_error([&] { (void)SafeTensorsFile::from_bytes(nullptr, "nul"); }, {"nul"}, "null bytes");
}

TEST(SafeTensorsReject, FramingErrors) {
  TempDir dir;
  expect_bad_file(dir, "empty", "", {"8"});
  expect_bad_file(dir, "five_bytes", std::string("\x02\x00\x00\x00\x00", 5), {"8"});
  expect_bad_file(dir, "seven_bytes", std::string(7, '\0'), {"8"});
  // Length 1000 but only 10 header bytes follow.
  std::string beyond = st_bytes("{}");
  beyond[0] = static_cast<char>(0xe8);
  beyond[1] = static_cast<char>(0x03);
  expect_bad_file(dir, "header_beyond_file", beyond + std::string(8, ' '), {"truncated", "1000"});
  // Length with the top bit set (would wrap in signed arithmetic).
  std::string huge = st_bytes("{}");
  huge[7] = static_cast<char>(0x80);
  expect_bad_file(dir, "header_len_huge", huge, {"header length"});
  // 200 MiB declared: over the cap even before looking at the file size.
  std::string big = st_bytes("{}");
  big[3] = static_cast<char>(0x0c);
  expect_bad_file(dir, "header_len_over_cap", big, {"header length"});
  expect_bad_file(dir, "header_len_zero", std::string(8, '\0'), {"header length"});
}

TEST(SafeTensorsReject, HeaderJson) {
  TempDir dir;
  expect_bad_file(dir, "invalid_json", st_bytes(R"({"a": {"dtype": "F32",)"), {"JSON"});
  expect_bad_file(dir, "trailing_garbage", st_bytes(R"({} x)"), {"JSON"});
  expect_bad_file(dir, "not_utf8", st_bytes("{\"\xff\xfe\":1}"), {"JSON"});
  expect_bad_file(dir, "nul_in_header", st_bytes(std::string("{\"a\0\":1}", 8)), {"JSON"});
  expect_bad_file(dir, "array_header", st_bytes("[1, 2, 3]"), {"object"});
  expect_bad_file(dir, "string_header", st_bytes("\"hello\""), {"object"});
  expect_bad_file(dir, "number_header", st_bytes("42"), {"object"});
}

TEST(SafeTensorsReject, TensorEntries) {
  TempDir dir;
  const std::string data(64, '\0');
  auto one = [&](const std::string& entry, const std::string& name = "w") {
    return st_bytes("{\"" + name + "\":" + entry + "}", data);
  };
  expect_bad_file(dir, "entry_not_object", one("[1,2]"), {"'w'"});
  expect_bad_file(dir, "empty_name", one(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})", ""), {"empty name"});
  expect_bad_file(dir, "missing_dtype", one(R"({"shape":[2],"data_offsets":[0,8]})"), {"'w'", "dtype"});
  expect_bad_file(dir, "dtype_not_string", one(R"({"dtype":7,"shape":[2],"data_offsets":[0,8]})"), {"'w'", "dtype"});
  expect_bad_file(dir, "dtype_null", one(R"({"dtype":null,"shape":[2],"data_offsets":[0,8]})"), {"'w'", "dtype"});
  expect_bad_file(dir, "unsupported_dtype_u8", one(R"({"dtype":"U8","shape":[2],"data_offsets":[0,2]})"),
                  {"'w'", "unsupported", "U8"});
  expect_bad_file(dir, "unsupported_dtype_fp8", one(R"({"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]})"),
                  {"'w'", "F8_E4M3"});
  expect_bad_file(dir, "lowercase_dtype", one(R"({"dtype":"f32","shape":[2],"data_offsets":[0,8]})"), {"'w'", "f32"});
  expect_bad_file(dir, "missing_shape", one(R"({"dtype":"F32","data_offsets":[0,8]})"), {"'w'", "shape"});
  expect_bad_file(dir, "shape_not_array", one(R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})"), {"'w'", "shape"});
  expect_bad_file(dir, "negative_shape", one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), {"'w'", "shape"});
  expect_bad_file(dir, "float_shape", one(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})"), {"'w'", "shape"});
  expect_bad_file(dir, "fraction_shape", one(R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,6]})"), {"'w'", "shape"});
  expect_bad_file(dir, "string_shape", one(R"({"dtype":"F32","shape":["2"],"data_offsets":[0,8]})"), {"'w'", "shape"});
  expect_bad_file(dir, "absurd_shape", one(R"({"dtype":"F32","shape":[2199023255552],"data_offsets":[0,8]})"),
                  {"'w'", "shape"});
  expect_bad_file(dir, "overflowing_shape",
                  one(R"({"dtype":"F32","shape":[1048576,1048576,1048576,1048576],"data_offsets":[0,8]})"),
                  {"'w'", "shape"});
  expect_bad_file(dir, "u64_shape", one(R"({"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]})"),
                  {"'w'", "shape"});
  expect_bad_file(dir, "missing_offsets", one(R"({"dtype":"F32","shape":[2]})"), {"'w'", "data_offsets"});
  expect_bad_file(dir, "one_offset", one(R"({"dtype":"F32","shape":[2],"data_offsets":[8]})"), {"'w'", "data_offsets"});
  expect_bad_file(dir, "three_offsets", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,16]})"),
                  {"'w'", "data_offsets"});
  expect_bad_file(dir, "negative_offset", one(R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})"),
                  {"'w'", "offset"});
  expect_bad_file(dir, "float_offset", one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8.0]})"), {"'w'", "offset"});
  expect_bad_file(dir, "reversed_offsets", one(R"({"dtype":"F32","shape":[0],"data_offsets":[8,0]})"),
                  {"'w'", "begin"});
  expect_bad_file(dir, "byte_count_short", one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0,8]})"),
                  {"'w'", "[2, 2]", "16"});
  expect_bad_file(dir, "byte_count_long", one(R"({"dtype":"BF16","shape":[3],"data_offsets":[0,8]})"),
                  {"'w'", "[3]", "6"});
  expect_bad_file(dir, "scalar_byte_count", one(R"({"dtype":"F64","shape":[],"data_offsets":[0,4]})"), {"'w'"});
}

TEST(SafeTensorsReject, DataOutOfRange) {
  TempDir dir;
  // Tensor claims bytes past the end of the file (a truncated download).
  const std::string hdr = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})";
  expect_bad_file(dir, "truncated_data", st_bytes(hdr, std::string(20, '\1')), {"truncated", "'w'", "24", "20"});
  expect_bad_file(dir, "no_data_at_all", st_bytes(hdr), {"truncated"});
  // A real file cut short at every few bytes must always be rejected cleanly.
  const std::string good_path = dir.file("good.safetensors");
  save_safetensors(good_path, {{"x", make_tensor(DType::F32, {8}, 1)}, {"y", make_tensor(DType::I64, {3}, 2)}},
                   {{"k", "v"}});
  const std::string good = read_bytes(good_path);
  (void)SafeTensorsFile::open(good_path);
  for (size_t cut = 0; cut < good.size(); cut += 3) {
    const std::string label = "cut@" + std::to_string(cut);
    expect_error([&] { (void)SafeTensorsFile::from_bytes(as_vec(good.substr(0, cut)), label); }, {label}, label);
  }
}

TEST(SafeTensorsReject, OverlappingTensors) {
  TempDir dir;
  const std::string data(32, '\0');
  expect_bad_file(dir, "overlap_partial",
                  st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           data),
                  {"overlap", "'a'", "'b'"});
  expect_bad_file(dir, "overlap_same_range",
                  st_bytes(R"({"p":{"dtype":"I32","shape":[4],"data_offsets":[0,16]},"q":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
                           data),
                  {"overlap", "'p'", "'q'"});
  expect_bad_file(dir, "overlap_contained",
                  st_bytes(R"({"outer":{"dtype":"F64","shape":[4],"data_offsets":[0,32]},"inner":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                           data),
                  {"overlap", "'outer'", "'inner'"});
  // Touching ranges are fine.
  const auto ok = SafeTensorsFile::from_bytes(
      as_vec(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                      data)),
      "touching");
  EXPECT_EQ(ok.tensors().size(), 2u);
}

TEST(SafeTensorsReject, BadMetadata) {
  TempDir dir;
  expect_bad_file(dir, "metadata_string", st_bytes(R"({"__metadata__":"pt"})"), {"__metadata__"});
  expect_bad_file(dir, "metadata_array", st_bytes(R"({"__metadata__":["a"]})"), {"__metadata__"});
  expect_bad_file(dir, "metadata_number_value", st_bytes(R"({"__metadata__":{"format":"pt","step":5}})"),
                  {"__metadata__", "step"});
  expect_bad_file(dir, "metadata_object_value", st_bytes(R"({"__metadata__":{"nested":{"a":"b"}}})"),
                  {"__metadata__", "nested"});
}

TEST(SafeTensorsReject, GoldenFilesStillParse) {
  // Sanity: the real files used by other tests are accepted and fully readable.
  LM_REQUIRE_GOLDEN(golden);
  int n_files = 0;
  for (const auto& e : fs::recursive_directory_iterator(golden)) {
    if (e.path().extension() != ".safetensors" || fs::file_size(e.path()) > (64u << 20)) continue;
    const SafeTensorsFile f = SafeTensorsFile::open(e.path().string());
    for (const auto& name : f.names()) {
      const Tensor t = f.get(name);
      EXPECT_EQ(t.shape(), f.info(name).shape) << e.path() << " " << name;
    }
    ++n_files;
  }
  EXPECT_GT(n_files, 0);
}

TEST(SafeTensorsReject, FuzzSeedCorpusIsWhatItClaims) {
  // fuzz/corpus/safetensors: seeds named bad_* must be rejected, all others must load fully.
  const fs::path corpus = fs::path(LONGMOE_SOURCE_DIR) / "fuzz" / "corpus" / "safetensors";
  if (!fs::is_directory(corpus)) GTEST_SKIP() << "no fuzz corpus at " << corpus;
  int n = 0;
  for (const auto& e : fs::directory_iterator(corpus)) {
    const std::string path = e.path().string();
    if (e.path().filename().string().rfind("bad_", 0) == 0) {
      expect_error([&] { (void)SafeTensorsFile::open(path); }, {path}, path);
    } else {
      const SafeTensorsFile f = SafeTensorsFile::open(path);
      for (const auto& name : f.names()) EXPECT_EQ(f.get(name).shape(), f.info(name).shape) << path << " " << name;
    }
    ++n;
  }
  EXPECT_GT(n, 5);
}

// Not safetensors-specific, but reached by every get_as/convert of untrusted data: float -> int
// conversion must be defined for NaN, infinities and out-of-range values (saturating, NaN -> 0).
TEST(TensorConversion, FloatToIntSaturatesAndMapsNanToZero) {
  const double big = 1e300;
  const Tensor x = Tensor::from_vector<double>({NAN, INFINITY, -INFINITY, big, -big, 3e9, -3e9, 2.9, -2.9, 0.0}, {10});
  const Tensor i32 = x.to(DType::I32);
  const std::vector<int32_t> w32 = {0, INT32_MAX, INT32_MIN, INT32_MAX, INT32_MIN, INT32_MAX, INT32_MIN, 2, -2, 0};
  for (int64_t e = 0; e < 10; ++e) EXPECT_EQ(i32.data<int32_t>()[e], w32[static_cast<size_t>(e)]) << e;
  const Tensor i64 = x.to(DType::I64);
  const std::vector<int64_t> w64 = {0, INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN, 3000000000, -3000000000, 2, -2, 0};
  for (int64_t e = 0; e < 10; ++e) EXPECT_EQ(i64.data<int64_t>()[e], w64[static_cast<size_t>(e)]) << e;
  // Exact boundaries: -2^31 fits, 2^31 does not; I64 -> I32 saturates too.
  const Tensor b = Tensor::from_vector<int64_t>({-2147483648LL, 2147483647LL, 2147483648LL, -2147483649LL}, {4});
  const Tensor b32 = b.to(DType::I32);
  EXPECT_EQ(b32.data<int32_t>()[0], INT32_MIN);
  EXPECT_EQ(b32.data<int32_t>()[1], INT32_MAX);
  EXPECT_EQ(b32.data<int32_t>()[2], INT32_MAX);
  EXPECT_EQ(b32.data<int32_t>()[3], INT32_MIN);
  // F32 NaN through half types and back to int.
  EXPECT_EQ(Tensor::full({2}, NAN, DType::BF16).to(DType::I32).data<int32_t>()[1], 0);
  EXPECT_EQ(Tensor::full({2}, INFINITY, DType::F16).to(DType::I64).data<int64_t>()[0], INT64_MAX);
}

// ---------------------------------------------------------------------------------------------
// Atomic writes

TEST(SafeTensorsAtomicWrite, OverwriteFullyReplacesTheOldFile) {
  TempDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  save_safetensors(path, {{"old_a", make_tensor(DType::F32, {1000}, 1)}, {"old_b", make_tensor(DType::I64, {10}, 2)}},
                   {{"version", "1"}});
  const Tensor n = make_tensor(DType::BF16, {3}, 3);
  save_safetensors(path, {{"new", n}}, {{"version", "2"}});  // smaller than before
  const SafeTensorsFile f = SafeTensorsFile::open(path);
  EXPECT_EQ(f.names(), std::vector<std::string>{"new"});
  EXPECT_EQ(f.metadata().at("version"), "2");
  expect_same(n, f.get("new"), "new");
  EXPECT_EQ(dir.entries(), std::set<std::string>{"ckpt.safetensors"});
  EXPECT_EQ(fs::file_size(path), read_bytes(path).size());

  // A reader holding the old mapping keeps seeing the old data after a replace (new inode).
  const Tensor keep = f.get("new");
  save_safetensors(path, {{"new", make_tensor(DType::BF16, {3}, 4)}});
  expect_same(n, keep, "old mapping after replace");
}

TEST(SafeTensorsAtomicWrite, FailedSaveLeavesOldFileUntouched) {
  TempDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  save_safetensors(path, {{"w", make_tensor(DType::F32, {16}, 1)}}, {{"step", "10"}});
  const std::string before = read_bytes(path);
  const Tensor t = make_tensor(DType::F32, {4}, 2);

  expect_error([&] { save_safetensors(path, {{"a", t}, {"b", t}, {"a", t}}); }, {path, "'a'"}, "duplicate name");
  expect_error([&] { save_safetensors(path, {{"a", t}, {"", t}}); }, {path}, "empty name");
  expect_error([&] { save_safetensors(path, {{"__metadata__", t}}); }, {path, "__metadata__"}, "reserved name");
  expect_error([&] { save_safetensors(path, {{"a", t}, {"u", Tensor()}}); }, {path, "'u'"}, "undefined tensor");
  expect_error([&] { save_safetensors(path, {{"bad\xff", t}}); }, {path}, "non-UTF-8 name");
  expect_error([&] { save_safetensors(path, {{"a", t}}, {{"k", "\xc3"}}); }, {path}, "non-UTF-8 metadata");

  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(dir.entries(), std::set<std::string>{"ckpt.safetensors"});
  EXPECT_EQ(SafeTensorsFile::open(path).metadata().at("step"), "10");
}

TEST(SafeTensorsAtomicWrite, UnwritableDirectoryLeavesOldFileUntouched) {
  TempDir dir;
  const fs::path sub = dir.path() / "ro";
  fs::create_directory(sub);
  const std::string path = (sub / "ckpt.safetensors").string();
  save_safetensors(path, {{"w", make_tensor(DType::F32, {16}, 1)}});
  const std::string before = read_bytes(path);
  fs::permissions(sub, fs::perms::owner_read | fs::perms::owner_exec);
  // Root (and CAP_DAC_OVERRIDE) ignores directory permissions: probe instead of guessing.
  const bool writable = ::access(sub.c_str(), W_OK) == 0;
  if (!writable) {
    expect_error([&] { save_safetensors(path, {{"w", make_tensor(DType::F32, {4}, 2)}}); }, {path},
                 "read-only directory");
    EXPECT_EQ(read_bytes(path), before);
  }
  fs::permissions(sub, fs::perms::owner_all);
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(sub)) left.insert(e.path().filename().string());
  EXPECT_EQ(left, std::set<std::string>{"ckpt.safetensors"});
  if (writable) GTEST_SKIP() << "running with permission to write a read-only directory (root?)";
}

TEST(SafeTensorsAtomicWrite, WriteErrorMidFileLeavesOldFileUntouched) {
  // A disk that fills up mid-write, simulated with RLIMIT_FSIZE (which binds root as well): the
  // write() of the temporary file fails with EFBIG after 4 KiB.
  TempDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  save_safetensors(path, {{"w", make_tensor(DType::F32, {100}, 1)}}, {{"step", "1"}});
  const std::string before = read_bytes(path);
  struct rlimit old_lim {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_lim), 0);
  struct rlimit lim = old_lim;
  lim.rlim_cur = 4096;
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  expect_error([&] { save_safetensors(path, {{"big", Tensor::zeros({100000})}}, {{"step", "2"}}); }, {path},
               "disk full");
  ::setrlimit(RLIMIT_FSIZE, &old_lim);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_EQ(dir.entries(), std::set<std::string>{"ckpt.safetensors"});
  EXPECT_EQ(SafeTensorsFile::open(path).metadata().at("step"), "1");
}

TEST(SafeTensorsAtomicWrite, UnreachableTargetsFailCleanly) {
  TempDir dir;
  // Parent folder does not exist.
  const std::string nowhere = dir.file("no/such/dir/x.safetensors");
  expect_error([&] { save_safetensors(nowhere, {{"w", make_tensor(DType::F32, {2}, 1)}}); }, {nowhere}, "no parent");
  // Parent is a regular file.
  const std::string file = dir.file("plain");
  write_bytes(file, "plain file");
  const std::string under_file = file + "/x.safetensors";
  expect_error([&] { save_safetensors(under_file, {{"w", make_tensor(DType::F32, {2}, 1)}}); }, {under_file},
               "parent is a file");
  EXPECT_EQ(read_bytes(file), "plain file");
  // Target is an existing non-empty directory: rename fails, the directory and its content stay,
  // and the temporary file is removed.
  const fs::path target = dir.path() / "target";
  fs::create_directory(target);
  write_bytes((target / "inside").string(), "keep me");
  expect_error([&] { save_safetensors(target.string(), {{"w", make_tensor(DType::F32, {2}, 1)}}); },
               {target.string()}, "target is a directory");
  EXPECT_TRUE(fs::is_directory(target));
  EXPECT_EQ(read_bytes((target / "inside").string()), "keep me");
  EXPECT_EQ(dir.entries(), (std::set<std::string>{"plain", "target"}));
}

TEST(SafeTensorsAtomicWrite, WriteFileAtomicReplacesBytesAndPermissions) {
  TempDir dir;
  const std::string path = dir.file("blob.bin");
  lm::io::write_file_atomic(path, std::string("first version, rather long"));
  lm::io::write_file_atomic(path, std::string("v2\0x", 4));
  EXPECT_EQ(read_bytes(path), std::string("v2\0x", 4));
  lm::io::write_file_atomic(path, "");
  EXPECT_EQ(read_bytes(path), "");
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  EXPECT_EQ(dir.entries(), std::set<std::string>{"blob.bin"});
  // A relative path (no folder part) works too.
  const fs::path cwd = fs::current_path();
  fs::current_path(dir.path());
  lm::io::write_file_atomic("rel.bin", "rel");
  fs::current_path(cwd);
  EXPECT_EQ(read_bytes(dir.file("rel.bin")), "rel");
}

// Only regular files are opened: a FIFO under a checkpoint's or a config's name is refused at once instead of
// blocking the open or the read forever; a JSON number out of range names the file.
TEST(SafeTensorsFiles, FifosAreRefusedAndJsonOverflowNamesTheFile) {
  TempDir d;
  for (const char* name : {"model.safetensors", "config.json", "tokenizer.model"})
    ASSERT_EQ(::mkfifo(d.file(name).c_str(), 0600), 0) << name;
  const auto t0 = std::chrono::steady_clock::now();
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const std::string st = message([&] { SafeTensorsFile::open(d.file("model.safetensors")); });
  EXPECT_NE(st.find("not a regular file"), std::string::npos) << st;
  const std::string js = message([&] { lm::io::load_json_file(d.file("config.json")); });
  EXPECT_NE(js.find("not a regular file"), std::string::npos) << js;
  const std::string rf = message([&] { lm::io::read_file(d.file("tokenizer.model")); });
  EXPECT_NE(rf.find("not a regular file"), std::string::npos) << rf;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  lm::io::write_file_atomic(d.file("big.json"), R"({"vocab_size": 1e400})");
  const std::string big = message([&] { lm::io::load_json_file(d.file("big.json")); });
  EXPECT_NE(big.find(d.file("big.json")), std::string::npos) << big;
  EXPECT_NE(big.find("1e400"), std::string::npos) << big;
}
