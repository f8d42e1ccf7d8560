// Inference on the GPU (GpuModel::Impl, gpu_model_impl.hpp; the CPU engine is infer/session.cpp): the slot caches
// (InferState: KDA states and conv inputs per slot, the paged MLA latent pool), and the walk of stack.cpp run in
// prefill or decode mode, where the mixers continue from and update the caches (kda_mixer.cpp, mla.cpp); the LM
// head over the rows asked for. A decode step of a given (first slot, batch) is captured into a CUDA graph the
// second time it is asked for and replayed from then on (decode_walk).
//
// Legend: rows tokens of the call (prefill: n of one sequence; decode: S slots, one token each), d hidden,
//         V vocabulary, L layers; per slot the caches of model/cache.hpp (KDA "S" [H, K, K] and "conv" [3, HK, W-1]
//         fp32), per MLA layer the latent pool bf16 [blocks, kBlock, R + Dr].
#ifdef LONGMOE_HAVE_CUDA

#include "model/cuda/gpu_model_impl.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/cuda/stream.hpp"
#include "ops/gemm/cuda/gemm_cuda.hpp"

namespace lm::model::cuda {

size_t InferState::Prefill::bytes() const {
  static_assert(sizeof(Prefill) == 10 * sizeof(DBuf), "Prefill::bytes lists every buffer");
  return bytes_of({&o_part, &lse_part, &o_acc, &lse_acc, &cn, &ckr, &kv, &k, &v, &h0});
}
size_t InferState::bytes() const {
  return bytes_of(state) + bytes_of(conv) + bytes_of(latent) +
         bytes_of({&table, &lens, &q_lat, &o_lat, &dec_ws, &logits}) + pre.bytes();
}

void InferState::drop_graphs() {
  for (auto& [key, g] : graphs) cudaGraphExecDestroy(g.exec);
  graphs.clear();
}

InferState::~InferState() {
  drop_graphs();
  cudaFreeHost(ids_pin), cudaFreeHost(lens_pin), cudaFreeHost(logits_pin), cudaFreeHost(snap_pin);
  if (stream) cudaStreamDestroy(stream);
}

void GpuModel::Impl::reserve_caches(int64_t n_slots, int64_t max_tokens, int64_t pool_tokens) {
  LM_CHECK(n_slots >= 1 && max_tokens >= 1, "gpu model: caches need at least one slot of one token (got {} x {})",
           n_slots, max_tokens);
  LM_CHECK(pool_tokens >= 0, "gpu model: a latent pool of {} tokens", pool_tokens);
  LM_CHECK(c.num_mla_layers() == 0 || (c.kv_lora_rank == 512 && c.qk_rope_head_dim == 64),
           "gpu model: inference needs kv_lora_rank 512 and qk_rope_head_dim 64 in MLA layers (the absorbed decode "
           "kernel's), this config has {} and {}", c.kv_lora_rank, c.qk_rope_head_dim);
  constexpr int64_t B = InferState::kBlock;
  const int64_t table_ld = (max_tokens + B - 1) / B;
  const int64_t blocks = pool_tokens ? (pool_tokens + B - 1) / B : n_slots * table_ld;
  LM_CHECK(blocks <= INT32_MAX, "gpu model: a latent pool of {} blocks", blocks);
  ck(cudaDeviceSynchronize(), "reserve caches");  // (nothing of a training step still runs; see moe_forward)
  InferState& f = inf;
  f.drop_graphs();
  f.state.clear(), f.conv.clear(), f.latent.clear();
  f.state.resize(size_t(L)), f.conv.resize(size_t(L)), f.latent.resize(size_t(L));
  for (int64_t i = 0; i < L; ++i) {
    const CacheSpec spec = plan[i].kda() ? KdaMixer<float>::cache_spec(c) : GatedMla<float>::cache_spec(c);
    for (const CacheSpec::State& st : spec.states) {
      LM_CHECK(st.dtype == DType::F32, "gpu model: cache state '{}' must be fp32", st.name);
      LM_CHECK(st.name == "S" || st.name == "conv", "gpu model: unknown cache state '{}'", st.name);
      DBuf& b = st.name == "S" ? f.state[size_t(i)] : f.conv[size_t(i)];
      ck(cudaMemset(b.ensure(size_t(n_slots) * st.numel() * 4), 0, size_t(n_slots) * st.numel() * 4), "cache");
    }
    if (spec.row_width) {
      LM_CHECK(spec.row_dtype == DType::BF16, "gpu model: latent rows must be bf16");
      f.latent[size_t(i)].ensure(size_t(blocks) * B * spec.row_width * 2);
    }
  }
  f.slots = n_slots, f.max_tokens = max_tokens, f.blocks = blocks, f.table_ld = table_ld;
  f.snap_bytes = 0;
  for_each_slot_cache([&](const DBuf&, size_t per_slot) { f.snap_bytes += per_slot; });
  f.pos.assign(size_t(n_slots), 0);
  f.table_h.assign(size_t(n_slots), {});
  f.refs.assign(size_t(blocks), 0);
  f.snaps.clear();  // (their blocks are gone with the pool)
  cudaFreeHost(f.snap_pin);
  f.snap_pin = nullptr;
  f.free_blocks.resize(size_t(blocks));
  for (int64_t b = 0; b < blocks; ++b) f.free_blocks[size_t(b)] = int32_t(blocks - 1 - b);  // block 0 first
  ck(cudaMemset(f.table.ensure(size_t(n_slots) * table_ld * 4), 0, size_t(n_slots) * table_ld * 4), "table");
  ck(cudaMemset(f.lens.ensure(size_t(n_slots) * 4), 0, size_t(n_slots) * 4), "lens");
  cudaFreeHost(f.ids_pin), cudaFreeHost(f.lens_pin), cudaFreeHost(f.logits_pin);
  f.ids_pin = f.lens_pin = nullptr, f.logits_pin = nullptr;
  ck(cudaMallocHost(reinterpret_cast<void**>(&f.ids_pin), size_t(n_slots) * 4), "pinned ids");
  ck(cudaMallocHost(reinterpret_cast<void**>(&f.lens_pin), size_t(n_slots) * 4), "pinned lengths");
  ck(cudaMallocHost(reinterpret_cast<void**>(&f.logits_pin), size_t(n_slots) * V * 4), "pinned logits");
  if (!f.stream) ck(cudaStreamCreate(&f.stream), "inference stream");  // (blocking: ordered after uploads)
}

void GpuModel::Impl::release_blocks(std::vector<int32_t>& blocks) {
  InferState& f = inf;
  for (int32_t b : blocks)
    if (--f.refs[size_t(b)] == 0) f.free_blocks.push_back(b);
  blocks.clear();
}

void GpuModel::Impl::share_blocks(int64_t slot, const std::vector<int32_t>& blocks, int64_t pos) {
  InferState& f = inf;
  std::vector<int32_t>& t = f.table_h[size_t(slot)];
  for (int32_t b : blocks) ++f.refs[size_t(b)];  // (before the release: the two lists may share blocks)
  release_blocks(t);
  t = blocks;
  if (!t.empty())
    ck(cudaMemcpyAsync(as<int32_t>(f.table.p) + slot * f.table_ld, t.data(), t.size() * 4, cudaMemcpyHostToDevice,
                       f.stream),
       "block table");
  ck(cudaStreamSynchronize(f.stream), "share blocks");  // (t may change on the host from here)
  f.pos[size_t(slot)] = pos;
}

int64_t GpuModel::Impl::fresh_blocks(int64_t slot, int64_t from, int64_t upto) const {
  const InferState& f = inf;
  constexpr int64_t B = InferState::kBlock;
  if (c.num_mla_layers() == 0) return 0;
  const std::vector<int32_t>& t = f.table_h[size_t(slot)];
  const size_t need = size_t((upto + B - 1) / B), own_from = size_t(from / B);
  int64_t fresh = need > t.size() ? int64_t(need - t.size()) : 0;
  for (size_t j = own_from; j < std::min(need, t.size()); ++j) fresh += f.refs[size_t(t[j])] > 1;
  return fresh;
}

void GpuModel::Impl::claim_blocks(int64_t slot, int64_t from, int64_t upto) {
  InferState& f = inf;
  constexpr int64_t B = InferState::kBlock;
  if (c.num_mla_layers() == 0) return;
  std::vector<int32_t>& t = f.table_h[size_t(slot)];
  const size_t need = size_t((upto + B - 1) / B), own_from = size_t(from / B);
  const size_t fresh = size_t(fresh_blocks(slot, from, upto));
  if (fresh == 0) return;  // (the common decode step: its block is there and its own)
  LM_CHECK(fresh <= f.free_blocks.size(),
           "gpu model: the latent cache is full: slot {} needs {} more blocks of {} tokens, {} of {} are free", slot,
           fresh, B, f.free_blocks.size(), f.blocks);
  auto take = [&] {
    const int32_t b = f.free_blocks.back();
    f.free_blocks.pop_back();
    f.refs[size_t(b)] = 1;
    return b;
  };
  size_t changed = t.size();
  for (size_t j = own_from; j < std::min(need, t.size()); ++j) {
    if (f.refs[size_t(t[j])] == 1) continue;
    const int32_t b = take();  // copy-on-write: the block's rows before `from` are the sharing sequences'
    for (const DBuf& pool : f.latent)
      if (pool.p) {
        const size_t bb = pool.bytes / size_t(f.blocks);
        ck(cudaMemcpyAsync(as<char>(pool.p) + size_t(b) * bb, as<char>(pool.p) + size_t(t[j]) * bb, bb,
                           cudaMemcpyDeviceToDevice, f.stream),
           "copy a shared latent block");
      }
    --f.refs[size_t(t[j])];
    t[j] = b;
    changed = std::min(changed, j);
  }
  while (t.size() < need) t.push_back(take());
  // (from pageable memory: the copy has read t when it returns)
  ck(cudaMemcpyAsync(as<int32_t>(f.table.p) + slot * f.table_ld + changed, t.data() + changed,
                     (t.size() - changed) * 4, cudaMemcpyHostToDevice, f.stream),
     "block table");
}

std::vector<float> GpuModel::Impl::infer(const int32_t* ids, const Seqs& s, int64_t out_rows) {
  InferState::LeaveMode off{inf};
  cu::StreamScope on(inf.stream);
  const bool was_training = training;
  training = false;
  forward(ids, nullptr, s);
  training = was_training;
  const int64_t n = rows;
  float* logits = grow<float>(inf.logits, size_t(out_rows) * V * 4);
  const auto* hn = as<uint16_t>(got(top.hn, "hn")) + (n - out_rows) * d;
  oc::linear_fwd(hn, W("lm_head.weight"), logits, DType::F32, out_rows, d, V);
  std::vector<float> h(size_t(out_rows) * V);
  ck(cudaMemcpyAsync(h.data(), logits, h.size() * 4, cudaMemcpyDeviceToHost, inf.stream), "logits");
  ck(cudaStreamSynchronize(inf.stream), "logits");
  return h;
}

void GpuModel::Impl::decode_walk_eager(int64_t first, int64_t S) {
  InferState& f = inf;
  cu::StreamScope on(f.stream);
  f.mode = InferState::Mode::Decode, f.first = first, f.S = S;
  InferState::LeaveMode off{f};
  ck(cudaMemcpyAsync(as<int32_t>(f.lens.p) + first, f.lens_pin + first, size_t(S) * 4, cudaMemcpyHostToDevice,
                     f.stream),
     "lengths");
  const bool was_training = training;
  training = false;
  forward(f.ids_pin + first, nullptr, Seqs::batch(S, 1));  // (the ids go up from the pinned array, see forward)
  training = was_training;
  float* logits = grow<float>(f.logits, size_t(S) * V * 4);
  oc::linear_fwd(got(top.hn, "hn"), W("lm_head.weight"), logits, DType::F32, S, d, V);
  ck(cudaMemcpyAsync(f.logits_pin + first * V, logits, size_t(S) * V * 4, cudaMemcpyDeviceToHost, f.stream),
     "logits");
}

namespace {
// "N nodes: a kernel, b memcpy, ..." of a captured graph (what a step costs in launches).
std::string node_kinds(cudaGraph_t g) {
  size_t n = 0;
  if (cudaGraphGetNodes(g, nullptr, &n) != cudaSuccess) return "?";
  std::vector<cudaGraphNode_t> nodes(n);
  if (n && cudaGraphGetNodes(g, nodes.data(), &n) != cudaSuccess) return "?";
  std::map<std::string, int> kinds;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType t;
    if (cudaGraphNodeGetType(node, &t) != cudaSuccess) continue;
    switch (t) {
      case cudaGraphNodeTypeKernel: ++kinds["kernel"]; break;
      case cudaGraphNodeTypeMemcpy: ++kinds["memcpy"]; break;
      case cudaGraphNodeTypeMemset: ++kinds["memset"]; break;
      case cudaGraphNodeTypeMemAlloc: ++kinds["alloc"]; break;
      case cudaGraphNodeTypeMemFree: ++kinds["free"]; break;
      case cudaGraphNodeTypeEventRecord: case cudaGraphNodeTypeWaitEvent: ++kinds["event"]; break;
      case cudaGraphNodeTypeEmpty: ++kinds["empty"]; break;
      default: ++kinds["other"];
    }
  }
  std::string r = fmt::format("{} nodes:", n);
  for (const auto& [k, c] : kinds) r += fmt::format(" {} {}", c, k);
  return r;
}
}  // namespace

