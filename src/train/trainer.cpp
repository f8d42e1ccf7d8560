// The training loop (issue "Training on CPU"): data -> tokenizer -> model -> optimiser, Quantile
// Balancing (or a baseline) per MoE layer per step, a staged context curriculum, metrics JSONL,
// held-out evaluation, atomic checkpoints and exact resume. The device's work is the engine's
// (train/engine.hpp); the run folder's files are run_dir.hpp's, the data run_data.hpp's.
//
// Legend: B sequences per step, T seq_len of the stage, m = tokens routed in a step (B·T), E experts,
//         k experts per token.
// One step: the B sequences are split into micro-batches; each runs forward+backward with the loss
// normalised by the step's total target count (so accumulation equals one big batch); then NaN/Inf
// check, clip, optimiser step, and the balancing update of every MoE layer's selection bias from the
// router scores of the whole step (the bias is installed for the next step).
#include "train/trainer.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "io/idx.hpp"
#include "train/captions.hpp"
#include "io/checkpoint.hpp"
#include "io/corpus.hpp"
#include "io/file.hpp"
#include "io/safetensors.hpp"
#include "model/accounting.hpp"
#include "model/model.hpp"
#include "train/data.hpp"
#include "train/engine.hpp"
#include "train/run_data.hpp"
#include "train/run_dir.hpp"
#include "train/synthetic.hpp"

