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
#include "serve/server.hpp"

using namespace lm;
using json = io::json;

namespace {

const io::Tokenizer& image_tokenizer() {
  static std::shared_ptr<io::Tokenizer> tok = [] {
    const auto dir = std::filesystem::temp_directory_path() / ("longmoe_serve_img_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir);
    std::vector<std::string> texts;
    for (int i = 0; i < 40; ++i) texts.push_back(serve_test::corpus_text(i));
    io::Tokenizer::TrainOptions o;
    o.vocab_size = 320;
    o.image = true;
    auto t = std::make_shared<io::Tokenizer>(io::Tokenizer::train(texts, (dir / "tok.model").string(), o));
    std::filesystem::remove_all(dir);
    return t;
  }();
  return *tok;
}

model::ModelConfig multimodal_config() {
  const model::ModelConfig text = serve_test::small_config(image_tokenizer().vocab_size());
  json j = {{"architectures", {"KimiK3ForConditionalGeneration"}},
            {"model_type", "kimi_k3"},
            {"text_config", text.to_json()},
            {"media_placeholder_token_id", image_tokenizer().special("<|image|>")},
            {"vision_config", json::parse(R"({
    "patch_size": 14, "init_pos_emb_height": 2, "init_pos_emb_width": 2, "init_pos_emb_time": 1,
    "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 16,
    "vt_intermediate_size": 24, "qkv_hidden_size": 16, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2", "mm_hidden_size": 16, "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5, "norm_type": "rmsnorm", "activation_func": "gelu_pytorch_tanh",
    "text_hidden_size": 32 })")}};
  return model::ModelConfig::from_json(j, "multimodal serve test");
}

// A grey W x H PNG (8-bit, no filter), pixel (x, y) = 4x + 2y + seed.
std::string png(int W, int H, int seed) {
  std::string raw;
  for (int y = 0; y < H; ++y) {
    raw.push_back(0);
    for (int x = 0; x < W; ++x) raw.push_back(static_cast<char>((4 * x + 2 * y + seed) & 0xFF));
  }
  uLongf n = compressBound(raw.size());
  std::string z(n, '\0');
  compress(reinterpret_cast<Bytef*>(z.data()), &n, reinterpret_cast<const Bytef*>(raw.data()), raw.size());
  z.resize(n);
  auto be = [](uint32_t v) {
    return std::string{char(v >> 24), char((v >> 16) & 0xFF), char((v >> 8) & 0xFF), char(v & 0xFF)};
  };
  auto chunk = [&](const std::string& type, const std::string& body) {
    const std::string tb = type + body;
    return be(static_cast<uint32_t>(body.size())) + tb +
           be(static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(tb.data()), static_cast<uInt>(tb.size()))));
  };
  const std::string ihdr = be(W) + be(H) + std::string{8, 0, 0, 0, 0};
  return std::string("\x89PNG\r\n\x1a\n", 8) + chunk("IHDR", ihdr) + chunk("IDAT", z) + chunk("IEND", "");
}

std::string base64(const std::string& s) {
  const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string o;
  for (size_t i = 0; i < s.size(); i += 3) {
    uint32_t v = uint32_t(uint8_t(s[i])) << 16;
    if (i + 1 < s.size()) v |= uint32_t(uint8_t(s[i + 1])) << 8;
    if (i + 2 < s.size()) v |= uint8_t(s[i + 2]);
    o += a[v >> 18], o += a[(v >> 12) & 63];
    o += i + 1 < s.size() ? a[(v >> 6) & 63] : '=';
    o += i + 2 < s.size() ? a[v & 63] : '=';
  }
  return o;
}

json image_part(const std::string& url) { return {{"type", "image_url"}, {"image_url", {{"url", url}}}}; }

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
