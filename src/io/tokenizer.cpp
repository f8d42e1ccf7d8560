#include "io/tokenizer.hpp"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <numeric>
#include <unordered_map>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "io/file.hpp"

// Defined in libsentencepiece but not declared by its public header; without it every training run
// prints a page of INFO lines to stderr.
namespace sentencepiece::logging {
void SetMinLogLevel(int v);
}

namespace lm::io {

namespace {

constexpr std::string_view kMetaSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's encoded space
// The first kRequired are in every longmoe tokenizer; the tool-use specials after them came later (a tokenizer
// trained before them loads without them, and the chat template writes their text instead: io/chat.hpp).
const std::vector<std::string> kSpecials = {"<|doc|>",     "<|system|>",   "<|user|>",      "<|assistant|>",
                                            "<|end|>",     "<|tool|>",     "<tool_call>",   "</tool_call>",
                                            "<tool_result>", "</tool_result>", "<|image|>"};
constexpr size_t kRequired = 5;
// <|image|> (the media placeholder, SPEC §9) is only in tokenizers trained with TrainOptions::image: a text-only
// run's vocabulary stays as it was.
constexpr std::string_view kImage = "<|image|>";

// Length of the well-formed UTF-8 character at s (RFC 3629: no overlongs, no surrogates, at most
// U+10FFFF), or 0 when the byte there does not start one. Matches what SentencePiece accepts.
size_t utf8_char_len(const unsigned char* s, size_t n) {
  const unsigned c = s[0];
  if (c < 0x80) return 1;
  size_t len;
  uint32_t cp;
  if (c >= 0xC2 && c <= 0xDF) len = 2, cp = c & 0x1Fu;
  else if (c >= 0xE0 && c <= 0xEF) len = 3, cp = c & 0x0Fu;
  else if (c >= 0xF0 && c <= 0xF4) len = 4, cp = c & 0x07u;
  else return 0;
  if (n < len) return 0;
  for (size_t k = 1; k < len; ++k) {
    if ((s[k] & 0xC0u) != 0x80u) return 0;
    cp = (cp << 6) | (s[k] & 0x3Fu);
  }
  if (len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) return 0;
  if (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) return 0;
  return len;
}

// Splits `text` into runs SentencePiece keeps exactly (`on_text`) and bytes it cannot (`on_bytes`:
// ill-formed UTF-8 and the U+2581 character), in order.
template <class OnText, class OnBytes>
void for_each_segment(std::string_view text, OnText&& on_text, OnBytes&& on_bytes) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0, run = 0;
  while (i < n) {
    const size_t len = utf8_char_len(s + i, n - i);
    const bool meta = len == 3 && text.substr(i, 3) == kMetaSpace;
    if (len != 0 && !meta) {
      i += len;
      continue;
    }
    if (i > run) on_text(text.substr(run, i - run));
    const size_t raw = meta ? 3 : 1;
    on_bytes(text.substr(i, raw));
    i += raw;
    run = i;
  }
  if (n > run) on_text(text.substr(run));
}

// Training lines: each document cut after every "\n" (kept, so newlines get learned pieces) and at
// SentencePiece's limit (which would silently drop longer lines), preferably at a space.
std::vector<std::string_view> training_lines(const std::vector<std::string>& texts, size_t max_len) {
  std::vector<std::string_view> lines;
  auto add_run = [&](std::string_view run) {
    while (!run.empty()) {
      size_t cut = std::min(run.find('\n'), run.size() - 1) + 1;
      if (cut > max_len) {
        cut = max_len;
        const size_t sp = run.rfind(' ', max_len - 1);
        if (sp != std::string_view::npos && sp > 0) cut = sp;
        else
          while (cut > 1 && (static_cast<unsigned char>(run[cut]) & 0xC0u) == 0x80u) --cut;  // whole characters
      }
      lines.push_back(run.substr(0, cut));
      run.remove_prefix(cut);
    }
  };
  for (const auto& t : texts) for_each_segment(t, add_run, [](std::string_view) {});
  return lines;
}

class LinesIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LinesIterator(const std::vector<std::string_view>& lines) : lines_(lines) { load(); }
  bool done() const override { return i_ >= lines_.size(); }
  void Next() override {
    ++i_;
    load();
  }
  const std::string& value() const override { return cur_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void load() {
    if (i_ < lines_.size()) cur_.assign(lines_[i_]);
  }
  const std::vector<std::string_view>& lines_;
  size_t i_ = 0;
  std::string cur_;
};

void quiet_sentencepiece() {
  static std::once_flag once;
  std::call_once(once, [] { sentencepiece::logging::SetMinLogLevel(2); });
}

}  // namespace

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
  std::string path, bytes;
  std::array<int32_t, 256> byte_id{};
  std::vector<std::string> surface;  // [V] what each id decodes to
  std::vector<uint8_t> special;      // [V] 1 for bos/eos/pad and the named specials
  std::vector<int32_t> named;        // ids of kSpecials (-1: an optional one this model lacks)
  int32_t bos = -1, eos = -1, pad = -1, unk = -1, vocab = 0;
  int64_t max_piece = 1;             // bytes of the longest surface
  // SentencePiece's Encode of a text without anything it must send as bytes, appended to `out`.
  void encode_run(std::string_view text, std::vector<int32_t>& out, std::vector<int>& ids) const {
    for_each_segment(
        text,
        [&](std::string_view run) {
          const auto st = sp.Encode(run, &ids);
          LM_CHECK(st.ok(), "tokenizer '{}': encoding failed: {}", path, st.ToString());
          out.insert(out.end(), ids.begin(), ids.end());
        },
        [&](std::string_view raw) { append_bytes(raw, out); });
  }
  void append_bytes(std::string_view raw, std::vector<int32_t>& out) const {
    for (const char c : raw) out.push_back(byte_id[static_cast<unsigned char>(c)]);
  }
};

