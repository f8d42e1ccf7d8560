// `longmoe tokenizer train|encode|decode`: train the SentencePiece BPE tokenizer on a corpus, and
// look at what it does to a string.
//   longmoe tokenizer train --input data/brown --vocab-size 4096 --out runs/tok.model
//   longmoe tokenizer encode --model runs/tok.model "Hello world"
//   longmoe tokenizer decode --model runs/tok.model 9 1234 567
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "apps/longmoe/commands.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "io/corpus.hpp"
#include "io/tokenizer.hpp"

namespace {

using namespace lm;

struct TrainArgs {
  std::vector<std::string> inputs;
  std::string format = "auto", out;
  bool paragraphs = false;
  int vocab = 4096;
  uint64_t seed = 0;
  double coverage = 0.9999;
  size_t sample = 0;
};

int run_train(const TrainArgs& a) {
  const auto t0 = std::chrono::steady_clock::now();
  const io::CorpusFormat fmt = io::parse_corpus_format(a.format);
  std::vector<std::string> docs;
  for (const auto& in : a.inputs) {
    auto d = io::read_corpus(in, fmt, a.paragraphs);
    std::printf("%s: %zu documents (%s)\n", in.c_str(), d.size(),
                std::string(io::corpus_format_name(fmt == io::CorpusFormat::Auto ? io::detect_corpus_format(in) : fmt))
                    .c_str());
    for (auto& s : d) docs.push_back(std::move(s));
  }
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();
  const auto t1 = std::chrono::steady_clock::now();
  io::Tokenizer::TrainOptions o;
  o.vocab_size = a.vocab, o.seed = a.seed, o.character_coverage = a.coverage, o.input_sentence_size = a.sample;
  const io::Tokenizer tok = io::Tokenizer::train(docs, a.out, o);
  const auto t2 = std::chrono::steady_clock::now();
  std::vector<size_t> ntok(docs.size());
  parallel_for_dynamic(static_cast<int64_t>(docs.size()),
                       [&](int64_t i) { ntok[static_cast<size_t>(i)] = tok.encode(docs[static_cast<size_t>(i)]).size(); });
  size_t tokens = 0;
  for (const size_t n : ntok) tokens += n;
  const auto t3 = std::chrono::steady_clock::now();
  auto secs = [](auto x, auto y) { return std::chrono::duration<double>(y - x).count(); };
  std::printf("read %zu documents, %.2f MB in %.2f s\n", docs.size(), static_cast<double>(bytes) / 1e6, secs(t0, t1));
  std::printf("trained BPE vocab %d in %.2f s -> %s\n", tok.vocab_size(), secs(t1, t2), a.out.c_str());
  std::printf("encoded the corpus in %.2f s: %zu tokens, %.2f bytes/token\n", secs(t2, t3), tokens,
              tokens ? static_cast<double>(bytes) / static_cast<double>(tokens) : 0.0);
  return 0;
}

lm::app::Register reg({"tokenizer", "Train the BPE tokenizer on a corpus; encode and decode with it", [](CLI::App& sub) {
  sub.require_subcommand(1);
  auto actions = std::make_shared<std::map<CLI::App*, std::function<int()>>>();

  auto ta = std::make_shared<TrainArgs>();
  CLI::App* tr = sub.add_subcommand("train", "Train a SentencePiece BPE tokenizer (byte fallback, chat and tool-use specials)");
  tr->add_option("--input", ta->inputs, "Corpus files or folders")->required();
  tr->add_option("--format", ta->format, "auto|text|folder|jsonl|brown (auto: by the path)");
  tr->add_flag("--paragraphs", ta->paragraphs, "Text files: one document per blank-line-separated paragraph");
  tr->add_option("--vocab-size", ta->vocab, "Vocabulary size (incl. 270 reserved: controls, specials, bytes)");
  tr->add_option("--out", ta->out, "Model file to write (atomically)")->required();
  tr->add_option("--seed", ta->seed, "Seed (used when --sample draws a subset of lines)");
  tr->add_option("--coverage", ta->coverage, "Character coverage in [0.98, 1]; rarer characters become bytes");
  tr->add_option("--sample", ta->sample, "Train on a seeded sample of this many lines (0: all)");
  (*actions)[tr] = [ta] { return run_train(*ta); };

  auto model = std::make_shared<std::string>();
  auto text = std::make_shared<std::string>();
  CLI::App* en = sub.add_subcommand("encode", "Print the token ids of a text");
  en->add_option("--model", *model, "Tokenizer model file")->required();
  en->add_option("text", *text, "Text to encode")->required();
  (*actions)[en] = [model, text] {
    const auto tok = io::Tokenizer::load(*model);
    const auto ids = tok.encode(*text);
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? " " : "", ids[i]);
    std::printf("\n");
    return 0;
  };

  auto dmodel = std::make_shared<std::string>();
  auto ids = std::make_shared<std::vector<int32_t>>();
  CLI::App* de = sub.add_subcommand("decode", "Print the text of token ids");
  de->add_option("--model", *dmodel, "Tokenizer model file")->required();
  de->add_option("ids", *ids, "Token ids")->required();
  (*actions)[de] = [dmodel, ids] {
    const auto tok = io::Tokenizer::load(*dmodel);
    const std::string s = tok.decode(*ids);
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::printf("\n");
    return 0;
  };

  return [actions] {
    for (auto& [s, act] : *actions)
      if (s->parsed()) return act();
    return 1;
  };
}});

}  // namespace
