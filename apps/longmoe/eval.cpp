// `longmoe eval --model DIR`: held-out perplexity over a corpus (text, folder, JSONL or the Brown corpus,
// io/corpus) and retrieval at chosen context lengths: passkey (one number hidden in filler text) and
// multi-needle (several key -> number facts, one asked for). Accuracy is reported per length.
// The prompt text (intro, filler, needles, passkey question) comes from io/retrieval.hpp, which the
// trainer's synthetic passkey documents (data.passkey_fraction) use too: at length L, prompt + answer
// hold at most L tokens, as in a training document of L + 1 tokens (with its <|doc|>); the keys come
// from another stream.
// --classify DIR (a multimodal model trained with data.images): the first --images test images of the Fashion-MNIST
// folder DIR, each asked "<image> This is a picture of" (train/captions.hpp), the greedy answer parsed for a class
// name; accuracy against the labels (chance 10%), per class, and how many answers named no class.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>

#include "apps/longmoe/commands.hpp"
#include "apps/longmoe/infer_common.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"
#include "io/corpus.hpp"
#include "io/idx.hpp"
#include "io/retrieval.hpp"
#include "train/captions.hpp"

namespace {

using namespace lm;

struct Args : app::InferArgs {
  std::string data, format = "auto";
  int64_t window = 2048, max_docs = 0, max_tokens_eval = 200000;
  std::vector<int64_t> passkey, needles_at;
  int64_t needles = 4, trials = 5;
  std::string classify;
  int64_t images = 1000, image_size = 56;
  uint64_t seed = 1;
};

// Perplexity: each document as [<s>] + tokens, cut into windows scored independently.
void perplexity(infer::Engine& s, const io::Tokenizer& tok, const Args& a) {
  const auto docs = io::read_corpus(a.data, io::parse_corpus_format(a.format));
  const int64_t V = s.vocab_size(), W = std::min(a.window, s.max_context());
  double nll = 0;
  int64_t n = 0, ndocs = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& doc : docs) {
    if (a.max_docs > 0 && ndocs >= a.max_docs) break;
    if (n >= a.max_tokens_eval) break;
    ++ndocs;
    std::vector<int32_t> ids;
    if (tok.bos() >= 0) ids.push_back(tok.bos());
    const auto e = tok.encode(doc);
    ids.insert(ids.end(), e.begin(), e.end());
    for (size_t w0 = 0; w0 + 1 < ids.size(); w0 += static_cast<size_t>(W)) {
      const size_t w1 = std::min(ids.size(), w0 + static_cast<size_t>(W) + 1);  // + the last target
      const infer::EngineSequence seq(s);
      std::vector<float> logits;
      s.prefill(seq.id(), std::span(ids.data() + w0, w1 - w0 - 1), &logits, false);
      for (size_t t = 0; t + 1 < w1 - w0; ++t) {
        const float* l = logits.data() + t * static_cast<size_t>(V);
        const float mx = *std::max_element(l, l + V);
        double se = 0;
        for (int64_t v = 0; v < V; ++v) se += std::exp(static_cast<double>(l[v] - mx));
        nll += std::log(se) + mx - l[ids[w0 + t + 1]];
        ++n;
      }
    }
  }
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  LM_CHECK(n > 0, "eval: {} holds no scorable tokens", a.data);
  std::printf("perplexity  %s: %ld documents, %ld tokens, window %ld: mean NLL %.4f nats, perplexity %.3f "
              "(%.0f tokens/s)\n",
              a.data.c_str(), static_cast<long>(ndocs), static_cast<long>(n), static_cast<long>(W), nll / n,
              std::exp(nll / n), n / t);
}

// Greedy answer of up to `n` tokens.
std::string answer(infer::Engine& s, const io::Tokenizer& tok, const std::vector<int32_t>& prompt, int64_t n) {
  infer::SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = n;
  if (tok.eos() >= 0) sp.stop_tokens.push_back(tok.eos());
  sp.stop_tokens.push_back(tok.special("<|doc|>"));  // a trained document ends there
  infer::EngineSequence seq(s);
  return infer::generate(seq, tok, prompt, sp, [](const std::string&) {}).text();
}

std::vector<int32_t> encode_prompt(const io::Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids;
  if (tok.bos() >= 0) ids.push_back(tok.bos());
  const auto e = tok.encode(text);
  ids.insert(ids.end(), e.begin(), e.end());
  return ids;
}