void GpuModel::Impl::decode_walk(int64_t first, int64_t S) {
  InferState& f = inf;
  if (!f.use_graphs || profiling) return decode_walk_eager(first, S);
  const auto key = std::make_pair(first, S);
  auto it = f.graphs.find(key);
  if (it != f.graphs.end() && it->second.epoch == DBuf::epoch()) {
    ck(cudaGraphLaunch(it->second.exec, f.stream), "decode graph launch");
    return;
  }
  if (it != f.graphs.end()) cudaGraphExecDestroy(it->second.exec), f.graphs.erase(it);
  // This step runs eagerly (sizing every buffer the shape needs); then the same walk is captured for the next ones.
  decode_walk_eager(first, S);
  const uint64_t epoch = DBuf::epoch();
  cudaGraph_t g = nullptr;
  ck(cudaStreamBeginCapture(f.stream, cudaStreamCaptureModeThreadLocal), "decode graph capture");
  std::string failed;
  try {
    decode_walk_eager(first, S);
  } catch (const std::exception& e) {
    failed = e.what();
  }
  const cudaError_t end = cudaStreamEndCapture(f.stream, &g);
  cudaGraphExec_t exec = nullptr;
  if (failed.empty() && end == cudaSuccess && DBuf::epoch() == epoch &&
      cudaGraphInstantiate(&exec, g, 0) == cudaSuccess) {
    f.graphs[key] = {exec, epoch};
    ++f.captures;
    f.graph_nodes = node_kinds(g);
  } else {  // a walk that cannot be captured runs eagerly from now on
    cudaGetLastError();
    f.use_graphs = false;
    fmt::print(stderr, "gpu model: decode steps run without CUDA graphs ({})\n",
               failed.empty() ? cudaGetErrorString(end) : failed);
  }
  if (g) cudaGraphDestroy(g);
}

