#include "train/run_data.hpp"

#include <chrono>
#include <cmath>
#include <cstring>

#include "core/error.hpp"
#include "io/chat.hpp"
#include "io/corpus.hpp"
#include "train/synthetic.hpp"

namespace lm::train {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kSequenceStream = 0x53455153;  // "SEQS": a concat stage's synthetic sequences

// A checkpoint's data_fingerprint: the training corpus, and with passkey documents the documents of
// epoch 0 of the stage the saved position refers to (they depend on the seed, the stage's seq_len,
// the fraction, the tokenizer and the template). Without passkey documents: the corpus' alone, as
// before they existed. With multi-needle documents (concat stages), their fraction too.
uint64_t mix(uint64_t h, uint64_t x) {
  for (int i = 0; i < 8; ++i) h = (h ^ ((x >> (8 * i)) & 0xFF)) * 0x100000001B3ull;
  return h;
}
uint64_t data_fingerprint(const TokenizedDocs& corpus, const TokenizedDocs* passkey0) {
  const uint64_t h = corpus.fingerprint();
  return passkey0 ? mix(h, passkey0->fingerprint()) : h;
}

std::unique_ptr<io::Tokenizer> make_tokenizer(const RunConfig& cfg, const fs::path& tok_path,
                                              const std::string& resume_dir, const std::vector<std::string>& docs,
                                              const DataSplit& idx, const RunData::Say& say, bool writer) {
  if (!writer && resume_dir.empty()) return std::make_unique<io::Tokenizer>(io::Tokenizer::load(tok_path.string()));
  if (!resume_dir.empty())
    return std::make_unique<io::Tokenizer>(io::Tokenizer::load((fs::path(resume_dir) / "tokenizer.model").string()));
  if (!cfg.tokenizer.empty()) {
    auto tok = std::make_unique<io::Tokenizer>(io::Tokenizer::load(cfg.tokenizer));
    fs::copy_file(cfg.tokenizer, tok_path, fs::copy_options::overwrite_existing);
    return tok;
  }
  std::vector<std::string> texts;
  for (int64_t d : idx.train_docs) texts.push_back(docs[d]);
  const auto t0 = Clock::now();
  io::Tokenizer::TrainOptions to;
  to.vocab_size = cfg.tokenizer_vocab;
  to.seed = cfg.seed;
  to.image = !cfg.images.empty();  // the media placeholder of a run with images
  auto tok = std::make_unique<io::Tokenizer>(io::Tokenizer::train(texts, tok_path.string(), to));
  say(fmt::format("tokenizer: BPE, {} tokens, trained on {} documents in {:.1f}s", tok->vocab_size(), texts.size(),
                  std::chrono::duration<double>(Clock::now() - t0).count()));
  return tok;
}

}  // namespace

