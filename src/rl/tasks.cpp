#include "rl/tasks.hpp"

#include <fmt/format.h>

#include <set>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace lm::rl {

namespace {

// Draws of one task: a counter-based stream per seed.
struct Draw {
  Rng r;
  uint64_t i = 0;
  explicit Draw(uint64_t seed) : r{seed, 0x7a5c} {}
  int64_t below(int64_t n) { return static_cast<int64_t>(r.bits(i++).v[0] % static_cast<uint64_t>(n)); }
};

const char* kAdjectives[] = {"amber", "azure", "brisk", "coral", "dusky", "eager", "fiery", "gentle", "hollow",
                             "ivory", "jade", "keen", "lunar", "mossy", "noble", "olive", "pale", "quiet", "rusty",
                             "silver", "tawny", "umber", "vivid", "woolly", "young", "zesty"};
const char* kNouns[] = {"falcon", "lantern", "harbor", "meadow", "anvil", "beacon", "cedar", "dune", "ember", "fjord",
                        "glacier", "heron", "island", "juniper", "kettle", "ledger", "mantle", "nectar", "orchard",
                        "pebble", "quarry", "raven", "saddle", "thistle", "valley", "willow"};
constexpr int64_t kNames = 26 * 26 * 150;  // "amber falcon 17": more than the 100000 facts a document may hold

std::string name_of(int64_t k) {
  return fmt::format("{} {} {}", kAdjectives[k / 26 % 26], kNouns[k % 26], 1 + k / (26 * 26));
}

std::string normalise(std::string_view s) {
  std::string r;
  for (char c : s)
    if (c != ' ' && c != '\t' && c != '\n' && c != ',') r += c;
  return r;
}

Task arithmetic(uint64_t seed, int64_t steps) {
  Draw d(seed);
  int64_t v = 2 + d.below(40);
  std::string e = std::to_string(v);
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t op = d.below(4), x = 2 + d.below(20);
    if (op == 3 && v % x == 0 && v != 0) {
      e = fmt::format("({}) / {}", e, x), v /= x;
    } else if (op >= 2 && std::abs(v) < 100000) {
      e = fmt::format("({}) * {}", e, x), v *= x;
    } else if (op == 1) {
      e = fmt::format("{} - {}", e, x), v -= x;
    } else {
      e = fmt::format("{} + {}", e, x), v += x;
    }
  }
  Task t;
  t.kind = TaskKind::Arithmetic;
  t.question = fmt::format("Compute {}.", e);
  t.answer = std::to_string(v);
  return t;
}

Task lookup(uint64_t seed, int64_t facts, bool sum) {
  LM_CHECK(facts <= kNames, "rl task: at most {} facts (distinct names), got {}", kNames, facts);
  Draw d(seed);
  // `facts` distinct names (a partial shuffle of all of them) with four-digit codes.
  std::vector<int64_t> names(static_cast<size_t>(kNames));
  for (int64_t k = 0; k < kNames; ++k) names[static_cast<size_t>(k)] = k;
  for (int64_t k = 0; k < facts; ++k)
    std::swap(names[static_cast<size_t>(k)], names[static_cast<size_t>(k + d.below(kNames - k))]);
  std::vector<int64_t> codes;
  Task t;
  for (int64_t k = 0; k < facts; ++k) {
    codes.push_back(1000 + d.below(9000));
    t.document += fmt::format("The code of the {} is {}.\n", name_of(names[static_cast<size_t>(k)]), codes.back());
  }
  const int64_t a = d.below(facts);
  int64_t b = d.below(facts - 1);
  if (b >= a) ++b;
  if (sum) {
    t.kind = TaskKind::LookupSum;
    t.question = fmt::format("What is the sum of the codes of the {} and the {}?", name_of(names[static_cast<size_t>(a)]),
                             name_of(names[static_cast<size_t>(b)]));
    t.answer = std::to_string(codes[static_cast<size_t>(a)] + codes[static_cast<size_t>(b)]);
  } else {
    t.kind = TaskKind::Lookup;
    t.question = fmt::format("What is the code of the {}?", name_of(names[static_cast<size_t>(a)]));
    t.answer = std::to_string(codes[static_cast<size_t>(a)]);
  }
  return t;
}

}  // namespace

TaskKind task_kind(std::string_view name) {
  if (name == "arithmetic") return TaskKind::Arithmetic;
  if (name == "lookup") return TaskKind::Lookup;
  if (name == "lookup_sum") return TaskKind::LookupSum;
  throw Error(fmt::format("unknown RL task kind '{}' (arithmetic, lookup, lookup_sum)", name));
}

std::string_view task_kind_name(TaskKind k) {
  switch (k) {
    case TaskKind::Arithmetic: return "arithmetic";
    case TaskKind::Lookup: return "lookup";
    case TaskKind::LookupSum: return "lookup_sum";
  }
  return "?";
}

Task make_task(TaskKind kind, uint64_t seed, int64_t size) {
  if (kind == TaskKind::Arithmetic) {
    LM_CHECK(size >= 1 && size <= 12, "rl task arithmetic: 1 to 12 operations, got {}", size);
    return arithmetic(seed, size);
  }
  LM_CHECK(size >= 2 && size <= 100000, "rl task {}: 2 to 100000 facts, got {}", task_kind_name(kind), size);
  return lookup(seed, size, kind == TaskKind::LookupSum);
}

std::string task_prompt(const Task& t) {
  std::string p;
  if (!t.document.empty()) p = "Document:\n" + t.document + "\n";
  return p + t.question +
         " Tools: calculator {\"expression\"} and search {\"query\"}, called as <tool_call>{\"name\": ..., "
         "\"arguments\": {...}}</tool_call>. Give the final result as <answer>...</answer>.";
}

double reward(const Task& t, std::string_view final_answer) {
  const std::string a = normalise(final_answer);
  return !a.empty() && a == normalise(t.answer) ? 1.0 : 0.0;
}

}  // namespace lm::rl
