// IDX reading (see idx.hpp); gzip through zlib's gzread, which also reads an uncompressed file as it is.
#include "io/idx.hpp"

#include <zlib.h>

#include <filesystem>
#include <memory>

#include "core/error.hpp"

namespace lm::io {

IdxArray parse_idx(std::string_view b, const std::string& ctx) {
  LM_CHECK(b.size() >= 4, "{}: {} bytes is too short for an IDX header", ctx, b.size());
  const auto u8 = [&](size_t i) { return static_cast<uint8_t>(b[i]); };
  LM_CHECK(u8(0) == 0 && u8(1) == 0, "{}: not an IDX file (its first two bytes are not zero)", ctx);
  LM_CHECK(u8(2) == 0x08, "{}: IDX element type 0x{:02x} is not unsigned byte (0x08)", ctx, u8(2));
  const size_t n = u8(3);
  LM_CHECK(n >= 1, "{}: IDX header with no dimensions", ctx);
  LM_CHECK(b.size() >= 4 + 4 * n, "{}: truncated IDX header ({} dimensions need {} bytes, the file has {})", ctx, n,
           4 + 4 * n, b.size());
  IdxArray a;
  uint64_t total = 1;
  for (size_t k = 0; k < n; ++k) {
    const size_t o = 4 + 4 * k;
    const uint64_t d = (uint64_t(u8(o)) << 24) | (uint64_t(u8(o + 1)) << 16) | (uint64_t(u8(o + 2)) << 8) | u8(o + 3);
    LM_CHECK(d >= 1, "{}: IDX dimension {} is zero", ctx, k);
    total *= d;
    LM_CHECK(total <= b.size(), "{}: IDX dimensions need more bytes than the file's {}", ctx, b.size());
    a.dims.push_back(static_cast<int64_t>(d));
  }
  const size_t body = b.size() - 4 - 4 * n;
  LM_CHECK(body == total, "{}: IDX data is {} bytes, its dimensions need {} ({})", ctx, body, total,
           body < total ? "truncated" : "trailing bytes");
  a.data.assign(b.begin() + static_cast<ptrdiff_t>(4 + 4 * n), b.end());
  return a;
}

IdxArray read_idx(const std::string& path, int64_t max_bytes) {
  LM_CHECK(std::filesystem::is_regular_file(path), "{}: no such file", path);
  std::unique_ptr<gzFile_s, int (*)(gzFile)> f(gzopen(path.c_str(), "rb"), gzclose);
  LM_CHECK(f != nullptr, "{}: cannot open", path);
  std::string bytes;
  char buf[1 << 16];
  while (true) {
    const int got = gzread(f.get(), buf, sizeof buf);
    if (got < 0) {
      int code = 0;
      const char* why = gzerror(f.get(), &code);
      fail("{}: corrupt gzip data ({})", path, why ? why : "unknown error");
    }
    if (got == 0) break;
    bytes.append(buf, static_cast<size_t>(got));
    LM_CHECK(std::ssize(bytes) <= max_bytes, "{}: more than {} bytes decompressed", path, max_bytes);
  }
  // zlib reports a stream cut short only through gzerror after the last read.
  int code = 0;
  gzerror(f.get(), &code);
  LM_CHECK(code == Z_OK || code == Z_STREAM_END, "{}: truncated or corrupt gzip stream", path);
  return parse_idx(bytes, path);
}

Image LabelledImages::rgb(int64_t i, int64_t side) const {
  LM_CHECK(i >= 0 && i < n, "image {} outside [0, {})", i, n);
  Image img{cols, rows, std::vector<uint8_t>(size_t(rows * cols * 3))};
  const uint8_t* g = image(i);
  for (int64_t k = 0; k < rows * cols; ++k) img.rgb[size_t(3 * k)] = img.rgb[size_t(3 * k + 1)] = img.rgb[size_t(3 * k + 2)] = g[k];
  return side > 0 && (side != rows || side != cols) ? resize_image(img, side, side) : img;
}

const std::array<std::string, 10>& fashion_mnist_classes() {
  static const std::array<std::string, 10> names = {"t-shirt", "trouser", "pullover", "dress", "coat",
                                                    "sandal",  "shirt",   "sneaker",  "bag",   "ankle boot"};
  return names;
}

LabelledImages read_fashion_mnist(const std::string& dir, const std::string& split) {
  LM_CHECK(split == "train" || split == "t10k", "fashion-mnist split '{}' is not train or t10k", split);
  const std::string ip = dir + "/" + split + "-images-idx3-ubyte.gz", lp = dir + "/" + split + "-labels-idx1-ubyte.gz";
  LM_CHECK(std::filesystem::exists(ip), "{}: no such file (install Debian's dataset-fashion-mnist: "
           "scripts/deps.sh --with-fashion-mnist)", ip);
  IdxArray im = read_idx(ip), lb = read_idx(lp);
  LM_CHECK(im.dims.size() == 3, "{}: images are [N, rows, cols], not {} dimensions", ip, im.dims.size());
  LM_CHECK(lb.dims.size() == 1, "{}: labels are [N], not {} dimensions", lp, lb.dims.size());
  LM_CHECK(im.dims[0] == lb.dims[0], "{} holds {} images but {} holds {} labels", ip, im.dims[0], lp, lb.dims[0]);
  for (size_t i = 0; i < lb.data.size(); ++i)
    LM_CHECK(lb.data[i] < fashion_mnist_classes().size(), "{}: label {} of item {} is not one of the 10 classes", lp,
             lb.data[i], i);
  LabelledImages d;
  d.n = im.dims[0], d.rows = im.dims[1], d.cols = im.dims[2];
  d.pixels = std::move(im.data), d.labels = std::move(lb.data);
  return d;
}

}  // namespace lm::io
