// Batched multi-turn rollouts with pausing (see rollout.hpp).
#include "rl/rollout.hpp"

#include <algorithm>
#include <cmath>
#include <span>

#include "core/error.hpp"
#include "infer/sampler.hpp"
#include "io/chat.hpp"

namespace lm::rl {

using io::json;

RolloutConfig RolloutConfig::from_json(const json& j, const std::string& ctx) {
  LM_CHECK(j.is_object(), "{}: rollout must be an object", ctx);
  RolloutConfig c;
  for (const auto& [k, v] : j.items()) {
    const bool num = v.is_number();
    if (k == "max_turns" && num) c.budget.max_turns = v.get<int64_t>();
    else if (k == "max_tool_calls" && num) c.budget.max_tool_calls = v.get<int64_t>();
    else if (k == "max_tokens" && num) c.budget.max_tokens = v.get<int64_t>();
    else if (k == "max_turn_tokens" && num) c.max_turn_tokens = v.get<int64_t>();
    else if (k == "temperature" && num) c.temperature = v.get<float>();
    else if (k == "seed" && v.is_number_unsigned()) c.seed = v.get<uint64_t>();
    else if (k == "system" && v.is_string()) c.system = v.get<std::string>();
    else lm::fail("{}: rollout.{} is not a rollout setting of that type (numbers max_turns, max_tool_calls, "
                  "max_tokens, max_turn_tokens, temperature, seed; string system)", ctx, k);
  }
  check_budget(c.budget);
  LM_CHECK(c.max_turn_tokens >= 1, "{}: rollout.max_turn_tokens must be >= 1", ctx);
  LM_CHECK(std::isfinite(c.temperature) && c.temperature >= 0 && c.temperature <= 100,
           "{}: rollout.temperature must be in [0, 100]", ctx);
  return c;
}

json RolloutConfig::to_json() const {
  json j = {{"max_turns", budget.max_turns}, {"max_tool_calls", budget.max_tool_calls},
            {"max_tokens", budget.max_tokens}, {"max_turn_tokens", max_turn_tokens},
            {"temperature", temperature},      {"seed", seed}};
  if (!system.empty()) j["system"] = system;
  return j;
}

json Trajectory::to_json() const {
  json turns = json::array();
  for (const Turn& t : episode.turns) turns.push_back({{"role", t.role}, {"content", t.text}});
  json e = {{"turns", turns},          {"end", episode.end},       {"tool_calls", episode.tool_calls},
            {"tokens", episode.tokens}, {"reward", episode.reward}};
  if (episode.answer) e["answer"] = *episode.answer;
  return {{"id", id},
          {"task", {{"kind", task_kind_name(task.kind)}, {"seed", task.seed}, {"size", task.size}}},
          {"tokens", tokens},
          {"mask", mask},
          {"logp", logp},
          {"turn_start", turn_start},
          {"drawn", drawn},
          {"entropy_sum", entropy_sum},
          {"iterations", iterations},
          {"episode", e}};
}

Trajectory Trajectory::from_json(const json& j, const std::string& ctx) {
  try {
    Trajectory t;
    t.id = j.at("id").get<int64_t>();
    const json& tk = j.at("task");
    t.task = {task_kind(tk.at("kind").get<std::string>()), tk.at("seed").get<uint64_t>(), tk.at("size").get<int64_t>()};
    t.tokens = j.at("tokens").get<std::vector<int32_t>>();
    t.mask = j.at("mask").get<std::vector<uint8_t>>();
    t.logp = j.at("logp").get<std::vector<double>>();
    t.turn_start = j.at("turn_start").get<int64_t>();
    t.drawn = j.at("drawn").get<int64_t>();
    t.entropy_sum = j.at("entropy_sum").get<double>();
    t.iterations = j.at("iterations").get<int64_t>();
    const json& e = j.at("episode");
    for (const auto& x : e.at("turns")) t.episode.turns.push_back({x.at("role"), x.at("content")});
    t.episode.end = e.at("end").get<std::string>();
    t.episode.tool_calls = e.at("tool_calls").get<int64_t>();
    t.episode.tokens = e.at("tokens").get<int64_t>();
    t.episode.reward = e.at("reward").get<double>();
    if (e.contains("answer")) t.episode.answer = e.at("answer").get<std::string>();
    LM_CHECK(t.mask.size() == t.tokens.size() && t.logp.size() == t.tokens.size() && t.turn_start >= 0 &&
                 t.turn_start <= static_cast<int64_t>(t.tokens.size()) && t.drawn >= 0,
             "{}: trajectory {}: tokens, mask and logp differ in length or turn_start/drawn are out of range", ctx,
             t.id);
    return t;
  } catch (const json::exception& e) {
    lm::fail("{}: a trajectory is malformed: {}", ctx, e.what());
  }
}

Trajectory start_trajectory(const io::Tokenizer& tok, const RolloutConfig& c, int64_t id, const TaskRef& task) {
  Trajectory t;
  t.id = id;
  t.task = task;
  io::Conversation conv;
  if (!c.system.empty()) conv.push_back({"system", c.system});
  conv.push_back({"user", task_prompt(task.make())});
  t.tokens = io::chat_tokens(tok, conv, true, true);
  t.mask.assign(t.tokens.size(), 0);
  t.logp.assign(t.tokens.size(), 0.0);
  t.turn_start = static_cast<int64_t>(t.tokens.size());
  return t;
}

namespace {

// Entropy of softmax(x / T) (T = 1 for greedy decoding), in nats.
double entropy(const float* x, int64_t V, float temperature) {
  const double inv_t = temperature > 0 ? 1.0 / temperature : 1.0;
  const double mx = *std::max_element(x, x + V) * inv_t;
  double z = 0, s = 0;
  for (int64_t v = 0; v < V; ++v) {
    const double a = x[v] * inv_t - mx, e = std::exp(a);
    z += e;
    s += e * a;
  }
  return std::log(z) - s / z;
}

struct Live {
  Trajectory* t;
  Task task;
  Toolbox tools;
  infer::Sampler sampler;
  infer::Engine::Id seq;
  std::vector<float> logits;  // [V] after the last consumed token
};

// The call's sequences are closed however it ends (a GPU engine's slots are few).
struct CloseAll {
  infer::Engine& e;
  std::vector<Live>& live;
  ~CloseAll() {
    for (const Live& l : live) e.close(l.seq);
  }
};

}  // namespace

RolloutStats rollout(infer::Engine& s, const io::Tokenizer& tok, const RolloutConfig& c,
                     std::vector<Trajectory*> batch, int64_t deadline) {
  check_budget(c.budget);
  LM_CHECK(deadline >= 0, "rollout: deadline {} must be >= 0", deadline);
  const int64_t V = s.vocab_size(), max_ctx = s.max_context();
  const int32_t end_id = tok.special("<|end|>");
  infer::SamplingParams sp;
  sp.temperature = c.temperature;
  sp.seed = c.seed;
  sp.top_logprobs = 0;
  RolloutStats st;
  std::vector<Live> live;
  live.reserve(batch.size());
  const CloseAll closer{s, live};
  // The caches of a sequence: everything recorded so far, on the current weights. False: the context is full.
  auto catch_up = [&](Live& l) {
    const auto& tk = l.t->tokens;
    if (static_cast<int64_t>(tk.size()) >= max_ctx) return false;
    l.logits = s.prefill(l.seq, std::span(tk).subspan(static_cast<size_t>(s.pos(l.seq))), nullptr, false);
    return true;
  };
  for (Trajectory* t : batch) {
    if (t->done()) continue;
    ++t->iterations;
    Task task = t->task.make();
    Toolbox tools(task.document);
    live.push_back(Live{t, std::move(task), std::move(tools), infer::Sampler(sp, static_cast<uint64_t>(t->id)),
                        s.open(), {}});
    live.back().sampler.seek(t->drawn);
    if (!catch_up(live.back())) t->episode.end = "context_limit";
  }
  std::vector<int32_t> history;  // the repetition penalty is off: no history needed
  while (true) {
    std::vector<Live*> step;
    for (Live& l : live)
      if (!l.t->done()) step.push_back(&l);
    if (step.empty() || (deadline > 0 && st.generated >= deadline)) break;
    std::vector<infer::Engine::Id> dec_seqs;
    std::vector<int32_t> dec_tokens;
    std::vector<Live*> dec;
    for (Live* l : step) {
      Trajectory& t = *l->t;
      infer::TokenLogprobs lp;
      const int32_t id = l->sampler.sample(l->logits.data(), V, history, &lp);
      t.entropy_sum += entropy(l->logits.data(), V, c.temperature);
      t.tokens.push_back(id);
      t.mask.push_back(1);
      t.logp.push_back(lp.logprob);
      t.drawn = l->sampler.drawn();
      ++st.generated;
      const int64_t turn_len = static_cast<int64_t>(t.tokens.size()) - t.turn_start;
      // A turn may run one token past the episode's budget: that token is what ends it with token_budget.
      const int64_t cap = std::min(c.max_turn_tokens, c.budget.max_tokens - t.episode.tokens + 1);
      const bool full = static_cast<int64_t>(t.tokens.size()) >= max_ctx;
      if (id != end_id && turn_len < cap && !full) {
        dec.push_back(l);
        dec_seqs.push_back(l->seq);
        dec_tokens.push_back(id);
        continue;
      }
      // The turn is over: what the model wrote goes to the episode; the closing <|end|> is the template's when the
      // model did not write it.
      std::vector<int32_t> turn(t.tokens.begin() + t.turn_start, t.tokens.end());
      if (id == end_id) turn.pop_back();
      if (full) {
        t.episode.tokens += turn_len;
        t.episode.turns.push_back({"assistant", tok.decode(turn)});
        t.episode.end = "context_limit";
        continue;
      }
      if (id != end_id) {
        t.tokens.push_back(end_id);
        t.mask.push_back(0);
        t.logp.push_back(0);
      }
      if (episode_turn(l->task, l->tools, c.budget, Reply{tok.decode(turn), turn_len}, t.episode)) continue;
      const std::vector<int32_t> next = io::chat_tokens(tok, {{"tool", t.episode.turns.back().text}}, true, false);
      t.tokens.insert(t.tokens.end(), next.begin(), next.end());
      t.mask.insert(t.mask.end(), next.size(), 0);
      t.logp.insert(t.logp.end(), next.size(), 0.0);
      t.turn_start = static_cast<int64_t>(t.tokens.size());
      if (!catch_up(*l)) t.episode.end = "context_limit";
    }
    if (!dec.empty()) {
      const std::vector<float>& lg = s.decode(dec_seqs, dec_tokens);
      for (size_t i = 0; i < dec.size(); ++i)
        dec[i]->logits.assign(lg.begin() + static_cast<int64_t>(i) * V, lg.begin() + static_cast<int64_t>(i + 1) * V);
    }
  }
  for (const Live& l : live) st.paused += !l.t->done();
  return st;
}

}  // namespace lm::rl