const std::vector<std::string>& Tokenizer::special_names() { return kSpecials; }

Tokenizer Tokenizer::from_bytes(const std::string& bytes, const std::string& label) {
  quiet_sentencepiece();
  auto impl = std::make_shared<Impl>();
  impl->path = label;
  impl->bytes = bytes;
  LM_CHECK(!bytes.empty(), "tokenizer '{}' is empty", label);
  const auto st = impl->sp.LoadFromSerializedProto(bytes);
  LM_CHECK(st.ok(), "tokenizer '{}' is not a valid SentencePiece model: {}", label, st.ToString());
  auto& sp = impl->sp;
  impl->vocab = sp.GetPieceSize();
  LM_CHECK(impl->vocab > 0, "tokenizer '{}' has an empty vocabulary", label);
  impl->bos = sp.bos_id(), impl->eos = sp.eos_id(), impl->pad = sp.pad_id(), impl->unk = sp.unk_id();
  LM_CHECK(impl->bos >= 0 && impl->eos >= 0 && impl->pad >= 0 && impl->unk >= 0,
           "tokenizer '{}' lacks one of <s> </s> <pad> <unk> (bos {}, eos {}, pad {}, unk {})", label, impl->bos,
           impl->eos, impl->pad, impl->unk);
  for (int b = 0; b < 256; ++b) {
    const int id = sp.PieceToId(fmt::format("<0x{:02X}>", b));
    LM_CHECK(id >= 0 && sp.IsByte(id), "tokenizer '{}' was trained without byte fallback (no piece <0x{:02X}>)", label,
             b);
    impl->byte_id[static_cast<size_t>(b)] = id;
  }
  impl->surface.resize(static_cast<size_t>(impl->vocab));
  impl->special.assign(static_cast<size_t>(impl->vocab), 0);
  for (int id = 0; id < impl->vocab; ++id) {
    const std::string& piece = sp.IdToPiece(id);
    std::string& out = impl->surface[static_cast<size_t>(id)];
    if (sp.IsByte(id)) {
      out.assign(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));  // "<0xAB>"
    } else if (sp.IsControl(id)) {
      impl->special[static_cast<size_t>(id)] = 1;  // <s> </s> <pad>: render as nothing
    } else if (sp.IsUnknown(id)) {
      out = "\xEF\xBF\xBD";  // U+FFFD
    } else {
      for (size_t p = 0; p < piece.size();) {  // "▁" back to the space it stands for
        if (piece.compare(p, 3, kMetaSpace) == 0) out += ' ', p += 3;
        else out += piece[p++];
      }
    }
  }
  for (size_t i = 0; i < kSpecials.size(); ++i) {
    const int id = sp.PieceToId(kSpecials[i]);
    // User-defined pieces come before the byte pieces; a learned merge spelling the same text is not one.
    const bool has = id != impl->unk && id >= 0 && id < impl->byte_id[0];
    LM_CHECK(has || i >= kRequired, "tokenizer '{}' lacks the special token {} (train it with longmoe)", label,
             kSpecials[i]);
    impl->named.push_back(has ? id : -1);
    if (has) impl->special[static_cast<size_t>(id)] = 1;
  }
  for (const auto& out : impl->surface) impl->max_piece = std::max<int64_t>(impl->max_piece, std::ssize(out));
  Tokenizer tok(std::move(impl));
  // A model trained with other normalisation settings would silently change text: refuse it.
  const std::string probe = "A  b\n\tc.  \n\n d\xC3\xA9 ";
  LM_CHECK(tok.decode(tok.encode(probe)) == probe,
           "tokenizer '{}' does not keep text exactly (it was trained with normalisation or whitespace folding); "
           "train one with `longmoe tokenizer train`",
           label);
  return tok;
}

