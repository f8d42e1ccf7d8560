#pragma once
// A decoding engine over many sequences, what the inference verbs and the server drive, whichever device runs the
// model: the CPU Session (CpuEngine; infer/session.hpp) or the slot caches of the GPU model (GpuEngine;
// model/cuda/gpu_model.hpp). Sequences are named by ids; one thread drives an engine (the server's scheduler).
//
// Legend: S sequences decoded together, V vocabulary, n tokens of one prefill call, Cp the prefill chunk (the grid
// the server cuts prompts on), M sequences open at once at most.
//
// GPU slots: the model decodes a contiguous range of slots [0, S) per step (one CUDA graph per S), so before a step
// GpuEngine moves the sequences asked for into the first S slots: a sequence already there stays, one outside takes a
// slot of [0, S) that is free or held by a sequence not in this step (which moves out first, to a free slot). A move
// copies the KDA states and conv inputs and shares the latent blocks (GpuModel::copy_slot, then release_slot of the
// old slot), so it changes no result; the model holds M + 1 slots so that a free one always exists. Continuous
// batching changes the set only when a sequence joins or ends, so most steps move nothing.
// Admission: a sequence opened with `reserve` tokens holds that many of the latent pool (rounded up to its 64-token
// blocks) until it closes, so sequences admitted together can always run to their limits; fits() says whether one
// more would.
// GPU prefix cache: at the last grid point a prefill call reaches (a multiple of Cp, the sequence prefilled on the
// grid from its start), the slot is saved into a snapshot (GpuModel::save_snapshot: its KDA states and conv inputs
// in pinned host memory, its latent blocks kept in the pool, shared). A sequence opened on a prompt, or an empty one
// prefilled, loads the longest stored prefix of prompt[0 : n − 1] and prefills the rest; prefill chunks end on the
// absolute grid (GpuModel), so the resumed sequence computes what the whole prefill would, bit for bit. Snapshots
// are evicted least recently used first: for a new one when all are taken, and for latent blocks when a prefill or
// a decode step needs more than the pool has free (reservations count only the open sequences: snapshots give way).
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "infer/session.hpp"
#include "model/cuda/gpu_model.hpp"

