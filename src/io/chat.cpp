// The chat template and the demonstrations reader (chat.hpp).
#include "io/chat.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "io/corpus.hpp"
#include "io/json.hpp"

namespace lm::io {

namespace {

constexpr std::string_view kCall = "<tool_call>", kCallEnd = "</tool_call>";
constexpr std::string_view kResult = "<tool_result>", kResultEnd = "</tool_result>";

}  // namespace

bool is_chat_role(std::string_view role) {
  return role == "system" || role == "user" || role == "assistant" || role == "tool";
}

std::vector<int32_t> chat_tokens(const Tokenizer& tok, const Conversation& messages, bool generation_prompt, bool bos,
                                 int64_t max_tokens, std::vector<uint8_t>* assistant) {
  std::vector<int32_t> ids;
  uint8_t mark = 0;  // the mask value of the ids appended now
  const auto push = [&](int32_t id) {
    ids.push_back(id);
    if (assistant) assistant->push_back(mark);
  };
  const auto over = [&] { return max_tokens >= 0 && static_cast<int64_t>(ids.size()) > max_tokens; };
  const auto text = [&](std::string_view s) {
    const int64_t left = max_tokens >= 0 ? std::max<int64_t>(0, max_tokens - static_cast<int64_t>(ids.size())) : -1;
    for (const int32_t id : tok.encode_text(s, left)) push(id);
  };
  if (assistant) assistant->clear();
  if (bos && tok.bos() >= 0) push(tok.bos());
  const int32_t end = tok.special("<|end|>");
  const bool tool_specials = tok.has_special("<|tool|>");  // all five tool-use specials came together
  for (const auto& m : messages) {
    LM_CHECK(is_chat_role(m.role), "chat message role '{}' must be system, user, assistant or tool", m.role);
    const bool tool = m.role == "tool";
    push(tok.special(tool && !tool_specials ? "<|user|>" : "<|" + m.role + "|>"));
    mark = m.role == "assistant" ? 1 : 0;
    std::string_view c = m.content;
    if (!tool_specials) {
      text(c);
    } else if (m.role == "assistant") {  // each tag the model wrote is one token
      while (!c.empty() && !over()) {
        const size_t a = c.find(kCall), b = c.find(kCallEnd), at = std::min(a, b);
        if (at == std::string_view::npos) {
          text(c);
          break;
        }
        const std::string_view tag = at == a ? kCall : kCallEnd;
        text(c.substr(0, at));
        push(tok.special(tag));
        c.remove_prefix(at + tag.size());
      }
    } else if (tool && c.starts_with(kResult)) {  // only the wrapper; the tool's output stays text
      c.remove_prefix(kResult.size());
      const bool closed = c.ends_with(kResultEnd);
      if (closed) c.remove_suffix(kResultEnd.size());
      push(tok.special(kResult));
      text(c);
      if (closed) push(tok.special(kResultEnd));
    } else {
      text(c);
    }
    push(end);
    mark = 0;
    if (over()) return ids;
  }
  if (generation_prompt) push(tok.special("<|assistant|>"));
  return ids;
}

std::vector<Conversation> read_demos(const std::string& path) {
  std::vector<Conversation> out;
  for_each_jsonl(path, [&](const json& j, size_t line) {
    const std::string at = fmt::format("{}:{}", path, line);
    LM_CHECK(j.contains("messages"), "{}: no \"messages\" field (a line is {{\"messages\": [{{\"role\", "
             "\"content\"}}, ...]}})", at);
    const json& ms = j["messages"];
    LM_CHECK(ms.is_array() && !ms.empty(), "{}: \"messages\" must be a non-empty array, got {}", at,
             ms.is_array() ? "an empty one" : ms.type_name());
    Conversation conv;
    bool has_assistant = false;
    for (size_t i = 0; i < ms.size(); ++i) {
      const json& m = ms[i];
      const std::string field = fmt::format("messages[{}]", i);
      LM_CHECK(m.is_object(), "{}: {} must be an object {{\"role\", \"content\"}}, got {}", at, field, m.type_name());
      for (const auto& [key, v] : m.items())
        LM_CHECK(key == "role" || key == "content", "{}: {}.{} is not a message field (role, content)", at, field, key);
      LM_CHECK(m.contains("role"), "{}: {}.role is missing", at, field);
      LM_CHECK(m["role"].is_string(), "{}: {}.role is {}, not a string", at, field, m["role"].type_name());
      const std::string role = m["role"].get<std::string>();
      LM_CHECK(is_chat_role(role), "{}: {}.role '{}' is not a role (system, user, assistant, tool)", at, field, role);
      LM_CHECK(m.contains("content"), "{}: {}.content is missing", at, field);
      LM_CHECK(m["content"].is_string(), "{}: {}.content is {}, not a string", at, field, m["content"].type_name());
      has_assistant = has_assistant || role == "assistant";
      conv.push_back({role, m["content"].get<std::string>()});
    }
    LM_CHECK(has_assistant, "{}: the conversation has no assistant message (nothing to learn from)", at);
    out.push_back(std::move(conv));
  });
  LM_CHECK(!out.empty(), "demonstrations '{}' hold no conversation (one JSON object per line: {{\"messages\": "
           "[...]}})", path);
  return out;
}

}  // namespace lm::io
