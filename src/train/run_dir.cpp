#include "train/run_dir.hpp"

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <map>
#include <vector>

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/parallel.hpp"
#include "io/checkpoint.hpp"
#include "io/file.hpp"
#include "io/safetensors.hpp"

namespace lm::train {

namespace fs = std::filesystem;
using io::json;

std::vector<std::string> run_markers(const fs::path& out) {
  std::vector<std::string> r;
  std::error_code ec;
  for (const char* f : {"latest", "summary.json"})
    if (fs::exists(out / f, ec)) r.push_back(f);
  if (fs::is_directory(out / "ckpt", ec))
    for (const auto& e : fs::directory_iterator(out / "ckpt", ec))
      if (e.path().filename().string().rfind("step-", 0) == 0) r.push_back("ckpt/" + e.path().filename().string());
  std::sort(r.begin(), r.end());
  return r;
}

void clear_run(const fs::path& out) {
  for (const char* f : {"latest", "summary.json", "metrics.jsonl"}) fs::remove(out / f);
  fs::remove_all(out / "ckpt");
  // The stage folders too: the new run links only the stages it reaches, and an older run's later ones would stay.
  std::vector<fs::path> stages;
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && (n.rfind("stage-", 0) == 0 || n.rfind(".tmp-stage-", 0) == 0)) stages.push_back(e.path());
  }
  for (const fs::path& d : stages) fs::remove_all(d);
  io::fsync_dir(out.string());
}

TrainerState read_trainer_state(const json& j, const std::string& ctx, const std::vector<int64_t>& stage_steps,
                                const std::function<uint64_t(int64_t)>& fingerprint, bool finished_ok) {
  const auto n_stages = static_cast<int64_t>(stage_steps.size());
  TrainerState s;
  s.stage = io::get_required<int64_t>(j, "stage", ctx);
  s.step_in_stage = io::get_required<int64_t>(j, "step_in_stage", ctx);
  s.global_step = io::get_required<int64_t>(j, "global_step", ctx);
  s.tokens = io::get_required<int64_t>(j, "tokens", ctx);
  s.data_stage = io::get_or<int64_t>(j, "data_stage", s.stage, ctx);
  from_json(j.at("position"), s.position);
  LM_CHECK(s.stage >= 0, "{}: stage {} is negative", ctx, s.stage);
  const bool finished = finished_ok && s.stage == n_stages;
  LM_CHECK(s.stage < n_stages || finished, "{}: this run already finished all {} stages; nothing to resume", ctx,
           n_stages);
  const int64_t steps = finished ? 0 : stage_steps[static_cast<size_t>(s.stage)];
  LM_CHECK(s.step_in_stage >= 0 && s.step_in_stage <= steps, "{}: step_in_stage {} outside [0, {}] (the steps of "
           "stage {})", ctx, s.step_in_stage, steps, s.stage + 1);
  LM_CHECK(s.global_step >= s.step_in_stage, "{}: global_step {} is below step_in_stage {}", ctx, s.global_step,
           s.step_in_stage);
  LM_CHECK(s.tokens >= 0, "{}: tokens {} is negative", ctx, s.tokens);
  LM_CHECK(s.data_stage >= 0 && s.data_stage <= s.stage, "{}: data_stage {} outside [0, stage {}]", ctx,
           s.data_stage, s.stage);
  s.data_fingerprint = fingerprint(s.data_stage);
  LM_CHECK(io::get_required<uint64_t>(j, "data_fingerprint", ctx) == s.data_fingerprint,
           "{}: the training data differ from the run being resumed (different corpus, split, tokenizer, "
           "passkey or multi-needle documents)",
           ctx);
  return s;
}

