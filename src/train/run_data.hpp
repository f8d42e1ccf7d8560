#pragma once
// A run's data: the corpus split by whole documents into a training and a held-out part, the tokenizer,
// the unigram baseline, and per curriculum stage the synthetic passkey documents mixed into the training
// stream (train/synthetic.hpp; the held-out part stays pure corpus).
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "io/tokenizer.hpp"
#include "train/data.hpp"
#include "train/trainer.hpp"

namespace lm::train {

struct RunData {
  using Say = std::function<void(const std::string&)>;  // a progress line for the user
  // Reads the corpus and takes the tokenizer from the checkpoint resumed (resume_dir non-empty), else
  // cfg.tokenizer (copied to out/tokenizer.model), else trains a BPE tokenizer into out/tokenizer.model.
  // Checks that every stage fits a passkey document (with passkey documents). Not `writer` (a data-parallel replica
  // other than rank 0): out/tokenizer.model is the one rank 0 wrote, read instead of trained or copied.
  RunData(const RunConfig& cfg, const std::filesystem::path& out, const std::string& resume_dir, const Say& say,
          bool writer = true);

  // The tokenizer file a checkpoint copies.
  std::string tokenizer_file() const;
  // Stage si's passkey documents per epoch of the training stream (an empty function without them, and in a
  // concat_documents stage, whose passkey documents fill whole sequences instead: set_concat).
  Loader::ExtraDocs passkey_docs(int64_t si) const;
  // Stage si's concat_documents setting on the loader, with its passkey sequences.
  void set_concat(Loader& loader, int64_t si) const;
  // The data fingerprint of stage si's training stream (trainer_state.json): the corpus', and with passkey
  // documents theirs in epoch 0, which stay in stage_pk (and the time they took in stage_pk_seconds).
  uint64_t stage_fingerprint(int64_t si);

  const RunConfig& cfg;
  const std::filesystem::path tok_path;  // out/tokenizer.model
  std::unique_ptr<io::Tokenizer> tok;
  std::shared_ptr<TokenizedDocs> train;
  TokenizedDocs heldout;
  double unigram_ce = 0;  // the unigram baseline's held-out cross-entropy (nats per target)
  bool passkey = false;       // passkey documents (data.passkey_fraction > 0)
  int64_t passkey_target = 0;  // passkey tokens per epoch
  TokenizedDocs stage_pk;
  double stage_pk_seconds = 0;
};

}  // namespace lm::train
