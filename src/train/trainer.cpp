// The training loop (issue "Training on CPU"): data -> tokenizer -> model -> optimiser, Quantile
// Balancing (or a baseline) per MoE layer per step, a staged context curriculum, metrics JSONL,
// held-out evaluation, atomic checkpoints and exact resume.
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
#include <csignal>
#include <cstdlib>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <sstream>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "io/checkpoint.hpp"
#include "io/corpus.hpp"
#include "io/safetensors.hpp"
#include "io/tokenizer.hpp"
#include "model/accounting.hpp"
#include "model/cuda/gpu_model.hpp"
#include "model/model.hpp"
#include "train/cuda/adamw.hpp"
#include "train/data.hpp"
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
const char* balance_name(Balance b) {
  switch (b) {
    case Balance::QB: return "qb";
    case Balance::Sign: return "sign";
    case Balance::Aux: return "aux";
    case Balance::None: return "none";
  }
  return "?";
}

}  // namespace

RunConfig RunConfig::from_json(const json& j, const std::string& ctx) {
  io::check_known_fields(j,
              {"model", "data", "tokenizer", "out", "seed", "optimizer", "balance", "stages", "log_every",
               "eval_every", "eval_batches", "save_every", "keep_checkpoints", "max_steps", "comment"},
              ctx);
  RunConfig c;
  c.model = io::get_required<std::string>(j, "model", ctx);
  const json& d = j.at("data");
  io::check_known_fields(d, {"path", "format", "heldout_fraction", "passkey_fraction"}, ctx + " data");
  c.data = io::get_required<std::string>(d, "path", ctx + " data");
  c.data_format = io::get_or<std::string>(d, "format", "auto", ctx + " data");
  c.heldout_fraction = io::get_or<double>(d, "heldout_fraction", 0.05, ctx + " data");
  c.passkey_fraction = io::get_or<double>(d, "passkey_fraction", 0.0, ctx + " data");
  if (j.contains("tokenizer")) {
    const json& t = j["tokenizer"];
    io::check_known_fields(t, {"vocab_size", "model"}, ctx + " tokenizer");
    c.tokenizer_vocab = io::get_or<int>(t, "vocab_size", 4096, ctx + " tokenizer");
    c.tokenizer = io::get_or<std::string>(t, "model", "", ctx + " tokenizer");
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
    io::check_known_fields(s, {"seq_len", "tokens", "batch_seqs", "micro_seqs", "schedule"}, sctx);
    StageConfig st;
    st.seq_len = io::get_required<int64_t>(s, "seq_len", sctx);
    st.tokens = io::get_required<int64_t>(s, "tokens", sctx);
    st.batch_seqs = io::get_or<int64_t>(s, "batch_seqs", 8, sctx);
    st.micro_seqs = io::get_or<int64_t>(s, "micro_seqs", 0, sctx);
    if (s.contains("schedule")) st.schedule = ScheduleConfig::from_json(s["schedule"], sctx + " schedule");
    c.stages.push_back(st);
  }
  c.log_every = io::get_or<int64_t>(j, "log_every", 1, ctx);
  c.eval_every = io::get_or<int64_t>(j, "eval_every", 200, ctx);
  c.eval_batches = io::get_or<int64_t>(j, "eval_batches", 8, ctx);
  c.save_every = io::get_or<int64_t>(j, "save_every", 500, ctx);
  c.keep_checkpoints = io::get_or<int64_t>(j, "keep_checkpoints", 2, ctx);
  c.max_steps = io::get_or<int64_t>(j, "max_steps", 0, ctx);
  c.validate(ctx);
  return c;
}

RunConfig RunConfig::load(const std::string& path) { return from_json(io::load_json_file(path), path); }

json RunConfig::to_json() const {
  json j;
  j["model"] = model;
  j["data"] = {{"path", data},
               {"format", data_format},
               {"heldout_fraction", heldout_fraction},
               {"passkey_fraction", passkey_fraction}};
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
                           {"schedule", s.schedule.to_json()}});
  j["log_every"] = log_every;
  j["eval_every"] = eval_every;
  j["eval_batches"] = eval_batches;
  j["save_every"] = save_every;
  j["keep_checkpoints"] = keep_checkpoints;
  j["max_steps"] = max_steps;
  return j;
}

void RunConfig::validate(const std::string& ctx) const {
  LM_CHECK(heldout_fraction > 0 && heldout_fraction < 0.5, "{}: data.heldout_fraction must be in (0, 0.5)", ctx);
  LM_CHECK(passkey_fraction >= 0 && passkey_fraction <= 0.9,
           "{}: data.passkey_fraction must be in [0, 0.9] (0: no synthetic passkey documents), got {}", ctx,
           passkey_fraction);
  LM_CHECK(tokenizer_vocab >= 300 && tokenizer_vocab <= 1 << 20, "{}: tokenizer.vocab_size must be in [300, 2^20]",
           ctx);
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
  }
}

// ---- the run ---------------------------------------------------------------------------------