// ---- the public API (gpu_model.hpp) ----------------------------------------------------------------
void GpuModel::reserve_caches(int64_t slots, int64_t max_tokens, int64_t pool_tokens) {
  p_->reserve_caches(slots, max_tokens, pool_tokens);
}
int64_t GpuModel::cache_slots() const { return p_->inf.slots; }
int64_t GpuModel::slot_tokens(int64_t slot) const {
  LM_CHECK(slot >= 0 && slot < p_->inf.slots, "gpu model: slot {} outside [0, {})", slot, p_->inf.slots);
  return p_->inf.pos[size_t(slot)];
}
size_t GpuModel::cache_bytes() const { return p_->inf.bytes(); }
int64_t GpuModel::free_cache_tokens() const {
  return int64_t(p_->inf.free_blocks.size()) * InferState::kBlock;
}
void GpuModel::set_decode_graphs(bool on) {
  p_->inf.use_graphs = on;
  if (!on) p_->inf.drop_graphs();
}
bool GpuModel::decode_graphs() const { return p_->inf.use_graphs; }
int64_t GpuModel::decode_captures() const { return p_->inf.captures; }
std::string GpuModel::decode_graph_nodes() const { return p_->inf.graph_nodes; }

// The checks of a prompt of n tokens after what `slot` holds (prefill and extend), before anything changes.
void GpuModel::Impl::check_prompt(const char* what, int64_t slot, const int32_t* ids, int64_t n, int64_t chunk,
                                  std::span<const float> features) const {
  const InferState& f = inf;
  LM_CHECK(f.slots > 0, "gpu model: {} before reserve_caches", what);
  LM_CHECK(slot >= 0 && slot < f.slots, "gpu model: {} slot {} outside [0, {})", what, slot, f.slots);
  LM_CHECK(n >= 1, "gpu model: {} of no tokens", what);
  LM_CHECK(chunk >= 1, "gpu model: prefill_chunk {}", chunk);
  const int64_t held = std::string_view(what) == "extend" ? f.pos[size_t(slot)] : 0;
  LM_CHECK(held + n <= f.max_tokens,
           "gpu model: a prompt of {} tokens after {} cached exceeds the cache of {} tokens per sequence", n, held,
           f.max_tokens);
  for (int64_t t = 0; t < n; ++t)
    LM_CHECK(ids[t] >= 0 && ids[t] < V, "gpu model: token id {} at prompt position {} is outside the vocabulary "
             "[0, {})", ids[t], held + t, V);
  const int64_t n_ph = placeholder < 0 ? 0 : std::count(ids, ids + n, placeholder);
  LM_CHECK(features.size() % size_t(d) == 0, "gpu model: {} feature values are not whole rows of width {}",
           features.size(), d);
  LM_CHECK(n_ph == std::ssize(features) / d,
           "gpu model: the prompt has {} media placeholder token(s) (id {}) but {} image feature row(s) are given; "
           "a prompt carries one placeholder per feature row", n_ph, placeholder, std::ssize(features) / d);
}

