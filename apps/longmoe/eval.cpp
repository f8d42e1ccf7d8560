// `longmoe eval --model DIR`: held-out perplexity over a corpus (text, folder, JSONL or the Brown corpus,
// io/corpus) and retrieval at chosen context lengths: passkey (one number hidden in filler text) and
// multi-needle (several key -> number facts, one asked for). Accuracy is reported per length.
// Retrieval is infer/retrieval_eval.hpp (also run by the trainer after each stage, run config
// "eval_retrieval"); its passkey template is the one of the trainer's synthetic passkey documents.
// --classify DIR (a multimodal model trained with data.images): the first --images test images of the Fashion-MNIST
// folder DIR, each asked "<image> This is a picture of" (train/captions.hpp), the greedy answer parsed for a class
// name; accuracy against the labels (chance 10%), per class, and how many answers named no class.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>

#include "apps/longmoe/commands.hpp"
#include "apps/longmoe/infer_common.hpp"
#include "core/error.hpp"
#include "io/corpus.hpp"
#include "infer/retrieval_eval.hpp"
#include "io/file.hpp"
#include "io/idx.hpp"
#include "train/captions.hpp"

namespace {

using namespace lm;

struct Args : app::InferArgs {
  std::string data, format = "auto", json_out;
  int64_t window = 2048, max_docs = 0, max_tokens_eval = 200000;
  infer::RetrievalOptions retrieval;
  std::string classify;
  int64_t images = 1000, image_size = 56;
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
    if (i < 5)  // (quoted and escaped: an untrained model's bytes need not be text)
      examples += fmt::format("  image {} ({}): {}\n", i, names[static_cast<size_t>(label)],
                              io::json(got).dump(-1, ' ', false, io::json::error_handler_t::replace));
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
  LM_CHECK(!a.data.empty() || !a.retrieval.empty() || !a.classify.empty(),
           "eval: nothing to do (give --data, --passkey, --multi-needle and/or --classify)");
  LM_CHECK(a.window >= 2, "eval: --window must be >= 2");
  LM_CHECK(a.json_out.empty() || !a.retrieval.empty(), "eval: --json writes retrieval results; give --passkey or --multi-needle");
  infer::LoadedModel m = a.load();
  a.retrieval.validate(*m.tokenizer, "eval");
  Args no_prefix = a;  // (every prompt is new: nothing to reuse)
  no_prefix.prefix_cache_mb = 0;
  // The engine holds the longest prompt asked for unless --context says otherwise (then it is checked).
  if (a.context == 0) no_prefix.context = std::max(a.retrieval.longest(), a.data.empty() ? 0 : a.window);
  infer::OwnedEngine engine = no_prefix.engine(m);
  infer::Engine& s = *engine;
  std::printf("engine: %s\n", s.describe().c_str());
  if (!a.data.empty()) perplexity(s, *m.tokenizer, a);
  if (!a.classify.empty()) classify(s, m, a);
  if (a.retrieval.empty()) return 0;
  std::string lines;
  infer::eval_retrieval(s, *m.tokenizer, a.retrieval, [&](const infer::RetrievalPoint& p) {
    std::printf("%s\n", infer::describe(p, a.retrieval.needles).c_str());
    std::fflush(stdout);
    lines += p.to_json().dump() + "\n";
  });
  if (!a.json_out.empty()) io::write_file_atomic(a.json_out, lines);
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
                     sub.add_option("--passkey", a->retrieval.passkey, "context lengths for passkey retrieval, e.g. 1024,4096")
                         ->delimiter(',');
                     sub.add_option("--multi-needle", a->retrieval.multi_needle, "context lengths for multi-needle retrieval")
                         ->delimiter(',');
                     sub.add_option("--needles", a->retrieval.needles, "needles per multi-needle prompt");
                     sub.add_option("--trials", a->retrieval.trials, "prompts per length (depths spread evenly)");
                     sub.add_option("--seed", a->retrieval.seed, "seed of the hidden numbers");
                     sub.add_option("--json", a->json_out, "also write the retrieval results as JSON lines (one per "
                                    "length: {length, passkey | multi_needle, ..._correct, trials}; `longmoe plot "
                                    "FILE --x length --y passkey --log-x` draws them), atomically");
                     sub.add_option("--classify", a->classify, "Fashion-MNIST folder: name the class of its test "
                                    "images by generation (a model trained with data.images)");
                     sub.add_option("--images", a->images, "test images to classify (the first N of t10k)");
                     sub.add_option("--image-size", a->image_size, "px per side, as in training (data.images.size)");
                     return [a] { return run(*a); };
                   }});

}  // namespace
