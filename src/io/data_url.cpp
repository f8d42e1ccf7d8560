// Data URLs and base64 (see data_url.hpp).
#include "io/data_url.hpp"

#include <algorithm>
#include <array>
#include <cctype>

#include "core/error.hpp"

namespace lm::io {

namespace {
constexpr std::array<int8_t, 256> kValue = [] {
  std::array<int8_t, 256> v{};
  v.fill(-1);
  const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (int i = 0; i < 64; ++i) v[static_cast<unsigned char>(a[i])] = static_cast<int8_t>(i);
  return v;
}();

std::string lower(std::string_view s) {
  std::string o(s);
  std::transform(o.begin(), o.end(), o.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return o;
}
}  // namespace

std::string decode_base64(std::string_view t, const std::string& ctx) {
  LM_CHECK(t.size() % 4 == 0, "{}: base64 of {} characters is not a multiple of 4 (truncated or unpadded)", ctx,
           t.size());
  std::string out;
  out.reserve(t.size() / 4 * 3);
  for (size_t i = 0; i < t.size(); i += 4) {
    uint32_t acc = 0;
    int pad = 0;
    for (size_t k = 0; k < 4; ++k) {
      const unsigned char c = static_cast<unsigned char>(t[i + k]);
      if (c == '=' && i + 4 == t.size() && k >= 2 && (k == 3 || t[i + 3] == '=')) {
        ++pad, acc <<= 6;
        continue;
      }
      LM_CHECK(kValue[c] >= 0, "{}: invalid base64 character {} at position {}",
               ctx, c == '=' ? std::string("'=' (padding)") : std::isprint(c) ? fmt::format("'{}'", char(c))
                                                                               : fmt::format("0x{:02x}", c),
               i + k);
      acc = (acc << 6) | static_cast<uint32_t>(kValue[c]);
    }
    out.push_back(static_cast<char>(acc >> 16));
    if (pad < 2) out.push_back(static_cast<char>((acc >> 8) & 0xFF));
    if (pad < 1) out.push_back(static_cast<char>(acc & 0xFF));
  }
  return out;
}

DataUrl parse_data_url(std::string_view url, const std::string& ctx, bool image) {
  const std::string head = lower(url.substr(0, std::min<size_t>(url.size(), 8)));
  LM_CHECK(head.rfind("http://", 0) != 0 && head.rfind("https://", 0) != 0,
           "{}: remote image URLs are not fetched; send the image inline as a base64 data URL "
           "(data:image/png;base64,...)",
           ctx);
  LM_CHECK(head.rfind("data:", 0) == 0, "{}: not a data URL (data:image/png;base64,...); nothing else is read", ctx);
  const size_t comma = url.find(',');
  LM_CHECK(comma != std::string_view::npos, "{}: the data URL has no ',' before its data", ctx);
  const std::string meta = lower(url.substr(5, comma - 5));
  LM_CHECK(meta.size() >= 7 && meta.compare(meta.size() - 7, 7, ";base64") == 0,
           "{}: the data URL is not base64 ('{}'); images are sent as ;base64 data", ctx, meta);
  DataUrl d;
  d.media_type = meta.substr(0, std::min(meta.find(';'), meta.size()));
  LM_CHECK(!image || d.media_type.empty() || d.media_type.rfind("image/", 0) == 0,
           "{}: the data URL's media type '{}' is not an image type", ctx, d.media_type);
  d.bytes = decode_base64(url.substr(comma + 1), ctx);
  return d;
}

}  // namespace lm::io
