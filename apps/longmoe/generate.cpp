// `longmoe generate --model DIR --prompt TEXT [--device cuda]`: prefill the prompt, then stream the generated text
// to stdout as tokens arrive; timing and cache figures go to stderr. `--image FILE` (repeatable, a multimodal model)
// puts an image where the prompt has a <|image|> marker (in order), or before the prompt when it has none.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>

#include "apps/longmoe/commands.hpp"
#include "apps/longmoe/infer_common.hpp"
#include "core/error.hpp"
#include "io/file.hpp"

namespace {

using namespace lm;

struct Args : app::InferArgs {
  std::string prompt, prompt_file, system;
  std::vector<std::string> images;
  infer::ImageLimits image;
  bool chat = false, quiet = false;
};

int run(const Args& a) {
  LM_CHECK(a.prompt.empty() != a.prompt_file.empty(), "generate: give exactly one of --prompt and --prompt-file");
  const infer::SamplingParams sp0 = a.sampling();
  infer::LoadedModel m = a.load();
  const io::Tokenizer& tok = *m.tokenizer;
  const std::string text = a.prompt_file.empty() ? a.prompt : io::read_file(a.prompt_file);
  std::vector<int32_t> ids;
  infer::SamplingParams sp = sp0;
  int32_t ph = -1;
  std::vector<model::Media<float>> media;
  if (!a.images.empty()) {  // (checked before the engine starts)
    ph = infer::image_token(m.config, tok);
    sp.stop_tokens.push_back(ph);  // an input token: a reply that would write one ends instead
    for (const auto& f : a.images)
      media.push_back(infer::image_media(io::read_file(f), f, *m.config.vision, a.image));
  }
  if (tok.eos() >= 0) sp.stop_tokens.push_back(tok.eos());
  if (a.chat) {
    std::vector<io::ChatMessage> msgs;
    if (!a.system.empty()) msgs.push_back({"system", a.system});
    msgs.push_back({"user", text});
    ids = io::chat_tokens(tok, msgs);
    sp.stop_tokens.push_back(tok.special("<|end|>"));
    if (ph >= 0) infer::place_images(ids, tok.special("<|user|>"), ph, std::ssize(media));
  } else {
    if (tok.bos() >= 0) ids.push_back(tok.bos());
    const auto e = tok.encode(text);
    ids.insert(ids.end(), e.begin(), e.end());
    if (ph >= 0) infer::place_images(ids, tok.bos(), ph, std::ssize(media));
  }
  if (ph < 0 && m.model && m.model->media_placeholder() >= 0)  // <|image|> typed without an image
    LM_CHECK(std::find(ids.begin(), ids.end(), m.model->media_placeholder()) == ids.end(),
             "generate: the prompt has an <|image|> marker but no --image");
  infer::OwnedEngine engine = a.engine(m);
  infer::EngineSequence seq(*engine);
  if (ph >= 0) ids = infer::attach_images(seq, ids, ph, media);
  const auto t0 = std::chrono::steady_clock::now();
  double t_first = 0;
  bool first = true;
  const infer::Generation g = infer::generate(seq, tok, ids, sp, [&](const std::string& piece) {
    if (first) t_first = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), first = false;
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
  });
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("\n");
  std::fflush(stdout);  // the text ends before the statistics on stderr
  if (!a.quiet) {
    const auto n = static_cast<double>(g.generated().size());
    std::fprintf(stderr,
                 "[%zu prompt tokens, %zu generated (%s); %.2f s total, first text after %.2f s, %.1f tokens/s "
                 "decode; cache %.2f MiB]\n",
                 ids.size(), g.generated().size(), g.finish_reason().c_str(), t, t_first,
                 n > 1 ? (n - 1) / std::max(1e-9, t - t_first) : 0.0, engine->cache_bytes() / 1048576.0);
  }
  return 0;
}

app::Register reg({"generate", "Generate text from a checkpoint, streamed to stdout", [](CLI::App& sub) {
                     auto a = std::make_shared<Args>();
                     a->add_model(sub);
                     a->add_sampling(sub);
                     sub.add_option("--prompt", a->prompt, "prompt text");
                     sub.add_option("--prompt-file", a->prompt_file, "read the prompt from a file");
                     sub.add_flag("--chat", a->chat, "wrap the prompt in the chat template (one user turn)");
                     sub.add_option("--system", a->system, "system message (with --chat)");
                     sub.add_option("--image", a->images, "a PNG or JPEG for a multimodal model, at the prompt's "
                                    "<|image|> markers in order, else before the prompt (repeatable)");
                     a->add_image_limits(sub, a->image);
                     sub.add_flag("--quiet", a->quiet, "no statistics on stderr");
                     return [a] { return run(*a); };
                   }});

}  // namespace
