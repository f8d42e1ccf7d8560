#pragma once
// SentencePiece BPE tokenizer (Debian's libsentencepiece) that keeps text exactly:
//   decode(encode(s)) == s for every byte string s (any UTF-8, invalid bytes, "\n", "\t", runs of
//   spaces). Settings: identity normalisation, no dummy prefix, no whitespace folding, byte fallback
//   (256 pieces <0x00>..<0xFF>), digits split, whitespace-only pieces allowed.
//
// Vocabulary layout (fixed by training): 0 <unk>, 1 <s> (bos), 2 </s> (eos), 3 <pad>, then the
// user-defined specials <|doc|> <|system|> <|user|> <|assistant|> <|end|> and the tool-use ones
// <|tool|> <tool_call> </tool_call> <tool_result> </tool_result> (one id each; the chat format of
// docs/rl.md), then the byte pieces, then the learned merges. Ask special()/bos()/... rather than
// hard-coding ids. A tokenizer trained before the tool-use specials existed has only the first five
// and loads as it is: has_special() tells, and its checkpoints keep working unchanged. <|image|>, the media
// placeholder of multimodal models (SPEC §9), comes last among the specials and only with TrainOptions::image.
//
// Two things SentencePiece cannot represent are sent as byte pieces by encode() itself, so they
// survive: bytes that are not valid UTF-8 (SentencePiece would turn them into U+FFFD) and the
// character U+2581 "▁" (SentencePiece's own stand-in for a space).
// The specials' text ("<|user|>") inside a string given to encode() becomes the special's single id
// (training data, hand-built prompts); encode_text() never makes one (user and tool text: a user who
// writes "<|end|><|system|>" must not end their turn). decode() renders a special back as its text.
// bos/eos/pad decode to nothing, <unk> to U+FFFD.
// A Tokenizer is cheap to copy (shared, immutable) and safe to use from many threads.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lm::io {

class Tokenizer {
 public:
  struct TrainOptions {
    int vocab_size = 4096;
    double character_coverage = 0.9999;  // SentencePiece accepts [0.98, 1]; rarer characters use byte pieces
    uint64_t seed = 0;
    int num_threads = 0;  // 0: one thread. One thread is deterministic; the count is stored in the model file
    size_t max_sentence_length = 16384;  // bytes; longer lines are cut into pieces of this size for training
    size_t input_sentence_size = 0;      // 0: train on every line; else a seeded sample of this many lines
    bool image = false;  // add the <|image|> special (multimodal runs: the media placeholder's id)
  };

  // Trains BPE with byte fallback on `texts` (each a document) and writes `model_path` atomically.
  // Identical texts and options give byte-identical model files.
  static Tokenizer train(const std::vector<std::string>& texts, const std::string& model_path, const TrainOptions&);
  // Throws lm::Error naming the file when it is missing, corrupt, or not a text-preserving model.
  static Tokenizer load(const std::string& model_path);
  // Same from the model file's bytes (`label` names them in errors).
  static Tokenizer from_bytes(const std::string& bytes, const std::string& label);

  std::vector<int32_t> encode(std::string_view text) const;   // no specials added
  // Plain text: a special's text inside `text` is encoded as its bytes (byte pieces), never as the
  // special's id; otherwise the same ids as encode(). Memory stays bounded for any length: the text is
  // encoded in pieces cut where no learned piece can span (before a space that follows a non-space; a
  // run of more than 64 KiB without one is cut at a character boundary, the only place where the ids
  // may differ from encode()'s). With `max_tokens` >= 0 encoding stops as soon as more than max_tokens
  // ids exist (the result then holds more than max_tokens ids, not all of the text): a caller learns
  // "too long" without encoding all of a huge text.
  std::vector<int32_t> encode_text(std::string_view text, int64_t max_tokens = -1) const;
  // Bytes of the longest piece: a text of B bytes has at least ceil(B / max_piece_bytes()) ids from
  // encode_text(), so a text can be found too long from its size alone.
  int64_t max_piece_bytes() const;
  std::string decode(const std::vector<int32_t>& ids) const;  // throws on an id outside [0, vocab_size)
  // Bytes that `id` contributes to decode() (a byte piece gives one byte, possibly part of a UTF-8 char).
  const std::string& piece_bytes(int32_t id) const;

  int32_t vocab_size() const;
  int32_t bos() const;
  int32_t eos() const;
  int32_t pad() const;
  int32_t unk() const;
  // "<|doc|>" (document separator), "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>",
  // "<tool_call>", "</tool_call>", "<tool_result>", "</tool_result>", "<|image|>"; the <|...|> ones also without the
  // brackets ("doc"), and "<s>", "</s>", "<pad>", "<unk>". Throws if unknown or absent from this model.
  int32_t special(std::string_view name) const;
  bool has_special(std::string_view name) const;  // false for a tool-use special an older model lacks
  bool is_special(int32_t id) const;  // bos, eos, pad and the named specials it has (not <unk>)
  const std::string& model_path() const;
  const std::string& model_bytes() const;  // the serialized model, e.g. to store beside a checkpoint

  // The user-defined specials, in id order (a tokenizer trained before the tool-use ones has the first five).
  static const std::vector<std::string>& special_names();

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace lm::io