namespace {

json state_json(const TrainerState& s) {
  json j;
  j["stage"] = s.stage;
  j["step_in_stage"] = s.step_in_stage;
  j["global_step"] = s.global_step;
  j["tokens"] = s.tokens;
  j["position"] = s.position;
  j["data_fingerprint"] = s.data_fingerprint;
  j["data_stage"] = s.data_stage;
  j["threads"] = num_threads();
  return j;
}

// Removes all but the newest `keep` step folders of ckpt/ (their names sort by step), and never `current` (the
// one just written, which `latest` names): a folder left by an older run with later step numbers sorts after it.
void prune_checkpoints(const fs::path& ck, int64_t keep, const fs::path& current) {
  std::vector<fs::path> steps;
  for (const auto& e : fs::directory_iterator(ck))
    if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0 && e.path() != current)
      steps.push_back(e.path());
  std::sort(steps.begin(), steps.end());
  const size_t others = keep > 0 ? static_cast<size_t>(keep - 1) : 0;  // `current` counts as one of `keep`
  for (size_t i = 0; i + others < steps.size(); ++i) fs::remove_all(steps[i]);
}

// Temporary folders of saves that were killed (.tmp-*) and replaced checkpoints not yet removed (.old-*).
void remove_leftovers(const fs::path& ck) {
  std::vector<fs::path> stale;
  for (const auto& e : fs::directory_iterator(ck)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".tmp-", 0) == 0 || n.rfind(".old-", 0) == 0) stale.push_back(e.path());
  }
  for (const auto& p : stale) fs::remove_all(p);
}

}  // namespace

std::string save_checkpoint(const fs::path& out, const CheckpointContent& c, const TrainerState& st, int64_t keep,
                            const std::string& also_as) {
  const bool writer = !c.comm || c.comm->rank() == 0;
  const bool shards = c.sharded && c.comm && c.comm->size() > 1;
  const bool expert_shards = c.experts && c.experts->size() > 1;
  const std::map<std::string, std::string> md{{"longmoe_step", std::to_string(st.global_step)}, {"format", "pt"}};
  const fs::path ck = out / "ckpt";
  const std::string name = fmt::format("step-{:08}", st.global_step);
  const fs::path tmp = ck / (".tmp-" + name), dst = ck / name, old = ck / (".old-" + name);
  if (writer) {
    fs::create_directories(ck);
    remove_leftovers(ck);
    fs::create_directories(tmp);
    c.config.save((tmp / "config.json").string());
    fs::copy_file(c.tokenizer, tmp / "tokenizer.model", fs::copy_options::overwrite_existing);
    if (!expert_shards)
      io::save_checkpoint(tmp.string(), c.params.named(DType::F32), uint64_t{2} << 30,
                          {{"longmoe_step", std::to_string(st.global_step)}});
    if (!shards) io::save_safetensors((tmp / "optimizer.safetensors").string(), c.optim.state());
  }
  std::vector<std::string> shard_files;
  std::map<std::string, std::pair<std::string, uint64_t>> weight_map;
  if (shards || expert_shards) {
    c.comm->barrier();  // the folder exists
    if (shards) {
      const int R = c.comm->size();
      for (int r = 0; r < R; ++r) shard_files.push_back(fmt::format("optimizer-{:05}-of-{:05}.safetensors", r, R));
      io::save_safetensors((tmp / shard_files[size_t(c.comm->rank())]).string(), c.optim.state());
    }
    if (expert_shards) {  // this rank's experts (rank 0: and every other tensor) as one model shard
      io::json mine = io::json::object();
      if (c.writes_experts) {
        const io::NamedTensors t = c.params.named(DType::F32, [&](const model::ParamSpec& p) {
          return writer || p.component == model::Component::RoutedExpert;
        });
        const std::string file = io::shard_file_name(size_t(c.experts->rank()), size_t(c.experts->size()));
        io::save_safetensors((tmp / file).string(), t, md);
        for (const auto& [tensor, x] : t) mine[tensor] = {file, x.nbytes()};
      }
      const std::string m = mine.dump() + "\n";  // (a compact dump holds no raw newline)
      const std::vector<char> all = c.comm->all_gather_v(m.data(), m.size());
      for (auto from = all.begin(); from != all.end();) {
        const auto end = std::find(from, all.end(), '\n');
        const io::json theirs = io::json::parse(from, end);
        for (const auto& [tensor, v] : theirs.items())
          weight_map[tensor] = {v[0].get<std::string>(), v[1].get<uint64_t>()};
        from = end == all.end() ? end : end + 1;
      }
    }
    c.comm->barrier();  // every shard is in it
  }
  if (!writer) return dst.string();
  if (expert_shards) io::write_checkpoint_index(tmp.string(), weight_map);
  if (shards) {
    io::json idx = {{"format", "longmoe optimizer shards"}, {"world", shard_files.size()}, {"files", shard_files}};
    io::write_file_atomic((tmp / "optimizer.index.json").string(), idx.dump(2) + "\n");
  }
  // Test hook: die in the middle of a save (after the weights, before the rename), as a kill would.
  if (env::crash_in_save_at_step() == st.global_step) std::abort();
  for (const auto& [file, bytes] : c.extra_files) io::write_file_atomic((tmp / file).string(), bytes);
  io::write_file_atomic((tmp / "trainer_state.json").string(), state_json(st).dump(2) + "\n");
  // Replacing a checkpoint of the same step (a save after a resume): rename it aside, then the new one into
  // place, so a kill at any moment leaves a complete folder of that name or its predecessor under .old-.
  if (fs::exists(dst)) fs::rename(dst, old);
  fs::rename(tmp, dst);
  io::fsync_dir(ck.string());  // the rename is durable before `latest` names it
  io::write_file_atomic((out / "latest").string(), "ckpt/" + name + "\n");
  fs::remove_all(old);
  if (!also_as.empty()) link_checkpoint(out, dst, also_as);
  prune_checkpoints(ck, keep, dst);
  return dst.string();
}

