// The RL loop (see rl_run.hpp).
#include "rl/rl_run.hpp"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <numeric>

#include "core/error.hpp"
#include "dist/comm.hpp"
#include "infer/engine.hpp"
#include "infer/generate.hpp"
#include "io/checkpoint.hpp"
#include "io/file.hpp"
#include "model/cuda/gpu_model.hpp"
#include "train/engine.hpp"
#include "train/run_dir.hpp"

namespace lm::rl {

namespace fs = std::filesystem;
using io::json;

namespace {

constexpr const char* kDefaultOptim = R"({"kind": "adamw", "lr": 1e-5, "weight_decay": 0.0, "clip": 1.0})";

// Text a model wrote may hold invalid UTF-8 (a byte piece alone); JSON files get U+FFFD instead.
json utf8_safe(const json& j) { return json::parse(j.dump(-1, ' ', false, json::error_handler_t::replace)); }

int64_t default_size(TaskKind k, int64_t size) { return size > 0 ? size : (k == TaskKind::Arithmetic ? 4 : 20); }

}  // namespace

RlConfig RlConfig::from_json(const json& j, const std::string& ctx) {
  io::check_known_fields(j,
                         {"init", "out", "tasks", "eval", "iterations", "prompts_per_iter", "iteration_tokens",
                          "micro_trajectories", "epochs", "optimizer", "grpo", "rollout", "samples_per_iter", "save_every",
                          "keep_checkpoints", "max_iterations", "context", "comment"},
                         ctx);
  RlConfig c;
  c.init = io::get_required<std::string>(j, "init", ctx);
  c.out = io::get_or<std::string>(j, "out", c.out, ctx);
  if (j.contains("tasks")) {
    const json& t = j["tasks"];
    io::check_known_fields(t, {"kinds", "size", "seed"}, ctx + ": tasks");
    if (t.contains("kinds")) {
      c.kinds.clear();
      LM_CHECK(t["kinds"].is_array() && !t["kinds"].empty(), "{}: tasks.kinds must be a non-empty list", ctx);
      for (const auto& k : t["kinds"]) {
        LM_CHECK(k.is_string(), "{}: tasks.kinds holds a non-string", ctx);
        c.kinds.push_back(task_kind(k.get<std::string>()));
      }
    }
    c.task_size = io::get_or<int64_t>(t, "size", c.task_size, ctx + ": tasks");
    c.task_seed = io::get_or<uint64_t>(t, "seed", c.task_seed, ctx + ": tasks");
  }
  if (j.contains("eval")) {
    const json& e = j["eval"];
    io::check_known_fields(e, {"tasks", "seed", "every"}, ctx + ": eval");
    c.eval_tasks = io::get_or<int64_t>(e, "tasks", c.eval_tasks, ctx + ": eval");
    c.eval_seed = io::get_or<uint64_t>(e, "seed", c.eval_seed, ctx + ": eval");
    c.eval_every = io::get_or<int64_t>(e, "every", c.eval_every, ctx + ": eval");
  }
  c.iterations = io::get_or<int64_t>(j, "iterations", c.iterations, ctx);
  c.prompts_per_iter = io::get_or<int64_t>(j, "prompts_per_iter", c.prompts_per_iter, ctx);
  c.iteration_tokens = io::get_or<int64_t>(j, "iteration_tokens", c.iteration_tokens, ctx);
  c.micro_trajectories = io::get_or<int64_t>(j, "micro_trajectories", c.micro_trajectories, ctx);
  c.epochs = io::get_or<int64_t>(j, "epochs", c.epochs, ctx);
  c.optim = train::OptimConfig::from_json(j.contains("optimizer") ? j["optimizer"] : json::parse(kDefaultOptim),
                                          ctx + ": optimizer");
  if (j.contains("grpo")) c.grpo = GrpoConfig::from_json(j["grpo"], ctx);
  if (j.contains("rollout")) c.rollout = RolloutConfig::from_json(j["rollout"], ctx);
  c.samples_per_iter = io::get_or<int64_t>(j, "samples_per_iter", c.samples_per_iter, ctx);
  c.save_every = io::get_or<int64_t>(j, "save_every", c.save_every, ctx);
  c.keep_checkpoints = io::get_or<int64_t>(j, "keep_checkpoints", c.keep_checkpoints, ctx);
  c.max_iterations = io::get_or<int64_t>(j, "max_iterations", c.max_iterations, ctx);
  c.context = io::get_or<int64_t>(j, "context", c.context, ctx);
  LM_CHECK(c.context >= 0, "{}: context must be >= 0 (0: the model's limit; 8192 on the GPU), got {}", ctx, c.context);
  LM_CHECK(c.iterations >= 1 && c.prompts_per_iter >= 1 && c.micro_trajectories >= 1 && c.eval_tasks >= 1 &&
               c.epochs >= 1,
           "{}: iterations, prompts_per_iter, micro_trajectories, epochs and eval.tasks must be >= 1", ctx);
  LM_CHECK(c.iteration_tokens >= 0 && c.eval_every >= 0 && c.save_every >= 0 && c.samples_per_iter >= 0 &&
               c.keep_checkpoints >= 1 && c.max_iterations >= 0,
           "{}: iteration_tokens, eval.every, save_every, samples_per_iter, max_iterations must be >= 0 and "
           "keep_checkpoints >= 1", ctx);
  for (TaskKind k : c.kinds) make_task(k, c.task_seed, default_size(k, c.task_size));  // the size fits every kind
  c.optim.validate(ctx + ": optimizer");
  return c;
}

json RlConfig::to_json() const {
  json names = json::array();
  for (TaskKind k : kinds) names.push_back(task_kind_name(k));
  return {{"init", init},
          {"out", out},
          {"tasks", {{"kinds", names}, {"size", task_size}, {"seed", task_seed}}},
          {"eval", {{"tasks", eval_tasks}, {"seed", eval_seed}, {"every", eval_every}}},
          {"iterations", iterations},
          {"prompts_per_iter", prompts_per_iter},
          {"iteration_tokens", iteration_tokens},
          {"micro_trajectories", micro_trajectories},
          {"epochs", epochs},
          {"context", context},
          {"optimizer", optim.to_json()},
          {"grpo", grpo.to_json()},
          {"rollout", rollout.to_json()},
          {"samples_per_iter", samples_per_iter},
          {"save_every", save_every},
          {"keep_checkpoints", keep_checkpoints}};
}

namespace {

using Group = std::vector<Trajectory>;

struct Loop {
  const RlConfig& c;
  const RlOptions& o;
  fs::path out;
  infer::LoadedModel policy;                 // the host copy: checkpoints are written from it (and its optimiser)
  std::unique_ptr<model::Model<float>> ref;  // frozen initial policy (kl_coef > 0), on the CPU
  std::unique_ptr<train::Optimizer> opt;
  std::unique_ptr<train::Engine> engine;     // the policy's training steps (CPU or GPU, train/engine.hpp)
  std::unique_ptr<infer::Session> session;   // CPU rollouts: a Session over the host model ...
  std::unique_ptr<infer::Engine> roll;       // ... behind an engine, or the GPU model's slots
  std::string tokenizer_file;
  // What rl_state.json holds.
  int64_t iteration = 0, next_task = 0, next_id = 0;
  double first_eval = -1;
  std::vector<Group> open;