// n tokens after what `slot` holds, prefill_chunk at a time: each chunk through the walk in prefill mode, where the
// mixers continue from the caches (a chunk after the first: kda_forward from the cached state and conv inputs,
// mla_prefill_attend over the cached latents). Chunks end on the absolute grid of multiples of `chunk`, so a prompt
// is cut at the same positions however it arrives in calls that start on the grid: a sequence resumed from a grid
// point (a prefix snapshot) continues as the whole prefill would, bit for bit. On an error the slot is left empty.
std::vector<float> GpuModel::Impl::prefill_chunks(int64_t slot, const int32_t* ids, int64_t n, int64_t chunk,
                                                  std::vector<float>* all_logits, const float* features) {
  InferState& f = inf;
  struct Drop {  // a walk that fails leaves an empty slot, never a half-written one
    Impl& m;
    int64_t slot;
    bool armed = true;
    ~Drop() {
      if (armed) m.inf.pos[size_t(slot)] = 0, m.release_blocks(slot);
    }
  } drop{*this, slot};
  claim_blocks(slot, f.pos[size_t(slot)], f.pos[size_t(slot)] + n);
  if (all_logits) all_logits->clear();
  std::vector<float> lg;
  for (int64_t c0 = 0, m = 0; c0 < n; c0 += m) {
    m = std::min(chunk - f.pos[size_t(slot)] % chunk, n - c0);  // (chunks end on the absolute grid)
    f.mode = InferState::Mode::Prefill, f.first = slot, f.S = 1, f.start = f.pos[size_t(slot)];
    // this chunk's placeholders take the next feature rows
    const int64_t n_ph = placeholder < 0 || !features ? 0 : std::count(ids + c0, ids + c0 + m, placeholder);
    const SpliceScope splice{*this, {nullptr, features, n_ph}};
    if (n_ph) features += n_ph * d;
    lg = infer(ids + c0, Seqs::batch(1, m), all_logits ? m : 1);
    f.pos[size_t(slot)] += m;
    if (all_logits) all_logits->insert(all_logits->end(), lg.begin(), lg.end());
  }
  drop.armed = false;
  if (all_logits) return std::vector<float>(all_logits->end() - V, all_logits->end());
  return lg;
}