namespace lm::infer {

class Engine {
 public:
  using Id = int64_t;
  virtual ~Engine() = default;
  // A new sequence that may grow to `reserve` tokens (0: the context). It starts empty or, with the prefix cache
  // on, resumed from the longest stored prefix of prompt[0 : n − 1] (pos() tells how far; at least one prompt token
  // is left to prefill). lm::Error when it cannot be held (fits() is false).
  virtual Id open(std::span<const int32_t> prompt = {}, int64_t reserve = 0) = 0;
  virtual void close(Id id) = 0;
  // Whether a sequence of `reserve` tokens (0: the context) can be opened now; can_ever_fit: once the others end.
  virtual bool fits(int64_t reserve) const = 0;
  virtual bool can_ever_fit(int64_t reserve) const = 0;
  virtual const std::vector<int32_t>& tokens(Id id) const = 0;  // consumed so far
  int64_t pos(Id id) const { return static_cast<int64_t>(tokens(id).size()); }
  // Runs `t` after what sequence `id` holds: the logits [V] after the last token (all_logits: every token's,
  // [n, V]). With the prefix cache on, states at grid points may be stored when `store_prefix`. lm::Error for
  // ids outside the vocabulary or a length past the context (the sequence is then unchanged, or empty on the GPU).
  virtual std::vector<float> prefill(Id id, std::span<const int32_t> t, std::vector<float>* all_logits = nullptr,
                                     bool store_prefix = true) = 0;
  // The image(s) of `media` through the model's tower, queued on sequence `id` for the placeholders of its next
  // prefills (Session::attach_media). Returns the feature rows, one placeholder each. lm::Error for a model without a
  // tower, media the tower refuses, or an engine that takes no images.
  virtual int64_t attach_media(Id id, const model::Media<float>& media) = 0;
  // One token for each of the S sequences: logits [S, V] in the order asked, in the engine's buffer (valid until the
  // next decode: a step allocates nothing). On an error no sequence changes.
  virtual const std::vector<float>& decode(std::span<const Id> ids, std::span<const int32_t> t) = 0;
  virtual int64_t max_context() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t prefill_chunk() const = 0;    // Cp
  virtual int64_t max_sequences() const = 0;    // M (0: no limit but memory)
  virtual bool prefix_cache() const = 0;        // whether open() can resume from stored prefixes
  virtual PrefixStats prefix_stats() const = 0;
  virtual int64_t cache_bytes() const = 0;      // the caches held now (all sequences)
  virtual std::string describe() const = 0;     // e.g. "cpu" or "cuda: 16 slots, latent pool 1048576 tokens"
  // `f` runs between two sublayers of each prefill (Session::set_prefill_yield; empty: none). The GPU engine
  // ignores it: its chunk is one stream of kernels.
  virtual void set_prefill_yield(std::function<void()> f) { (void)f; }
};

// The CPU Session (borrowed: the caller keeps it alive).
class CpuEngine final : public Engine {
 public:
  explicit CpuEngine(Session& s) : s_(s) {}
  Id open(std::span<const int32_t> prompt = {}, int64_t reserve = 0) override;
  void close(Id id) override { seqs_.erase(id); }
  bool fits(int64_t) const override { return true; }
  bool can_ever_fit(int64_t reserve) const override { return reserve <= s_.max_context(); }
  const std::vector<int32_t>& tokens(Id id) const override { return get(id).tokens; }
  std::vector<float> prefill(Id id, std::span<const int32_t> t, std::vector<float>* all_logits = nullptr,
                             bool store_prefix = true) override;
  int64_t attach_media(Id id, const model::Media<float>& media) override;
  const std::vector<float>& decode(std::span<const Id> ids, std::span<const int32_t> t) override;
  int64_t max_context() const override { return s_.max_context(); }
  int64_t vocab_size() const override { return s_.vocab_size(); }
  int64_t prefill_chunk() const override { return s_.options().prefill_chunk; }
  int64_t max_sequences() const override { return 0; }
  bool prefix_cache() const override { return s_.options().prefix_cache_bytes > 0; }
  PrefixStats prefix_stats() const override { return s_.prefix_stats(); }
  int64_t cache_bytes() const override;
  std::string describe() const override { return "cpu"; }
  void set_prefill_yield(std::function<void()> f) override { s_.set_prefill_yield(std::move(f)); }

 private:
  const Sequence& get(Id id) const;
  Sequence& get(Id id) { return const_cast<Sequence&>(std::as_const(*this).get(id)); }
  Session& s_;
  std::map<Id, Sequence> seqs_;
  std::vector<float> logits_;
  Id next_ = 1;
};

struct GpuEngineOptions {
  int64_t max_sequences = 1;   // M
  int64_t context = 0;         // per sequence; 0: context_limit(config)
  int64_t prefill_chunk = 2048;
  int64_t pool_tokens = 0;     // latent pool; 0: M × context, capped by what fits in the device's memory
  int64_t prefix_cache_bytes = 0;  // pinned host memory for prefix snapshots (GpuModel::snapshot_bytes each); 0: off
};

// The GPU model's slots (the model is borrowed, its weights uploaded or drawn; its caches are reserved here).
class GpuEngine final : public Engine {
 public:
  GpuEngine(model::cuda::GpuModel& g, GpuEngineOptions o);
  Id open(std::span<const int32_t> prompt = {}, int64_t reserve = 0) override;
  void close(Id id) override;
  bool fits(int64_t reserve) const override;
  bool can_ever_fit(int64_t reserve) const override;
  const std::vector<int32_t>& tokens(Id id) const override { return get(id).tokens; }
  std::vector<float> prefill(Id id, std::span<const int32_t> t, std::vector<float>* all_logits = nullptr,
                             bool store_prefix = true) override;
  int64_t attach_media(Id id, const model::Media<float>& media) override;
  const std::vector<float>& decode(std::span<const Id> ids, std::span<const int32_t> t) override;
  int64_t max_context() const override { return o_.context; }
  int64_t vocab_size() const override;
  int64_t prefill_chunk() const override { return o_.prefill_chunk; }
  int64_t max_sequences() const override { return o_.max_sequences; }
  bool prefix_cache() const override { return g_.snapshot_count() > 0; }
  PrefixStats prefix_stats() const override { return prefix_.stats(); }
  int64_t cache_bytes() const override;
  std::string describe() const override;
  int64_t pool_tokens() const { return o_.pool_tokens; }
  int64_t moves() const { return moves_; }             // slot moves so far (for tests and the server's stats)