Tokenizer Tokenizer::load(const std::string& model_path) {
  return from_bytes(read_file(model_path), model_path);
}

Tokenizer Tokenizer::train(const std::vector<std::string>& texts, const std::string& model_path,
                           const TrainOptions& o) {
  quiet_sentencepiece();
  LM_CHECK(!texts.empty(), "tokenizer training needs at least one document");
  const int reserved = 4 + static_cast<int>(kSpecials.size()) + 256;  // unk bos eos pad, the specials, the bytes
  LM_CHECK(o.vocab_size > reserved, "tokenizer vocab_size {} must exceed {} (4 control ids, {} specials, 256 bytes)",
           o.vocab_size, reserved, kSpecials.size());
  LM_CHECK(o.character_coverage >= 0.98 && o.character_coverage <= 1.0,
           "tokenizer character_coverage {} must lie in [0.98, 1]", o.character_coverage);
  LM_CHECK(o.num_threads >= 0 && o.num_threads <= 128, "tokenizer num_threads {} must lie in [0, 128]", o.num_threads);
  LM_CHECK(o.max_sentence_length >= 64, "tokenizer max_sentence_length {} is too small (at least 64 bytes)",
           o.max_sentence_length);
  std::vector<std::string_view> lines = training_lines(texts, o.max_sentence_length);
  LM_CHECK(!lines.empty(), "tokenizer training got only empty documents");
  if (o.input_sentence_size > 0 && lines.size() > o.input_sentence_size) {
    // Our own seeded sample (SentencePiece's ignores the seed in this version): a partial
    // Fisher-Yates pick, kept in corpus order.
    std::vector<size_t> idx(lines.size());
    std::iota(idx.begin(), idx.end(), size_t{0});
    const Rng r{o.seed, 0x544F4B53414D50ull};  // "TOKSAMP"
    for (size_t i = 0; i < o.input_sentence_size; ++i) {
      const Philox4 b = r.bits(i);
      const uint64_t x = (static_cast<uint64_t>(b.v[0]) << 32) | b.v[1];
      std::swap(idx[i], idx[i + x % (idx.size() - i)]);
    }
    idx.resize(o.input_sentence_size);
    std::sort(idx.begin(), idx.end());
    std::vector<std::string_view> picked;
    picked.reserve(idx.size());
    for (const size_t i : idx) picked.push_back(lines[i]);
    lines = std::move(picked);
  }

  std::string specials;
  for (const auto& s : kSpecials)
    if (o.image || s != kImage) specials += (specials.empty() ? "" : ",") + s;
  std::unordered_map<std::string, std::string> kw = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},  // no NFKC: text comes back byte for byte
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},  // indentation and double spaces get pieces of their own
      {"split_digits", "true"},
      {"character_coverage", fmt::format("{}", o.character_coverage)},
      {"max_sentence_length", std::to_string(o.max_sentence_length)},
      {"num_threads", std::to_string(o.num_threads == 0 ? 1 : o.num_threads)},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "3"},
      {"user_defined_symbols", specials},
  };

  std::string proto;
  {
    // The library's random seed is process-wide; BPE training draws nothing from it, but pin it.
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    sentencepiece::SetRandomGeneratorSeed(static_cast<unsigned>(o.seed % 0xFFFFFFFFull));
    LinesIterator it(lines);
    const auto st = sentencepiece::SentencePieceTrainer::Train(kw, &it, &proto);
    LM_CHECK(st.ok(), "tokenizer training for '{}' failed: {}", model_path, st.ToString());
  }
  Tokenizer tok = from_bytes(proto, model_path);  // validate before anything reaches the disk
  write_file_atomic(model_path, proto);
  return tok;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  std::vector<int> ids;
  impl_->encode_run(text, out, ids);
  return out;
}

