// The engines of engine.hpp: the CPU Session's sequences by id, and the GPU model's slots.
#include "infer/engine.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "model/accounting.hpp"

namespace lm::infer {

namespace {
constexpr int64_t kBlock = model::cuda::GpuModel::kCacheBlock;  // the latent pool's reservation unit
}  // namespace

// ---- CpuEngine -----------------------------------------------------------------------------------------
const Sequence& CpuEngine::get(Id id) const {
  const auto it = seqs_.find(id);
  LM_CHECK(it != seqs_.end(), "engine: no open sequence {}", id);
  return it->second;
}

Engine::Id CpuEngine::open(std::span<const int32_t> prompt, int64_t reserve) {
  LM_CHECK(reserve <= s_.max_context(), "engine: a sequence of {} tokens exceeds the context limit of {} tokens",
           reserve, s_.max_context());
  Sequence seq = s_.new_sequence();
  if (prefix_cache() && prompt.size() > 1)
    if (Snapshot snap = s_.lookup_prefix(prompt, static_cast<int64_t>(prompt.size()) - 1)) seq = Session::resume(snap);
  const Id id = next_++;
  seqs_.emplace(id, std::move(seq));
  return id;
}

std::vector<float> CpuEngine::prefill(Id id, std::span<const int32_t> t, std::vector<float>* all_logits,
                                      bool store_prefix) {
  return s_.prefill(get(id), t, all_logits, store_prefix);
}

int64_t CpuEngine::attach_media(Id id, const model::Media<float>& media) {
  Sequence& seq = get(id);
  int64_t rows = 0;
  const std::vector<float> features = s_.model().media_features(media, &rows);
  s_.attach_media(seq, features);
  return rows;
}

const std::vector<float>& CpuEngine::decode(std::span<const Id> ids, std::span<const int32_t> t) {
  std::vector<Sequence*> seqs;
  for (Id id : ids) seqs.push_back(&get(id));
  logits_ = s_.decode(seqs, t);
  return logits_;
}

int64_t CpuEngine::cache_bytes() const {
  int64_t b = 0;
  for (const auto& [id, s] : seqs_) b += s.cache_bytes();
  return b;
}

// ---- GpuEngine -----------------------------------------------------------------------------------------
int64_t default_pool_tokens(const model::ModelConfig& c, int64_t max_sequences, int64_t context,
                            int64_t prefill_chunk, double device_bytes) {
  const int64_t slots = max_sequences + 1, want = max_sequences * ((context + kBlock - 1) / kBlock) * kBlock;
  if (c.num_mla_layers() == 0) return want;
  const double budget = 0.92 * device_bytes;
  const auto total = [&](int64_t pool) {
    return model::inference_memory(c, context, slots, prefill_chunk, pool).total();
  };
  constexpr int64_t probe = int64_t(1) << 20;  // (the cost of a token of pool, from a million of them)
  const double base = total(kBlock), per_token = (total(kBlock + probe) - base) / double(probe);
  const int64_t fit = kBlock + static_cast<int64_t>((budget - base) / per_token) / kBlock * kBlock;
  LM_CHECK(base <= budget && fit >= context,
           "gpu engine: one context of {} tokens does not fit the device: {:.1f} GiB of weights, caches and "
           "activations with its latent cache, {:.1f} GiB usable; give a shorter --context",
           context, total(context) / 1073741824.0, budget / 1073741824.0);
  return std::min(want, fit);
}

GpuEngine::GpuEngine(model::cuda::GpuModel& g, GpuEngineOptions o) : g_(g), o_(o) {
  const model::ModelConfig& c = g_.config();
  LM_CHECK(o_.max_sequences >= 1, "gpu engine: {} sequences", o_.max_sequences);
  LM_CHECK(o_.prefill_chunk >= 1, "gpu engine: prefill chunk {}", o_.prefill_chunk);
  o_.context = context_limit(c, o_.context);
  if (o_.pool_tokens == 0)
    o_.pool_tokens = default_pool_tokens(c, o_.max_sequences, o_.context, o_.prefill_chunk,
                                         static_cast<double>(model::cuda::device_memory_total()));
  g_.prefill_chunk = o_.prefill_chunk;
  g_.reserve_caches(o_.max_sequences + 1, o_.context, o_.pool_tokens);
  pool_blocks_ = g_.free_cache_tokens() / kBlock;
  LM_CHECK(o_.prefix_cache_bytes >= 0, "gpu engine: a prefix cache of {} bytes", o_.prefix_cache_bytes);
  // (a model without KDA layers saves no states: its snapshots are counted as 64 KiB each)
  const int64_t per = std::max<int64_t>(static_cast<int64_t>(g_.snapshot_bytes()), int64_t(1) << 16);
  g_.reserve_snapshots(o_.prefix_cache_bytes / per);
  for (int64_t k = g_.snapshot_count() - 1; k >= 0; --k) free_snaps_.push_back(k);
  at_.assign(static_cast<size_t>(o_.max_sequences + 1), 0);
  warm_up();
}

// Two prefill chunks in slot 0 (the second continues from the cache), one token in each other slot, then a decode
// step of every batch size from M down to 1, each captured into its CUDA graph; then nothing is kept. Every
// activation buffer gets the largest size the engine will ask for, so none grows later: a growth invalidates the
// captured graphs, and with continuous batching, whose batch size changes at every join and end, each size would
// then be captured again (two eager steps and an instantiation) many times over.
void GpuEngine::warm_up() {
  const int64_t M = o_.max_sequences;
  const int64_t n = std::min(o_.prefill_chunk, (o_.context - M - 1) / 2);
  if (n < 1) return;
  if (blocks_for(2 * n + M) + (M - 1) * blocks_for(M + 1) > pool_blocks_) return;  // (a small pool: skipped)
  const std::vector<int32_t> zeros(static_cast<size_t>(std::max(2 * n, M)), 0);
  try {
    g_.prefill(0, zeros.data(), 2 * n);
    for (int64_t s = 1; s < M; ++s) g_.prefill(s, zeros.data(), 1);
    for (int64_t S = M; S >= 1; --S) g_.decode(0, S, zeros.data());
  } catch (const Error&) {  // (only an optimisation: a step that cannot run here sizes its buffers when it runs)
  }
  for (int64_t s = 0; s < M; ++s) g_.release_slot(s);
}

const GpuEngine::Entry& GpuEngine::get(Id id) const {
  const auto it = seqs_.find(id);
  LM_CHECK(it != seqs_.end(), "engine: no open sequence {}", id);
  return it->second;
}

int64_t GpuEngine::vocab_size() const { return g_.config().vocab_size; }
int64_t GpuEngine::cache_bytes() const { return static_cast<int64_t>(g_.cache_bytes()); }
std::string GpuEngine::describe() const {
  return fmt::format("cuda: {} sequences of up to {} tokens, latent pool {} tokens, {}-token prefill chunks, "
                     "prefix cache of {} snapshots ({:.1f} MiB each)",
                     o_.max_sequences, o_.context, o_.pool_tokens, o_.prefill_chunk, g_.snapshot_count(),
                     g_.snapshot_bytes() / 1048576.0);
}

// A model without MLA layers keeps no latent rows: every sequence fits.
int64_t GpuEngine::blocks_for(int64_t reserve) const {
  if (g_.config().num_mla_layers() == 0) return 0;
  return ((reserve > 0 ? reserve : o_.context) + kBlock - 1) / kBlock;
}

bool GpuEngine::can_ever_fit(int64_t reserve) const {
  return reserve <= o_.context && blocks_for(reserve) <= pool_blocks_;
}

bool GpuEngine::fits(int64_t reserve) const {
  return can_ever_fit(reserve) && static_cast<int64_t>(seqs_.size()) < o_.max_sequences &&
         reserved_blocks_ + blocks_for(reserve) <= pool_blocks_;
}

Engine::Id GpuEngine::open(std::span<const int32_t> prompt, int64_t reserve) {
  LM_CHECK(static_cast<int64_t>(seqs_.size()) < o_.max_sequences, "gpu engine: all {} sequences are in use",
           o_.max_sequences);
  LM_CHECK(reserve <= o_.context, "gpu engine: a sequence of {} tokens exceeds the context limit of {} tokens",
           reserve, o_.context);
  const int64_t need = blocks_for(reserve);
  LM_CHECK(reserved_blocks_ + need <= pool_blocks_,
           "gpu engine: the latent cache cannot hold {} more tokens: {} of its {} tokens are reserved by open "
           "sequences", need * kBlock, reserved_blocks_ * kBlock, pool_blocks_ * kBlock);
  const int64_t slot = free_slot(-1);
  const Id id = next_++;
  Entry& e = seqs_[id] = Entry{slot, need, {}};
  at_[size_t(slot)] = id;
  reserved_blocks_ += need;
  resume(e, prompt);
  return id;
}

void GpuEngine::resume(Entry& e, std::span<const int32_t> prompt) {
  if (!prefix_cache() || prompt.size() < 2 || e.looked_up) return;
  e.looked_up = true;
  const auto* hit = prefix_.longest(prompt, static_cast<int64_t>(prompt.size()) - 1, o_.prefill_chunk);
  if (!hit) return;
  g_.load_snapshot(hit->value, e.slot);
  e.tokens = hit->tokens;
}

void GpuEngine::evict() {
  const int64_t snap = prefix_.pop_lru();
  g_.drop_snapshot(snap);
  free_snaps_.push_back(snap);
}

void GpuEngine::make_room(int64_t blocks) {
  while (g_.free_cache_tokens() / kBlock < blocks && !prefix_.empty()) evict();
}

void GpuEngine::store(Entry& e) {
  if (prefix_.find(e.tokens)) return;
  if (free_snaps_.empty()) evict();
  const int64_t snap = free_snaps_.back();
  free_snaps_.pop_back();
  g_.save_snapshot(e.slot, snap);
  if (const auto displaced = prefix_.insert(e.tokens, snap, static_cast<int64_t>(g_.snapshot_bytes()))) {
    g_.drop_snapshot(*displaced);
    free_snaps_.push_back(*displaced);
  }
}

void GpuEngine::close(Id id) {
  const auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  g_.release_slot(it->second.slot);
  at_[size_t(it->second.slot)] = 0;
  reserved_blocks_ -= it->second.reserve_blocks;
  seqs_.erase(it);
}

// A free slot other than `except`, from the top (the low slots are where decode batches go).
int64_t GpuEngine::free_slot(int64_t except) const {
  for (int64_t s = static_cast<int64_t>(at_.size()) - 1; s >= 0; --s)
    if (at_[size_t(s)] == 0 && s != except) return s;
  fail("gpu engine: no free slot (an internal error: {} slots hold {} sequences)", at_.size(), seqs_.size());
}

void GpuEngine::move(Id id, int64_t to) {
  Entry& e = get(id);
  LM_CHECK(at_[size_t(to)] == 0, "gpu engine: slot {} is taken", to);
  g_.copy_slot(e.slot, to);
  g_.release_slot(e.slot);
  at_[size_t(e.slot)] = 0;
  at_[size_t(to)] = id;
  e.slot = to;
  ++moves_;
}

// `t` after what e holds, in one call to the model (its latent blocks made room for first).
std::vector<float> GpuEngine::run(Entry& e, std::span<const int32_t> t, std::vector<float>* all_logits) {
  const int64_t p = e.pos(), n = static_cast<int64_t>(t.size());
  make_room(g_.blocks_needed(e.slot, n));
  // the placeholders of t take the next attached feature rows
  const int32_t ph = g_.media_placeholder();
  const int64_t n_ph = ph < 0 ? 0 : std::count(t.begin(), t.end(), ph), d = g_.config().hidden_size;
  const int64_t left = static_cast<int64_t>(e.media.size()) / d - e.media_taken;
  LM_CHECK(n_ph <= left, "the prompt has {} media placeholder token(s) (id {}), but {} image feature row(s) are "
           "attached for them", n_ph, ph, left);
  const std::span<const float> rows(e.media.data() + e.media_taken * d, size_t(n_ph * d));
  std::vector<float> lg;
  try {
    lg = p == 0 ? g_.prefill(e.slot, t.data(), n, all_logits, rows) : g_.extend(e.slot, t.data(), n, all_logits, rows);
  } catch (...) {
    e.tokens.clear(), e.on_grid = true, e.media_taken = 0;  // (the model left the slot empty)
    throw;
  }
  e.tokens.insert(e.tokens.end(), t.begin(), t.end());
  e.media_taken += n_ph;
  return lg;
}

std::vector<float> GpuEngine::prefill(Id id, std::span<const int32_t> t, std::vector<float>* all_logits,
                                      bool store_prefix) {
  Entry& e = get(id);
  LM_CHECK(!t.empty(), "prefill: no tokens");
  LM_CHECK(e.tokens.size() + t.size() <= size_t(o_.context),
           "prompt of {} tokens (after {} cached) exceeds the context limit of {} tokens", t.size(), e.tokens.size(),
           o_.context);
  if (e.tokens.empty() && !all_logits) {
    resume(e, t);
    t = t.subspan(e.tokens.size());
  }
  const int64_t Cp = o_.prefill_chunk, p = e.pos(), end = p + static_cast<int64_t>(t.size());
  if (p % Cp != 0) e.on_grid = false;
  // A snapshot is keyed by tokens, and an image's rows are not in them: a sequence with images stores none.
  if (const int32_t ph = g_.media_placeholder(); ph >= 0 && std::find(t.begin(), t.end(), ph) != t.end())
    e.on_grid = false;
  if (!store_prefix || !prefix_cache() || !e.on_grid || end < p / Cp * Cp + Cp) return run(e, t, all_logits);
  // Snapshots at the last grid point of the call and, when the call ends on it, at the one before as well (a repeat
  // of the prompt resumes there: it must prefill at least its last token). The call runs in pieces between them: the
  // same chunks as in one call.
  std::vector<int64_t> at = {end / Cp * Cp};
  if (at[0] == end && end - Cp > p) at.insert(at.begin(), end - Cp);
  std::vector<float> lg, part;
  if (all_logits) all_logits->clear();
  for (size_t k = 0; k <= at.size(); ++k) {
    const int64_t to = k < at.size() ? at[k] : end, from = e.pos();
    if (to == from) break;
    lg = run(e, t.subspan(size_t(from - p), size_t(to - from)), all_logits ? &part : nullptr);
    if (all_logits) all_logits->insert(all_logits->end(), part.begin(), part.end());
    if (k < at.size()) store(e);
  }
  return lg;
}

int64_t GpuEngine::attach_media(Id id, const model::Media<float>& media) {
  Entry& e = get(id);
  int64_t rows = 0;
  const std::vector<float> features = g_.media_features(media, &rows);
  if (e.media_taken > 0) {  // drop the rows already taken
    e.media.erase(e.media.begin(), e.media.begin() + e.media_taken * g_.config().hidden_size);
    e.media_taken = 0;
  }
  e.media.insert(e.media.end(), features.begin(), features.end());
  return rows;
}

const std::vector<float>& GpuEngine::decode(std::span<const Id> ids, std::span<const int32_t> t) {
  const int64_t S = static_cast<int64_t>(ids.size());
  LM_CHECK(S >= 1 && t.size() == ids.size(), "decode: {} sequences and {} tokens", ids.size(), t.size());
  std::vector<char> in_step(at_.size(), 0);
  for (Id id : ids) {
    const Entry& e = get(id);
    LM_CHECK(!e.tokens.empty(), "decode: sequence {} holds no tokens (prefill it first)", id);
    LM_CHECK(!in_step[size_t(e.slot)], "decode: sequence {} is asked for twice", id);
    in_step[size_t(e.slot)] = 1;
  }
  // The sequences of this step into slots [0, S): free targets first, then those held by other sequences.
  std::vector<int64_t> targets;
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t s = 0; s < S; ++s)
      if (!in_step[size_t(s)] && (at_[size_t(s)] == 0) == (pass == 0)) targets.push_back(s);
  size_t next = 0;
  for (Id id : ids) {
    if (get(id).slot < S) continue;
    const int64_t to = targets[next++];
    if (const Id other = at_[size_t(to)]) move(other, free_slot(to));
    move(id, to);
  }
  int64_t need = 0;
  for (Id id : ids) need += g_.blocks_needed(get(id).slot, 1);
  make_room(need);
  std::vector<int32_t> by_slot(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) by_slot[size_t(get(ids[size_t(i)]).slot)] = t[size_t(i)];
  const size_t V = static_cast<size_t>(vocab_size());
  by_slot_.resize(size_t(S) * V), logits_.resize(size_t(S) * V);
  g_.decode(0, S, by_slot.data(), by_slot_.data());
  for (int64_t i = 0; i < S; ++i) {
    Entry& e = get(ids[size_t(i)]);
    std::copy_n(by_slot_.data() + size_t(e.slot) * V, V, logits_.data() + size_t(i) * V);
    e.tokens.push_back(t[size_t(i)]);
    e.on_grid = false;  // (a decoded token's rows are the decode kernels': a snapshot needs a prefill's)
  }
  return logits_;
}

