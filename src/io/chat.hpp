#pragma once
// The chat and tool-call format (docs/rl.md "Chat format"): the one template that `chat`, `generate --chat`,
// `serve`, `sft` and RL rollouts render conversations with, and the demonstrations files `sft` trains on.
//
// Template (the tokenizer's specials, no whitespace added):
//   [<s>] <|system|> text <|end|> <|user|> text <|end|> <|assistant|> text <|end|> <|tool|> text <|end|> ...
//   [<|assistant|>]                                     (the generation prompt: the model writes the next turn)
// Contents are plain text (Tokenizer::encode_text: "<|end|>" typed in a message is seven characters), except the
// tool-use tags, which become their special tokens where they belong:
//   assistant  every "<tool_call>" and "</tool_call>" (the model writes a call as one token each side of the JSON)
//   tool       a "<tool_result>" opening the content and a "</tool_result>" closing it; anything between stays
//              text, so a tool's output cannot close its result early or start a turn
// A tokenizer trained before the tool-use specials (<|tool|> and the four tags) renders the same conversation
// with the tags as text and a tool turn as a <|user|> turn: older checkpoints keep working, with the format of
// docs/rl.md spelled out in bytes.
// Decoding the ids gives back the role markers and the contents, tags included (decode renders specials as text),
// so what the model generates parses with rl::parse_turn.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/tokenizer.hpp"

namespace lm::io {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" or "tool"
  std::string content;
  bool operator==(const ChatMessage&) const = default;
};
using Conversation = std::vector<ChatMessage>;

bool is_chat_role(std::string_view role);  // system, user, assistant, tool

// Token ids of a conversation, ending with <|assistant|> when `generation_prompt`. With `max_tokens` >= 0 it stops
// once more than max_tokens ids exist (the result is then longer than max_tokens but incomplete): an over-long
// conversation is never tokenized whole. With `assistant`, (*assistant)[i] = 1 exactly when id i was written by
// the assistant: the contents of its turns and their closing <|end|> (not the <|assistant|> that opens a turn: the
// prompt supplies it). lm::Error for a role outside is_chat_role.
std::vector<int32_t> chat_tokens(const Tokenizer& tok, const Conversation& messages, bool generation_prompt = true,
                                 bool bos = true, int64_t max_tokens = -1, std::vector<uint8_t>* assistant = nullptr);

// Demonstrations for `sft`: a JSONL file, one conversation per line,
//   {"messages": [{"role": "system|user|assistant|tool", "content": "..."}, ...]}
// with at least one assistant message each (its tokens are what the loss is taken on); other top-level fields are
// ignored, other message fields refused. Blank lines are skipped. lm::Error naming the file, the line and the field
// for anything else (not JSON, no messages, an unknown role, a missing or non-string content, no conversation).
std::vector<Conversation> read_demos(const std::string& path);

}  // namespace lm::io
