// libFuzzer target: arbitrary bytes -> io::decode_image -> io::image_patches (a small patch budget). lm::Error is
// the expected answer to a bad image; any other exception, a crash or a sanitizer report is a bug. An accepted
// image must patch into a grid within the budget with every value in [-1, 1].
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "core/error.hpp"
#include "io/image.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    // (at most 2^20 pixels: the fuzzer's 4 GiB limit is for bugs, not for big pictures)
    const lm::io::Image img =
        lm::io::decode_image(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz", int64_t(1) << 20);
    const lm::io::ImagePatches p = lm::io::image_patches(img, 14, 2, 64);
    if (p.h < 2 || p.w < 2 || p.h * p.w > 64 || p.pixel_values.size() != size_t(p.h * p.w * 3 * 196)) {
      std::fprintf(stderr, "image_patches: bad grid %lld x %lld\n", static_cast<long long>(p.h),
                   static_cast<long long>(p.w));
      std::abort();
    }
    for (float v : p.pixel_values)
      if (!(v >= -1.f && v <= 1.f)) {
        std::fprintf(stderr, "image_patches: value %f outside [-1, 1]\n", double(v));
        std::abort();
      }
  } catch (const lm::Error&) {
  }
  return 0;
}