std::vector<float> GpuModel::prefill(int64_t slot, const int32_t* ids, int64_t n, std::vector<float>* all_logits,
                                     std::span<const float> features) {
  Impl& m = *p_;
  m.check_prompt("prefill", slot, ids, n, prefill_chunk, features);  // (before the slot is dropped)
  m.profiling = profiling;
  m.inf.pos[size_t(slot)] = 0;
  m.release_blocks(slot);
  return m.prefill_chunks(slot, ids, n, prefill_chunk, all_logits, features.data());
}

std::vector<float> GpuModel::extend(int64_t slot, const int32_t* ids, int64_t n, std::vector<float>* all_logits,
                                    std::span<const float> features) {
  Impl& m = *p_;
  m.check_prompt("extend", slot, ids, n, prefill_chunk, features);
  m.profiling = profiling;
  return m.prefill_chunks(slot, ids, n, prefill_chunk, all_logits, features.data());
}

std::vector<float> GpuModel::decode(int64_t first, int64_t S, const int32_t* ids) {
  std::vector<float> lg(size_t(S) * size_t(p_->V));
  decode(first, S, ids, lg.data());
  return lg;
}

void GpuModel::decode(int64_t first, int64_t S, const int32_t* ids, float* logits) {
  Impl& m = *p_;
  InferState& f = m.inf;
  LM_CHECK(S >= 1 && first >= 0 && first + S <= f.slots, "gpu model: decode slots [{}, {}) outside [0, {})", first,
           first + S, f.slots);
  for (int64_t s = first; s < first + S; ++s) {
    LM_CHECK(f.pos[size_t(s)] > 0, "gpu model: decode of slot {}, which holds no sequence", s);
    LM_CHECK(f.pos[size_t(s)] < f.max_tokens, "gpu model: slot {} is full ({} tokens)", s, f.max_tokens);
  }
  for (int64_t s = 0; s < S; ++s) {
    LM_CHECK(ids[s] >= 0 && ids[s] < m.V, "gpu model: token id {} of slot {} is outside the vocabulary [0, {})",
             ids[s], first + s, m.V);
    LM_CHECK(ids[s] != m.placeholder, "gpu model: decode of the media placeholder (id {}) in slot {}: images enter "
             "through a prefill", ids[s], first + s);
  }
  for (int64_t s = first; s < first + S; ++s) m.claim_blocks(s, f.pos[size_t(s)], f.pos[size_t(s)] + 1);
  m.profiling = profiling;
  for (int64_t s = 0; s < S; ++s)
    f.ids_pin[first + s] = ids[s], f.lens_pin[first + s] = int32_t(f.pos[size_t(first + s)]);
  m.decode_walk(first, S);
  ck(cudaStreamSynchronize(f.stream), "decode");
  for (int64_t s = first; s < first + S; ++s) ++f.pos[size_t(s)];
  std::copy_n(f.logits_pin + first * m.V, size_t(S) * size_t(m.V), logits);
}

