// Demonstrations for sft (rl/demos.hpp): the scripted solver solves every kind of task with the tools it is meant
// to use, and the JSONL it writes reads back as the conversations of those episodes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "core/error.hpp"
#include "io/chat.hpp"
#include "io/file.hpp"
#include "rl/demos.hpp"

using namespace lm;
using namespace lm::rl;

namespace {

TEST(RlDemos, ScriptedSolverSolvesEveryKind) {
  const struct {
    TaskKind kind;
    int64_t size, calls;
  } cases[] = {{TaskKind::Arithmetic, 6, 1}, {TaskKind::Lookup, 500, 1}, {TaskKind::LookupSum, 500, 3}};
  for (const auto& c : cases)
    for (uint64_t seed = 0; seed < 30; ++seed) {
      const Task t = make_task(c.kind, seed, c.size);
      const Episode e = run_episode(t, scripted_solver());
      EXPECT_EQ(e.end, "answer") << task_kind_name(c.kind) << " " << seed;
      EXPECT_EQ(e.reward, 1.0) << task_kind_name(c.kind) << " " << seed;
      EXPECT_EQ(e.tool_calls, c.calls) << task_kind_name(c.kind) << " " << seed;
    }
}

TEST(RlDemos, JsonlReadsBackAsTheEpisodes) {
  const auto path = (std::filesystem::temp_directory_path() / ("lm_rl_demos_" + std::to_string(::getpid()) +
                                                               ".jsonl")).string();
  io::write_file_atomic(path, demos_jsonl({TaskKind::LookupSum, TaskKind::Arithmetic}, 4, 10));
  const auto d = io::read_demos(path);
  std::filesystem::remove(path);
  ASSERT_EQ(d.size(), 4u);
  for (size_t i = 0; i < d.size(); ++i) {
    const Task t = make_task(i % 2 ? TaskKind::Arithmetic : TaskKind::LookupSum, 10 + i, i % 2 ? 4 : 20);
    const Episode e = run_episode(t, scripted_solver());
    EXPECT_EQ(d[i], episode_conversation(t, e)) << i;
    EXPECT_EQ(d[i].front().role, "user");
    EXPECT_EQ(d[i].back().content, "<answer>" + t.answer + "</answer>");
  }
  EXPECT_THROW(demos_jsonl({}, 1, 0), Error);
}

}  // namespace