  void say(const std::string& s) const {
    if (!o.quiet) std::printf("%s\n", s.c_str()), std::fflush(stdout);
  }

  TaskRef task(uint64_t seed, int64_t n) const {
    const TaskKind k = c.kinds[static_cast<size_t>(n) % c.kinds.size()];
    return {k, seed, default_size(k, c.task_size)};
  }

  // The engines: training on `device`, rollouts by the same weights (the GPU's bf16 copy is AdamW's own, so the
  // rollouts of the next iteration see each step without a copy).
  void start_engines(const std::string& device) {
    train::RunConfig rc;
    rc.optim = c.optim;
    rc.balance = train::Balance::None;  // (RL steps do not rebalance the experts)
    train::check_device(device, rc);
    engine = train::make_engine(device, rc, *policy.model, *opt, dist::single());
    if (model::cuda::GpuModel* g = engine->gpu_model()) {
      infer::GpuEngineOptions go;
      go.max_sequences = std::max(c.prompts_per_iter * c.grpo.group_size, c.eval_tasks);
      go.context = c.context > 0 ? c.context : 8192;
      go.prefix_cache_bytes = 0;  // the weights change every iteration
      roll = std::make_unique<infer::GpuEngine>(*g, go);
    } else {
      infer::SessionOptions so;
      so.prefix_cache_bytes = 0;
      so.max_context = c.context;
      session = std::make_unique<infer::Session>(*policy.model, so);
      roll = std::make_unique<infer::CpuEngine>(*session);
    }
  }

