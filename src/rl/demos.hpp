#pragma once
// Demonstrations of the built-in tasks for `longmoe sft` (docs/rl.md): a scripted policy that solves each task with
// the tools, and its episodes written as conversations in the chat format (io/chat.hpp), one JSONL line each.
#include <cstdint>
#include <string>
#include <vector>

#include "io/chat.hpp"
#include "rl/episode.hpp"

namespace lm::rl {

// Solves every task kind with the tools, reading what it needs from the question and the tool results:
//   arithmetic  calculator(the expression), then the answer
//   lookup      search(the name), then the code it read
//   lookup_sum  search(first name), search(second name), calculator(code + code), then the answer
// Each reply counts its bytes / 4 as its tokens (an estimate; no tokenizer here).
Policy scripted_solver();

// An episode as a conversation: [system], the user turn (task_prompt), then the episode's turns.
io::Conversation episode_conversation(const Task& t, const Episode& e, const std::string& system = "");

// n demonstrations: task i is make_task(kinds[i % kinds.size()], seed + i, size or the kind's default: 4
// operations, 20 facts), solved by scripted_solver(); each line {"messages": [...], "kind": K, "seed": S}
// (io::read_demos reads it; the other fields say where it came from). lm::Error if an episode is not solved.
std::string demos_jsonl(const std::vector<TaskKind>& kinds, int64_t n, uint64_t seed, int64_t size = 0);

}  // namespace lm::rl