int64_t GpuModel::blocks_needed(int64_t slot, int64_t n) const {
  LM_CHECK(slot >= 0 && slot < p_->inf.slots, "gpu model: slot {} outside [0, {})", slot, p_->inf.slots);
  const int64_t pos = p_->inf.pos[size_t(slot)];
  return p_->fresh_blocks(slot, pos, pos + n);
}

void GpuModel::release_slot(int64_t slot) {
  InferState& f = p_->inf;
  LM_CHECK(slot >= 0 && slot < f.slots, "gpu model: release_slot {} outside [0, {})", slot, f.slots);
  f.pos[size_t(slot)] = 0;
  p_->release_blocks(slot);
}

void GpuModel::copy_slot(int64_t from, int64_t to) {
  Impl& m = *p_;
  InferState& f = m.inf;
  LM_CHECK(from >= 0 && from < f.slots && to >= 0 && to < f.slots, "gpu model: copy_slot {} -> {} outside [0, {})",
           from, to, f.slots);
  if (from == to) return;
  m.for_each_slot_cache([&](const DBuf& b, size_t per_slot) {
    ck(cudaMemcpyAsync(as<char>(b.p) + to * per_slot, as<char>(b.p) + from * per_slot, per_slot,
                       cudaMemcpyDeviceToDevice, f.stream),
       "copy_slot");
  });
  // The latent blocks are shared, not copied: the first write into a shared block copies it (claim_blocks).
  m.share_blocks(to, f.table_h[size_t(from)], f.pos[size_t(from)]);
}