  // Greedy held-out success: over all tasks, and per kind ("eval_success_<kind>") when there are several.
  json evaluate() {
    RolloutConfig rc = c.rollout;
    rc.temperature = 0;
    std::vector<Trajectory> ts;
    for (int64_t i = 0; i < c.eval_tasks; ++i)
      ts.push_back(start_trajectory(*policy.tokenizer, rc, i, task(c.eval_seed + static_cast<uint64_t>(i), i)));
    std::vector<Trajectory*> p;
    for (auto& t : ts) p.push_back(&t);
    rollout(*roll, *policy.tokenizer, rc, p);
    std::map<std::string, std::pair<double, double>> by_kind;  // kind -> (solved, tasks)
    double ok = 0;
    for (const auto& t : ts) {
      ok += t.episode.reward == 1.0;
      auto& k = by_kind[std::string(task_kind_name(t.task.kind))];
      k.first += t.episode.reward == 1.0, k.second += 1;
    }
    json r = {{"eval_success", ok / static_cast<double>(c.eval_tasks)}};
    if (by_kind.size() > 1)
      for (const auto& [k, v] : by_kind) r["eval_success_" + k] = v.first / v.second;
    return r;
  }

  json state() const {
    json groups = json::array();
    for (const Group& g : open) {
      json a = json::array();
      for (const Trajectory& t : g) a.push_back(t.to_json());
      groups.push_back(a);
    }
    return {{"iteration", iteration}, {"next_task", next_task}, {"next_id", next_id},
            {"first_eval", first_eval}, {"groups", groups}};
  }
  void load_state(const json& j, const std::string& ctx) {
    iteration = io::get_required<int64_t>(j, "iteration", ctx);
    next_task = io::get_required<int64_t>(j, "next_task", ctx);
    next_id = io::get_required<int64_t>(j, "next_id", ctx);
    first_eval = io::get_required<double>(j, "first_eval", ctx);
    for (const auto& g : j.at("groups")) {
      open.emplace_back();
      for (const auto& t : g) open.back().push_back(Trajectory::from_json(t, ctx));
    }
  }

  std::string save() {
    engine->sync_to_host();
    train::TrainerState st;
    st.global_step = iteration;
    const std::string s = state().dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
    return train::save_checkpoint(out, {policy.config, tokenizer_file, policy.model->params(), *opt, nullptr, false,
                                        {{"rl_state.json", s}}},
                                  st, c.keep_checkpoints, "");
  }

