#include "rl/episode.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.hpp"

namespace lm::rl {

void check_budget(const Budget& b) {
  LM_CHECK(b.max_turns >= 1 && b.max_tool_calls >= 0 && b.max_tokens >= 1,
           "rl episode: budgets must be positive (turns {}, tool calls {}, tokens {})", b.max_turns, b.max_tool_calls,
           b.max_tokens);
}

bool episode_turn(const Task& task, const Toolbox& tools, const Budget& b, const Reply& r, Episode& e) {
  e.tokens += std::max<int64_t>(0, r.tokens);
  e.turns.push_back({"assistant", r.text});
  if (e.tokens > b.max_tokens) {
    e.end = "token_budget";
    return true;
  }
  const ParsedTurn p = parse_turn(r.text);
  if (p.call) {
    if (e.tool_calls == b.max_tool_calls) {
      e.end = "tool_budget";
      return true;
    }
    ++e.tool_calls;
    e.turns.push_back({"tool", tool_result_text(tools.call(*p.call))});
  } else if (p.answer) {
    e.answer = p.answer;
    e.end = "answer";
    e.reward = reward(task, *p.answer);
    return true;
  } else {  // neither: say what is expected, as a tool turn the model reads
    e.turns.push_back({"tool", tool_result_text(ToolResult{
                                   false, p.error.empty() ? std::string("give a <tool_call> or an <answer>")
                                                          : p.error})});
  }
  if (e.assistant_turns() >= b.max_turns) {
    e.end = "turn_budget";
    return true;
  }
  return false;
}

Episode run_episode(const Task& task, const Policy& policy, const Budget& b) {
  check_budget(b);
  const Toolbox tools(task.document);
  Episode e;
  while (!episode_turn(task, tools, b, policy(task, e.turns), e)) {
  }
  return e;
}

}  // namespace lm::rl
