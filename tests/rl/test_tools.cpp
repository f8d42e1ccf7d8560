// Agentic RL's tools and tasks (rl/tools.hpp, rl/tasks.hpp): the calculator's exact arithmetic and its refusals,
// search over the task's document, the tool-call format (malformed calls become messages, never exceptions),
// tools that do not exist (no shell, network or files), and generated tasks whose answers the tools reproduce.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "rl/episode.hpp"
#include "rl/tasks.hpp"
#include "rl/tools.hpp"

using namespace lm;
using namespace lm::rl;

TEST(RlTools, CalculatorIsExact) {
  EXPECT_EQ(calculator("(17 + 5) * 3").text, "66");
  EXPECT_EQ(calculator("2 + 3 * 4 - -1").text, "15");
  EXPECT_EQ(calculator("7 / 2").text, "7/2");
  EXPECT_EQ(calculator("1/3 + 1/6").text, "1/2");
  EXPECT_EQ(calculator("((((1))))").text, "1");
  EXPECT_EQ(calculator("9223372036854775807").text, "9223372036854775807");
  EXPECT_TRUE(calculator("6 / 3").ok);
}

TEST(RlTools, CalculatorRefusesWhatItCannotEvaluate) {
  for (const char* bad : {"", "1 / 0", "(1 + 2", "2 ** 3", "import os", "cat /etc/passwd", "$(rm -rf /)", "1e3",
                          "9223372036854775808", "9223372036854775807 + 1", "3037000500 * 3037000500", "1 +"}) {
    const ToolResult r = calculator(bad);
    EXPECT_FALSE(r.ok) << bad << " -> " << r.text;
    EXPECT_FALSE(r.text.empty()) << bad;
  }
  EXPECT_NE(calculator("1 / 0").text.find("division by zero"), std::string::npos);
  EXPECT_FALSE(calculator(std::string(300, '1')).ok);
  EXPECT_FALSE(calculator(std::string(100, '(') + "1" + std::string(100, ')')).ok);  // nesting bound
}

TEST(RlTools, SearchFindsWholeWordsInTheDocument) {
  const std::string doc = "The code of the amber falcon is 4821.\nThe code of the amber fjord is 1234.\nNothing else.";
  EXPECT_EQ(search(doc, "amber falcon").text, "The code of the amber falcon is 4821.");
  EXPECT_EQ(search(doc, "AMBER").text, "The code of the amber falcon is 4821.\nThe code of the amber fjord is 1234.");
  EXPECT_EQ(search(doc, "amb").text, "no match");  // whole words only
  EXPECT_FALSE(search(doc, " ,.").ok);
}

TEST(RlTools, ToolCallFormatAndMalformedCalls) {
  ParsedTurn t = parse_turn(R"(I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>)");
  ASSERT_TRUE(t.call);
  EXPECT_EQ(t.call->name, "calculator");
  const Toolbox tb("The code of the amber falcon is 4821.");
  EXPECT_EQ(tool_result_text(tb.call(*t.call)), "<tool_result>4</tool_result>");
  t = parse_turn("Done: <answer> 4821 </answer>");
  ASSERT_TRUE(t.answer);
  EXPECT_EQ(*t.answer, "4821");
  EXPECT_FALSE(t.call);
  for (const char* bad : {"<tool_call>{\"name\": calculator}</tool_call>", "<tool_call>[1, 2]</tool_call>",
                          "<tool_call>{\"name\": \"search\"", "<tool_call>{\"name\": \"x\", \"arguments\": 3}</tool_call>",
                          "<answer>12"}) {
    const ParsedTurn p = parse_turn(bad);
    EXPECT_FALSE(p.call) << bad;
    EXPECT_FALSE(p.answer) << bad;
    EXPECT_FALSE(p.error.empty()) << bad;
  }
  EXPECT_TRUE(parse_turn("just text").error.empty());
}

TEST(RlTools, NoShellNetworkOrFiles) {
  const Toolbox tb("doc");
  for (const char* name : {"shell", "bash", "python", "read_file", "http_get", "fetch", ""}) {
    const ToolResult r = tb.call(ToolCall{name, io::json{{"command", "cat /etc/passwd"}}});
    EXPECT_FALSE(r.ok) << name;
    EXPECT_NE(r.text.find("unknown tool"), std::string::npos) << r.text;
  }
  EXPECT_FALSE(tb.call(ToolCall{"calculator", io::json{{"expression", 5}}}).ok);  // wrong argument type
  EXPECT_FALSE(tb.call(ToolCall{"search", io::json::object()}).ok);
}

