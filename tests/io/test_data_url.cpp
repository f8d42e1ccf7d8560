// Data URLs and base64 (io/data_url.hpp): RFC 4648 test vectors, every padding length, and clear errors for what a
// client may send wrong (remote URLs, non-base64 data URLs, bad characters, truncation, other media types).
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "io/data_url.hpp"
#include "testing.hpp"

using namespace lm;

using lm::testing::error_of;

TEST(DataUrl, Base64Vectors) {
  // RFC 4648 §10.
  const std::pair<const char*, const char*> v[] = {{"", ""},           {"f", "Zg=="},         {"fo", "Zm8="},
                                                   {"foo", "Zm9v"},    {"foob", "Zm9vYg=="},  {"fooba", "Zm9vYmE="},
                                                   {"foobar", "Zm9vYmFy"}};
  for (const auto& [plain, enc] : v) EXPECT_EQ(io::decode_base64(enc, "t"), plain) << enc;
  EXPECT_EQ(io::decode_base64("AP8A/w==", "t"), std::string("\x00\xff\x00\xff", 4));
  EXPECT_EQ(io::decode_base64("+/+/", "t"), std::string("\xfb\xff\xbf", 3));
}

TEST(DataUrl, Base64Errors) {
  EXPECT_NE(error_of([] { io::decode_base64("Zm9", "img"); }).find("not a multiple of 4"), std::string::npos);
  EXPECT_NE(error_of([] { io::decode_base64("Zm!v", "img"); }).find("invalid base64 character '!' at position 2"),
            std::string::npos);
  EXPECT_NE(error_of([] { io::decode_base64("Zg==Zm9v", "img"); }).find("padding"), std::string::npos);
  EXPECT_NE(error_of([] { io::decode_base64("Z===", "img"); }).find("position 1"), std::string::npos);
  EXPECT_NE(error_of([] { io::decode_base64("Zm 9", "img"); }).find("' '"), std::string::npos);
}

TEST(DataUrl, ParsesImageDataUrls) {
  const io::DataUrl d = io::parse_data_url("data:image/PNG;base64,Zm9vYmFy", "url");
  EXPECT_EQ(d.media_type, "image/png");
  EXPECT_EQ(d.bytes, "foobar");
  EXPECT_EQ(io::parse_data_url("DATA:;base64,Zg==", "url").bytes, "f");
  EXPECT_EQ(io::parse_data_url("data:image/jpeg;name=x.jpg;base64,Zg==", "url").media_type, "image/jpeg");
  const std::string remote = error_of([] { io::parse_data_url("https://example.com/cat.png", "messages[0]"); });
  EXPECT_NE(remote.find("messages[0]: remote image URLs are not fetched"), std::string::npos) << remote;
  EXPECT_NE(error_of([] { io::parse_data_url("HTTP://x", "u"); }).find("remote"), std::string::npos);
  EXPECT_NE(error_of([] { io::parse_data_url("file:///etc/passwd", "u"); }).find("not a data URL"), std::string::npos);
  EXPECT_NE(error_of([] { io::parse_data_url("data:image/png,rawbytes", "u"); }).find("not base64"), std::string::npos);
  EXPECT_NE(error_of([] { io::parse_data_url("data:image/png;base64", "u"); }).find("no ','"), std::string::npos);
  EXPECT_NE(error_of([] { io::parse_data_url("data:text/plain;base64,Zg==", "u"); }).find("not an image type"),
            std::string::npos);
  EXPECT_NE(error_of([] { io::parse_data_url("data:image/png;base64,Zg=", "u"); }).find("multiple of 4"),
            std::string::npos);
}
