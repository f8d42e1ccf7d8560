#pragma once
// One agentic episode (docs/rl.md): the policy writes assistant turns; a tool call is answered by the task's
// Toolbox in a tool turn; the episode ends at an <answer>, or at a budget (turns, tool calls, tokens) with that
// reason, so a malformed or endless loop of calls always ends. The reward is the task's for the final answer
// (0 without one).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "rl/tasks.hpp"
#include "rl/tools.hpp"

namespace lm::rl {

struct Budget {
  int64_t max_turns = 8;        // assistant turns
  int64_t max_tool_calls = 6;
  int64_t max_tokens = 4096;    // generated tokens over the episode
};

struct Turn {
  std::string role;  // "assistant" or "tool"
  std::string text;
};

struct Episode {
  std::vector<Turn> turns;
  std::optional<std::string> answer;
  std::string end;  // "answer", "turn_budget", "tool_budget", "token_budget"
  int64_t tool_calls = 0, tokens = 0;
  double reward = 0;

  int64_t assistant_turns() const {
    return std::count_if(turns.begin(), turns.end(), [](const Turn& t) { return t.role == "assistant"; });
  }
};

// The policy's next assistant turn after the task and the turns so far, and the tokens it generated for it.
struct Reply {
  std::string text;
  int64_t tokens = 0;
};
using Policy = std::function<Reply(const Task&, const std::vector<Turn>&)>;

Episode run_episode(const Task& task, const Policy& policy, const Budget& budget = {});

// One assistant turn `r` of episode `e` (what run_episode does per turn, for callers that drive many episodes at
// once, e.g. rl/rollout.hpp): appends the turn and, unless the episode ends, the tool turn answering it. Returns
// true when the episode has ended (e.end and e.reward set).
bool episode_turn(const Task& task, const Toolbox& tools, const Budget& b, const Reply& r, Episode& e);
void check_budget(const Budget& b);  // lm::Error unless every budget is positive

}  // namespace lm::rl