void link_checkpoint(const fs::path& out, const fs::path& ckpt, const std::string& as) {
  const fs::path sd = out / as, tmp = out / (".tmp-" + as), old = out / (".old-" + as);
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  for (const auto& e : fs::directory_iterator(ckpt)) fs::create_hard_link(e.path(), tmp / e.path().filename());
  io::fsync_dir(tmp.string());
  fs::remove_all(old);
  if (fs::exists(sd)) fs::rename(sd, old);
  fs::rename(tmp, sd);
  io::fsync_dir(out.string());
  fs::remove_all(old);
}

bool relink_stage_if_needed(const fs::path& out, const fs::path& ckpt, const std::string& as) {
  const fs::path state = out / as / "trainer_state.json";
  const auto global_step = [](const fs::path& f) {
    return io::get_required<int64_t>(io::load_json_file(f.string()), "global_step", f.string());
  };
  bool ok = fs::is_regular_file(state);
  if (ok) {
    try {
      ok = global_step(state) == global_step(ckpt / "trainer_state.json");
    } catch (const Error&) {
      ok = false;  // a torn or foreign file: make the link again
    }
  }
  if (!ok) link_checkpoint(out, ckpt, as);
  fs::remove_all(out / (".tmp-" + as));
  fs::remove_all(out / (".old-" + as));
  return !ok;
}

std::vector<std::string> optimizer_files(const fs::path& dir) {
  if (fs::exists(dir / "optimizer.safetensors")) return {(dir / "optimizer.safetensors").string()};
  const fs::path ip = dir / "optimizer.index.json";
  LM_CHECK(fs::exists(ip), "checkpoint {}: no optimizer state (neither optimizer.safetensors nor optimizer.index.json)",
           dir.string());
  const io::json j = io::load_json_file(ip.string());
  const std::string ctx = ip.string();
  // (find, not value("format", ""): GCC 12's -Wnull-dereference misfires inside nlohmann's value())
  const bool tagged = j.is_object() && j.find("format") != j.end() && *j.find("format") == "longmoe optimizer shards";
  LM_CHECK(tagged && j.contains("files") &&
               j["files"].is_array() && !j["files"].empty(),
           "{}: not a longmoe optimizer index (format \"longmoe optimizer shards\" with a non-empty \"files\" list)",
           ctx);
  std::vector<std::string> r;
  for (const auto& f : j["files"]) {
    LM_CHECK(f.is_string(), "{}: files must be strings", ctx);
    const std::string n = f.get<std::string>();
    LM_CHECK(!n.empty() && n.find('/') == std::string::npos && n.find("..") == std::string::npos,
             "{}: shard name '{}' must be a plain file name in the checkpoint folder", ctx, n);
    LM_CHECK(fs::is_regular_file(dir / n), "{}: shard '{}' is missing", ctx, n);
    r.push_back((dir / n).string());
  }
  return r;
}

