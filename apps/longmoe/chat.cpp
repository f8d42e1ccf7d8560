// `longmoe chat --model DIR`: an interactive conversation in a plain terminal. Each stdin line is a user
// turn; the reply streams to stdout. The conversation's tokens stay in one sequence, so each turn
// prefills only the new tokens. Lines "/reset" (new conversation) and "/exit"; end of input ends it. "/image PATH"
// (a multimodal model) adds a PNG or JPEG to the next user turn, before its text.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>

#include "apps/longmoe/commands.hpp"
#include "apps/longmoe/infer_common.hpp"
#include "core/error.hpp"
#include "io/file.hpp"

namespace {

using namespace lm;

struct Args : app::InferArgs {
  std::string system;
  infer::ImageLimits image;
};

int run(const Args& a) {
  infer::SamplingParams sp = a.sampling();
  infer::LoadedModel m = a.load();
  const io::Tokenizer& tok = *m.tokenizer;
  infer::OwnedEngine engine = a.engine(m);
  const bool tty = isatty(STDIN_FILENO) && isatty(STDOUT_FILENO);
  sp.stop_tokens.push_back(tok.special("<|end|>"));
  if (tok.eos() >= 0) sp.stop_tokens.push_back(tok.eos());
  const int32_t end = tok.special("<|end|>");
  infer::EngineSequence seq(*engine);
  std::vector<int32_t> conv;  // every token of the conversation; seq.tokens() is always a prefix of it
  auto reset = [&] {
    seq.reset();
    conv = io::chat_tokens(tok, a.system.empty() ? std::vector<io::ChatMessage>{}
                                                    : std::vector<io::ChatMessage>{{"system", a.system}},
                              false);
  };
  std::vector<model::Media<float>> pending;  // images for the next user turn
  const int32_t ph = m.model && m.model->media_placeholder() >= 0 ? m.model->media_placeholder() : -1;
  if (ph >= 0) sp.stop_tokens.push_back(ph);  // an input token: a reply that would write one ends instead
  reset();
  if (tty)
    std::printf("longmoe chat (%s, %s). /reset starts over, /exit or Ctrl-D ends.\n", m.name.c_str(),
                engine->describe().c_str());
  std::string line;
  uint64_t turn = 0;
  while (true) {
    if (tty) std::printf("you> "), std::fflush(stdout);
    if (!std::getline(std::cin, line)) break;
    if (line == "/exit") break;
    if (line == "/reset") {
      reset();
      continue;
    }
    if (line.rfind("/image ", 0) == 0) {
      try {
        const std::string path = line.substr(7);
        infer::image_token(m.config, tok);
        pending.push_back(infer::image_media(io::read_file(path), path, *m.config.vision, a.image));
        std::printf("[image %s: %ld feature rows, for the next turn]\n", path.c_str(),
                    static_cast<long>(infer::media_rows(*m.config.vision, pending.back())));
      } catch (const Error& e) {
        std::printf("[%s]\n", e.what());
      }
      continue;
    }
    auto user = io::chat_tokens(tok, {{"user", line}}, true, false);
    std::vector<int64_t> rows;
    for (const auto& p : pending) rows.push_back(infer::media_rows(*m.config.vision, p));
    if (!pending.empty()) {
      infer::place_images(user, tok.special("<|user|>"), ph, std::ssize(pending));
      user = infer::expand_placeholders(user, ph, rows);
    }
    conv.insert(conv.end(), user.begin(), user.end());
    if (static_cast<int64_t>(conv.size()) >= seq.max_context()) {
      std::printf("[the conversation reached the context limit of %ld tokens; /reset to start over]\n",
                  static_cast<long>(seq.max_context()));
      conv.resize(conv.size() - user.size());
      continue;  // (the images stay queued for the next turn)
    }
    for (const auto& p : pending) seq.attach_media(p);
    pending.clear();
    if (tty) std::printf("assistant> ");
    infer::SamplingParams tp = sp;
    tp.seed = sp.seed + turn++;
    const std::vector<int32_t> delta(conv.begin() + seq.pos(), conv.end());
    const infer::Generation g = infer::generate(seq, tok, delta, tp, [](const std::string& piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    });
    std::printf("\n");
    std::fflush(stdout);
    // The reply as generated (not re-tokenised) plus the end of the turn.
    conv.insert(conv.end(), g.generated().begin(), g.generated().end());
    conv.push_back(end);
  }
  return 0;
}

app::Register reg({"chat", "Interactive chat with a checkpoint (stdin lines in, streamed replies out)",
                   [](CLI::App& sub) {
                     auto a = std::make_shared<Args>();
                     a->add_model(sub);
                     a->add_sampling(sub);
                     sub.add_option("--system", a->system, "system message");
                     a->add_image_limits(sub, a->image);
                     return [a] { return run(*a); };
                   }});

}  // namespace
