#include "rl/episode.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.hpp"

namespace lm::rl {

Episode run_episode(const Task& task, const Policy& policy, const Budget& b) {
  LM_CHECK(b.max_turns >= 1 && b.max_tool_calls >= 0 && b.max_tokens >= 1,
           "rl episode: budgets must be positive (turns {}, tool calls {}, tokens {})", b.max_turns, b.max_tool_calls,
           b.max_tokens);
  const Toolbox tools(task.document);
  Episode e;
  for (int64_t turn = 0; turn < b.max_turns; ++turn) {
    Reply r = policy(task, e.turns);
    e.tokens += std::max<int64_t>(0, r.tokens);
    e.turns.push_back({"assistant", r.text});
    if (e.tokens > b.max_tokens) {
      e.end = "token_budget";
      return e;
    }
    const ParsedTurn p = parse_turn(r.text);
    if (p.call) {
      if (e.tool_calls == b.max_tool_calls) {
        e.end = "tool_budget";
        return e;
      }
      ++e.tool_calls;
      e.turns.push_back({"tool", tool_result_text(tools.call(*p.call))});
    } else if (p.answer) {
      e.answer = p.answer;
      e.end = "answer";
      e.reward = reward(task, *p.answer);
      return e;
    } else {  // neither: say what is expected, as a tool turn the model reads
      e.turns.push_back({"tool", tool_result_text(ToolResult{
                                     false, p.error.empty() ? std::string("give a <tool_call> or an <answer>")
                                                            : p.error})});
    }
  }
  e.end = "turn_budget";
  return e;
}

}  // namespace lm::rl