// ---- snapshots ----------------------------------------------------------------------------------------
void GpuModel::reserve_snapshots(int64_t count) {
  Impl& m = *p_;
  InferState& f = m.inf;
  LM_CHECK(f.slots > 0, "gpu model: reserve_snapshots before reserve_caches");
  LM_CHECK(count >= 0, "gpu model: {} snapshots", count);
  for (InferState::Snap& s : f.snaps) m.release_blocks(s.blocks);
  f.snaps.assign(size_t(count), {});
  cudaFreeHost(f.snap_pin);
  f.snap_pin = nullptr;
  if (count > 0 && f.snap_bytes > 0)
    ck(cudaMallocHost(reinterpret_cast<void**>(&f.snap_pin), size_t(count) * f.snap_bytes), "pinned snapshots");
}
int64_t GpuModel::snapshot_count() const { return int64_t(p_->inf.snaps.size()); }
size_t GpuModel::snapshot_bytes() const { return p_->inf.snap_bytes; }

int64_t GpuModel::snapshot_tokens(int64_t snap) const {
  const InferState& f = p_->inf;
  LM_CHECK(snap >= 0 && snap < int64_t(f.snaps.size()), "gpu model: snapshot {} outside [0, {})", snap,
           f.snaps.size());
  return f.snaps[size_t(snap)].pos;
}

void GpuModel::drop_snapshot(int64_t snap) {
  snapshot_tokens(snap);  // (the check)
  InferState::Snap& s = p_->inf.snaps[size_t(snap)];
  p_->release_blocks(s.blocks);
  s.pos = 0;
}

void GpuModel::save_snapshot(int64_t slot, int64_t snap) {
  Impl& m = *p_;
  InferState& f = m.inf;
  LM_CHECK(slot >= 0 && slot < f.slots, "gpu model: save_snapshot of slot {} outside [0, {})", slot, f.slots);
  drop_snapshot(snap);
  char* host = f.snap_pin + size_t(snap) * f.snap_bytes;
  m.for_each_slot_cache([&](const DBuf& b, size_t per_slot) {
    ck(cudaMemcpyAsync(host, as<char>(b.p) + slot * per_slot, per_slot, cudaMemcpyDeviceToHost, f.stream),
       "save snapshot");
    host += per_slot;
  });
  ck(cudaStreamSynchronize(f.stream), "save snapshot");
  InferState::Snap& s = f.snaps[size_t(snap)];
  s.pos = f.pos[size_t(slot)];
  // The blocks holding its rows (a slot may hold blocks claimed ahead of its length).
  const std::vector<int32_t>& t = f.table_h[size_t(slot)];
  s.blocks.assign(t.begin(), t.begin() + std::min<int64_t>(int64_t(t.size()), (s.pos + InferState::kBlock - 1) /
                                                                                 InferState::kBlock));
  for (int32_t b : s.blocks) ++f.refs[size_t(b)];
}

void GpuModel::load_snapshot(int64_t snap, int64_t slot) {
  Impl& m = *p_;
  InferState& f = m.inf;
  LM_CHECK(slot >= 0 && slot < f.slots, "gpu model: load_snapshot into slot {} outside [0, {})", slot, f.slots);
  LM_CHECK(snapshot_tokens(snap) > 0, "gpu model: snapshot {} is empty", snap);
  const char* host = f.snap_pin + size_t(snap) * f.snap_bytes;
  m.for_each_slot_cache([&](const DBuf& b, size_t per_slot) {
    ck(cudaMemcpyAsync(as<char>(b.p) + slot * per_slot, host, per_slot, cudaMemcpyHostToDevice, f.stream),
       "load snapshot");
    host += per_slot;
  });
  m.share_blocks(slot, f.snaps[size_t(snap)].blocks, f.snaps[size_t(snap)].pos);  // (synchronises)
}

}  // namespace lm::model::cuda

#endif