TEST(RlTasks, AnswersAreWhatTheToolsComputeAndTheRewardChecksThem) {
  for (uint64_t seed = 1; seed <= 50; ++seed) {
    const Task a = make_task(TaskKind::Arithmetic, seed, 1 + int64_t(seed % 12));
    const std::string expr = a.question.substr(8, a.question.size() - 9);  // "Compute <expr>."
    EXPECT_EQ(calculator(expr).text, a.answer) << a.question;
    EXPECT_EQ(reward(a, a.answer), 1.0);
    EXPECT_EQ(reward(a, a.answer + "1"), 0.0);
    const Task l = make_task(TaskKind::LookupSum, seed, 200);
    const Toolbox tb(l.document);
    // The two names of the question, searched, give the two codes; their sum is the answer.
    const size_t p1 = l.question.find("codes of the ") + 13, p2 = l.question.find(" and the ");
    const std::string n1 = l.question.substr(p1, p2 - p1), n2 = l.question.substr(p2 + 9, l.question.size() - p2 - 10);
    auto code = [&](const std::string& n) {
      const std::string hit = tb.call(ToolCall{"search", io::json{{"query", n}}}).text;
      return hit.substr(hit.rfind(' ') + 1, 4);
    };
    EXPECT_EQ(calculator(code(n1) + " + " + code(n2)).text, l.answer) << l.question;
    EXPECT_EQ(reward(l, " " + l.answer + "\n"), 1.0);
    EXPECT_EQ(reward(l, ""), 0.0);
  }
  EXPECT_EQ(make_task(TaskKind::Lookup, 7, 1000).document, make_task(TaskKind::Lookup, 7, 1000).document);
  EXPECT_NE(make_task(TaskKind::Lookup, 7, 1000).question, make_task(TaskKind::Lookup, 8, 1000).question);
  EXPECT_THROW(make_task(TaskKind::Arithmetic, 1, 0), Error);
  EXPECT_THROW(make_task(TaskKind::Lookup, 1, 1), Error);
  EXPECT_THROW(make_task(TaskKind::Lookup, 1, 100001), Error);
  EXPECT_THROW(task_kind("shell"), Error);
  EXPECT_EQ(task_kind(task_kind_name(TaskKind::LookupSum)), TaskKind::LookupSum);
}

// Episodes (rl/episode.hpp) with scripted policies: a solved lookup_sum (search, search, calculator, answer) earns
// its reward; endless calls end at the tool budget, malformed ones at the turn budget with an error message each
// time, a long-winded policy at the token budget; a wrong answer earns nothing.
TEST(RlEpisode, BudgetsEndEveryLoopAndRewardsComeFromTheAnswer) {
  const Task t = make_task(TaskKind::LookupSum, 3, 50);
  const size_t p1 = t.question.find("codes of the ") + 13, p2 = t.question.find(" and the ");
  const std::string n1 = t.question.substr(p1, p2 - p1), n2 = t.question.substr(p2 + 9, t.question.size() - p2 - 10);
  auto call = [](const std::string& name, const std::string& key, const std::string& val) {
    return "<tool_call>" + io::json{{"name", name}, {"arguments", {{key, val}}}}.dump() + "</tool_call>";
  };
  auto last_code = [](const std::vector<Turn>& turns) {  // the 4 digits before "." in the last tool result
    const std::string& s = turns.back().text;
    return s.substr(s.find("</tool_result>") - 5, 4);
  };
  std::string c1;  // the first code the solver read
  const Policy solver = [&](const Task&, const std::vector<Turn>& h) -> Reply {
    if (h.empty()) return {call("search", "query", n1), 10};
    if (h.size() == 2) return c1 = last_code(h), Reply{call("search", "query", n2), 10};
    if (h.size() == 4) return {call("calculator", "expression", c1 + " + " + last_code(h)), 12};
    return {"<answer>" + h.back().text.substr(13, h.back().text.size() - 27) + "</answer>", 5};
  };
  const Episode ok = run_episode(t, solver);
  EXPECT_EQ(ok.end, "answer");
  EXPECT_EQ(ok.tool_calls, 3);
  EXPECT_EQ(ok.reward, 1.0) << (ok.answer ? *ok.answer : "(none)");
  EXPECT_EQ(ok.tokens, 37);

  const Episode loop = run_episode(t, [&](const Task&, const std::vector<Turn>&) {
    return Reply{call("calculator", "expression", "1 + 1"), 5};
  }, Budget{20, 6, 4096});
  EXPECT_EQ(loop.end, "tool_budget");
  EXPECT_EQ(loop.tool_calls, 6);
  EXPECT_EQ(loop.reward, 0.0);

  const Episode junk = run_episode(t, [](const Task&, const std::vector<Turn>&) {
    return Reply{"<tool_call>{not json</tool_call>", 5};
  }, Budget{4, 6, 4096});
  EXPECT_EQ(junk.end, "turn_budget");
  ASSERT_EQ(junk.turns.size(), 8u);
  EXPECT_NE(junk.turns[1].text.find("error: the tool call is not valid JSON"), std::string::npos) << junk.turns[1].text;

  const Episode chatty = run_episode(t, [](const Task&, const std::vector<Turn>&) { return Reply{"hmm", 3000}; });
  EXPECT_EQ(chatty.end, "token_budget");
  EXPECT_EQ(chatty.turns.size(), 3u);  // its first turn (answered with what to do), then the one past the budget

  const Episode wrong = run_episode(t, [](const Task&, const std::vector<Turn>&) { return Reply{"<answer>1</answer>", 3}; });
  EXPECT_EQ(wrong.end, "answer");
  EXPECT_EQ(wrong.reward, 0.0);
  EXPECT_THROW(run_episode(t, solver, Budget{0, 1, 1}), Error);
}