namespace {

using Clock = std::chrono::steady_clock;

// A checkpoint's data_fingerprint: the training corpus, and with passkey documents the documents of
// epoch 0 of the stage the saved position refers to (they depend on the seed, the stage's seq_len,
// the fraction, the tokenizer and the template). Without passkey documents: the corpus' alone, as
// before they existed.
uint64_t data_fingerprint(const TokenizedDocs& corpus, const TokenizedDocs* passkey0) {
  uint64_t h = corpus.fingerprint();
  if (!passkey0) return h;
  const uint64_t x = passkey0->fingerprint();
  for (int i = 0; i < 8; ++i) h = (h ^ ((x >> (8 * i)) & 0xFF)) * 0x100000001B3ull;
  return h;
}

std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

// "model.layers.12.block_sparse_moe.experts.3.w1.weight" -> "layer 12 (MoE)".
std::string describe_param(const std::string& name, const model::ModelConfig& c) {
  static const std::regex re(R"(model\.layers\.(\d+)\.([a-z_]+))");
  std::smatch m;
  if (!std::regex_search(name, m, re)) return "'" + name + "'";
  const int64_t i = std::stoll(m[1].str());
  const std::string part = m[2].str();
  std::string what = part == "self_attn" ? (c.is_kda(i) ? "KDA mixer" : "MLA mixer")
                     : part == "block_sparse_moe" ? "MoE"
                     : part == "mlp" ? "dense FFN"
                                     : part;
  return fmt::format("layer {} ({}), parameter '{}'", i, what, name);
}

struct Balancer {
  Balance kind;
  bool hist;
  ops::QbHistogram h;
  double gamma;
  int64_t E = 0, k = 0;
  std::vector<std::vector<float>> scores;    // per MoE layer: [m, E] of the step (exact QB)
  std::vector<std::vector<int64_t>> counts;  // per MoE layer: histogram counts (hist QB)
  std::vector<std::vector<int64_t>> loads;   // per MoE layer: [E] selections this step
  std::vector<int64_t> layers;               // MoE layer indices
  std::vector<double> maxvio;                // per MoE layer, last step
};

}  // namespace

// SIGINT / SIGTERM: the first one asks the step loop to stop after the current step and save a
// checkpoint (a stopped run is one --resume away from continuing); a second one exits at once.
namespace {
std::atomic<int> g_interrupts{0};
void on_interrupt(int sig) {
  if (g_interrupts.fetch_add(1) > 0) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}
struct InterruptScope {
  using Handler = void (*)(int);
  Handler old_int, old_term;
  InterruptScope() {
    g_interrupts = 0;
    old_int = std::signal(SIGINT, on_interrupt);
    old_term = std::signal(SIGTERM, on_interrupt);
  }
  ~InterruptScope() {
    std::signal(SIGINT, old_int);
    std::signal(SIGTERM, old_term);
  }
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;
};
}  // namespace

