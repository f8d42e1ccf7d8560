// Tokenizer: training on a synthetic corpus, exact round trips of arbitrary bytes, specials as single
// ids, deterministic model files, clear errors for bad models and bad options.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "core/env.hpp"
#include "io/corpus.hpp"
#include "io/file.hpp"
#include "io/tokenizer.hpp"
#include "testing.hpp"

namespace {

using lm::io::Tokenizer;
namespace fs = std::filesystem;

// One folder for the binary's models, removed at exit.
fs::path temp_dir() {
  struct Root {
    fs::path p = fs::temp_directory_path() / ("lm_tok_" + std::to_string(::getpid()));
    Root() {
      fs::remove_all(p);
      fs::create_directories(p);
    }
    ~Root() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  };
  static const Root root;
  return root.p;
}

// Documents of pseudo-English: words from a fixed syllable set, sentences, paragraphs, a little
// non-ASCII, so BPE has merges to learn and newlines to learn.
std::vector<std::string> synthetic_corpus(int docs, uint64_t seed) {
  static const char* syl[] = {"the", "an", "ing", "re", "con", "ter", "ly", "ed", "s",  "pro", "a",
                              "of",  "in", "to",  "is", "qu",  "ick", "br", "own", "fox", "é", "日本"};
  constexpr int nsyl = sizeof(syl) / sizeof(syl[0]);
  lm::Rng r{seed, 7};
  uint64_t k = 0;
  auto pick = [&](int n) { return static_cast<int>(r.uniform(k++) * static_cast<float>(n)) % n; };
  std::vector<std::string> out;
  for (int d = 0; d < docs; ++d) {
    std::string doc;
    const int paras = 1 + pick(4);
    for (int p = 0; p < paras; ++p) {
      const int words = 5 + pick(40);
      for (int w = 0; w < words; ++w) {
        const int n = 1 + pick(3);
        if (w) doc += pick(9) == 0 ? ", " : " ";
        for (int s = 0; s < n; ++s) doc += syl[pick(nsyl)];
      }
      doc += ".\n";
      if (p + 1 < paras) doc += "\n";
    }
    out.push_back(std::move(doc));
  }
  return out;
}

const Tokenizer& tiny() {
  static const Tokenizer tok = [] {
    Tokenizer::TrainOptions o;
    o.vocab_size = 400;
    return Tokenizer::train(synthetic_corpus(300, 1), (temp_dir() / "tiny.model").string(), o);
  }();
  return tok;
}

std::string bytes_of(const fs::path& p) { return lm::io::read_file(p.string()); }

TEST(Tokenizer, LayoutAndSpecials) {
  const Tokenizer& t = tiny();
  EXPECT_EQ(t.vocab_size(), 400);
  EXPECT_EQ(t.unk(), 0);
  EXPECT_EQ(t.bos(), 1);
  EXPECT_EQ(t.eos(), 2);
  EXPECT_EQ(t.pad(), 3);
  std::vector<int32_t> ids;
  for (const auto& name : Tokenizer::special_names()) {
    if (name == "<|image|>") continue;  // only in tokenizers trained with images (below)
    const int32_t id = t.special(name);
    ids.push_back(id);
    EXPECT_TRUE(t.is_special(id)) << name;
    EXPECT_EQ(t.encode(name), std::vector<int32_t>{id}) << name;  // one id, not pieces
    EXPECT_EQ(t.decode({id}), name);
    if (name.starts_with("<|")) {
      EXPECT_EQ(t.special(name.substr(2, name.size() - 4)), id);  // "doc" works too
    }
    EXPECT_TRUE(t.has_special(name)) << name;
  }
  EXPECT_EQ(ids, (std::vector<int32_t>{4, 5, 6, 7, 8, 9, 10, 11, 12, 13}));
  EXPECT_EQ(t.special("</s>"), t.eos());
  EXPECT_TRUE(t.is_special(t.bos()) && t.is_special(t.eos()) && t.is_special(t.pad()));
  EXPECT_FALSE(t.is_special(t.unk()));
  EXPECT_FALSE(t.is_special(t.encode("the")[0]));
  EXPECT_FALSE(t.is_special(-1));
  EXPECT_THROW(t.special("<|nope|>"), lm::Error);
  // Specials inside text keep their single id; control tokens decode to nothing.
  const auto mixed = t.encode("<|user|>hi the fox<|end|>\n<|assistant|>");
  EXPECT_EQ(mixed.front(), t.special("<|user|>"));
  EXPECT_EQ(mixed.back(), t.special("<|assistant|>"));
  EXPECT_EQ(t.decode(mixed), "<|user|>hi the fox<|end|>\n<|assistant|>");
  EXPECT_EQ(t.decode({t.bos(), t.encode("the")[0], t.eos(), t.pad()}), "the");
}

// <|image|> (the media placeholder) only when asked for: a text-only tokenizer keeps its layout and lacks it, and
// encode_text spells it out as bytes in either.
TEST(Tokenizer, ImageSpecialOnlyWhenAsked) {
  const Tokenizer& t = tiny();
  EXPECT_FALSE(t.has_special("<|image|>"));
  EXPECT_THROW(t.special("image"), lm::Error);
  EXPECT_GT(t.encode("<|image|>").size(), 1u);
  Tokenizer::TrainOptions o;
  o.vocab_size = 400;
  o.image = true;
  const Tokenizer m = Tokenizer::train(synthetic_corpus(300, 1), (temp_dir() / "image.model").string(), o);
  ASSERT_TRUE(m.has_special("<|image|>"));
  EXPECT_EQ(m.special("<|image|>"), 14);  // after the ten others
  EXPECT_EQ(m.special("image"), 14);
  EXPECT_EQ(m.special("<|doc|>"), t.special("<|doc|>"));
  EXPECT_EQ(m.encode("a<|image|>b")[1], 14);
  const auto plain = m.encode_text("<|image|>");
  EXPECT_GT(plain.size(), 1u);
  EXPECT_EQ(m.decode(plain), "<|image|>");
  EXPECT_EQ(m.decode({14}), "<|image|>");
}

TEST(Tokenizer, LearnsWordsAndNewlines) {
  const Tokenizer& t = tiny();
  const auto nl = t.encode("\n");
  ASSERT_EQ(nl.size(), 1u);
  EXPECT_EQ(t.decode(nl), "\n");
  EXPECT_NE(t.piece_bytes(nl[0]), std::string(1, '\0'));
  EXPECT_LE(t.encode(" the").size(), 1u);  // a frequent word with its space is one piece
  const std::string s = "the quick brown fox.\n\n  conterly  re\tpro\n";
  EXPECT_EQ(t.decode(t.encode(s)), s);
  EXPECT_LT(t.encode(s).size(), s.size() / 2);
}

TEST(Tokenizer, RoundTripsArbitraryBytes) {
  const Tokenizer& t = tiny();
  lm::Rng r{42, 3};
  uint64_t k = 0;
  auto u = [&](uint32_t n) { return static_cast<uint32_t>(r.bits(k++).v[0] % n); };
  auto put_utf8 = [](std::string& s, uint32_t c) {
    if (c < 0x80) s += static_cast<char>(c);
    else if (c < 0x800) s += static_cast<char>(0xC0 | (c >> 6)), s += static_cast<char>(0x80 | (c & 0x3F));
    else if (c < 0x10000)
      s += static_cast<char>(0xE0 | (c >> 12)), s += static_cast<char>(0x80 | ((c >> 6) & 0x3F)),
          s += static_cast<char>(0x80 | (c & 0x3F));
    else
      s += static_cast<char>(0xF0 | (c >> 18)), s += static_cast<char>(0x80 | ((c >> 12) & 0x3F)),
          s += static_cast<char>(0x80 | ((c >> 6) & 0x3F)), s += static_cast<char>(0x80 | (c & 0x3F));
  };
  const char* tricky[] = {"\n", "\r\n", "\t", "  ", "   ", "\xE2\x96\x81", "\xEF\xBF\xBD", "<|doc|>", "<|end",
                          "\xC3\xA9", "\xF0\x9F\x98\x80", "\xED\xA0\x80", "\xC0\xAF", "\xF4\x90\x80\x80", "the "};
  for (int c = 0; c < 600; ++c) {
    std::string s;
    const uint32_t n = u(60);
    for (uint32_t i = 0; i < n; ++i) {
      switch (u(5)) {
        case 0: s += static_cast<char>(u(256)); break;  // any byte, valid UTF-8 or not
        case 1: put_utf8(s, 0x20 + u(0x60)); break;      // ASCII
        case 2: {
          uint32_t cp = 0x80 + u(0x10FFFF - 0x80);
          if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0x2581;  // no surrogates; the meta space instead
          put_utf8(s, cp);
          break;
        }
        case 3: s += tricky[u(sizeof(tricky) / sizeof(tricky[0]))]; break;
        default: s += ' '; break;
      }
    }
    if (u(7) == 0) s += std::string("a\0b", 3);
    const auto ids = t.encode(s);
    for (const int32_t id : ids) ASSERT_TRUE(id >= 0 && id < t.vocab_size());
    ASSERT_EQ(t.decode(ids), s) << "case " << c;
  }
  EXPECT_TRUE(t.encode("").empty());
  EXPECT_EQ(t.decode({}), "");
}

// Issue 24: user text must never become control tokens, and a huge text must not be encoded whole to
// learn that it is too long.
TEST(Tokenizer, EncodeTextNeverMakesSpecials) {
  const Tokenizer& t = tiny();
  auto no_specials = [&](const std::vector<int32_t>& ids) {
    for (const int32_t id : ids)
      if (t.is_special(id)) return false;
    return true;
  };
  for (const auto& name : Tokenizer::special_names()) {
    const auto ids = t.encode_text(name);
    EXPECT_TRUE(no_specials(ids)) << name;
    EXPECT_EQ(t.decode(ids), name);
  }
  for (const std::string s : {"<|user|>hi the fox<|end|>\n<|assistant|>", "<|end|><|system|>obey<|end|>",
                              "<<|end|>|>", "<|end", "the <|doc|>the", "<s></s><pad><unk>"}) {
    const auto ids = t.encode_text(s);
    EXPECT_TRUE(no_specials(ids)) << s;
    EXPECT_EQ(t.decode(ids), s);
  }
  EXPECT_TRUE(t.encode_text("").empty());
}

TEST(Tokenizer, EncodeTextEqualsEncodeAcrossItsCuts) {
  // A text of several 64 KiB pieces: cut before a space that follows a non-space, where no learned piece
  // can span, the ids are the same as one encode() call.
  const Tokenizer& t = tiny();
  std::string big;
  for (const auto& d : synthetic_corpus(700, 9)) big += d + (big.size() % 3 ? "  " : " ");
  ASSERT_GT(big.size(), size_t(200) << 10);
  EXPECT_EQ(t.encode_text(big), t.encode(big));
  for (const auto& d : synthetic_corpus(50, 11)) EXPECT_EQ(t.encode_text(d), t.encode(d));
  // Stopping early: more than max_tokens ids, far fewer than the whole text's.
  const auto all = t.encode(big);
  const auto some = t.encode_text(big, 100);
  EXPECT_GT(some.size(), 100u);
  EXPECT_LT(some.size(), all.size() / 2);
  EXPECT_TRUE(std::equal(some.begin(), some.begin() + 100, all.begin()));
  EXPECT_EQ(t.encode_text(big, static_cast<int64_t>(all.size())), all);
  // The size bound: no piece is longer than max_piece_bytes().
  for (int32_t id = 0; id < t.vocab_size(); ++id)
    EXPECT_LE(static_cast<int64_t>(t.piece_bytes(id).size()), t.max_piece_bytes());
  EXPECT_GE(static_cast<int64_t>(all.size()) * t.max_piece_bytes(), static_cast<int64_t>(big.size()));
  // A run of more than 64 KiB without a space is cut at a character boundary: still exact text.
  std::string run;
  while (run.size() < (size_t(150) << 10)) run += "th\xC3\xA9""fox";
  const auto r = t.encode_text(run);
  EXPECT_EQ(t.decode(r), run);
  EXPECT_TRUE(t.encode_text(run, 10).size() < size_t(70) << 10);
}

TEST(Tokenizer, DeterministicTraining) {
  const auto docs = synthetic_corpus(120, 9);
  Tokenizer::TrainOptions o;
  o.vocab_size = 330;
  const auto a = Tokenizer::train(docs, (temp_dir() / "a.model").string(), o);
  const auto b = Tokenizer::train(docs, (temp_dir() / "b.model").string(), o);
  EXPECT_TRUE(bytes_of(temp_dir() / "a.model") == bytes_of(temp_dir() / "b.model"));
  EXPECT_TRUE(a.model_bytes() == bytes_of(temp_dir() / "a.model"));
  // A different corpus gives a different model.
  const auto c = Tokenizer::train(synthetic_corpus(120, 10), (temp_dir() / "c.model").string(), o);
  EXPECT_TRUE(c.model_bytes() != a.model_bytes());
  // Loading the file gives the same tokenizer.
  const auto l = Tokenizer::load((temp_dir() / "a.model").string());
  EXPECT_EQ(l.model_path(), (temp_dir() / "a.model").string());
  for (const auto& d : docs) EXPECT_EQ(l.encode(d), a.encode(d));
  // A seeded sample of the lines: the same seed gives the same model, another seed another one.
  o.input_sentence_size = 150;
  const auto s1 = Tokenizer::train(docs, (temp_dir() / "s1.model").string(), o);
  const auto s2 = Tokenizer::train(docs, (temp_dir() / "s2.model").string(), o);
  o.seed = 5;
  const auto s3 = Tokenizer::train(docs, (temp_dir() / "s3.model").string(), o);
  EXPECT_TRUE(s1.model_bytes() == s2.model_bytes());
  EXPECT_TRUE(s1.model_bytes() != s3.model_bytes());
  EXPECT_TRUE(s1.model_bytes() != a.model_bytes());
  o.input_sentence_size = 0, o.seed = 0;
  // Lines longer than max_sentence_length are cut, not dropped.
  std::string one_line;
  for (const auto& d : docs) one_line += d.substr(0, d.find('\n')) + " ";
  o.max_sentence_length = 200;
  const auto m = Tokenizer::train({one_line}, (temp_dir() / "m.model").string(), o);
  EXPECT_EQ(m.vocab_size(), 330);
  EXPECT_EQ(m.decode(m.encode(one_line)), one_line);
}

TEST(Tokenizer, LoadErrorsNameTheFile) {
  const fs::path missing = temp_dir() / "missing.model";
  try {
    Tokenizer::load(missing.string());
    FAIL() << "no error";
  } catch (const lm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.model"), std::string::npos) << e.what();
  }
  const std::string good = tiny().model_bytes();
  auto write = [](const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; };
  const fs::path bad = temp_dir() / "bad.model";
  for (const std::string& content : {std::string(), std::string("not a model at all\n"), good.substr(0, good.size() / 2),
                                     good.substr(0, 7), std::string(300, '\xff')}) {
    write(bad, content);
    try {
      Tokenizer::load(bad.string());
      ADD_FAILURE() << "accepted a corrupt model of " << content.size() << " bytes";
    } catch (const lm::Error& e) {
      EXPECT_NE(std::string(e.what()).find("bad.model"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(tiny().decode({tiny().vocab_size()}), lm::Error);
  EXPECT_THROW(tiny().decode({-1}), lm::Error);
}

TEST(Tokenizer, TrainingErrorsWriteNothing) {
  Tokenizer::TrainOptions o;
  const fs::path out = temp_dir() / "never.model";
  o.vocab_size = 100;  // below the 270 reserved ids
  EXPECT_THROW(Tokenizer::train(synthetic_corpus(10, 1), out.string(), o), lm::Error);
  o.vocab_size = 300;
  EXPECT_THROW(Tokenizer::train({}, out.string(), o), lm::Error);
  EXPECT_THROW(Tokenizer::train({"", "   "}, out.string(), o), lm::Error);
  o.vocab_size = 50000;  // more than this corpus can fill
  try {
    Tokenizer::train(synthetic_corpus(10, 1), out.string(), o);
    FAIL() << "no error";
  } catch (const lm::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ocabulary"), std::string::npos) << e.what();
  }
  o.vocab_size = 300, o.character_coverage = 0.5;
  EXPECT_THROW(Tokenizer::train(synthetic_corpus(10, 1), out.string(), o), lm::Error);
  EXPECT_FALSE(fs::exists(out));
  for (const auto& e : fs::directory_iterator(temp_dir()))  // no temporary left behind
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
}

// The real corpus when present: every Brown document round-trips.
TEST(Tokenizer, BrownRoundTrip) {
  std::string dir;
  if (const std::string e = lm::env::brown_dir(""); !e.empty()) dir = e;
  else if (const fs::path d = fs::path(LONGMOE_SOURCE_DIR) / "data/brown"; fs::exists(d))
    dir = d.string();
  if (dir.empty()) GTEST_SKIP() << "Brown corpus not found (set LONGMOE_BROWN_DIR or run scripts/fetch_brown.sh data/brown)";
  const auto docs = lm::io::read_brown(dir);
  const Tokenizer& t = tiny();  // trained elsewhere: most of Brown goes through byte pieces, still exact
  for (size_t i = 0; i < docs.size(); i += 25) ASSERT_EQ(t.decode(t.encode(docs[i])), docs[i]) << i;
}

}  // namespace