void retrieval(infer::Engine& s, const io::Tokenizer& tok, const Args& a, bool multi) {
  const Rng rng{a.seed, multi ? 2u : 1u};
  const char* words[] = {"apple", "river", "candle", "falcon", "marble", "violet", "harbor", "quartz"};
  for (int64_t L : multi ? a.needles_at : a.passkey) {
    int64_t ok = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t k = 0; k < a.trials; ++k) {
      const uint64_t i = static_cast<uint64_t>(L * 1000 + k);
      std::string question, expect;
      std::vector<int32_t> ids;
      if (!multi) {
        // Prompt + answer in L tokens: the prompt is L minus the answer's tokens (or a sentence less).
        expect = io::passkey_key(rng.bits(i).v[0]);
        const double depth = a.trials > 1 ? static_cast<double>(k) / static_cast<double>(a.trials - 1) : 0.5;
        ids = io::passkey_prompt(tok, L, depth, expect).ids;
      } else {
        std::string body = io::retrieval_filler(tok, L - 60 - 25 * a.needles);
        const int64_t ask = static_cast<int64_t>(rng.bits(i).v[1] % static_cast<uint32_t>(a.needles));
        for (int64_t j = 0; j < a.needles; ++j) {
          const std::string num = std::to_string(1000000 + rng.bits(i * 64 + static_cast<uint64_t>(j)).v[2] % 9000000);
          const std::string w = words[j % 8] + (j >= 8 ? std::to_string(j / 8) : std::string());
          body = io::with_needle(body, rng.uniform_f64(i * 64 + static_cast<uint64_t>(j)),
                                 "The special magic number for " + w + " is: " + num + ". ");
          if (j == ask) {
            expect = num;
            question = "What is the special magic number for " + w + "? The special magic number for " + w + " is: ";
          }
        }
        ids = encode_prompt(tok, std::string(io::kRetrievalIntro) + body + "\n" + question);
      }
      if (static_cast<int64_t>(ids.size()) >= s.max_context()) ids.erase(ids.begin() + 1, ids.begin() + 1 + (static_cast<int64_t>(ids.size()) - s.max_context() + 16));
      const std::string got = answer(s, tok, ids, 12);
      const bool hit = got.find(expect) != std::string::npos;
      ok += hit;
    }
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-11s length %7ld: accuracy %5.1f%% (%ld / %ld)%s  [%.1f s]\n", multi ? "multi-needle" : "passkey",
                static_cast<long>(L), 100.0 * ok / std::max<int64_t>(1, a.trials), static_cast<long>(ok),
                static_cast<long>(a.trials), multi ? fmt::format(", {} needles", a.needles).c_str() : "", t);
    std::fflush(stdout);
  }
}

void classify(infer::Engine& s, const infer::LoadedModel& m, const Args& a) {
  const io::Tokenizer& tok = *m.tokenizer;
  infer::image_token(m.config, tok);  // (a clear error for a text-only model or tokenizer)
  io::LabelledImages test = io::read_fashion_mnist(a.classify, "t10k");
  LM_CHECK(a.images >= 1 && a.images <= test.n, "eval: --images {} outside [1, {}]", a.images, test.n);
  const train::CaptionData cd(std::move(test), tok, m.config, a.image_size, 0);
  infer::SamplingParams sp;
  sp.temperature = 0;
  sp.max_tokens = 8;
  for (const char* stop : {"<|doc|>", "</s>", "<|image|>"}) sp.stop_tokens.push_back(tok.special(stop));
  sp.stop = {"."};
  const auto& names = io::fashion_mnist_classes();
  std::vector<int64_t> right(names.size()), seen(names.size());
  int64_t ok = 0, none = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::string examples;
  for (int64_t i = 0; i < a.images; ++i) {
    infer::EngineSequence seq(s);
    std::vector<int32_t> prompt = cd.class_prompt();
    seq.attach_media(cd.media(i));
    const std::string got = infer::generate(seq, tok, prompt, sp, [](const std::string&) {}).text();
    const int label = cd.images().labels[static_cast<size_t>(i)], k = train::CaptionData::parse_class(got);
    ++seen[static_cast<size_t>(label)];
    if (k == label) ++ok, ++right[static_cast<size_t>(label)];
    if (k < 0) ++none;
    if (i < 5) examples += fmt::format("  image {} ({}): \"{}\"\n", i, names[static_cast<size_t>(label)], got);
  }
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("classify    %s t10k: %ld images at %ld px: accuracy %.1f%% (%ld / %ld; chance 10%%), %ld answers "
              "named no class  [%.1f s]\n%s",
              a.classify.c_str(), static_cast<long>(a.images), static_cast<long>(a.image_size),
              100.0 * static_cast<double>(ok) / static_cast<double>(a.images), static_cast<long>(ok),
              static_cast<long>(a.images), static_cast<long>(none), t, examples.c_str());
  for (size_t c = 0; c < names.size(); ++c)
    std::printf("  %-10s %5.1f%% of %ld\n", names[c].c_str(),
                seen[c] ? 100.0 * static_cast<double>(right[c]) / static_cast<double>(seen[c]) : 0.0,
                static_cast<long>(seen[c]));
  std::fflush(stdout);
}