TrainResult train(const RunConfig& cfg, const TrainOptions& opt) {
  const auto t_start = Clock::now();
  // The device first: nothing is written (no run folder, no tokenizer) for a run that cannot start.
  LM_CHECK(opt.device == "cpu" || opt.device == "cuda", "train: --device must be cpu or cuda, not '{}'", opt.device);
  if (opt.device == "cuda") {
    LM_CHECK(cfg.optim.kind == "adamw",
             "train --device cuda: optimizer.kind must be \"adamw\" (Muon runs on the CPU only), not \"{}\"",
             cfg.optim.kind);
    LM_CHECK(cfg.balance == Balance::None || (cfg.balance == Balance::QB && cfg.qb_estimator == "exact"),
             "train --device cuda: balance must be qb with the exact estimator, or none (got {})",
             balance_name(cfg.balance));
    LM_CHECK(model::cuda::available(), "train --device cuda: no usable CUDA device{}",
             model::cuda::built_with_cuda() ? "" : " (longmoe was built without CUDA: nvcc was not found)");
  }
  const InterruptScope interrupt_scope;
  const fs::path out(cfg.out);
  fs::create_directories(out);
  const bool tty = !opt.quiet && isatty(STDERR_FILENO);
  auto say = [&](const std::string& s) {
    if (!opt.quiet) std::printf("%s\n", s.c_str()), std::fflush(stdout);
  };

  // Resume point (read first: a resumed run must use the tokenizer it started with).
  std::string resume_dir;
  json state;
  if (opt.resume) {
    resume_dir = resolve_checkpoint(out.string());
    state = io::load_json_file((fs::path(resume_dir) / "trainer_state.json").string());
    say(fmt::format("resuming from {}", resume_dir));
  }

  // ---- data and tokenizer
  const auto docs = io::read_corpus(cfg.data, io::parse_corpus_format(cfg.data_format));
  LM_CHECK(docs.size() >= 2, "'{}': need at least 2 documents (one is held out), found {}", cfg.data, docs.size());
  // The held-out documents are chosen before the tokenizer exists (one placeholder token per document),
  // so the tokenizer never sees them.
  TokenizedDocs index_only;
  for (size_t i = 0; i < docs.size(); ++i) index_only.ids.push_back(0), index_only.offsets.push_back(i + 1);
  const DataSplit idx = split_documents(index_only, cfg.heldout_fraction, cfg.seed);
  const fs::path tok_path = out / "tokenizer.model";
  std::unique_ptr<io::Tokenizer> tok;
  if (!resume_dir.empty()) {
    tok = std::make_unique<io::Tokenizer>(io::Tokenizer::load((fs::path(resume_dir) / "tokenizer.model").string()));
  } else if (!cfg.tokenizer.empty()) {
    tok = std::make_unique<io::Tokenizer>(io::Tokenizer::load(cfg.tokenizer));
    fs::copy_file(cfg.tokenizer, tok_path, fs::copy_options::overwrite_existing);
  } else {
    std::vector<std::string> texts;
    for (int64_t d : idx.train_docs) texts.push_back(docs[d]);
    const auto t0 = Clock::now();
    io::Tokenizer::TrainOptions to;
    to.vocab_size = cfg.tokenizer_vocab;
    to.seed = cfg.seed;
    tok = std::make_unique<io::Tokenizer>(io::Tokenizer::train(texts, tok_path.string(), to));
    say(fmt::format("tokenizer: BPE, {} tokens, trained on {} documents in {:.1f}s", tok->vocab_size(),
                    texts.size(), std::chrono::duration<double>(Clock::now() - t0).count()));
  }
  const TokenizedDocs all = tokenize_documents(*tok, docs);
  auto train_docs = std::make_shared<TokenizedDocs>(select_documents(all, idx.train_docs));
  const TokenizedDocs heldout = select_documents(all, idx.heldout_docs);
  const Unigram unigram = Unigram::fit(*train_docs, tok->vocab_size());
  const double unigram_ce = unigram.cross_entropy(heldout);
  say(fmt::format("data: {} documents ({} train, {} held out), {} train tokens, {} held-out tokens; unigram "
                  "held-out ppl {:.1f}",
                  docs.size(), idx.train_docs.size(), idx.heldout_docs.size(), train_docs->tokens(),
                  heldout.tokens(), std::exp(unigram_ce)));

  // ---- synthetic passkey documents (training stream only): per stage at its seq_len, per epoch
  const bool passkey = cfg.passkey_fraction > 0;
  const int64_t passkey_target = passkey ? passkey_target_tokens(train_docs->tokens(), cfg.passkey_fraction) : 0;
  if (passkey)
    for (size_t i = 0; i < cfg.stages.size(); ++i) {
      try {
        passkey_min_doc_tokens(*tok, cfg.stages[i].seq_len);
      } catch (const Error& e) {
        fail("stages[{}]: {}", i, e.what());
      }
    }
  auto passkey_docs = [&, tk = tok.get()](int64_t si) -> Loader::ExtraDocs {
    if (!passkey) return {};
    return [tk, T = cfg.stages[static_cast<size_t>(si)].seq_len, target = passkey_target,
            rng = passkey_rng(cfg.seed, si)](uint64_t epoch) { return passkey_documents(*tk, T, target, rng.fork(epoch)); };
  };
  // Epoch 0's passkey documents of stage si and the fingerprint they give.
  TokenizedDocs stage_pk;
  double stage_pk_seconds = 0;
  auto stage_fingerprint = [&](int64_t si) {
    if (!passkey) return data_fingerprint(*train_docs, nullptr);
    const auto t0 = Clock::now();
    stage_pk = passkey_docs(si)(0);
    stage_pk_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    return data_fingerprint(*train_docs, &stage_pk);
  };

  // ---- model
  model::ModelConfig mcfg = model::ModelConfig::load(cfg.model);
  if (mcfg.vocab_size != tok->vocab_size()) {
    say(fmt::format("model: vocab_size {} -> {} (the tokenizer's)", mcfg.vocab_size, tok->vocab_size()));
    mcfg.vocab_size = tok->vocab_size();
  }
  mcfg.validate(cfg.model);
  mcfg.save((out / "config.json").string());
  io::write_file_atomic((out / "run.json").string(), cfg.to_json().dump(2) + "\n");
  auto m = std::make_unique<model::Model<float>>(mcfg);
  const auto counts = model::count_params(mcfg);
  if (!resume_dir.empty()) m->params().load(io::Checkpoint::open((fs::path(resume_dir) / "model.safetensors").string()));
  else m->params().init(cfg.seed);
  m->params().enable_grads();
  Optimizer optim(m->params(), mcfg, cfg.optim);
  if (!resume_dir.empty())
    optim.load_state(io::SafeTensorsFile::open((fs::path(resume_dir) / "optimizer.safetensors").string()));
  // GPU: the same weights and AdamW state, moved to the device; the host copies are refreshed at each save.
  std::unique_ptr<model::cuda::GpuModel> gm;
  std::unique_ptr<cuda::AdamW> gadam;  // gm's AdamW moments
  int64_t gpu_t = optim.step_count();  // AdamW steps taken (bias corrections)
  if (opt.device == "cuda") {  // (checked at the top)
    gm = std::make_unique<model::cuda::GpuModel>(
        mcfg, [&](const model::ParamSpec& s) { return param_rule(s, mcfg, cfg.optim).decay; });
    gadam = std::make_unique<cuda::AdamW>(*gm);
    gm->upload(m->params());
    std::map<std::string, Tensor> st;
    for (auto& [name, t] : optim.state()) st.emplace(name, t);
    for (const auto& pr : m->params().all()) {
      auto im = st.find("optim.adamw.m." + pr.spec.name), iv = st.find("optim.adamw.v." + pr.spec.name);
      if (im != st.end() && iv != st.end()) gadam->set(pr.spec.name, im->second.data<float>(), iv->second.data<float>());
    }
  }
  // The GPU's weights and AdamW state into the host model and optimizer (for a checkpoint).
  auto sync_from_gpu = [&] {
    if (!gm) return;
    gm->download(m->params());
    std::map<std::string, Tensor> st;
    st.emplace("optim.step", Tensor::from_vector<int64_t>({gpu_t}, {1}));
    for (const auto& [name, t] : optim.state()) {
      if (name.rfind("optim.adamw.m.", 0) != 0) continue;
      const std::string pn = name.substr(14);
      Tensor mt = Tensor::empty(t.shape(), DType::F32), vt = Tensor::empty(t.shape(), DType::F32);
      gadam->get(pn, mt.data<float>(), vt.data<float>());
      st.emplace(name, std::move(mt));
      st.emplace("optim.adamw.v." + pn, std::move(vt));
    }
    optim.load_state(st, "GPU optimizer state");
  };
  say(fmt::format("model: {:.2f}M parameters, {:.2f}M activated; {} layers ({} KDA, {} MLA), {} MoE layers, "
                  "balance {}; {}",
                  counts.total / 1e6, counts.activated / 1e6, mcfg.num_hidden_layers, mcfg.num_kda_layers(),
                  mcfg.num_mla_layers(), mcfg.num_moe_layers(), balance_name(cfg.balance),
                  gm ? std::string("on the GPU") : fmt::format("{} threads", num_threads())));

  // ---- balancing state
  Balancer bal;
  bal.kind = cfg.balance;
  bal.hist = cfg.qb_estimator == "hist";
  bal.h.bins = cfg.qb_bins;
  bal.gamma = cfg.sign_gamma;
  for (int64_t i = 0; i < mcfg.num_hidden_layers; ++i)
    if (m->moe(i)) {
      bal.layers.push_back(i);
      if (cfg.balance == Balance::Aux) m->moe(i)->aux_coef = cfg.aux_coef;
    }
  bal.E = mcfg.num_experts;
  bal.k = mcfg.num_experts_per_token;
  bal.scores.resize(bal.layers.size());
  bal.counts.resize(bal.layers.size());
  bal.loads.resize(bal.layers.size());
  bal.maxvio.assign(bal.layers.size(), 0.0);

  // ---- position
  // data_stage: the stage whose passkey documents the loader's stream holds (the saved position is in
  // that stream); a stage switch moves it on (Loader::set_extra), keeping the corpus where it was.
  int64_t stage0 = 0, step_in_stage0 = 0, global_step = 0, tokens_seen = 0, data_stage = 0;
  Position pos;
  uint64_t data_fp = 0;
  if (!resume_dir.empty()) {
    const std::string sctx = resume_dir + "/trainer_state.json";
    stage0 = io::get_required<int64_t>(state, "stage", sctx);
    step_in_stage0 = io::get_required<int64_t>(state, "step_in_stage", sctx);
    global_step = io::get_required<int64_t>(state, "global_step", sctx);
    tokens_seen = io::get_required<int64_t>(state, "tokens", sctx);
    data_stage = io::get_or<int64_t>(state, "data_stage", stage0, sctx);
    from_json(state.at("position"), pos);
    LM_CHECK(stage0 < static_cast<int64_t>(cfg.stages.size()),
             "{}: this run already finished all {} stages; nothing to resume", sctx, cfg.stages.size());
    LM_CHECK(data_stage >= 0 && data_stage <= stage0, "{}: data_stage {} outside [0, stage {}]", sctx, data_stage,
             stage0);
    data_fp = stage_fingerprint(data_stage);
    LM_CHECK(io::get_required<uint64_t>(state, "data_fingerprint", sctx) == data_fp,
             "{}: the training data differ from the run being resumed (different corpus, split, tokenizer or "
             "passkey documents)",
             sctx);
  } else {
    data_fp = stage_fingerprint(data_stage);
  }
  Loader loader(train_docs, cfg.stages[stage0].seq_len, cfg.seed, pos, passkey_docs(data_stage));
  const int64_t first_tokens = tokens_seen;

  // Metrics: a resumed run first drops the lines written after its checkpoint.
  const fs::path metrics_path = out / "metrics.jsonl";
  if (!resume_dir.empty() && fs::exists(metrics_path)) {
    std::ifstream in(metrics_path);
    std::string line, kept;
    while (std::getline(in, line)) {
      try {
        if (json::parse(line).value("step", int64_t{0}) <= global_step) kept += line + "\n";
      } catch (const json::exception&) {
        // a torn last line from the killed run: drop it
      }
    }
    io::write_file_atomic(metrics_path.string(), kept);
  } else if (resume_dir.empty()) {
    io::write_file_atomic(metrics_path.string(), "");
  }
  std::ofstream metrics(metrics_path, std::ios::app);

  TrainResult result;
  result.first_step = global_step;
  std::string last_ckpt = resume_dir;

  auto evaluate = [&](int64_t seq_len, int64_t max_batches) {
    const int64_t B = std::max<int64_t>(1, std::min<int64_t>(8, 8192 / seq_len));
    const auto batches = eval_batches(heldout, seq_len, B, tok->pad() >= 0 ? tok->pad() : 0, max_batches);
    double sum = 0;
    int64_t n = 0;
    for (const auto& b : batches) {
      const model::Seqs sq = model::Seqs::packed(b.cu_seqlens);
      auto add = [&](const auto& st) { sum += st.loss_sum, n += st.n_valid; };
      if (gm) add(gm->loss(b.ids.data(), b.targets.data(), sq));
      else add(m->loss(b.ids.data(), b.targets.data(), sq));
    }
    return n > 0 ? sum / static_cast<double>(n) : NAN;
  };

  auto save = [&](int64_t stage, int64_t step_in_stage, const std::string& also_as) {
    const fs::path ck = out / "ckpt";
    fs::create_directories(ck);
    const std::string name = fmt::format("step-{:08}", global_step);
    const fs::path tmp = ck / (".tmp-" + name), dst = ck / name;
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    sync_from_gpu();
    mcfg.save((tmp / "config.json").string());
    fs::copy_file(fs::exists(tok_path) ? tok_path.string() : tok->model_path(), tmp / "tokenizer.model",
                  fs::copy_options::overwrite_existing);
    io::save_checkpoint(tmp.string(), m->params().named(DType::F32), uint64_t{2} << 30,
                        {{"longmoe_step", std::to_string(global_step)}});
    io::save_safetensors((tmp / "optimizer.safetensors").string(), optim.state());
    // Test hook: die in the middle of a save (after the weights, before the rename), as a kill would.
    if (const char* c = std::getenv("LONGMOE_CRASH_IN_SAVE_AT_STEP"); c && std::atoll(c) == global_step) std::abort();
    json st;
    st["stage"] = stage;
    st["step_in_stage"] = step_in_stage;
    st["global_step"] = global_step;
    st["tokens"] = tokens_seen;
    st["position"] = loader.position();
    st["data_fingerprint"] = data_fp;
    st["data_stage"] = data_stage;
    st["threads"] = num_threads();
    io::write_file_atomic((tmp / "trainer_state.json").string(), st.dump(2) + "\n");
    fs::remove_all(dst);
    fs::rename(tmp, dst);
    io::write_file_atomic((out / "latest").string(), "ckpt/" + name + "\n");
    last_ckpt = dst.string();
    if (!also_as.empty()) {  // stage-end checkpoints stay; hard links cost no space
      const fs::path sd = out / also_as;
      fs::remove_all(sd);
      fs::create_directories(sd);
      for (const auto& e : fs::directory_iterator(dst)) fs::create_hard_link(e.path(), sd / e.path().filename());
    }
    // Keep the newest `keep_checkpoints` step folders.
    std::vector<fs::path> steps;
    for (const auto& e : fs::directory_iterator(ck))
      if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0) steps.push_back(e.path());
    std::sort(steps.begin(), steps.end());
    for (size_t i = 0; i + static_cast<size_t>(cfg.keep_checkpoints) < steps.size(); ++i) fs::remove_all(steps[i]);
  };

  // ---- stages
  double tok_rate = 0;
  for (int64_t si = stage0; si < static_cast<int64_t>(cfg.stages.size()); ++si) {
    const StageConfig& S = cfg.stages[si];
    const int64_t per_step = S.batch_seqs * S.seq_len;
    const int64_t steps = std::max<int64_t>(1, S.tokens / per_step);
    const int64_t micro = S.micro_seqs ? S.micro_seqs : S.batch_seqs;
    const Schedule sched(S.schedule, steps);
    if (passkey && data_stage != si) {  // this stage's documents, at its seq_len; the corpus continues
      loader.set_extra(passkey_docs(si));
      data_stage = si;
      data_fp = stage_fingerprint(si);
    }
    loader.set_seq_len(S.seq_len);
    say(fmt::format("stage {}/{}: seq_len {}, {} steps of {} x {} tokens ({} micro-batches), schedule {}", si + 1,
                    cfg.stages.size(), S.seq_len, steps, S.batch_seqs, S.seq_len, S.batch_seqs / micro,
                    S.schedule.kind));
    if (passkey) {
      const double tok_frac = static_cast<double>(stage_pk.tokens()) /
                              static_cast<double>(stage_pk.tokens() + train_docs->tokens());
      const double doc_frac = static_cast<double>(stage_pk.num_docs()) /
                              static_cast<double>(stage_pk.num_docs() + train_docs->num_docs());
      int64_t lo = S.seq_len, hi = 0;
      for (int64_t d = 0; d < stage_pk.num_docs(); ++d) {
        const auto n = static_cast<int64_t>(stage_pk.doc(d).size());
        lo = std::min(lo, n), hi = std::max(hi, n);
      }
      result.stage_passkey_token_fraction.push_back(tok_frac);
      result.stage_passkey_doc_fraction.push_back(doc_frac);
      say(fmt::format("  passkey: {} synthetic documents of {}..{} tokens per epoch: {:.1f}% of the training tokens, "
                      "{:.1f}% of the documents (made in {:.1f}s)",
                      stage_pk.num_docs(), lo, hi, 100 * tok_frac, 100 * doc_frac, stage_pk_seconds));
    }
    const int64_t first = si == stage0 ? step_in_stage0 : 0;
    const auto stage_t0 = Clock::now();
    int64_t stage_tokens = 0;
    bool stopped = false;  // max_steps reached, or SIGINT/SIGTERM, inside the stage
    int64_t step = first;
    for (; step < steps; ++step) {
      if (g_interrupts.load() > 0) result.interrupted = true;
      if ((cfg.max_steps > 0 && global_step >= cfg.max_steps) || result.interrupted) {
        stopped = true;
        break;
      }
      const auto t0 = Clock::now();
      // The step's micro-batches, fetched first: the loss is normalised by their total target count.
      // One batch of all B sequences (the loader's lanes are defined by B), then split: accumulation
      // sees exactly the sequences of the unaccumulated step.
      std::vector<Batch> mb;
      int64_t n_valid = 0;
      {
        Batch whole = loader.next(S.batch_seqs);
        if (micro == S.batch_seqs) {
          mb.push_back(std::move(whole));
        } else {
          for (int64_t b = 0; b < S.batch_seqs; b += micro) mb.push_back(whole.sequences(b, micro));
        }
        for (const Batch& b : mb) n_valid += b.predicted();
      }
      if (gm) gm->zero_grads();
      else m->params().zero_grads();
      for (auto& s : bal.scores) s.clear();
      for (auto& c : bal.counts) c.clear();
      for (auto& l : bal.loads) l.assign(bal.E, 0);
      double loss_sum = 0, aux = 0;
      for (const Batch& b : mb) {
        const model::Seqs seqs = model::Seqs::packed(b.cu_seqlens);
        if (gm) {  // GPU: loss, gradients and the experts' loads (QB reads the scores on the device)
          const auto st = gm->forward_backward(b.ids.data(), b.targets.data(), seqs, n_valid);
          loss_sum += st.loss_sum;
          if (!std::isfinite(st.loss_sum))
            fail("step {}: the loss became {} on the GPU. Stopping; the last checkpoint is {}", global_step,
                 st.loss_sum, last_ckpt.empty() ? "none" : last_ckpt);
          for (size_t li = 0; li < bal.layers.size(); ++li) {
            const auto l = gm->expert_loads(bal.layers[li]);
            for (int64_t e = 0; e < bal.E; ++e) bal.loads[li][e] += l[e];
          }
          continue;
        }
        const auto st = m->forward_backward(b.ids.data(), b.targets.data(), seqs, n_valid);
        loss_sum += st.loss_sum;
        if (!std::isfinite(st.loss_sum)) {
          // Find the first layer whose output is no longer finite.
          model::ForwardResult<float> fr;
          m->forward(b.ids.data(), seqs, model::ForwardOptions{true, false, false}, &fr);
          for (size_t i = 0; i < fr.hidden.size(); ++i)
            for (float x : fr.hidden[i])
              if (!std::isfinite(x))
                fail("step {}: the loss became {}; the first non-finite activation is the output of layer {} ({} "
                     "mixer, {}). Stopping; the last checkpoint is {}",
                     global_step, st.loss_sum, i, mcfg.is_kda(static_cast<int64_t>(i)) ? "KDA" : "MLA",
                     mcfg.is_moe(static_cast<int64_t>(i)) ? "MoE" : "dense FFN",
                     last_ckpt.empty() ? "none" : last_ckpt);
          fail("step {}: the loss became {} (every layer's output is finite: the LM head overflowed). Stopping; the "
               "last checkpoint is {}",
               global_step, st.loss_sum, last_ckpt.empty() ? "none" : last_ckpt);
        }
        const int64_t rows = b.tokens();
        for (size_t li = 0; li < bal.layers.size(); ++li) {
          auto* moe = m->moe(bal.layers[li]);
          std::vector<int64_t> l(bal.E);
          ops::expert_loads(moe->topk_idx().data(), rows, bal.k, bal.E, l.data());
          for (int64_t e = 0; e < bal.E; ++e) bal.loads[li][e] += l[e];
          if (cfg.balance == Balance::QB) {
            if (bal.hist) {
              bal.counts[li].resize(bal.E * ops::qb_hist_slots(bal.h), 0);
              ops::qb_hist_accumulate(moe->scores().data(), moe->bias(), static_cast<const float*>(nullptr), rows,
                                      bal.E, bal.k, bal.h, bal.counts[li].data());
            } else {
              bal.scores[li].insert(bal.scores[li].end(), moe->scores().begin(), moe->scores().end());
            }
          }
          aux += moe->last_aux_loss;
        }
      }
      const double loss = loss_sum / static_cast<double>(std::max<int64_t>(n_valid, 1));
      StepInfo info;
      if (gm) {
        // AdamW as train::Optimizer does it: global-norm clip, then the update (and the bf16 copy).
        info.grad_norm = gm->grad_norm();
        if (!std::isfinite(info.grad_norm))
          fail("step {}: a gradient became NaN/Inf on the GPU. Stopping; the last checkpoint is {}", global_step,
               last_ckpt.empty() ? "none" : last_ckpt);
        if (cfg.optim.clip > 0 && info.grad_norm > cfg.optim.clip)
          info.clip_coef = cfg.optim.clip / (info.grad_norm + 1e-6);
        info.lr_adamw = info.lr_muon = cfg.optim.lr_adamw * sched.factor_at(step);
        cuda::AdamWStep as;
        as.lr = info.lr_adamw, as.beta1 = cfg.optim.beta1, as.beta2 = cfg.optim.beta2, as.eps = cfg.optim.eps;
        as.weight_decay = cfg.optim.weight_decay, as.step = ++gpu_t, as.grad_scale = info.clip_coef;
        gadam->step(as);
        if (cfg.balance == Balance::QB) gm->balance();
        for (size_t li = 0; li < bal.layers.size(); ++li)
          bal.maxvio[li] = ops::max_violation(bal.loads[li].data(), bal.E);
      } else {
        try {
          info = optim.step(sched.factor_at(step));
        } catch (const Error& e) {
          const auto bad = nonfinite_grad(m->params());
          if (bad)
            fail("step {}: a gradient became NaN/Inf in {}. Stopping; the last checkpoint is {}", global_step,
                 describe_param(*bad, mcfg), last_ckpt.empty() ? "none" : last_ckpt);
          throw;
        }
      }
      // Balancing: the new bias is installed for the next step.
      for (size_t li = 0; li < bal.layers.size() && !gm; ++li) {
        auto* moe = m->moe(bal.layers[li]);
        float* b = moe->bias();
        if (cfg.balance == Balance::QB) {
          if (bal.hist) {
            std::vector<float> beta(bal.E);
            ops::qb_beta_from_hist(bal.counts[li].data(), b, beta.data(), bal.E, bal.k, bal.h);
            ops::qb_bias_from_beta(beta.data(), b, bal.E);
          } else {
            const int64_t mrows = static_cast<int64_t>(bal.scores[li].size()) / bal.E;
            ops::qb_update_exact(bal.scores[li].data(), b, static_cast<const float*>(nullptr), b, mrows, bal.E, bal.k);
          }
        } else if (cfg.balance == Balance::Sign) {
          ops::bias_sign_update(bal.loads[li].data(), b, bal.E, static_cast<float>(bal.gamma));
        }
        bal.maxvio[li] = ops::max_violation(bal.loads[li].data(), bal.E);
      }
      ++global_step;
      tokens_seen += per_step;
      stage_tokens += per_step;
      result.losses.push_back(loss);
      const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
      result.train_seconds += dt;
      tok_rate = tok_rate == 0 ? per_step / dt : 0.9 * tok_rate + 0.1 * per_step / dt;
      double mv_max = 0;
      for (double v : bal.maxvio) mv_max = std::max(mv_max, v);
      if (!bal.maxvio.empty()) result.maxvio_worst.push_back(mv_max);
      if (global_step % cfg.log_every == 0 || step + 1 == steps) {
        json row = {{"step", global_step}, {"stage", si},          {"tokens", tokens_seen},
                    {"loss", loss},        {"lr", info.lr_adamw},  {"lr_muon", info.lr_muon},
                    {"grad_norm", info.grad_norm}, {"tok_per_s", per_step / dt}, {"maxvio", bal.maxvio},
                    {"elapsed", std::chrono::duration<double>(Clock::now() - t_start).count()}};
        if (cfg.balance == Balance::Aux) row["aux_loss"] = aux;
        metrics << row.dump() << "\n" << std::flush;
      }
      const double eta = (steps - step - 1) * per_step / std::max(tok_rate, 1e-9);
      if (tty) {
        std::fprintf(stderr, "\r[stage %ld/%zu T=%ld] step %ld/%ld  loss %.4f  %.0f tok/s  lr %.2e  maxvio %.3f  ETA %s   ",
                     static_cast<long>(si + 1), cfg.stages.size(), static_cast<long>(S.seq_len),
                     static_cast<long>(step + 1), static_cast<long>(steps), loss, tok_rate, info.lr_adamw, mv_max,
                     fmt_duration(eta).c_str());
      } else if (!opt.quiet && ((step + 1) % std::max<int64_t>(1, steps / 20) == 0 || step + 1 == steps)) {
        std::printf("[stage %ld/%zu T=%ld] step %ld/%ld  loss %.4f  %.0f tok/s  lr %.2e  maxvio %.3f  ETA %s\n",
                    static_cast<long>(si + 1), cfg.stages.size(), static_cast<long>(S.seq_len),
                    static_cast<long>(step + 1), static_cast<long>(steps), loss, tok_rate, info.lr_adamw, mv_max,
                    fmt_duration(eta).c_str());
        std::fflush(stdout);
      }
      if (cfg.eval_every > 0 && global_step % cfg.eval_every == 0 && step + 1 < steps) {
        const double el = evaluate(S.seq_len, cfg.eval_batches);
        metrics << json{{"step", global_step}, {"stage", si}, {"eval_loss", el}, {"eval_ppl", std::exp(el)}}.dump()
                << "\n"
                << std::flush;
      }
      if (cfg.save_every > 0 && global_step % cfg.save_every == 0 && step + 1 < steps) save(si, step + 1, "");
      result.final_train_loss = loss;
    }
    if (tty) std::fprintf(stderr, "\n");
    if (stopped) {  // a partial stage: checkpoint where it stopped, so --resume continues from here
      save(si, step, "");
      if (result.interrupted) say(fmt::format("interrupted at step {}: checkpoint {} saved; continue with --resume",
                                              global_step, last_ckpt));
      break;
    }
    // Stage end: held-out perplexity over the whole split, then the stage's checkpoint.
    const double stage_s = std::chrono::duration<double>(Clock::now() - stage_t0).count();
    const double el = evaluate(S.seq_len, 0);
    metrics << json{{"step", global_step}, {"stage", si}, {"eval_loss", el}, {"eval_ppl", std::exp(el)},
                    {"stage_end", true}}.dump()
            << "\n"
            << std::flush;
    say(fmt::format("stage {} done: {} tokens in {}, {:.0f} tok/s; held-out loss {:.4f}, ppl {:.2f} (unigram ppl "
                    "{:.2f})",
                    si + 1, stage_tokens, fmt_duration(stage_s), stage_tokens / std::max(stage_s, 1e-9), el,
                    std::exp(el), std::exp(unigram_ce)));
    result.heldout_loss = el;
    result.heldout_ppl = std::exp(el);
    result.stage_heldout_ppl.push_back(std::exp(el));
    save(si + 1, 0, fmt::format("stage-{}", si));
    if (cfg.max_steps > 0 && global_step >= cfg.max_steps) break;
  }
  result.steps = global_step;
  result.tokens = tokens_seen;
  result.unigram_ppl = std::exp(unigram_ce);
  result.tokens_per_s = result.train_seconds > 0
                            ? static_cast<double>(tokens_seen - first_tokens) / result.train_seconds
                            : tok_rate;
  result.checkpoint = last_ckpt;
  if (!result.interrupted) {
    // summary.json: the run's headline figures, for people and scripts (docs/experiments.md).
    const BalanceSummary bs = summarize_balance(result, 0.3, 50);
    json sj = {{"steps", global_step},
               {"tokens", tokens_seen},
               {"tokens_per_s", result.tokens_per_s},
               {"threads", num_threads()},
               {"final_train_loss", result.final_train_loss},
               {"heldout_loss", result.heldout_loss},
               {"heldout_ppl", result.heldout_ppl},
               {"stage_heldout_ppl", result.stage_heldout_ppl},
               {"unigram_ppl", result.unigram_ppl},
               {"balance", cfg.to_json()["balance"]},
               {"passkey_fraction", cfg.passkey_fraction},
               {"checkpoint", last_ckpt}};
    if (passkey) {
      sj["stage_passkey_token_fraction"] = result.stage_passkey_token_fraction;
      sj["stage_passkey_doc_fraction"] = result.stage_passkey_doc_fraction;
    }
    if (!result.maxvio_worst.empty()) {
      sj["maxvio_first_step_below_0.3"] = bs.first_step_below;
      sj["maxvio_median_after_step_50"] = bs.median_after;
      sj["maxvio_max_after_step_50"] = bs.max_after;
    }
    io::write_file_atomic((out / "summary.json").string(), sj.dump(2) + "\n");
  }
  say(fmt::format("done: {} steps, {} tokens in {}; checkpoint {}", global_step, tokens_seen,
                  fmt_duration(std::chrono::duration<double>(Clock::now() - t_start).count()), last_ckpt));
  return result;
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
