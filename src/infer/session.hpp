#pragma once
// Decoding engine over model::Model<float> (SPEC §2, §3, §6): per-sequence caches, chunked prefill,
// batched single-token decode, snapshots and a prefix cache keyed by token ids.
//
// Legend: L layers, d hidden, V vocabulary, H/K KDA heads and head dim (V = K), W conv taps,
//         Hm MLA heads, R kv_lora_rank, Dr qk_rope_head_dim, RD = R + Dr, T tokens in a sequence,
//         S sequences decoded together, n tokens of one prefill chunk, Cp the prefill chunk.
//
// Cache of one sequence (fp32 on the CPU): one model::LayerCache per layer, laid out as the layer's mixer
// describes it (cache_spec: a KDA layer's state and conv inputs, an MLA layer's latent rows [T, RD]). AttnRes
// keeps nothing: every read is over the depth sources of its own token, which the walk rebuilds for the new
// tokens alone. The session walks the stack plan and calls each layer's own prefill / decode.
// Prefill runs a prompt in chunks whose boundaries sit on the absolute grid of multiples of Cp
// (the first chunk of a continued sequence ends at the next grid point): KDA carries its state through
// h0/ht and the conv caches, MLA attends (absorbed, causal with an offset) to the latent cache so far.
// Because a prompt is always cut at the same absolute positions, the state at a grid point does not
// depend on how the prompt arrived; prefix-cache snapshots are taken at grid points, so resuming one
// and prefilling the rest gives the same bits as a fresh prefill.
// Decode: one token for each of S sequences; projections, FFNs and MoE are one GEMM over the S rows;
// KDA is the recurrent step, MLA the absorbed form over each sequence's latent cache; AttnRes reads are
// batched per block (phase 1 over the closed blocks for every read of the block, phase 2 with the partial sum).
// Not thread-safe: one thread drives a Session (the server's scheduler).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "infer/prefix_index.hpp"
#include "model/model.hpp"

namespace lm::infer {

struct SessionOptions {
  int64_t prefill_chunk = 512;                   // Cp: tokens per prefill step (also the snapshot grid)
  int64_t max_context = 0;                       // 0: max_position_embeddings, else 131072
  int64_t prefix_cache_bytes = int64_t(256) << 20;  // budget of stored prefix snapshots; 0 disables
};

// Everything a sequence needs to continue: the tokens consumed and the per-layer caches.
class Sequence {
 public:
  int64_t pos() const { return static_cast<int64_t>(tokens.size()); }
  // Bytes held by the caches (KDA states, conv inputs, MLA latent rows in use / allocated).
  int64_t cache_bytes() const;
  int64_t cache_capacity_bytes() const;

  std::vector<int32_t> tokens;                  // [T]
  std::vector<model::LayerCache<float>> layers;  // [L], each as its layer's cache_spec() lays it out
  // Every cached value came from prefill chunks on the absolute grid, so the caches equal a fresh prefill's
  // bit for bit; only such sequences feed the prefix cache. Cleared by decode and by a prefill that starts
  // off the grid.
  bool on_grid = true;
  // Image features attached (Session::attach_media) and not yet taken: the media placeholders of the next prefills
  // take these rows in order [rows, d] (SPEC §9, the model's splice). A sequence holding an image is never on the
  // grid: the prefix cache is keyed on tokens alone.
  std::vector<float> media;
  int64_t media_taken = 0;  // rows of `media` already consumed
};

// An immutable copy of a sequence's caches at a token boundary.
using Snapshot = std::shared_ptr<const Sequence>;

// Wall time per part of the last calls (reset by the caller), for `longmoe bench decode`.
struct SessionProfile {
  double kda = 0, mla = 0, ffn = 0, attnres = 0, other = 0;
  void clear() { *this = SessionProfile{}; }
};

class Session {
 public:
  explicit Session(model::Model<float>& m, SessionOptions o = {});
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const model::ModelConfig& config() const { return cfg_; }
  model::Model<float>& model() const { return m_; }
  const SessionOptions& options() const { return opt_; }
  int64_t max_context() const { return max_ctx_; }
  int64_t vocab_size() const { return cfg_.vocab_size; }