namespace lm::train {

namespace fs = std::filesystem;
using io::json;

// ---- run config ------------------------------------------------------------------------------

namespace {

Balance parse_balance(const std::string& s, const std::string& ctx) {
  if (s == "qb") return Balance::QB;
  if (s == "sign") return Balance::Sign;
  if (s == "aux") return Balance::Aux;
  if (s == "none") return Balance::None;
  fail("{}: balance.kind must be one of qb, sign, aux, none (got '{}')", ctx, s);
}

}  // namespace

const char* balance_name(Balance b) {
  switch (b) {
    case Balance::QB: return "qb";
    case Balance::Sign: return "sign";
    case Balance::Aux: return "aux";
    case Balance::None: return "none";
  }
  return "?";
}

RunConfig RunConfig::from_json(const json& j, const std::string& ctx) {
  io::check_known_fields(j,
              {"model", "init", "data", "tokenizer", "out", "seed", "optimizer", "balance", "stages", "log_every",
               "eval_every", "eval_batches", "save_every", "keep_checkpoints", "max_steps", "parallel", "eval_retrieval",
               "comment"},
              ctx);
  RunConfig c;
  c.init = io::get_or<std::string>(j, "init", "", ctx);
  std::string init_tokenizer;
  if (!c.init.empty()) {
    c.init = resolve_checkpoint(c.init);
    init_tokenizer = (fs::path(c.init) / "tokenizer.model").string();
    LM_CHECK(fs::exists(init_tokenizer), "{}: init checkpoint {} has no tokenizer.model", ctx, c.init);
  }
  c.model = c.init.empty() || j.contains("model") ? io::get_required<std::string>(j, "model", ctx)
                                                  : (fs::path(c.init) / "config.json").string();
  const json& d = j.at("data");
  io::check_known_fields(
      d, {"path", "format", "heldout_fraction", "passkey_fraction", "multi_needle_fraction", "answer_weight", "images"},
      ctx + " data");
  if (d.contains("images")) {
    const json& im = d["images"];
    const std::string ictx = ctx + " data.images";
    io::check_known_fields(im, {"path", "size", "fraction"}, ictx);
    c.images = io::get_required<std::string>(im, "path", ictx);
    c.image_size = io::get_or<int64_t>(im, "size", 56, ictx);
    c.image_fraction = io::get_or<double>(im, "fraction", 0.25, ictx);
  }
  c.data = io::get_required<std::string>(d, "path", ctx + " data");
  c.data_format = io::get_or<std::string>(d, "format", "auto", ctx + " data");
  c.heldout_fraction = io::get_or<double>(d, "heldout_fraction", 0.05, ctx + " data");
  c.passkey_fraction = io::get_or<double>(d, "passkey_fraction", 0.0, ctx + " data");
  c.multi_needle_fraction = io::get_or<double>(d, "multi_needle_fraction", 0.0, ctx + " data");
  c.answer_weight = io::get_or<double>(d, "answer_weight", 1.0, ctx + " data");
  if (j.contains("tokenizer")) {
    const json& t = j["tokenizer"];
    io::check_known_fields(t, {"vocab_size", "model"}, ctx + " tokenizer");
    c.tokenizer_vocab = io::get_or<int>(t, "vocab_size", 4096, ctx + " tokenizer");
    c.tokenizer = io::get_or<std::string>(t, "model", "", ctx + " tokenizer");
  }
  if (!c.init.empty()) {
    LM_CHECK(c.tokenizer.empty() || fs::equivalent(c.tokenizer, init_tokenizer),
             "{}: tokenizer.model {} is not the init checkpoint's ({}), whose ids its weights read", ctx, c.tokenizer,
             init_tokenizer);
    c.tokenizer = init_tokenizer;
  }
  c.out = io::get_or<std::string>(j, "out", c.out, ctx);
  c.seed = io::get_or<uint64_t>(j, "seed", 1, ctx);
  if (j.contains("optimizer")) c.optim = OptimConfig::from_json(j["optimizer"], ctx + " optimizer");
  if (j.contains("balance")) {
    const json& b = j["balance"];
    io::check_known_fields(b, {"kind", "estimator", "bins", "gamma", "aux_coef"}, ctx + " balance");
    c.balance = parse_balance(io::get_or<std::string>(b, "kind", "qb", ctx + " balance"), ctx);
    c.qb_estimator = io::get_or<std::string>(b, "estimator", "exact", ctx + " balance");
    c.qb_bins = io::get_or<int64_t>(b, "bins", 256, ctx + " balance");
    c.sign_gamma = io::get_or<double>(b, "gamma", 1e-3, ctx + " balance");
    c.aux_coef = io::get_or<double>(b, "aux_coef", 1e-2, ctx + " balance");
  }
  LM_CHECK(j.contains("stages") && j["stages"].is_array() && !j["stages"].empty(),
           "{}: 'stages' must be a non-empty array of {{seq_len, tokens, batch_seqs, schedule}}", ctx);
  for (size_t i = 0; i < j["stages"].size(); ++i) {
    const json& s = j["stages"][i];
    const std::string sctx = ctx + " stages[" + std::to_string(i) + "]";
    io::check_known_fields(s, {"seq_len", "tokens", "batch_seqs", "micro_seqs", "concat_documents", "schedule"}, sctx);
    StageConfig st;
    st.seq_len = io::get_required<int64_t>(s, "seq_len", sctx);
    st.tokens = io::get_required<int64_t>(s, "tokens", sctx);
    st.batch_seqs = io::get_or<int64_t>(s, "batch_seqs", 8, sctx);
    st.micro_seqs = io::get_or<int64_t>(s, "micro_seqs", 0, sctx);
    st.concat_documents = io::get_or<bool>(s, "concat_documents", false, sctx);
    if (s.contains("schedule")) st.schedule = ScheduleConfig::from_json(s["schedule"], sctx + " schedule");
    c.stages.push_back(st);
  }
  c.log_every = io::get_or<int64_t>(j, "log_every", 1, ctx);
  c.eval_every = io::get_or<int64_t>(j, "eval_every", 200, ctx);
  c.eval_batches = io::get_or<int64_t>(j, "eval_batches", 8, ctx);
  c.save_every = io::get_or<int64_t>(j, "save_every", 500, ctx);
  c.keep_checkpoints = io::get_or<int64_t>(j, "keep_checkpoints", 2, ctx);
  c.max_steps = io::get_or<int64_t>(j, "max_steps", 0, ctx);
  if (j.contains("eval_retrieval"))
    c.eval_retrieval = io::RetrievalOptions::from_json(j["eval_retrieval"], ctx + " eval_retrieval");
  if (j.contains("parallel")) {
    const json& p = j["parallel"];
    io::check_known_fields(p, {"dp", "ep", "cp", "zero", "bucket_mb", "ep_capacity"}, ctx + " parallel");
    c.parallel.dp = io::get_or<int64_t>(p, "dp", 1, ctx + " parallel");
    c.parallel.zero = static_cast<int>(io::get_or<int64_t>(p, "zero", 1, ctx + " parallel"));
    LM_CHECK(c.parallel.zero == 0 || c.parallel.zero == 1,
             "{}: parallel.zero must be 0 (a whole optimiser state per replica) or 1 (sharded), got {}", ctx,
             c.parallel.zero);
    c.parallel.ep = io::get_or<int64_t>(p, "ep", 1, ctx + " parallel");
    c.parallel.ep_capacity = io::get_or<double>(p, "ep_capacity", 0.0, ctx + " parallel");
    c.parallel.cp = io::get_or<int64_t>(p, "cp", 1, ctx + " parallel");
    c.parallel.bucket_mb = io::get_or<double>(p, "bucket_mb", c.parallel.bucket_mb, ctx + " parallel");
  }
  c.validate(ctx);
  return c;
}

std::vector<int64_t> RunConfig::stage_steps() const {
  std::vector<int64_t> r;
  for (const StageConfig& s : stages) r.push_back(s.steps());
  return r;
}

RunConfig RunConfig::load(const std::string& path) { return from_json(io::load_json_file(path), path); }

json RunConfig::to_json() const {
  json j;
  j["model"] = model;
  if (!init.empty()) j["init"] = init;
  j["data"] = {{"path", data},
               {"format", data_format},
               {"heldout_fraction", heldout_fraction},
               {"passkey_fraction", passkey_fraction}};
  if (multi_needle_fraction > 0) j["data"]["multi_needle_fraction"] = multi_needle_fraction;
  if (answer_weight != 1) j["data"]["answer_weight"] = answer_weight;
  if (!images.empty())
    j["data"]["images"] = {{"path", images}, {"size", image_size}, {"fraction", image_fraction}};
  j["tokenizer"] = {{"vocab_size", tokenizer_vocab}};
  if (!tokenizer.empty()) j["tokenizer"]["model"] = tokenizer;
  j["out"] = out;
  j["seed"] = seed;
  j["optimizer"] = optim.to_json();
  j["balance"] = {{"kind", balance_name(balance)}, {"estimator", qb_estimator}, {"bins", qb_bins},
                  {"gamma", sign_gamma}, {"aux_coef", aux_coef}};
  j["stages"] = json::array();
  for (const auto& s : stages)
    j["stages"].push_back({{"seq_len", s.seq_len},
                           {"tokens", s.tokens},
                           {"batch_seqs", s.batch_seqs},
                           {"micro_seqs", s.micro_seqs},
                           {"concat_documents", s.concat_documents},
                           {"schedule", s.schedule.to_json()}});
  j["log_every"] = log_every;
  j["eval_every"] = eval_every;
  j["eval_batches"] = eval_batches;
  j["save_every"] = save_every;
  j["keep_checkpoints"] = keep_checkpoints;
  j["max_steps"] = max_steps;
  if (parallel.dp != 1 || parallel.ep != 1 || parallel.zero != 1 || parallel.cp != 1) {
    j["parallel"] = {{"dp", parallel.dp}, {"ep", parallel.ep}, {"zero", parallel.zero}};
    if (parallel.cp != 1) j["parallel"]["cp"] = parallel.cp;
    j["parallel"]["bucket_mb"] = parallel.bucket_mb;
    if (parallel.ep_capacity != 0) j["parallel"]["ep_capacity"] = parallel.ep_capacity;
  }
  if (!eval_retrieval.empty()) j["eval_retrieval"] = eval_retrieval.to_json();
  return j;
}

void RunConfig::validate(const std::string& ctx) const {
  LM_CHECK(heldout_fraction > 0 && heldout_fraction < 0.5, "{}: data.heldout_fraction must be in (0, 0.5)", ctx);
  LM_CHECK(passkey_fraction >= 0 && passkey_fraction <= 0.9,
           "{}: data.passkey_fraction must be in [0, 0.9] (0: no synthetic passkey documents), got {}", ctx,
           passkey_fraction);
  LM_CHECK(multi_needle_fraction >= 0 && multi_needle_fraction <= 0.9 && synthetic_fraction() <= 0.9 + 1e-12,
           "{}: data.multi_needle_fraction must be in [0, 0.9] and at most 0.9 with data.passkey_fraction, got {} and "
           "{}", ctx, multi_needle_fraction, passkey_fraction);
  LM_CHECK(answer_weight >= 1 && answer_weight <= 1000, "{}: data.answer_weight must be in [1, 1000], got {}", ctx,
           answer_weight);
  LM_CHECK(answer_weight == 1 ||
               (synthetic_fraction() > 0 && parallel.cp == 1 && parallel.ep == 1 &&
                std::any_of(stages.begin(), stages.end(), [](const StageConfig& s) { return s.concat_documents; })),
           "{}: data.answer_weight weighs the answers of the passkey and multi-needle sequences of concat_documents "
           "stages: it needs data.passkey_fraction or data.multi_needle_fraction, a concat_documents stage, and no "
           "context or expert parallel", ctx);
  for (size_t i = 0; i < stages.size() && multi_needle_fraction > 0; ++i)
    LM_CHECK(stages[i].concat_documents, "{}: stages[{}]: data.multi_needle_fraction needs concat_documents in every "
             "stage (a multi-needle document fills a whole sequence)", ctx, i);
  if (!images.empty()) {
    LM_CHECK(image_fraction > 0 && image_fraction <= 0.9, "{}: data.images.fraction must be in (0, 0.9], got {}", ctx,
             image_fraction);
    LM_CHECK(image_size >= 28 && image_size <= 448 && image_size % 28 == 0,
             "{}: data.images.size must be a multiple of 28 in [28, 448], got {}", ctx, image_size);
    LM_CHECK(data_format != "chat" && synthetic_fraction() == 0 && parallel.dp == 1,
             "{}: data.images: a text corpus run of one process without passkey or multi-needle documents only (so "
             "far)", ctx);
    for (size_t i = 0; i < stages.size(); ++i) {
      const int64_t n_img = std::llround(image_fraction * double(stages[i].batch_seqs));
      LM_CHECK(n_img >= 1 && n_img < stages[i].batch_seqs && !stages[i].concat_documents,
               "{}: stages[{}]: data.images.fraction {} of batch_seqs {} must leave at least one image and one text "
               "sequence (and no concat_documents)",
               ctx, i, image_fraction, stages[i].batch_seqs);
    }
  }
  LM_CHECK(tokenizer_vocab >= 300 && tokenizer_vocab <= 1 << 20, "{}: tokenizer.vocab_size must be in [300, 2^20]",
           ctx);
  if (data_format == "chat") {
    LM_CHECK(!tokenizer.empty(), "{}: data.format chat (demonstrations) needs a tokenizer: init (a checkpoint to "
             "fine-tune) or tokenizer.model", ctx);
    LM_CHECK(synthetic_fraction() == 0, "{}: data.passkey_fraction and data.multi_needle_fraction must be 0 with "
             "data.format chat", ctx);
    for (size_t i = 0; i < stages.size(); ++i)  // conversations keep their segments: none attends to another
      LM_CHECK(!stages[i].concat_documents, "{}: stages[{}].concat_documents is not for data.format chat", ctx, i);
  } else {
    try {
      io::parse_corpus_format(data_format);
    } catch (const Error& e) {
      fail("{}: data.format: {} (or chat: demonstrations)", ctx, e.what());
    }
  }
  LM_CHECK(qb_estimator == "exact" || qb_estimator == "hist", "{}: balance.estimator must be exact or hist", ctx);
  LM_CHECK(qb_bins >= 2 && qb_bins % 2 == 0, "{}: balance.bins must be an even number >= 2", ctx);
  LM_CHECK(sign_gamma > 0 && aux_coef >= 0, "{}: balance.gamma must be > 0 and aux_coef >= 0", ctx);
  LM_CHECK(log_every >= 1 && eval_every >= 0 && save_every >= 0 && eval_batches >= 1 && keep_checkpoints >= 1 &&
               max_steps >= 0,
           "{}: log_every, eval_batches, keep_checkpoints must be >= 1; eval_every, save_every, max_steps >= 0", ctx);
  for (size_t i = 0; i < stages.size(); ++i) {
    const auto& s = stages[i];
    LM_CHECK(s.seq_len >= 2 && s.tokens > 0 && s.batch_seqs >= 1 && s.micro_seqs >= 0 && s.micro_seqs <= s.batch_seqs,
             "{}: stages[{}] needs seq_len >= 2, tokens > 0, batch_seqs >= 1, 0 <= micro_seqs <= batch_seqs", ctx, i);
    LM_CHECK(s.micro_seqs == 0 || s.batch_seqs % s.micro_seqs == 0,
             "{}: stages[{}]: batch_seqs ({}) must be a multiple of micro_seqs ({})", ctx, i, s.batch_seqs,
             s.micro_seqs);
    LM_CHECK(s.batch_seqs % parallel.dp == 0 && s.replica_seqs(parallel.dp) % s.replica_micro(parallel.dp) == 0,
             "{}: stages[{}]: with parallel.dp {} each replica runs batch_seqs / dp sequences per step, which must "
             "be whole (batch_seqs {}) and a multiple of micro_seqs ({}) when larger",
             ctx, i, parallel.dp, s.batch_seqs, s.micro_seqs);
  }
  LM_CHECK(parallel.dp >= 1 && parallel.dp <= 65536, "{}: parallel.dp must be in [1, 65536], got {}", ctx,
           parallel.dp);
  LM_CHECK(parallel.cp >= 1 && parallel.cp <= 65536, "{}: parallel.cp must be in [1, 65536], got {}", ctx,
           parallel.cp);
  LM_CHECK(parallel.bucket_mb > 0 && parallel.bucket_mb <= 65536,
           "{}: parallel.bucket_mb (MiB of gradients per all-reduce) must be in (0, 65536], got {}", ctx,
           parallel.bucket_mb);
  LM_CHECK(parallel.ep >= 1 && parallel.dp % parallel.ep == 0,
           "{}: parallel.ep {} must divide parallel.dp {} (groups of ep replicas share the experts)", ctx, parallel.ep,
           parallel.dp);
  LM_CHECK(parallel.ep_capacity >= 0 && std::isfinite(parallel.ep_capacity),
           "{}: parallel.ep_capacity must be >= 0 (0: no token is ever dropped), got {}", ctx, parallel.ep_capacity);
  LM_CHECK(parallel.ep == 1 || parallel.zero == 1, "{}: parallel.ep {} shards the experts' optimiser state with them: "
           "it needs zero 1", ctx, parallel.ep);
  if (parallel.cp > 1) {
    // What the context-parallel model and step support so far (Model::set_context_parallel): one group of cp ranks
    // over whole sequences of one document window each, no media, no batch-dependent auxiliary loss.
    LM_CHECK(parallel.dp == 1, "{}: parallel dp {} x cp {}: context parallel runs with dp 1 only so far (one group "
             "of cp ranks, each with its segment of every sequence)", ctx, parallel.dp, parallel.cp);
    LM_CHECK(images.empty() && synthetic_fraction() == 0 && data_format != "chat",
             "{}: parallel.cp {}: a text corpus without synthetic documents only (images, passkey and multi-needle "
             "documents and chat segments are not split over ranks)", ctx, parallel.cp);
    LM_CHECK(balance != Balance::Aux, "{}: parallel.cp {}: balance aux is a statistic of the whole batch, which no "
             "rank sees; use qb, sign or none", ctx, parallel.cp);
    for (size_t i = 0; i < stages.size(); ++i)
      LM_CHECK(stages[i].concat_documents && stages[i].seq_len % parallel.cp == 0,
               "{}: stages[{}]: parallel.cp {} splits every sequence into cp segments: it needs concat_documents (no "
               "document boundary inside a sequence: packed batches are not split) and seq_len ({}) a multiple of cp",
               ctx, i, parallel.cp, stages[i].seq_len);
  }
}

// ---- the run ---------------------------------------------------------------------------------

namespace {

// The expert-parallel layout against the model: lm::Error unless its MoE layers' experts split over ep ranks.
void check_expert_parallel(const RunConfig& cfg, const model::ModelConfig& m) {
  if (cfg.parallel.ep == 1) return;
  LM_CHECK(m.num_moe_layers() > 0 && m.num_experts % cfg.parallel.ep == 0,
           "{}: parallel.ep {} must divide the {} routed experts of the MoE layers (the model has {} MoE layers)",
           cfg.model, cfg.parallel.ep, m.num_experts, m.num_moe_layers());
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

// One curriculum stage as this process runs it.
struct Stage {
  int64_t index;
  const StageConfig& cfg;
  int64_t per_step;  // tokens per step, B·T
  int64_t steps;
  int64_t micro;     // sequences per micro-batch
  Schedule sched;
  int64_t first;     // the first step run here (non-zero when resumed inside the stage)
  Clock::time_point t0;
};

// One optimiser step, for the log.
struct StepReport {
  double loss = 0, aux_loss = 0, seconds = 0;
  int64_t ep_dropped = 0;
  StepInfo info;
  std::vector<double> maxvio;  // per MoE layer
  double maxvio_worst = 0;
};

// A run between its steps: the data, the host model and optimiser, the engine, the position in the
// curriculum and the training stream, the files. train() below is its main loop.
class Run {
 public:
  // The run folder, the resume point, data and tokenizer, model and engine, the loader, metrics.jsonl.
  Run(const RunConfig& cfg, const TrainOptions& opt, Clock::time_point t_start);
  int64_t first_stage() const { return start_.stage; }
  Stage begin_stage(int64_t si);
  bool stop_requested();                                 // max_steps reached, or SIGINT/SIGTERM
  StepReport train_step(const Stage& st, int64_t step);  // batch -> forward_backward -> step -> balance
  void log_step(const Stage& st, int64_t step, const StepReport& r);
  void eval_and_save(const Stage& st, int64_t step);     // the periodic ones
  // After the stage's step loop ended at `step` (< steps: stopped inside the stage). False: the run ends.
  bool end_stage(const Stage& st, int64_t step);
  TrainResult finish();                                  // the result and summary.json

 private:
  void say(const std::string& s) const {
    if (writer_ && !opt_.quiet) std::printf("%s\n", s.c_str()), std::fflush(stdout);
  }
  void load_model();
  void report_passkey(const StageConfig& S);
  double evaluate(int64_t seq_len, int64_t max_batches);
  void save(int64_t stage, int64_t step_in_stage, const std::string& also_as);

  const RunConfig& cfg_;
  const TrainOptions& opt_;
  dist::Comm& comm_;   // the job's processes: data-parallel replicas that run the same steps on their shards
  const bool writer_;  // rank 0: the one that writes the run folder and logs
  // Expert parallel: this rank's group (its ranks hold every expert once between them) and the replicas holding
  // the same experts as this one.
  std::unique_ptr<dist::Comm> ep_comm_, edp_comm_;
  const Clock::time_point t_start_;
  const fs::path out_;
  const bool tty_;
  std::string resume_dir_;  // the checkpoint resumed ("" for a new run)
  std::unique_ptr<RunData> data_;
  model::ModelConfig mcfg_;
  std::unique_ptr<model::Model<float>> model_;
  std::unique_ptr<Optimizer> optim_;
  std::unique_ptr<Engine> engine_;
  // Where this process started, and where it is: global_step, tokens, data_stage and data_fingerprint
  // are kept up to date (stage, step_in_stage and position are filled in by save()).
  TrainerState start_, at_;
  std::unique_ptr<Loader> loader_;
  std::unique_ptr<CaptionData> captions_;  // with data.images
  std::unique_ptr<MetricsLog> metrics_;
  TrainResult result_;
  std::string last_ckpt_;
  double tok_rate_ = 0;  // tokens/s, smoothed over the steps
  int64_t stage_tokens_ = 0;
};

Run::Run(const RunConfig& cfg, const TrainOptions& opt, Clock::time_point t_start)
    : cfg_(cfg),
      opt_(opt),
      comm_(opt.comm ? *opt.comm : dist::world()),
      writer_(comm_.rank() == 0),
      t_start_(t_start),
      out_(cfg.out),
      tty_(writer_ && !opt.quiet && isatty(STDERR_FILENO)) {
  fs::create_directories(out_);
  if (!opt.resume) {
    const std::vector<std::string> markers = run_markers(out_);
    std::string other;
    for (const std::string& m : markers) other += (other.empty() ? "" : ", ") + m;
    if (!markers.empty() && opt.overwrite) {
      say(fmt::format("--overwrite: removing the run in {} ({})", out_.string(), other));
      if (writer_) clear_run(out_);
    } else {
      LM_CHECK(markers.empty(), "'{}' already holds a run ({}): continue it with --resume, start over with "
               "--overwrite (removes its checkpoints, metrics and summary), or train into another --out",
               out_.string(), other);
    }
  }
  // The resume point first: a resumed run must use the tokenizer it started with.
  io::json state;
  if (opt.resume) {
    resume_dir_ = resolve_checkpoint(out_.string());
    state = io::load_json_file((fs::path(resume_dir_) / "trainer_state.json").string());
    say(fmt::format("resuming from {}", resume_dir_));
  }
  // Every rank has checked the folder; rank 0 prepares the data first (it may train the tokenizer into the run
  // folder), the others then read its tokenizer.
  comm_.barrier();
  auto make_data = [&] {
    data_ = std::make_unique<RunData>(cfg, out_, resume_dir_, [this](const std::string& s) { say(s); }, writer_);
  };
  if (writer_) make_data();
  comm_.barrier();
  if (!writer_) make_data();
  load_model();
  if (resume_dir_.empty())
    at_.data_fingerprint = data_->stage_fingerprint(0);
  else
    at_ = read_trainer_state(state, resume_dir_ + "/trainer_state.json", cfg.stage_steps(),
                             [this](int64_t si) { return data_->stage_fingerprint(si); },
                             !summary_of_step(out_, io::get_or<int64_t>(state, "global_step", -1, "trainer state")));
  start_ = at_;
  // A stage-end checkpoint (the next stage's step 0): a kill during its stage link may have left the link half made.
  if (writer_ && !resume_dir_.empty() && at_.stage > 0 && at_.step_in_stage == 0 &&
      relink_stage_if_needed(out_, resume_dir_, fmt::format("stage-{}", at_.stage - 1)))
    say(fmt::format("relinked stage-{} (its link was not complete)", at_.stage - 1));
  // (a finished run resumed for its summary stands past the last stage: the loader is never read then)
  const size_t ls = std::min(static_cast<size_t>(at_.stage), cfg.stages.size() - 1);
  loader_ = std::make_unique<Loader>(data_->train, cfg.stages[ls].seq_len, cfg.seed, at_.position,
                                     data_->passkey_docs(at_.data_stage));
  // A resumed run first drops the metrics lines written after its checkpoint.
  if (writer_) metrics_ = std::make_unique<MetricsLog>(out_ / "metrics.jsonl", !resume_dir_.empty(), at_.global_step);
  result_.first_step = at_.global_step;
  last_ckpt_ = resume_dir_;
}

// The model config trained (vocab_size from the tokenizer) and the run config, written to the run folder; the
// host model and optimiser (initialised, or the resumed checkpoint's), and the engine over them.
void Run::load_model() {
  mcfg_ = model::ModelConfig::load(cfg_.model);
  if (mcfg_.vocab_size != data_->tok->vocab_size()) {
    say(fmt::format("model: vocab_size {} -> {} (the tokenizer's)", mcfg_.vocab_size, data_->tok->vocab_size()));
    mcfg_.vocab_size = data_->tok->vocab_size();
  }
  // The tokenizer's special ids: without them HF transformers falls back to Kimi's (163839), outside a small
  // vocabulary, and cannot build the model.
  const io::Tokenizer& tok = *data_->tok;
  for (auto [field, id] : {std::pair{&mcfg_.bos_token_id, tok.bos()}, std::pair{&mcfg_.eos_token_id, tok.eos()},
                           std::pair{&mcfg_.pad_token_id, tok.pad()}})
    *field = id >= 0 ? io::json(id) : io::json();
  if (!cfg_.images.empty()) {  // the tokenizer's <|image|> is the placeholder the splice replaces (SPEC §9)
    LM_CHECK(mcfg_.vision.has_value(), "{}: data.images needs a model config with vision_config", cfg_.model);
    mcfg_.vision->media_placeholder_token_id = tok.special("<|image|>");
  }
  mcfg_.validate(cfg_.model);
  if (!cfg_.images.empty()) {
    const auto t0 = Clock::now();
    captions_ = std::make_unique<CaptionData>(io::read_fashion_mnist(cfg_.images, "train"), tok, mcfg_,
                                              cfg_.image_size, cfg_.seed);
    const int64_t longest = captions_->longest_document();
    int64_t shortest_seq = cfg_.stages.front().seq_len;
    for (const auto& S : cfg_.stages) shortest_seq = std::min(shortest_seq, S.seq_len);
    LM_CHECK(longest <= shortest_seq, "{}: an image document takes up to {} tokens, more than seq_len {}", cfg_.images,
             longest, shortest_seq);
    say(fmt::format("images: {} labelled {}x{} images from {} in {:.1f}s, upscaled to {}x{} ({} feature rows each), "
                    "{:.0f}% of every step's sequences",
                    captions_->images().n, captions_->images().rows, captions_->images().cols, cfg_.images,
                    seconds_since(t0), cfg_.image_size, cfg_.image_size, captions_->rows_per_image(),
                    100 * cfg_.image_fraction));
  }
  if (writer_) {
    mcfg_.save((out_ / "config.json").string());
    io::write_file_atomic((out_ / "run.json").string(), cfg_.to_json().dump(2) + "\n");
  }
  // Expert parallel: replicas [g·ep, (g+1)·ep) share the experts (group g), and the replicas of the same place in
  // every group hold the same ones.
  model::ExpertShard shard;
  if (cfg_.parallel.ep > 1) {
    LM_CHECK(opt_.device == "cpu", "parallel.ep: expert parallelism runs on the CPU only so far");
    check_expert_parallel(cfg_, mcfg_);
    const int ep = static_cast<int>(cfg_.parallel.ep);
    ep_comm_ = comm_.split(comm_.rank() / ep, comm_.rank());
    edp_comm_ = comm_.split(comm_.rank() % ep, comm_.rank());
    const int64_t El = mcfg_.num_experts / ep;
    shard = {ep_comm_->rank() * El, El};
  }
  model_ = std::make_unique<model::Model<float>>(mcfg_, shard);
  if (ep_comm_) model_->set_expert_parallel(ep_comm_.get(), cfg_.parallel.ep_capacity);
  if (cfg_.parallel.cp > 1) {
    LM_CHECK(opt_.device == "cpu", "parallel.cp: context parallelism runs on the CPU only so far");
    model_->set_context_parallel(&comm_);  // (dp 1: the job's ranks are the one context-parallel group)
  }
  const auto counts = model::count_params(mcfg_);
  const fs::path resume(resume_dir_);
  if (!resume_dir_.empty()) {
    model_->params().load(io::Checkpoint::open(resume.string()));  // (one file, or the index of its shards)
  } else if (!cfg_.init.empty()) {  // fine-tuning: the weights of another run, checked against this config first
    const io::Checkpoint ckpt = io::Checkpoint::open(cfg_.init);
    model::check_checkpoint(model::param_specs(mcfg_), ckpt);
    model_->params().load(ckpt);
    say(fmt::format("init: the weights of {}", cfg_.init));
  } else {
    model_->params().init(cfg_.seed);
  }
  model_->params().enable_grads();
  optim_ = std::make_unique<Optimizer>(model_->params(), mcfg_, cfg_.optim);
  if (ep_comm_) optim_->set_expert_parallel(*ep_comm_, *edp_comm_);
  if (cfg_.parallel.zero == 1) optim_->shard(comm_);  // (one process: nothing)
  if (!resume_dir_.empty()) optim_->load_state(optimizer_files(resume));
  engine_ = make_engine(opt_.device, cfg_, *model_, *optim_, comm_, edp_comm_.get());
  const std::string vision = mcfg_.vision ? fmt::format(" + {:.2f}M vision tower and projector",
                                                         model::count_vision_params(*mcfg_.vision).total() / 1e6)
                                          : std::string();
  say(fmt::format("model: {:.2f}M parameters{}, {:.2f}M activated; {} layers ({} KDA, {} MLA), {} MoE layers, "
                  "balance {}; {}",
                  counts.total / 1e6, vision, counts.activated / 1e6, mcfg_.num_hidden_layers, mcfg_.num_kda_layers(),
                  mcfg_.num_mla_layers(), mcfg_.num_moe_layers(), balance_name(cfg_.balance), engine_->where()));
}

Stage Run::begin_stage(int64_t si) {
  const StageConfig& S = cfg_.stages[si];
  const int64_t per_step = S.batch_seqs * S.seq_len;
  const int64_t steps = S.steps();
  const int64_t micro = S.micro_seqs ? S.micro_seqs : S.batch_seqs;
  const int64_t first = si == start_.stage ? start_.step_in_stage : 0;
  Stage st{si, S, per_step, steps, micro, Schedule(S.schedule, steps), first, {}};
  if (data_->passkey && at_.data_stage != si) {  // this stage's documents, at its seq_len; the corpus continues
    loader_->set_extra(data_->passkey_docs(si));
    at_.data_stage = si;
    at_.data_fingerprint = data_->stage_fingerprint(si);
  }
  loader_->set_seq_len(S.seq_len);
  data_->set_concat(*loader_, si);
  say(fmt::format("stage {}/{}: seq_len {}, {} steps of {} x {} tokens ({} micro-batches), schedule {}", si + 1,
                  cfg_.stages.size(), S.seq_len, steps, S.batch_seqs, S.seq_len, S.batch_seqs / st.micro,
                  S.schedule.kind));
  if (const std::string m = engine_->plan(st.micro * S.seq_len); !m.empty()) say("  " + m);
  if (cfg_.synthetic_fraction() > 0) report_passkey(S);
  st.t0 = Clock::now();
  stage_tokens_ = 0;
  return st;
}

// The share of the stage's synthetic documents (passkey; multi-needle in concat stages) in its training stream.
void Run::report_passkey(const StageConfig& S) {
  if (S.concat_documents) {
    // (expected shares: a chosen sequence holds a document of 3/4 of its tokens on average)
    result_.stage_passkey_token_fraction.push_back(0.75 * cfg_.passkey_fraction);
    result_.stage_passkey_doc_fraction.push_back(cfg_.passkey_fraction);
    say(fmt::format("  documents concatenated; {:.1f}% of the sequences are one passkey document and {:.1f}% one "
                    "multi-needle document ({} facts), of {}..{} tokens",
                    100 * cfg_.passkey_fraction, 100 * cfg_.multi_needle_fraction, kTrainNeedles, S.seq_len / 2,
                    S.seq_len));
    return;
  }
  const TokenizedDocs &pk = data_->stage_pk, &corpus = *data_->train;
  const double tok_frac = static_cast<double>(pk.tokens()) / static_cast<double>(pk.tokens() + corpus.tokens());
  const double doc_frac =
      static_cast<double>(pk.num_docs()) / static_cast<double>(pk.num_docs() + corpus.num_docs());
  int64_t lo = S.seq_len, hi = 0;
  for (int64_t d = 0; d < pk.num_docs(); ++d) {
    const auto n = static_cast<int64_t>(pk.doc(d).size());
    lo = std::min(lo, n), hi = std::max(hi, n);
  }
  result_.stage_passkey_token_fraction.push_back(tok_frac);
  result_.stage_passkey_doc_fraction.push_back(doc_frac);
  say(fmt::format("  passkey: {} synthetic documents of {}..{} tokens per epoch: {:.1f}% of the training tokens, "
                  "{:.1f}% of the documents (made in {:.1f}s)",
                  pk.num_docs(), lo, hi, 100 * tok_frac, 100 * doc_frac, data_->stage_pk_seconds));
}

bool Run::stop_requested() {
  // Collective: every replica stops after the same step (a signal may reach them at different moments).
  int64_t interrupted = interrupt_requested() ? 1 : 0;
  comm_.all_reduce_sum(&interrupted, 1);
  if (interrupted > 0) result_.interrupted = true;
  return (cfg_.max_steps > 0 && at_.global_step >= cfg_.max_steps) || result_.interrupted;
}

StepReport Run::train_step(const Stage& st, int64_t step) {
  const auto t0 = Clock::now();
  // The step's micro-batches, fetched first: the loss is normalised by their total target count.
  // One batch of all B sequences (the loader's lanes are defined by B), then split: accumulation
  // sees exactly the sequences of the unaccumulated step.
  // Data parallel: every replica reads the same batch and runs its shard, sequences [r·B/dp, (r+1)·B/dp).
  // With images: round(image_fraction · B) of the B sequences are captioned images (one micro-batch of their own,
  // drawn for this global step), the others the corpus' lanes.
  std::vector<Batch> mb;
  const int64_t n_img = captions_ ? std::llround(cfg_.image_fraction * double(st.cfg.batch_seqs)) : 0;
  const int64_t n_text = st.cfg.batch_seqs - n_img;
  Batch whole = loader_->next(n_text);
  ImageBatch img;
  if (n_img > 0) img = captions_->batch(static_cast<uint64_t>(at_.global_step), n_img, st.cfg.seq_len);
  // The model's count: it also drops targets that name the media placeholder (SPEC §9).
  const int64_t n_valid = model_->count_targets(whole.targets.data(), static_cast<int64_t>(whole.targets.size())) +
                          model_->count_targets(img.batch.targets.data(), img.batch.tokens());
  const int64_t shard = st.cfg.replica_seqs(cfg_.parallel.dp), first = comm_.rank() / cfg_.parallel.cp * shard;
  const int64_t micro = st.cfg.replica_micro(cfg_.parallel.dp);
  if (micro >= n_text && n_img == 0) {
    mb.push_back(std::move(whole));
  } else if (n_img > 0) {  // (one process: validate)
    for (int64_t b = 0; b < n_text; b += micro) mb.push_back(whole.sequences(b, std::min(micro, n_text - b)));
  } else {
    for (int64_t b = first; b < first + shard; b += micro) mb.push_back(whole.sequences(b, micro));
  }
  // Context parallel: every rank its segment of each sequence; n_valid stays the whole step's.
  if (cfg_.parallel.cp > 1)
    for (Batch& b : mb) b = b.segment(comm_.rank() % cfg_.parallel.cp, cfg_.parallel.cp);

  StepReport r;
  double loss_sum = 0;
  try {
    engine_->zero_grads(static_cast<int64_t>(mb.size()) + (n_img > 0 ? 1 : 0));
    for (const Batch& b : mb) loss_sum += engine_->forward_backward(b, n_valid).loss_sum;
    if (n_img > 0) loss_sum += engine_->forward_backward(img.batch, n_valid, &img.media).loss_sum;
    comm_.all_reduce_sum(&loss_sum, 1);
    r.info = engine_->step(st.sched.factor_at(step));  // (sums the replicas' gradients first)
  } catch (const NonFinite& e) {
    fail("step {}: {}. Stopping; the last checkpoint is {}", at_.global_step, e.what(),
         last_ckpt_.empty() ? "none" : last_ckpt_);
  }
  engine_->balance();  // the new biases are installed for the next step
  r.loss = loss_sum / static_cast<double>(std::max<int64_t>(n_valid, 1));
  r.aux_loss = engine_->aux_loss();
  r.ep_dropped = engine_->ep_dropped();
  result_.ep_dropped += r.ep_dropped;
  for (const auto& l : engine_->expert_loads())
    r.maxvio.push_back(ops::max_violation(l.data(), static_cast<int64_t>(l.size())));

  ++at_.global_step;
  at_.tokens += st.per_step;
  stage_tokens_ += st.per_step;
  result_.losses.push_back(r.loss);
  result_.final_train_loss = r.loss;
  r.seconds = seconds_since(t0);
  result_.train_seconds += r.seconds;
  tok_rate_ = tok_rate_ == 0 ? st.per_step / r.seconds : 0.9 * tok_rate_ + 0.1 * st.per_step / r.seconds;
  for (double v : r.maxvio) r.maxvio_worst = std::max(r.maxvio_worst, v);
  if (!r.maxvio.empty()) result_.maxvio_worst.push_back(r.maxvio_worst);
  return r;
}

// A metrics line (every log_every steps and at the stage's last) and the progress line: rewritten in place on a
// terminal, else about 20 lines per stage.
void Run::log_step(const Stage& st, int64_t step, const StepReport& r) {
  if (at_.global_step % cfg_.log_every == 0 || step + 1 == st.steps) {
    json row = {{"step", at_.global_step}, {"stage", st.index},      {"tokens", at_.tokens},
                {"loss", r.loss},          {"lr", r.info.lr_adamw},  {"lr_muon", r.info.lr_muon},
                {"grad_norm", r.info.grad_norm}, {"tok_per_s", st.per_step / r.seconds}, {"maxvio", r.maxvio},
                {"elapsed", seconds_since(t_start_)}};
    if (cfg_.balance == Balance::Aux) row["aux_loss"] = r.aux_loss;
    if (cfg_.parallel.ep > 1) row["ep_dropped"] = r.ep_dropped;
    if (r.info.buckets > 0)  // several ranks: how much of the gradient reduction ran under the backward
      row["grad_buckets"] = {{"n", r.info.buckets}, {"in_backward", r.info.buckets_early},
                             {"hidden", r.info.buckets_hidden}, {"wait_s", r.info.reduce_wait_s}};
    if (metrics_) metrics_->write(row);
  }
  const bool every_20th = (step + 1) % std::max<int64_t>(1, st.steps / 20) == 0 || step + 1 == st.steps;
  if (!writer_ || (!tty_ && (opt_.quiet || !every_20th))) return;
  const double eta = (st.steps - step - 1) * st.per_step / std::max(tok_rate_, 1e-9);
  char line[1024];
  std::snprintf(line, sizeof line,
                "[stage %ld/%zu T=%ld] step %ld/%ld  loss %.4f  %.0f tok/s  lr %.2e  maxvio %.3f  ETA %s",
                static_cast<long>(st.index + 1), cfg_.stages.size(), static_cast<long>(st.cfg.seq_len),
                static_cast<long>(step + 1), static_cast<long>(st.steps), r.loss, tok_rate_, r.info.lr_adamw,
                r.maxvio_worst, fmt_duration(eta).c_str());
  if (tty_) {
    std::fprintf(stderr, "\r%s   ", line);
  } else {
    std::printf("%s\n", line);
    std::fflush(stdout);
  }
}

void Run::eval_and_save(const Stage& st, int64_t step) {
  const bool inside = step + 1 < st.steps;  // the stage's end evaluates and saves anyway
  if (cfg_.eval_every > 0 && at_.global_step % cfg_.eval_every == 0 && inside) {
    const double el = evaluate(st.cfg.seq_len, cfg_.eval_batches);
    if (metrics_) metrics_->write(
        json{{"step", at_.global_step}, {"stage", st.index}, {"eval_loss", el}, {"eval_ppl", std::exp(el)}});
  }
  if (cfg_.save_every > 0 && at_.global_step % cfg_.save_every == 0 && inside) save(st.index, step + 1, "");
}

bool Run::end_stage(const Stage& st, int64_t step) {
  if (tty_) std::fprintf(stderr, "\n");
  if (step < st.steps) {  // a partial stage: checkpoint where it stopped, so --resume continues from here
    save(st.index, step, "");
    if (result_.interrupted)
      say(fmt::format("interrupted at step {}: checkpoint {} saved; continue with --resume", at_.global_step,
                      last_ckpt_));
    return false;
  }
  // Stage end: held-out perplexity over the whole split, then the stage's checkpoint.
  const double stage_s = seconds_since(st.t0);
  const double el = evaluate(st.cfg.seq_len, 0);
  if (metrics_) metrics_->write(json{{"step", at_.global_step}, {"stage", st.index}, {"eval_loss", el}, {"eval_ppl", std::exp(el)},
                       {"stage_end", true}});
  say(fmt::format("stage {} done: {} tokens in {}, {:.0f} tok/s; held-out loss {:.4f}, ppl {:.2f} (unigram ppl "
                  "{:.2f})",
                  st.index + 1, stage_tokens_, fmt_duration(stage_s), stage_tokens_ / std::max(stage_s, 1e-9), el,
                  std::exp(el), std::exp(data_->unigram_ce)));
  if (const double used = engine_->device_memory_in_use(); used >= 0)
    say(fmt::format("  device memory in use at the stage's end: {:.1f} GiB (the plan above predicted the step's peak)",
                    used / 1073741824.0));
  result_.heldout_loss = el;
  result_.heldout_ppl = std::exp(el);
  result_.stage_heldout_ppl.push_back(std::exp(el));
  save(st.index + 1, 0, fmt::format("stage-{}", st.index));
  return !(cfg_.max_steps > 0 && at_.global_step >= cfg_.max_steps);
}

TrainResult Run::finish() {
  if (start_.stage == static_cast<int64_t>(cfg_.stages.size())) {  // resumed after the last stage's checkpoint
    const double el = evaluate(cfg_.stages.back().seq_len, 0);
    result_.heldout_loss = el;
    result_.heldout_ppl = std::exp(el);
    say(fmt::format("the run had finished its last stage but not written its summary; held-out loss {:.4f}, ppl "
                    "{:.2f}: summary written now", el, std::exp(el)));
  }
  result_.steps = at_.global_step;
  result_.tokens = at_.tokens;
  result_.unigram_ppl = std::exp(data_->unigram_ce);
  result_.tokens_per_s = result_.train_seconds > 0
                             ? static_cast<double>(at_.tokens - start_.tokens) / result_.train_seconds
                             : tok_rate_;
  result_.checkpoint = last_ckpt_;
  if (writer_ && !result_.interrupted) write_summary(out_, cfg_, result_);
  say(fmt::format("done: {} steps, {} tokens in {}; checkpoint {}", at_.global_step, at_.tokens,
                  fmt_duration(seconds_since(t_start_)), last_ckpt_));
  return std::move(result_);
}

// Mean loss over the held-out batches of seq_len tokens (max_batches 0: the whole split).
double Run::evaluate(int64_t seq_len, int64_t max_batches) {
  const int64_t B = std::max<int64_t>(1, std::min<int64_t>(8, 8192 / seq_len));
  const int32_t pad = data_->tok->pad() >= 0 ? data_->tok->pad() : 0;
  double sum = 0;
  int64_t n = 0;
  for (const auto& b : eval_batches(data_->heldout, seq_len, B, pad, max_batches)) {
    const LossStats st = engine_->loss(b);
    sum += st.loss_sum, n += st.n_valid;
  }
  return n > 0 ? sum / static_cast<double>(n) : NAN;
}

void Run::save(int64_t stage, int64_t step_in_stage, const std::string& also_as) {
  engine_->sync_to_host();
  // The replicas hold the same weights: rank 0 writes the checkpoint (with experts sharded, the ranks of its
  // expert-parallel group one model shard each), every rank its optimiser shard (ZeRO-1).
  TrainerState st = at_;
  st.stage = stage, st.step_in_stage = step_in_stage, st.position = loader_->position();
  CheckpointContent c{mcfg_, data_->tokenizer_file(), model_->params(), *optim_, &comm_, cfg_.parallel.zero == 1};
  c.experts = ep_comm_.get();  // (expert parallel: the first group's ranks write the model, one shard each)
  c.writes_experts = edp_comm_ && edp_comm_->rank() == 0;
  last_ckpt_ = save_checkpoint(out_, c, st, cfg_.keep_checkpoints, also_as);
}

}  // namespace

TrainResult train(const RunConfig& cfg, const TrainOptions& opt) {
  const auto t_start = Clock::now();
  check_device(opt.device, cfg);  // first: nothing is written (no run folder, no tokenizer) for a run that cannot start
  if (cfg.parallel.cp > 1) cfg.validate("train");  // (a config built in code: its cp layout checked as a file's is)
  if (cfg.parallel.ep > 1) check_expert_parallel(cfg, model::ModelConfig::load(cfg.model));
  const dist::Comm& comm = opt.comm ? *opt.comm : dist::world();
  LM_CHECK(comm.size() == cfg.parallel.world(),
           "train: the run config asks for {} process(es) (parallel.dp {} x parallel.cp {}) but this job has {} ({}); "
           "start it with mpirun -np {} or set parallel.dp (or cp) to the job's size",
           cfg.parallel.world(), cfg.parallel.dp, cfg.parallel.cp, comm.size(), comm.name(), cfg.parallel.world());
  const InterruptScope interrupt_scope;
  Run run(cfg, opt, t_start);  // run folder, resume point, data and tokenizer, model and engine, metrics
  for (int64_t si = run.first_stage(); si < static_cast<int64_t>(cfg.stages.size()); ++si) {
    const Stage st = run.begin_stage(si);
    int64_t step = st.first;
    for (; step < st.steps && !run.stop_requested(); ++step) {
      const StepReport r = run.train_step(st, step);  // batch -> forward_backward -> step -> balance
      run.log_step(st, step, r);
      run.eval_and_save(st, step);
    }
    if (!run.end_stage(st, step)) break;  // stopped inside the stage, or max_steps reached at its end
  }
  return run.finish();
}

BalanceSummary summarize_balance(const TrainResult& r, double below, int64_t after) {
  BalanceSummary b;
  std::vector<double> tail;
  for (size_t i = 0; i < r.maxvio_worst.size(); ++i) {
    const int64_t step = r.first_step + static_cast<int64_t>(i) + 1;  // 1-based global step
    if (b.first_step_below < 0 && r.maxvio_worst[i] < below) b.first_step_below = step;
    if (step > after) tail.push_back(r.maxvio_worst[i]);
  }
  if (tail.empty()) {
    b.median_after = b.max_after = std::nan("");
    return b;
  }
  b.max_after = *std::max_element(tail.begin(), tail.end());
  std::nth_element(tail.begin(), tail.begin() + tail.size() / 2, tail.end());
  b.median_after = tail[tail.size() / 2];
  return b;
}

}  // namespace lm::train
