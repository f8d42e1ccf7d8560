#pragma once
// Images for the serve tests (tests/serve/test_images*.cpp): a tokenizer with <|image|>, a multimodal config around a
// text config with a tiny tower (14 px patches, 2 x 2 table, 2 blocks of width 16), grey PNGs and their data URLs.
#include <zlib.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "io/json.hpp"
#include "io/tokenizer.hpp"
#include "model/config.hpp"
#include "serve/harness.hpp"

namespace lm::serve_test {

inline const io::Tokenizer& image_tokenizer() {
  static std::shared_ptr<io::Tokenizer> tok = [] {
    const auto dir = std::filesystem::temp_directory_path() / ("longmoe_serve_img_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir);
    std::vector<std::string> texts;
    for (int i = 0; i < 40; ++i) texts.push_back(corpus_text(i));
    io::Tokenizer::TrainOptions o;
    o.vocab_size = 320;
    o.image = true;
    auto t = std::make_shared<io::Tokenizer>(io::Tokenizer::train(texts, (dir / "tok.model").string(), o));
    std::filesystem::remove_all(dir);
    return t;
  }();
  return *tok;
}

// `text` in K3's multimodal layout with the tiny tower (text_hidden_size = the text model's width).
inline model::ModelConfig multimodal_config(const model::ModelConfig& text) {
  json v = json::parse(R"({
    "patch_size": 14, "init_pos_emb_height": 2, "init_pos_emb_width": 2, "init_pos_emb_time": 1,
    "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 16,
    "vt_intermediate_size": 24, "qkv_hidden_size": 16, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2", "mm_hidden_size": 16, "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5, "norm_type": "rmsnorm", "activation_func": "gelu_pytorch_tanh" })");
  v["text_hidden_size"] = text.hidden_size;
  json j = {{"architectures", {"KimiK3ForConditionalGeneration"}},
            {"model_type", "kimi_k3"},
            {"text_config", text.to_json()},
            {"media_placeholder_token_id", image_tokenizer().special("<|image|>")},
            {"vision_config", v}};
  return model::ModelConfig::from_json(j, "multimodal serve test");
}

// A grey W x H PNG (8-bit, no filter), pixel (x, y) = 4x + 2y + seed.
inline std::string png(int W, int H, int seed) {
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

inline std::string base64(const std::string& s) {
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

inline io::json image_part(const std::string& url) { return {{"type", "image_url"}, {"image_url", {{"url", url}}}}; }

}  // namespace lm::serve_test
