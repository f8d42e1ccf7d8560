#pragma once
// The whole K3 / Kimi Linear decoder (SPEC §1, §6): embedding, L decoder layers (KDA or gated MLA
// mixer, dense FFN or LatentMoE), plain pre-norm residuals or Block AttnRes, final norm, untied LM
// head; chunked cross-entropy for training. Explicit forward and backward, no tape.
//
// A config with vision_config adds the MoonViT-V2 tower and projector (SPEC §9) and the splice: the prompt carries
// one media_placeholder_token_id per feature row, and those embedding rows are replaced, in order, by the features.
//
// Legend: rows = tokens in the batch, d hidden, V vocabulary, L layers, N AttnRes sources, M feature rows.
#include <array>
#include <functional>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "model/config.hpp"
#include "model/layers.hpp"
#include "model/params.hpp"
#include "model/seqs.hpp"
#include "model/stack.hpp"
#include "model/vision.hpp"

namespace lm::model {

// Wall time per layer kind, accumulated over forward/backward calls (for `longmoe bench model`).
struct Profile {
  enum Kind { Embedding, Kda, Mla, DenseFfn, Moe, AttnRes, Norm, LmHead, Vision, kNum };
  std::array<double, kNum> fwd{}, bwd{};
  static const char* name(int k);
  void clear() { fwd.fill(0), bwd.fill(0); }
};

struct ForwardOptions {
  bool hidden = false;   // keep every layer's output (the AttnRes partial block sum, or the residual h)
  bool logits = false;   // full logits [rows, V] (tests and verify; use lm_head on a few rows otherwise)
  bool topk = false;     // keep MoE selections (ascending per row)
};

template <class F>
struct ForwardResult {
  std::vector<Buf<F>> hidden;               // [L][rows, d]
  Buf<F> final_hidden;                      // [rows, d] after the final norm
  Buf<F> logits;                            // [rows, V]
  std::vector<std::vector<int32_t>> topk;   // [L][rows, k] (empty for non-MoE layers)
};

// The media of one batch (SPEC §9), in prompt order: their patches one after another and one grid per media.
// The prompt's placeholders take their feature rows in the same order, (h/mh)·(w/mw) per media.
template <class F>
struct Media {
  std::vector<F> pixel_values;   // [Σ t·h·w, 3·p·p], normalised (io::image_patches)
  std::vector<MediaGrid> grids;  // (t, h, w) in patches per media
  bool empty() const { return grids.empty(); }
};

template <class F>
class Model {
 public:
  // `experts`: the routed experts this rank holds (expert parallel; set_expert_parallel then runs the others on
  // their ranks). Default: all.
  explicit Model(const ModelConfig& c, ExpertShard experts = {});
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const StackPlan& plan() const { return plan_; }
  ParamStore<F>& params() { return ps_; }
  const ParamStore<F>& params() const { return ps_; }

  // Forward over token ids [rows] (the layout given by `s`). Keeps activations for backward.
  // Throws lm::Error for ids outside the vocabulary. With `media` (a model with a tower), the tower's feature
  // rows replace the embeddings of the placeholder tokens; the placeholder count must equal the feature rows
  // (also without media: a placeholder with no image is an error).
  void forward(const int32_t* ids, const Seqs& s, const ForwardOptions& opt, ForwardResult<F>* out,
               const Media<F>* media = nullptr);