int run(const Args& a) {
  LM_CHECK(!a.data.empty() || !a.passkey.empty() || !a.needles_at.empty() || !a.classify.empty(),
           "eval: nothing to do (give --data, --passkey, --multi-needle and/or --classify)");
  LM_CHECK(a.trials >= 1 && a.needles >= 1 && a.window >= 2, "eval: --trials, --needles must be >= 1, --window >= 2");
  infer::LoadedModel m = a.load();
  Args no_prefix = a;  // (every prompt is new: nothing to reuse)
  no_prefix.prefix_cache_mb = 0;
  infer::OwnedEngine engine = no_prefix.engine(m);
  infer::Engine& s = *engine;
  std::printf("engine: %s\n", s.describe().c_str());
  for (int64_t L : a.passkey) {
    LM_CHECK(L >= 128 && L <= s.max_context(), "eval: passkey length {} outside [128, {}]", L, s.max_context());
    LM_CHECK(L >= io::passkey_min_tokens(*m.tokenizer),
             "eval: passkey length {} is shorter than the smallest passkey prompt ({} tokens with this tokenizer)", L,
             io::passkey_min_tokens(*m.tokenizer));
  }
  for (int64_t L : a.needles_at)
    LM_CHECK(L >= 128 + 25 * a.needles && L <= s.max_context(), "eval: multi-needle length {} too short or over the context", L);
  if (!a.data.empty()) perplexity(s, *m.tokenizer, a);
  if (!a.passkey.empty()) retrieval(s, *m.tokenizer, a, false);
  if (!a.needles_at.empty()) retrieval(s, *m.tokenizer, a, true);
  if (!a.classify.empty()) classify(s, m, a);
  return 0;
}

app::Register reg({"eval", "Held-out perplexity, passkey and multi-needle retrieval accuracy per context length",
                   [](CLI::App& sub) {
                     auto a = std::make_shared<Args>();
                     a->add_model(sub);
                     sub.add_option("--data", a->data, "held-out corpus: text file, folder, .jsonl or Brown dir");
                     sub.add_option("--format", a->format, "auto, text, folder, jsonl or brown");
                     sub.add_option("--window", a->window, "perplexity window in tokens");
                     sub.add_option("--max-docs", a->max_docs, "documents to score at most (0: all)");
                     sub.add_option("--max-eval-tokens", a->max_tokens_eval, "stop scoring after this many tokens");
                     sub.add_option("--passkey", a->passkey, "context lengths for passkey retrieval, e.g. 1024,4096")
                         ->delimiter(',');
                     sub.add_option("--multi-needle", a->needles_at, "context lengths for multi-needle retrieval")
                         ->delimiter(',');
                     sub.add_option("--needles", a->needles, "needles per multi-needle prompt");
                     sub.add_option("--trials", a->trials, "prompts per length (depths spread evenly)");
                     sub.add_option("--seed", a->seed, "seed of the hidden numbers");
                     sub.add_option("--classify", a->classify, "Fashion-MNIST folder: name the class of its test "
                                    "images by generation (a model trained with data.images)");
                     sub.add_option("--images", a->images, "test images to classify (the first N of t10k)");
                     sub.add_option("--image-size", a->image_size, "px per side, as in training (data.images.size)");
                     return [a] { return run(*a); };
                   }});

}  // namespace