namespace {
std::atomic<int> g_interrupts{0};
void on_interrupt(int sig) {
  if (g_interrupts.fetch_add(1) > 0) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}
}  // namespace

InterruptScope::InterruptScope() {
  g_interrupts = 0;
  old_int_ = std::signal(SIGINT, on_interrupt);
  old_term_ = std::signal(SIGTERM, on_interrupt);
}
InterruptScope::~InterruptScope() {
  std::signal(SIGINT, old_int_);
  std::signal(SIGTERM, old_term_);
}
bool interrupt_requested() { return g_interrupts.load() > 0; }

MetricsLog::MetricsLog(const fs::path& path, bool resume, int64_t global_step) {
  if (resume && fs::exists(path)) {
    std::ifstream in(path);
    std::string line, kept;
    while (std::getline(in, line)) {
      try {
        if (json::parse(line).value("step", int64_t{0}) <= global_step) kept += line + "\n";
      } catch (const json::exception&) {
        // a torn last line from the killed run: drop it
      }
    }
    io::write_file_atomic(path.string(), kept);
  } else if (!resume) {
    io::write_file_atomic(path.string(), "");
  }
  f_.open(path, std::ios::app);
}

void MetricsLog::write(const json& row) { f_ << row.dump() << "\n" << std::flush; }

bool summary_of_step(const fs::path& out, int64_t global_step) {
  try {
    const std::string f = (out / "summary.json").string();
    return io::get_or<int64_t>(io::load_json_file(f), "steps", -1, f) == global_step;
  } catch (const std::exception&) {
    return false;  // none (or not readable): the run's summary is still to be written
  }
}

void write_summary(const fs::path& out, const RunConfig& cfg, const TrainResult& r) {
  json sj = {{"steps", r.steps},
             {"tokens", r.tokens},
             {"tokens_per_s", r.tokens_per_s},
             {"threads", num_threads()},
             {"final_train_loss", r.final_train_loss},
             {"heldout_loss", r.heldout_loss},
             {"heldout_ppl", r.heldout_ppl},
             {"stage_heldout_ppl", r.stage_heldout_ppl},
             {"unigram_ppl", r.unigram_ppl},
             {"balance", cfg.to_json()["balance"]},
             {"passkey_fraction", cfg.passkey_fraction},
             {"multi_needle_fraction", cfg.multi_needle_fraction},
             {"answer_weight", cfg.answer_weight},
             {"checkpoint", r.checkpoint}};
  if (cfg.passkey_fraction > 0) {
    sj["stage_passkey_token_fraction"] = r.stage_passkey_token_fraction;
    sj["stage_passkey_doc_fraction"] = r.stage_passkey_doc_fraction;
  }
  if (!r.maxvio_worst.empty()) {
    const BalanceSummary bs = summarize_balance(r, 0.3, 50);
    sj["maxvio_first_step_below_0.3"] = bs.first_step_below;
    sj["maxvio_median_after_step_50"] = bs.median_after;
    sj["maxvio_max_after_step_50"] = bs.max_after;
  }
  io::write_file_atomic((out / "summary.json").string(), sj.dump(2) + "\n");
}

}  // namespace lm::train
