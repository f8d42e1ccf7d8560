#pragma once
// IDX files (the MNIST / Fashion-MNIST format), plain or gzip-compressed (zlib), and the Fashion-MNIST data set of
// Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist; `scripts/deps.sh --with-fashion-mnist`).
//
// IDX: bytes 0-1 zero, byte 2 the element type (0x08: unsigned byte, the only one read here), byte 3 the number of
// dimensions n, then n big-endian uint32 sizes, then the elements row-major. Images: [N, 28, 28]; labels: [N].
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/image.hpp"

namespace lm::io {

struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> data;  // Π dims bytes
};

// lm::Error naming `ctx` for a short header, another element type, no or zero dimensions, or a size that differs from
// Π dims (truncated or trailing bytes).
IdxArray parse_idx(std::string_view bytes, const std::string& ctx);
// A file, gzip-compressed or not. lm::Error naming the file when it is missing, a corrupt or truncated gzip stream, or
// larger than `max_bytes` decompressed.
IdxArray read_idx(const std::string& path, int64_t max_bytes = int64_t(1) << 30);

struct LabelledImages {
  int64_t n = 0, rows = 0, cols = 0;
  std::vector<uint8_t> pixels;  // [n, rows, cols] grey levels
  std::vector<uint8_t> labels;  // [n], each < classes
  const uint8_t* image(int64_t i) const { return pixels.data() + i * rows * cols; }
  // Item i as an RGB image (grey in every channel), resized to side × side (0: as it is).
  Image rgb(int64_t i, int64_t side = 0) const;
};

inline constexpr std::string_view kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// The ten classes by label, as captions name them.
const std::array<std::string, 10>& fashion_mnist_classes();
// `split` "train" (60,000) or "t10k" (10,000): DIR/{split}-images-idx3-ubyte.gz and -labels-idx1-ubyte.gz. lm::Error
// for a missing or malformed file, images that are not [N, rows, cols], labels that are not [N] of the same N, or a
// label outside the ten classes.
LabelledImages read_fashion_mnist(const std::string& dir, const std::string& split);

}  // namespace lm::io