// ---- make_engine ---------------------------------------------------------------------------------------
void check_device(const std::string& device) {
  LM_CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda, not '{}'", device);
  LM_CHECK(device == "cpu" || model::cuda::available(), "--device cuda: no usable CUDA device{}",
           model::cuda::built_with_cuda() ? "" : " (longmoe was built without CUDA)");
}

OwnedEngine make_engine(const model::ModelConfig& c, model::Model<float>* m, const EngineOptions& o, uint64_t seed) {
  check_device(o.device);
  OwnedEngine e;
  if (o.device == "cpu") {
    LM_CHECK(m != nullptr, "the cpu engine needs the model's weights on the host");
    e.session = std::make_unique<Session>(*m, o.session);
    e.engine = std::make_unique<CpuEngine>(*e.session);
    return e;
  }
  e.gpu = std::make_unique<model::cuda::GpuModel>(c, model::cuda::GpuModel::Inference{});
  if (m) e.gpu->upload(m->params());
  else e.gpu->init_random(seed);
  GpuEngineOptions g;
  g.max_sequences = o.max_sequences;
  g.context = o.session.max_context;
  g.prefill_chunk = o.session.prefill_chunk;
  g.pool_tokens = o.pool_tokens;
  g.prefix_cache_bytes = o.session.prefix_cache_bytes;
  e.engine = std::make_unique<GpuEngine>(*e.gpu, g);
  return e;
}

}  // namespace lm::infer