RunData::RunData(const RunConfig& c, const fs::path& out, const std::string& resume_dir, const Say& say, bool writer)
    : cfg(c), tok_path(out / "tokenizer.model") {
  const bool chat = cfg.data_format == "chat";
  std::vector<std::string> docs;
  std::vector<io::Conversation> convs;
  if (chat) convs = io::read_demos(cfg.data);
  else docs = io::read_corpus(cfg.data, io::parse_corpus_format(cfg.data_format));
  const size_t n = chat ? convs.size() : docs.size();
  LM_CHECK(n >= 2, "'{}': need at least 2 {} (one is held out), found {}", cfg.data,
           chat ? "conversations" : "documents", n);
  // The held-out documents are chosen before the tokenizer exists (one placeholder token per document),
  // so the tokenizer never sees them.
  TokenizedDocs index_only;
  for (size_t i = 0; i < n; ++i) index_only.ids.push_back(0), index_only.offsets.push_back(i + 1);
  const DataSplit idx = split_documents(index_only, cfg.heldout_fraction, cfg.seed);
  tok = make_tokenizer(cfg, tok_path, resume_dir, docs, idx, say, writer);  // (chat: validate() asked for one)
  const TokenizedDocs all = chat ? tokenize_conversations(*tok, convs) : tokenize_documents(*tok, docs);
  train = std::make_shared<TokenizedDocs>(select_documents(all, idx.train_docs));
  heldout = select_documents(all, idx.heldout_docs);
  const Unigram unigram = Unigram::fit(*train, tok->vocab_size());
  unigram_ce = unigram.cross_entropy(heldout);
  say(fmt::format("data: {} {} ({} train, {} held out), {} train tokens, {} held-out tokens; unigram "
                  "held-out ppl {:.1f}",
                  n, chat ? "conversations" : "documents", idx.train_docs.size(), idx.heldout_docs.size(),
                  train->tokens(), heldout.tokens(), std::exp(unigram_ce)));
  if (chat) {  // a sequence that starts inside a conversation learns nothing from it (TokenizedDocs::loss_mask)
    int64_t longest = 0, targets = 0;
    for (int64_t d = 0; d < all.num_docs(); ++d) longest = std::max<int64_t>(longest, std::ssize(all.doc(d)));
    for (const uint8_t m : train->loss_mask) targets += m;
    int64_t shortest_seq = cfg.stages.front().seq_len;
    for (const auto& s : cfg.stages) shortest_seq = std::min(shortest_seq, s.seq_len);
    say(fmt::format("  {} assistant tokens to learn ({:.0f}% of the training tokens); the longest conversation has {} "
                    "tokens{}",
                    targets, 100.0 * static_cast<double>(targets) / static_cast<double>(std::max<int64_t>(1, train->tokens())),
                    longest,
                    longest > shortest_seq ? fmt::format(" (more than seq_len {}: what follows a sequence's end is not "
                                                         "learnt)", shortest_seq)
                                           : ""));
  }

  passkey = cfg.passkey_fraction > 0;
  passkey_target = passkey ? passkey_target_tokens(train->tokens(), cfg.passkey_fraction) : 0;
  for (size_t i = 0; i < cfg.stages.size(); ++i) {
    try {
      if (passkey) passkey_min_doc_tokens(*tok, cfg.stages[i].seq_len);
      if (cfg.multi_needle_fraction > 0) multi_needle_min_doc_tokens(*tok, cfg.stages[i].seq_len);
    } catch (const Error& e) {
      fail("stages[{}]: {}", i, e.what());
    }
  }
}

std::string RunData::tokenizer_file() const { return fs::exists(tok_path) ? tok_path.string() : tok->model_path(); }

Loader::ExtraDocs RunData::passkey_docs(int64_t si) const {
  if (!passkey || cfg.stages[static_cast<size_t>(si)].concat_documents) return {};
  return [tk = tok.get(), T = cfg.stages[static_cast<size_t>(si)].seq_len, target = passkey_target,
          rng = passkey_rng(cfg.seed, si)](uint64_t epoch) {
    return passkey_documents(*tk, T, target, rng.fork(epoch));
  };
}

void RunData::set_concat(Loader& loader, int64_t si) const {
  const StageConfig& S = cfg.stages[static_cast<size_t>(si)];
  const double synth = cfg.synthetic_fraction();
  if (!S.concat_documents || synth == 0) return loader.set_concat(S.concat_documents);
  // (without multi-needle documents, retrieval_sequence is passkey_sequence: the same sequences as before them)
  loader.set_concat(true, synth,
                    [tk = tok.get(), T = S.seq_len, multi = cfg.multi_needle_fraction / synth](const Philox4& bits) {
                      return retrieval_sequence(*tk, T, multi, bits);
                    },
                    passkey_rng(cfg.seed, si).fork(kSequenceStream), cfg.answer_weight);
}

uint64_t RunData::stage_fingerprint(int64_t si) {
  if (!passkey || cfg.stages[static_cast<size_t>(si)].concat_documents) {
    stage_pk = {};
    const uint64_t h = data_fingerprint(*train, nullptr);
    if (cfg.multi_needle_fraction == 0) return h;
    uint64_t f = 0;
    std::memcpy(&f, &cfg.multi_needle_fraction, sizeof f);
    return mix(mix(h, f), static_cast<uint64_t>(kTrainNeedles));
  }
  const auto t0 = Clock::now();
  stage_pk = passkey_docs(si)(0);
  stage_pk_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return data_fingerprint(*train, &stage_pk);
}

}  // namespace lm::train