  // Training step half: forward, mean cross-entropy over targets >= 0 (ignored: < 0), backward into the
  // parameter gradients (accumulated, scaled by grad_scale / n_valid where n_valid is this call's count
  // unless `n_valid_total` > 0 is given, e.g. the count over all micro-batches). Returns the summed
  // token loss and the count. MoE aux losses (when enabled) are added to the gradients, not the sum.
  // A target naming the media placeholder carries no loss (count_targets); the gradient of the spliced rows
  // goes into the tower and projector, none into the embedding table.
  struct LossStats {
    double loss_sum = 0;
    int64_t n_valid = 0;
  };
  LossStats forward_backward(const int32_t* ids, const int32_t* targets, const Seqs& s, int64_t n_valid_total = 0,
                             const Media<F>* media = nullptr);
  // Loss only (evaluation): no activations kept beyond what forward needs.
  LossStats loss(const int32_t* ids, const int32_t* targets, const Seqs& s, const Media<F>* media = nullptr);
  // RL (rl/grpo.hpp): log p(target_t | tokens <= t) per row [rows] (0 where the target is < 0), no activations kept
  // for a backward.
  std::vector<F> target_logprobs(const int32_t* ids, const int32_t* targets, const Seqs& s);
  // One forward, then `dloss` turns the rows' log-probs [rows] into dL/dlogp_t [rows] (0 where the target is < 0;
  // e.g. the clipped policy-gradient loss), and the backward accumulates dL/dparams = sum_t dL/dlogp_t dlogp_t/dparams
  // into the gradients (the cross-entropy op with per-row scales -dL/dlogp_t, since loss_t = -logp_t). Returns the
  // log-probs.
  using LogpGrad = std::function<std::vector<F>(const std::vector<F>& logp)>;
  std::vector<F> forward_backward_logp(const int32_t* ids, const int32_t* targets, const Seqs& s, const LogpGrad& dloss);
  // The targets of [rows] that carry loss: >= 0 and not the media placeholder (SPEC §9: an image's rows are
  // inputs, never predicted; HF's labels mask the placeholder positions, and our targets are those labels
  // shifted by one, so the last placeholder of an image still predicts the text after it).
  int64_t count_targets(const int32_t* targets, int64_t rows) const;

  // The tower (nullptr for a text-only config); its tensors live in params() beside the text model's.
  VisionTower<F>* vision() { return tower_.get(); }
  // The tower and projector over `media` (SPEC §9): features [M, d], the rows its placeholders take in order (M in
  // *rows). What the splice runs; the inference session calls it once per image and keeps the rows. lm::Error for a
  // model without a tower or placeholder id, pixel_values that are no whole number of patches, grids off the config.
  Buf<F> media_features(const Media<F>& media, int64_t* rows = nullptr);
  // The placeholder id of a model with a tower (-1: none).
  int32_t media_placeholder() const { return placeholder_; }

  // Context parallel (null: off; SPEC §2, §3): every forward and backward then runs on this rank's segment of each
  // sequence, a Seqs::batch(B, T) whose rank r holds tokens [r·T, (r+1)·T) of B sequences of R·T. The mixers see the
  // earlier segments through `comm` (KDA by the scan over segment states and the convs' halo, MLA over the gathered
  // latents); the rest is token-local. Parameter gradients are this rank's share: sum them over `comm`. Packed
  // (varlen) batches and media are refused. Every rank of `comm` runs each call together.
  void set_context_parallel(dist::Comm* comm);
  dist::Comm* context_parallel() const { return cp_; }
  // Expert parallel (null: off): every MoE layer runs its experts over `ep` (LatentMoe::set_expert_parallel); this
  // model's ExpertShard must be its rank's share. Every rank of `ep` runs each call together, over as many rows.
  void set_expert_parallel(dist::Comm* ep, double capacity_factor = 0);
  dist::Comm* expert_parallel() const { return ep_; }

  // Called in every backward as parameter gradients become final (gradient reduction that overlaps the backward,
  // dist::GradBuckets): with L once the head's are (lm_head, model.norm, the output read), then with i after decoder
  // layer i (L−1 first), then with −1 after the embedding's and the tower's. Empty: not called.
  std::function<void(int64_t)> on_grads_final;

  // Backward from d(final hidden after norm) — used by tests; forward_backward is the usual entry.
  void backward_from_hidden(const F* d_final_hidden, const Seqs& s);

