// `longmoe eval --model DIR`: held-out perplexity over a corpus (text, folder, JSONL or the Brown corpus,
// io/corpus) and retrieval at chosen context lengths: passkey (one number hidden in filler text) and
// multi-needle (several key -> number facts, one asked for). Accuracy is reported per length.
// Retrieval is infer/retrieval_eval.hpp (also run by the trainer after each stage, run config
// "eval_retrieval"); its passkey template is the one of the trainer's synthetic passkey documents.
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

namespace {

using namespace lm;

struct Args : app::InferArgs {
  std::string data, format = "auto", json_out;
  int64_t window = 2048, max_docs = 0, max_tokens_eval = 200000;
  infer::RetrievalOptions retrieval;
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

int run(const Args& a) {
  LM_CHECK(!a.data.empty() || !a.retrieval.empty(), "eval: nothing to do (give --data, --passkey and/or --multi-needle)");
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
                     return [a] { return run(*a); };
                   }});

}  // namespace