 private:
  struct Entry {
    int64_t slot = -1, reserve_blocks = 0;
    std::vector<int32_t> tokens;
    bool on_grid = true;  // every token prefilled in calls that started on the grid (what a snapshot may hold)
    bool looked_up = false;  // the prefix cache was asked for this sequence's prompt (once: a miss counts once)
    std::vector<float> media = {};  // image feature rows attached [k, d], for the placeholders of the next prefills
    int64_t media_taken = 0;   // rows of `media` already consumed
    int64_t pos() const { return static_cast<int64_t>(tokens.size()); }
  };
  const Entry& get(Id id) const;
  Entry& get(Id id) { return const_cast<Entry&>(std::as_const(*this).get(id)); }
  int64_t blocks_for(int64_t reserve) const;
  void warm_up();
  int64_t free_slot(int64_t except) const;
  void move(Id id, int64_t to);
  void resume(Entry& e, std::span<const int32_t> prompt);  // from the longest stored prefix of prompt[0 : n − 1]
  void store(Entry& e);                                    // a snapshot of e (already stored: made the most recent)
  void evict();                                            // the least recently used snapshot
  void make_room(int64_t blocks);                          // evicts until the pool has `blocks` free (or none is left)
  std::vector<float> run(Entry& e, std::span<const int32_t> t, std::vector<float>* all_logits);
  model::cuda::GpuModel& g_;
  GpuEngineOptions o_;
  std::map<Id, Entry> seqs_;
  std::vector<Id> at_;  // [M + 1] the sequence in each slot (0: free)
  std::vector<float> by_slot_, logits_;  // a step's logits [S, V] in slot order and in the order asked
  int64_t reserved_blocks_ = 0, pool_blocks_ = 0, moves_ = 0;
  Id next_ = 1;
  PrefixIndex<int64_t> prefix_;  // the stored prefixes and their snapshots
  std::vector<int64_t> free_snaps_;
};

// The latent pool GpuEngine gets by default: M × context tokens, or fewer so that inference_memory() stays within
// 92% of the device's memory (lm::Error naming the sizes when not even one context fits).
int64_t default_pool_tokens(const model::ModelConfig& c, int64_t max_sequences, int64_t context,
                            int64_t prefill_chunk, double device_bytes);

// An engine with what it runs on: a Session over the model's weights (cpu), or the GPU model they are uploaded to
// (cuda: bf16 weights, fp32 KDA states, bf16 latent cache).
struct EngineOptions {
  std::string device = "cpu";  // "cpu" or "cuda"
  SessionOptions session;      // max_context, prefill_chunk and the prefix cache's budget apply to both devices
  int64_t max_sequences = 1;   // cuda: sequences open at once
  int64_t pool_tokens = 0;     // cuda: the latent pool (0: default_pool_tokens)
};
struct OwnedEngine {
  std::unique_ptr<Session> session;
  std::unique_ptr<model::cuda::GpuModel> gpu;
  std::unique_ptr<Engine> engine;
  Engine& operator*() const { return *engine; }
  Engine* operator->() const { return engine.get(); }
};
// lm::Error for a device other than cpu and cuda, or cuda without a usable GPU (or a build without CUDA).
void check_device(const std::string& device);
// The weights are `m`'s; with m null (cuda only), random ones drawn on the device from `seed`. check_device first.
OwnedEngine make_engine(const model::ModelConfig& c, model::Model<float>* m, const EngineOptions& o,
                        uint64_t seed = 1);

}  // namespace lm::infer