  // One GRPO step over the completed groups; the metrics of the step.
  json step(const std::vector<Group>& done) {
    std::vector<const Trajectory*> ts;
    std::vector<double> shaped;
    for (const Group& g : done)
      for (const Trajectory& t : g) ts.push_back(&t), shaped.push_back(shaped_reward(t.episode.reward,
                                                                                     t.episode.tokens, c.grpo));
    const std::vector<double> adv = group_advantages(shaped, c.grpo.group_size, c.grpo.adv_eps);
    int64_t N = 0;
    for (const Trajectory* t : ts) N += std::accumulate(t->mask.begin() + 1, t->mask.end(), int64_t{0});
    double loss = 0, pol = 0, kl = 0, clip = 0, ratio = 0, ratio_dev = 0;
    train::StepInfo si;
    // epochs > 1: more optimiser steps on the same rollouts; from the second on the ratios leave 1 and clip.
    for (int64_t epoch = 0; epoch < c.epochs; ++epoch) {
      engine->zero_grads();
      loss = pol = kl = clip = ratio = ratio_dev = 0;
      for (size_t b = 0; b < ts.size(); b += static_cast<size_t>(c.micro_trajectories)) {
        const size_t e = std::min(ts.size(), b + static_cast<size_t>(c.micro_trajectories));
        train::Batch mb;
        std::vector<int32_t>&ids = mb.ids, &tg = mb.targets;
        std::vector<int64_t>& cu = mb.cu_seqlens;
        cu = {0};
        GrpoTokens gt;
        for (size_t i = b; i < e; ++i) {
          const Trajectory& t = *ts[i];
          const size_t n = t.tokens.size() - 1;  // row r predicts token r + 1
          for (size_t r = 0; r < n; ++r) {
            ids.push_back(t.tokens[r]);
            const bool m = t.mask[r + 1] != 0;
            tg.push_back(m ? t.tokens[r + 1] : -100);
            gt.mask.push_back(m);
            gt.old_logp.push_back(t.logp[r + 1]);
            gt.adv.push_back(adv[i]);
          }
          cu.push_back(cu.back() + static_cast<int64_t>(n));
        }
        mb.seqs = static_cast<int64_t>(cu.size()) - 1, mb.seq_len = 0;
        if (ref && c.grpo.kl_coef > 0) {
          const std::vector<float> rl = ref->target_logprobs(ids.data(), tg.data(), model::Seqs::packed(cu));
          gt.ref_logp.assign(rl.begin(), rl.end());
        }
        engine->forward_backward_logp(mb, [&](const std::vector<float>& lp) {
          const GrpoLoss L = grpo_loss(std::vector<double>(lp.begin(), lp.end()), gt, c.grpo);
          // grpo_loss normalises by this micro-batch's tokens; the step's mean is over all N.
          const double w = N > 0 ? static_cast<double>(L.n) / static_cast<double>(N) : 0.0;
          loss += w * L.loss, pol += w * L.policy_loss, kl += w * L.kl, clip += w * L.clip_frac;
          ratio += w * L.ratio_mean, ratio_dev += w * L.ratio_dev;
          std::vector<float> g(L.dlogp.size());
          for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(w * L.dlogp[i]);
          return g;
        });
      }
      si = engine->step(1.0);
    }
    double reward = 0, success = 0, turns = 0, tokens = 0, ent = 0, gen = 0, iters = 0;
    for (const Trajectory* t : ts) {
      reward += t->episode.reward;
      success += t->episode.reward == 1.0;
      turns += static_cast<double>(t->episode.assistant_turns());
      tokens += static_cast<double>(t->episode.tokens);
      ent += t->entropy_sum;
      gen += static_cast<double>(t->drawn);
      iters += static_cast<double>(t->iterations);
    }
    const double n = static_cast<double>(ts.size());
    return {{"reward", reward / n},    {"success", success / n},      {"turns", turns / n},
            {"traj_tokens", tokens / n}, {"entropy", gen > 0 ? ent / gen : 0.0}, {"kl", kl},
            {"clip_frac", clip},       {"loss", loss},                {"policy_loss", pol},
            {"ratio", ratio}, {"ratio_dev", ratio_dev},          {"grad_norm", si.grad_norm},   {"lr", si.lr_adamw},
            {"trajectories", ts.size()}, {"train_tokens", N},         {"traj_iterations", iters / n}};
  }
};

}  // namespace

RlResult run_rl(const RlConfig& c, const RlOptions& o) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  Loop L{c, o, fs::path(c.out), {}, {}, {}, {}, {}, {}, {}, 0, 0, 0, -1, {}};
  const std::string init = io::resolve_checkpoint(c.init);
  LM_CHECK(!(o.resume && o.overwrite), "rl: --resume continues the run in {}, --overwrite replaces it; give one", c.out);
  fs::create_directories(L.out);
  const auto markers = train::run_markers(L.out);
  std::string resume_dir;
  if (o.resume) {
    LM_CHECK(fs::exists(L.out / "latest"), "rl --resume: {} holds no checkpoint to continue", c.out);
    resume_dir = io::resolve_checkpoint(c.out);
  } else {
    LM_CHECK(markers.empty() || o.overwrite, "rl: {} holds another run ({}); --resume continues it, --overwrite "
             "replaces it", c.out, markers.front());
    if (o.overwrite) train::clear_run(L.out);
    fs::remove(L.out / "samples.jsonl");
  }
  L.policy = infer::load_model_dir(resume_dir.empty() ? init : resume_dir);
  // The run keeps its own copy of the tokenizer its checkpoints carry (the init folder may go away).
  L.tokenizer_file = (L.out / "tokenizer.model").string();
  io::write_file_atomic(L.tokenizer_file,
                        io::read_file((fs::path(resume_dir.empty() ? init : resume_dir) / "tokenizer.model").string()));
  if (c.grpo.kl_coef > 0) L.ref = std::move(infer::load_model_dir(init).model);
  L.policy.model->params().enable_grads();
  L.opt = std::make_unique<train::Optimizer>(L.policy.model->params(), L.policy.config, c.optim);
  if (!resume_dir.empty()) {
    L.opt->load_state(train::optimizer_files(resume_dir));
    const std::string sp = (fs::path(resume_dir) / "rl_state.json").string();
    L.load_state(io::load_json_file(sp), sp);
  }
  L.start_engines(o.device);  // (after the optimiser state: the GPU engine starts from it)
  io::write_file_atomic((L.out / "run.json").string(), c.to_json().dump(2) + "\n");
  train::MetricsLog metrics(L.out / "metrics.jsonl", o.resume, L.iteration);
  train::MetricsLog samples(L.out / "samples.jsonl", o.resume, L.iteration);
  RlResult r;
  const auto eval_row = [&](int64_t step) {
    const auto te = Clock::now();
    json row = L.evaluate();
    const double s = row["eval_success"].get<double>();
    r.eval_success.push_back(s);
    if (L.first_eval < 0) L.first_eval = s;
    row["step"] = step;
    row["eval_tasks"] = c.eval_tasks;
    row["eval_seconds"] = std::chrono::duration<double>(Clock::now() - te).count();
    metrics.write(row);
    L.say(fmt::format("iteration {:4}  held-out success {:.3f} ({} tasks) {}", step, s, c.eval_tasks, row.dump()));
  };
  if (L.iteration == 0) eval_row(0);
  int64_t here = 0;
  const train::InterruptScope interrupts;  // SIGINT / SIGTERM: finish the iteration, save, stop
  while (L.iteration < c.iterations && !(c.max_iterations > 0 && here >= c.max_iterations) && !r.interrupted) {
    const auto ti = Clock::now();
    while (static_cast<int64_t>(L.open.size()) < c.prompts_per_iter) {  // new prompts, K samples each
      const TaskRef t = L.task(c.task_seed + static_cast<uint64_t>(L.next_task), L.next_task);
      ++L.next_task;
      Group g;
      for (int64_t k = 0; k < c.grpo.group_size; ++k) g.push_back(start_trajectory(*L.policy.tokenizer, c.rollout,
                                                                                   L.next_id++, t));
      L.open.push_back(std::move(g));
    }
    std::vector<Trajectory*> live;
    for (Group& g : L.open)
      for (Trajectory& t : g) live.push_back(&t);
    const RolloutStats rs = rollout(*L.roll, *L.policy.tokenizer, c.rollout, live, c.iteration_tokens);
    const double roll_s = std::chrono::duration<double>(Clock::now() - ti).count();
    std::vector<Group> done, still;
    for (Group& g : L.open)
      (std::all_of(g.begin(), g.end(), [](const Trajectory& t) { return t.done(); }) ? done : still)
          .push_back(std::move(g));
    L.open = std::move(still);
    json row = done.empty() ? json::object() : L.step(done);
    ++L.iteration, ++here;
    row["step"] = L.iteration;
    row["rollout_tokens"] = rs.generated;
    row["paused"] = rs.paused;
    row["groups_trained"] = done.size();
    row["rollout_seconds"] = roll_s;
    row["seconds"] = std::chrono::duration<double>(Clock::now() - ti).count();
    metrics.write(row);
    r.metrics.push_back(row);
    int64_t written = 0;
    for (const Group& g : done)
      for (const Trajectory& t : g) {
        if (written++ >= c.samples_per_iter) break;
        json conv = json::array();
        for (const Turn& x : t.episode.turns) conv.push_back({{"role", x.role}, {"content", x.text}});
        samples.write(utf8_safe({{"step", L.iteration}, {"id", t.id}, {"task", task_kind_name(t.task.kind)},
                                 {"seed", t.task.seed}, {"reward", t.episode.reward}, {"end", t.episode.end},
                                 {"tokens", t.episode.tokens}, {"iterations", t.iterations}, {"turns", conv}}));
      }
    L.say(fmt::format("iteration {:4}  reward {:.3f}  success {:.3f}  tokens {:.0f}  kl {:.4f}  clip {:.3f}  "
                      "paused {}  {:.1f} s",
                      L.iteration, row.value("reward", 0.0), row.value("success", 0.0),
                      row.value("traj_tokens", 0.0), row.value("kl", 0.0), row.value("clip_frac", 0.0), rs.paused,
                      row["seconds"].get<double>()));
    const bool last = L.iteration == c.iterations;
    if (last || (c.eval_every > 0 && L.iteration % c.eval_every == 0)) eval_row(L.iteration);
    r.interrupted = train::interrupt_requested();
    if (last || (c.save_every > 0 && L.iteration % c.save_every == 0) ||
        (c.max_iterations > 0 && here >= c.max_iterations) || r.interrupted)
      r.checkpoint = L.save();
  }
  r.iterations = L.iteration;
  r.first_eval = L.first_eval;
  r.last_eval = r.eval_success.empty() ? -1 : r.eval_success.back();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (L.iteration == c.iterations && !r.eval_success.empty())
    io::write_file_atomic((L.out / "summary.json").string(),
                          json{{"iterations", L.iteration}, {"eval_tasks", c.eval_tasks},
                               {"eval_success_first", r.first_eval}, {"eval_success_last", r.last_eval},
                               {"seconds_this_process", r.seconds}, {"checkpoint", r.checkpoint}}
                                  .dump(2) + "\n");
  return r;
}

}  // namespace lm::rl