  // Layer access for decode (infer/) and balancing (train/).
  int64_t num_layers() const { return cfg_.num_hidden_layers; }
  KdaMixer<F>* kda(int64_t i) { return std::get_if<KdaMixer<F>>(&mixers_[i]); }
  GatedMla<F>* mla(int64_t i) { return std::get_if<GatedMla<F>>(&mixers_[i]); }
  // The per-sequence cache layer i's mixer keeps for inference (model/cache.hpp).
  CacheSpec cache_spec(int64_t i) const {
    return std::visit([](const auto& m) { return m.cache_spec(); }, mixers_[static_cast<size_t>(i)]);
  }
  LatentMoe<F>* moe(int64_t i) { return moes_[i].get(); }
  DenseFfn<F>* dense(int64_t i) { return denses_[i].get(); }

  Profile profile;

 private:
  struct LayerActs {
    Buf<F> x_in;         // mixer read: AttnRes output, or the residual stream h (plain)
    Buf<F> xn, rstd1;    // input_layernorm
    Buf<F> y_in;         // ffn read
    Buf<F> yn, rstd2;    // post_attention_layernorm
    Buf<F> prefix_mid;   // AttnRes: partial block sum after the mixer (before the ffn)
    Buf<F> prefix_in;    // AttnRes: partial block sum entering the layer
  };
  void forward_impl(const int32_t* ids, const Seqs& s, const ForwardOptions& opt, ForwardResult<F>* out,
                    const Media<F>* media);
  void backward_impl(const Buf<F>& d_hn, const Seqs& s);
  // SPEC §9: the tower's features into the embedding rows [rows, d] of the placeholders (positions kept in
  // media_rows_); backward: those rows' gradient into the tower, cleared before the embedding sees it.
  void splice_forward(const int32_t* ids, int64_t rows, const Media<F>* media, F* emb);
  void splice_backward(F* d_emb);
  // `targets` with the placeholder's masked to -1 (the caller's array when nothing is masked).
  const int32_t* loss_targets(const int32_t* targets, int64_t rows);

  // AttnRes read over `src` (closed blocks + one partial) with the layer's (w, γ).
  void read(const std::vector<const F*>& src, const Param<F>* w, const Param<F>* g, int64_t rows, F* h);
  void read_backward(const std::vector<const F*>& src, const std::vector<F*>& dsrc, Param<F>* w, Param<F>* g,
                     int64_t rows, const F* dh);

  ModelConfig cfg_;
  ParamStore<F> ps_;
  StackPlan plan_;
  std::vector<std::variant<KdaMixer<F>, GatedMla<F>>> mixers_;
  std::vector<std::unique_ptr<DenseFfn<F>>> denses_;
  std::vector<std::unique_ptr<LatentMoe<F>>> moes_;
  Param<F>* embed_;
  Param<F>* lm_head_;
  Param<F>* final_norm_;
  std::vector<Param<F>*> ln1_, ln2_, attn_w_, attn_g_, mlp_w_, mlp_g_;
  Param<F>* out_w_ = nullptr;
  Param<F>* out_g_ = nullptr;
  std::unique_ptr<VisionTower<F>> tower_;
  int32_t placeholder_ = -1;
  dist::Comm* cp_ = nullptr;
  dist::Comm* ep_ = nullptr;

  // Activations of the last forward.
  std::vector<int32_t> ids_;
  std::vector<int64_t> media_rows_;  // the placeholder positions, in order (feature row j -> media_rows_[j])
  std::vector<int32_t> masked_targets_;
  std::vector<LayerActs> acts_;
  std::vector<Buf<F>> blocks_;   // closed AttnRes block sums (blocks_[0] = embedding)
  Buf<F> h_final_;               // input of the final norm (after the output read, if any)
  Buf<F> hn_, rstd_f_;           // after the final norm
  Buf<F> residual_;              // plain residual stream at the end
  Buf<F> lse_;
};

}  // namespace lm::model
