// Images in serve (issue 22 item 5): OpenAI image_url parts with base64 data URLs reach a multimodal model exactly as
// the engine's own prefill with the same image (same greedy answer, same prompt tokens), and every malformed image
// is a 400 naming the part: a remote URL (never fetched), bad base64, a corrupt image, one over the pixel limit, an
// image outside a user message.
#include <gtest/gtest.h>
#include <httplib.h>
#include <zlib.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "infer/engine.hpp"
#include "infer/generate.hpp"
#include "io/chat.hpp"
#include "io/json.hpp"
#include "serve/harness.hpp"
#include "serve/images.hpp"
#include "serve/server.hpp"

using namespace lm;
using json = io::json;
using serve_test::base64;
using serve_test::image_part;
using serve_test::image_tokenizer;
using serve_test::png;

namespace {

model::ModelConfig multimodal_config() {
  return serve_test::multimodal_config(serve_test::small_config(serve_test::image_tokenizer().vocab_size()));
}

struct ImageServer {
  model::Model<float> m{multimodal_config()};
  infer::Session s{m, infer::SessionOptions{16, 512, int64_t(16) << 20}};
  std::unique_ptr<serve::Server> server;
  int port = 0;
  std::thread th;
  explicit ImageServer(int64_t max_pixels = int64_t(1) << 24) {
    m.params().init(5);
    serve::ServerOptions o = serve_test::opts();
    o.port = 0;
    o.vision = *m.config().vision;
    o.image_limits.max_pixels = max_pixels;
    server = std::make_unique<serve::Server>(s, image_tokenizer(), o);
    port = server->bind();
    th = std::thread([this] { server->run(); });
  }
  ~ImageServer() {
    server->stop();
    th.join();
  }
  json post(const json& body, int* status) {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);
    auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
    if (!r) return json();
    *status = r->status;
    return json::parse(r->body, nullptr, false);
  }
};

}  // namespace

// The answer to [text, image, text] equals the engine's own greedy generation of the same conversation with the
// image's placeholders opening the user turn (the images of a message come before its text).
TEST(ServeImages, ImagePartsReachTheModelAsInTheEngine) {
  ImageServer h;
  const auto& tok = image_tokenizer();
  const std::string a = png(60, 40, 3);  // resized to 56 x 28: 4 x 2 patches, 2 feature rows
  const json content = json::array({{{"type", "text"}, {"text", "river stone"}},
                                    image_part("data:image/png;base64," + base64(a)),
                                    {{"type", "text"}, {"text", "light"}}});
  int st = 0;
  const json got = h.post({{"messages", json::array({{{"role", "system"}, {"content", "alpha"}},
                                                     {{"role", "user"}, {"content", content}}})},
                           {"max_tokens", 8},
                           {"temperature", 0}},
                          &st);
  ASSERT_EQ(st, 200) << got.dump();

  infer::CpuEngine e(h.s);
  infer::EngineSequence seq(e);
  std::vector<int32_t> ids = io::chat_tokens(tok, {{"system", "alpha"}, {"user", "river stone\nlight"}});
  const int32_t ph = infer::image_token(h.m.config(), tok);
  infer::place_images(ids, tok.special("<|user|>"), ph, 1);
  const model::Media<float> media = infer::image_media(a, "a", *h.m.config().vision);
  EXPECT_EQ(infer::media_rows(*h.m.config().vision, media), 2);
  // A small image upscaled to the training size first (min_side), or kept (28 px: one 2 x 2 block).
  const std::string small = png(28, 28, 9);
  EXPECT_EQ(infer::media_rows(*h.m.config().vision, infer::image_media(small, "s", *h.m.config().vision)), 1);
  const model::Media<float> up = infer::image_media(small, "s", *h.m.config().vision, {.min_side = 56});
  ASSERT_EQ(up.grids.size(), 1u);
  EXPECT_EQ(up.grids[0].h, 4);
  EXPECT_EQ(up.grids[0].w, 4);
  ids = infer::attach_images(seq, ids, ph, {media});
  infer::SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 8;
  sp.stop_tokens = {tok.eos(), tok.special("<|end|>"), ph};
  const std::string want = infer::generate(seq, tok, ids, sp, [](const std::string&) {}).text();
  EXPECT_EQ(got["usage"]["prompt_tokens"], static_cast<int64_t>(ids.size()));
  EXPECT_EQ(got["choices"][0]["message"]["content"], serve_test::as_json_text(want));
}

TEST(ServeImages, MalformedImagesAre400) {
  ImageServer h(100 * 100);
  auto ask = [&](const json& part, const std::string& role = "user") {
    int st = 0;
    const json e = h.post({{"messages", json::array({{{"role", role}, {"content", json::array({part})}}})},
                           {"max_tokens", 2}},
                          &st);
    EXPECT_EQ(st, 400) << e.dump();
    return e.value("error", json::object()).value("message", std::string());
  };
  EXPECT_NE(ask(image_part("https://example.com/a.png")).find("remote image URLs are not fetched"), std::string::npos);
  EXPECT_NE(ask(image_part("data:image/png;base64,iVBO!!==")).find("invalid base64 character '!'"), std::string::npos);
  EXPECT_NE(ask(image_part("data:image/png;base64," + base64("not an image at all"))).find("not a PNG or JPEG"),
            std::string::npos);
  const std::string cut = png(40, 40, 1);
  EXPECT_NE(ask(image_part("data:image/png;base64," + base64(cut.substr(0, cut.size() - 30)))).find("messages[0]"),
            std::string::npos);
  EXPECT_NE(ask(image_part("data:image/png;base64," + base64(png(128, 128, 1)))).find("more than the 10000 allowed"),
            std::string::npos);
  EXPECT_NE(ask(image_part("data:text/plain;base64,Zg==")).find("not an image type"), std::string::npos);
  EXPECT_NE(ask({{"type", "image_url"}, {"image_url", 7}}).find("image_url"), std::string::npos);
  EXPECT_NE(ask(image_part("data:image/png;base64," + base64(png(28, 28, 1))), "assistant").find("user messages"),
            std::string::npos);
  // The server still answers.
  int st = 0;
  h.post({{"messages", json::array({{{"role", "user"}, {"content", "river"}}})}, {"max_tokens", 2}}, &st);
  EXPECT_EQ(st, 200);
}
