#pragma once
// Generated tasks with verifiable answers, for RL rollouts and their evaluation (docs/rl.md). Each is deterministic
// in its seed; its reward is 1 when the final answer (the <answer>…</answer> of the last turn) equals the expected
// one after normalisation (whitespace and thousands separators dropped), else 0.
//   arithmetic  a chain of `steps` integer operations to compute (the calculator helps; every intermediate is an
//               integer, so the answer is exact)
//   lookup      a long document of `facts` sentences ("The code of the amber falcon 17 is 4821.") and a question about
//               one of them (the search tool finds it; the long-horizon retrieval of a document in the prompt)
//   lookup_sum  the same document, asking for the sum of two codes: a search, another search, then the calculator
#include <cstdint>
#include <string>
#include <string_view>

namespace lm::rl {

enum class TaskKind { Arithmetic, Lookup, LookupSum };
TaskKind task_kind(std::string_view name);  // "arithmetic", "lookup", "lookup_sum"; lm::Error for any other
std::string_view task_kind_name(TaskKind k);

struct Task {
  TaskKind kind = TaskKind::Arithmetic;
  std::string question;  // the user turn
  std::string document;  // the document placed in the prompt and searched by the search tool (lookup kinds)
  std::string answer;    // expected final answer
};

// size: arithmetic operations (1..12) or document facts (2..100000). lm::Error outside those ranges.
Task make_task(TaskKind kind, uint64_t seed, int64_t size);
// The user turn: the document (if any), then the question and how to answer.
std::string task_prompt(const Task& t);
double reward(const Task& t, std::string_view final_answer);

}  // namespace lm::rl
