#pragma once
// The tools an agent may call during RL rollouts and chat, and the text format of a call (docs/rl.md). Every tool is
// deterministic and sandboxed: it computes from its arguments and the task's own document only (no shell, no
// network, no files), and bad input (malformed calls, unknown tools, arguments of the wrong type, expressions it
// cannot evaluate) becomes an error message for the model, never an exception or a crash.
//
// Format, inside an assistant turn:
//   <tool_call>{"name": "calculator", "arguments": {"expression": "(17 + 5) * 3"}}</tool_call>
//   <answer>66</answer>
// The result of a call comes back to the model as the text of a tool turn (rl::tool_result_text).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "io/json.hpp"

namespace lm::rl {

struct ToolCall {
  std::string name;
  io::json arguments = io::json::object();
};

// What an assistant turn asks for: a tool call, a final answer, or neither (error names what was malformed: a call
// whose JSON does not parse, a missing name, an unterminated tag). A turn with both takes the call (the answer
// comes after its result).
struct ParsedTurn {
  std::optional<ToolCall> call;
  std::optional<std::string> answer;  // trimmed
  std::string error;
};
ParsedTurn parse_turn(std::string_view assistant_text);

struct ToolResult {
  bool ok = false;
  std::string text;  // the result, or the error message the model reads
};

// calculator {"expression": E}: exact rational arithmetic over integers: + − * /, parentheses, unary minus; the
// result an integer or a reduced fraction "p/q". Errors: any other character, a division by zero, a number or an
// intermediate beyond 64 bits, more than 256 characters or 64 levels of parentheses.
ToolResult calculator(std::string_view expression);
// search {"query": Q} over `document`: its sentences (ended by . ! ? or a newline) that contain every word of Q
// (case-insensitive), at most 3, in document order; "no match" when none does.
ToolResult search(std::string_view document, std::string_view query);

// The tools of one task: calculator and search over the task's document.
class Toolbox {
 public:
  explicit Toolbox(std::string document = {}) : document_(std::move(document)) {}
  ToolResult call(const ToolCall& c) const;
  static const std::vector<std::string>& names();  // "calculator", "search"

 private:
  std::string document_;
};

// The text of a tool turn for a result: "<tool_result>…</tool_result>" with the result or "error: …".
std::string tool_result_text(const ToolResult& r);

}  // namespace lm::rl