std::vector<int32_t> Tokenizer::encode_text(std::string_view text, int64_t max_tokens) const {
  // A learned piece never holds a non-space followed by a space (SentencePiece splits its training text
  // into words before each space that follows a non-space; runs of spaces stay whole), so encoding
  // the pieces of a text cut there gives the ids of encoding it whole.
  constexpr size_t kSegment = size_t(64) << 10;
  std::vector<int32_t> out;
  out.reserve(std::min<size_t>(text.size(), max_tokens >= 0 ? static_cast<size_t>(max_tokens) + 1 : text.size()) / 3 +
              4);
  std::vector<int> ids;
  const auto over = [&] { return max_tokens >= 0 && static_cast<int64_t>(out.size()) > max_tokens; };
  const auto plain = [&](std::string_view run) {
    while (!run.empty() && !over()) {
      size_t cut = run.size();
      if (cut > kSegment) {
        cut = 0;
        for (size_t i = kSegment; i > 0 && cut == 0; --i)
          if (run[i] == ' ' && run[i - 1] != ' ') cut = i;
        if (cut == 0) {  // one "word" of 64 KiB: cut at a character boundary
          cut = kSegment;
          while (cut > 1 && (static_cast<unsigned char>(run[cut]) & 0xC0u) == 0x80u) --cut;
        }
      }
      impl_->encode_run(run.substr(0, cut), out, ids);
      run.remove_prefix(cut);
    }
  };
  // The specials' text goes out as bytes; SentencePiece never sees it (it would match it whole).
  size_t run = 0, i = 0;
  while (i < text.size() && !over()) {
    size_t hit = 0;
    if (text[i] == '<')
      for (size_t k = 0; k < kSpecials.size(); ++k)
        if (impl_->named[k] >= 0 && text.compare(i, kSpecials[k].size(), kSpecials[k]) == 0)
          hit = std::max(hit, kSpecials[k].size());
    if (hit == 0) {
      ++i;
      continue;
    }
    plain(text.substr(run, i - run));
    if (over()) break;
    impl_->append_bytes(text.substr(i, hit), out);
    i += hit;
    run = i;
  }
  if (!over()) plain(text.substr(run));
  return out;
}

int64_t Tokenizer::max_piece_bytes() const { return impl_->max_piece; }

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (const int32_t id : ids) out += piece_bytes(id);
  return out;
}

const std::string& Tokenizer::piece_bytes(int32_t id) const {
  LM_CHECK(id >= 0 && id < impl_->vocab, "token id {} is outside the vocabulary [0, {}) of tokenizer '{}'", id,
           impl_->vocab, impl_->path);
  return impl_->surface[static_cast<size_t>(id)];
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab; }
int32_t Tokenizer::bos() const { return impl_->bos; }
int32_t Tokenizer::eos() const { return impl_->eos; }
int32_t Tokenizer::pad() const { return impl_->pad; }
int32_t Tokenizer::unk() const { return impl_->unk; }
const std::string& Tokenizer::model_path() const { return impl_->path; }
const std::string& Tokenizer::model_bytes() const { return impl_->bytes; }

int32_t Tokenizer::special(std::string_view name) const {
  if (name == "<s>" || name == "bos") return impl_->bos;
  if (name == "</s>" || name == "eos") return impl_->eos;
  if (name == "<pad>" || name == "pad") return impl_->pad;
  if (name == "<unk>" || name == "unk") return impl_->unk;
  for (size_t i = 0; i < kSpecials.size(); ++i) {
    const std::string_view full = kSpecials[i];
    const bool bars = full.starts_with("<|");
    if (name == full || (bars && name == full.substr(2, full.size() - 4))) {
      LM_CHECK(impl_->named[i] >= 0 || full != kImage,
               "tokenizer '{}' has no special token {} (it was trained for a text-only model; a multimodal run trains "
               "one that has it)",
               impl_->path, full);
      LM_CHECK(impl_->named[i] >= 0,
               "tokenizer '{}' has no special token {} (it was trained before the tool-use specials; has_special() "
               "tells, and `longmoe tokenizer train` makes a tokenizer that has them)",
               impl_->path, full);
      return impl_->named[i];
    }
  }
  std::string known;
  for (const auto& n : kSpecials) known += n + " ";
  fail("unknown special token '{}' (known: {}<s> </s> <pad> <unk>)", name, known);
}

bool Tokenizer::has_special(std::string_view name) const {
  for (size_t i = 0; i < kSpecials.size(); ++i)
    if (name == kSpecials[i]) return impl_->named[i] >= 0;
  return special(name) >= 0;  // the controls and the short names (throws for an unknown name)
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < impl_->vocab && impl_->special[static_cast<size_t>(id)] != 0;
}

}  // namespace lm::io
