#pragma once
// Data URLs (RFC 2397) and base64 (RFC 4648 §4), for images sent inline to the server (OpenAI image_url parts):
//   data:[<media type>][;<parameter>]*;base64,<base64 data>
// Only base64 data URLs are read (an image is binary); nothing is ever fetched.
#include <string>
#include <string_view>

namespace lm::io {

// The bytes of standard base64 with '=' padding (whitespace is not allowed). lm::Error naming `ctx` for a character
// outside the alphabet (and its position), a length that is not a multiple of 4, or padding inside the text.
std::string decode_base64(std::string_view text, const std::string& ctx);

struct DataUrl {
  std::string media_type;  // e.g. "image/png" (lower-cased; "" when the URL names none)
  std::string bytes;       // the decoded data
};
// lm::Error naming `ctx` for a URL that is not a data URL (an http(s) URL is named as remote: it is not fetched), a
// data URL that is not base64, a media type that is not image/* (when `image`), or bad base64.
DataUrl parse_data_url(std::string_view url, const std::string& ctx, bool image = true);

}  // namespace lm::io
