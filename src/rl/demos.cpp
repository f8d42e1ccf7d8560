#include "rl/demos.hpp"

#include <fmt/format.h>

#include "core/error.hpp"
#include "io/json.hpp"

namespace lm::rl {

namespace {

// Written as docs/rl.md shows a call (name first; io::json would sort the keys).
std::string call(const std::string& name, const char* key, const std::string& value) {
  return fmt::format(R"(<tool_call>{{"name": "{}", "arguments": {{"{}": {}}}}}</tool_call>)", name, key,
                     io::json(value).dump());
}

// The text of the question between `before` and `after` (a name of a lookup task).
std::string between(const std::string& q, std::string_view before, std::string_view after) {
  const size_t a = q.find(before);
  LM_CHECK(a != std::string::npos, "scripted solver: no '{}' in the question '{}'", before, q);
  const size_t b = q.find(after, a + before.size());
  LM_CHECK(b != std::string::npos, "scripted solver: no '{}' in the question '{}'", after, q);
  return q.substr(a + before.size(), b - a - before.size());
}

// The result inside the tool turn "<tool_result>...</tool_result>".
std::string result_of(const Turn& t) {
  constexpr std::string_view open = "<tool_result>", close = "</tool_result>";
  LM_CHECK(t.role == "tool" && t.text.starts_with(open) && t.text.ends_with(close),
           "scripted solver: expected a tool result, got '{}'", t.text);
  return t.text.substr(open.size(), t.text.size() - open.size() - close.size());
}

// The code in "... The code of the <name> is 4821. ..." (search's answer).
std::string code_of(const std::string& found, const std::string& name) {
  return between(found, "the " + name + " is ", ".");
}

Reply reply(std::string text) {
  const auto tokens = static_cast<int64_t>(text.size() / 4 + 1);
  return {std::move(text), tokens};
}

}  // namespace

Policy scripted_solver() {
  return [](const Task& t, const std::vector<Turn>& h) -> Reply {
    const size_t done = h.size() / 2;  // tool calls answered so far (each an assistant turn and a tool turn)
    switch (t.kind) {
      case TaskKind::Arithmetic:
        if (done == 0) return reply(call("calculator", "expression", between(t.question, "Compute ", ".")));
        return reply("<answer>" + result_of(h.back()) + "</answer>");
      case TaskKind::Lookup: {
        const std::string name = between(t.question, "code of the ", "?");
        if (done == 0) return reply(call("search", "query", name));
        return reply("<answer>" + code_of(result_of(h.back()), name) + "</answer>");
      }
      case TaskKind::LookupSum: {
        const std::string a = between(t.question, "codes of the ", " and the "), b = between(t.question, " and the ", "?");
        if (done == 0) return reply(call("search", "query", a));
        if (done == 1) return reply(call("search", "query", b));
        if (done == 2)
          return reply(call("calculator", "expression",
                            code_of(result_of(h[1]), a) + " + " + code_of(result_of(h[3]), b)));
        return reply("<answer>" + result_of(h.back()) + "</answer>");
      }
    }
    fail("scripted solver: unknown task kind");
  };
}

io::Conversation episode_conversation(const Task& t, const Episode& e, const std::string& system) {
  io::Conversation c;
  if (!system.empty()) c.push_back({"system", system});
  c.push_back({"user", task_prompt(t)});
  for (const Turn& turn : e.turns) c.push_back({turn.role, turn.text});
  return c;
}

std::string demos_jsonl(const std::vector<TaskKind>& kinds, int64_t n, uint64_t seed, int64_t size) {
  LM_CHECK(!kinds.empty() && n >= 1, "rl demos: need at least one task kind and n >= 1 (got {} kinds, n {})",
           kinds.size(), n);
  const Policy solver = scripted_solver();
  std::string out;
  for (int64_t i = 0; i < n; ++i) {
    const TaskKind kind = kinds[static_cast<size_t>(i) % kinds.size()];
    const uint64_t s = seed + static_cast<uint64_t>(i);
    const Task t = make_task(kind, s, size > 0 ? size : kind == TaskKind::Arithmetic ? 4 : 20);
    const Episode e = run_episode(t, solver);
    LM_CHECK(e.reward == 1.0, "rl demos: the scripted solver did not solve {} seed {} (it ended with {})",
             task_kind_name(kind), s, e.end);
    io::json msgs = io::json::array();
    for (const auto& m : episode_conversation(t, e)) msgs.push_back({{"role", m.role}, {"content", m.content}});
    out += io::json{{"messages", msgs}, {"kind", task_kind_name(kind)}, {"seed", s}}.dump() + "\n";
  }
  return out;
}

}  // namespace lm::rl