  // An empty sequence (zero KDA state, empty caches).
  Sequence new_sequence() const;

  // Runs `tokens` through the model after what `seq` already holds. Returns the logits [V] after the
  // last token; with `all_logits` also writes the logits of every new token [n, V]. An empty `seq`
  // first resumes from the longest stored prefix snapshot (exact token match) when the prefix cache is
  // on, and snapshots are stored at grid points when `store_prefix`. Throws lm::Error for ids outside
  // the vocabulary or a total length above max_context; `seq` is then unchanged.
  std::vector<float> prefill(Sequence& seq, std::span<const int32_t> tokens, std::vector<float>* all_logits = nullptr,
                             bool store_prefix = true);

  // Queues image features [rows, d] (Model::media_features) for the placeholders of the next prefills of `seq`: each
  // placeholder token takes the next row, in order, where the model's forward would splice it. A prefill with more
  // placeholders than rows queued is an lm::Error (and changes nothing); decode refuses placeholders.
  void attach_media(Sequence& seq, std::span<const float> features) const;

  // One new token for each sequence (S = seqs.size()): logits [S, V]. Same checks as prefill; on an
  // error no sequence is changed.
  std::vector<float> decode(const std::vector<Sequence*>& seqs, std::span<const int32_t> tokens);

  // Snapshot of a sequence (a copy of its caches) and a sequence resumed from one. A resumed sequence
  // continues exactly like the original would.
  static Snapshot snapshot(const Sequence& seq);
  static Sequence resume(const Snapshot& s);

  // Prefix cache.
  PrefixStats prefix_stats() const { return prefix_.stats(); }
  void clear_prefix_cache() { prefix_.clear(); }
  // The longest stored snapshot whose tokens are a prefix of `tokens[0 : max_len]` (null if none).
  Snapshot lookup_prefix(std::span<const int32_t> tokens, int64_t max_len);

  // Called between two sublayers of every prefill walk while set (never inside a layer's own call, never in a
  // decode walk, never re-entered): the CPU server runs newly arrived requests there instead of after a long
  // prompt's piece. It may prefill and decode other sequences; the walking sequence's bits do not change.
  void set_prefill_yield(std::function<void()> f) { yield_ = std::move(f); }

  SessionProfile profile;

 private:
  // Runs `n` new tokens of one sequence (prefill chunk) or one token of each of `seqs` (decode) through
  // the stack; writes the final-normed hidden [rows, d].
  // `features` (prefill only): the rows the placeholders among `ids` take, in order.
  void walk(const std::vector<Sequence*>& seqs, const int32_t* ids, int64_t rows, bool decode, float* hn,
            const float* features = nullptr);
  void check_sequence(const Sequence& s, const char* what, int64_t index) const;
  // Ids inside the vocabulary; placeholders only up to `media_rows` of them (decode: none).
  void check_ids(std::span<const int32_t> ids, int64_t media_rows = 0) const;
  void store_prefix(const Sequence& s);

  model::Model<float>& m_;
  const model::ModelConfig& cfg_;
  const model::StackPlan& plan_;
  SessionOptions opt_;
  int64_t max_ctx_;
  std::vector<model::CacheSpec> specs_;  // [L] the mixers' cache layouts
  const float* embed_;
  const float* lm_head_;
  const float* final_norm_;
  std::vector<const float*> ln1_, ln2_;
  // AttnRes per block b: the pseudo-queries and gains of the reads that share its closed sources
  // (StackPlan::block_reads), [Q_b, d] each, in walk order.
  struct BlockReads {
    std::vector<float> w, g;
    int64_t Q = 0;
  };
  std::vector<BlockReads> blocks_;
  std::vector<const float*> attn_w_, attn_g_, mlp_w_, mlp_g_;
  const float* out_w_ = nullptr;
  const float* out_g_ = nullptr;

  PrefixIndex<Snapshot> prefix_;  // within opt_.prefix_cache_bytes
  std::function<void()> yield_;
  bool yielding_ = false;
};

// The context limit of a model: `requested` when positive, else max_position_embeddings, else 131072.
int64_t context_limit(const model::ModelConfig& c, int64_t requested);

}  // namespace lm::infer
