#pragma once
// The stack plan: the decoder's wiring (SPEC §1, §6), decided once from the config and walked by every
// engine — model::Model (CPU training), model::cuda::GpuModel and infer::Session (decode). No other code
// decides a layer's mixer or FFN, which AttnRes sources a read takes or where a block closes.
//
// Block AttnRes, with `partial` the running sum of the open block and `closed` the closed block sums
// (closed[0] is the embedding, closed by layer 0):
//   layer i:  x = attn_closed == 0 ? partial : Read_attn,i(closed[0 : attn_closed] ++ [partial])
//             opens_block ? (closed.push(partial), partial = mixer(norm1(x))) : partial += mixer(norm1(x))
//             y = Read_mlp,i(closed[0 : mlp_closed] ++ [partial]);   partial += ffn(norm2(y))
//   end:      h = Read_out(closed[0 : out_closed] ++ [partial]) -> final norm
// Plain pre-norm residuals (no attn_res_block_size): h += mixer(norm1(h)); h += ffn(norm2(h)).
//
// Legend: L layers, bs attn_res_block_size, nb = out_closed = ceil(L / bs) closed blocks at the end.
#include <cstdint>
#include <vector>

#include "model/config.hpp"

namespace lm::model {

enum class MixerKind { Kda, Mla };
enum class FfnKind { Dense, Moe };

struct LayerPlan {
  int64_t index = 0;
  MixerKind mixer = MixerKind::Kda;
  FfnKind ffn = FfnKind::Dense;
  int64_t mixer_slot = 0;   // index among the layers with this mixer kind (the per-kind caches)
  int64_t moe_slot = -1;    // index among the MoE layers, -1 for a dense FFN
  // Block AttnRes (all zero / false with plain residuals).
  int64_t block = 0;        // the block this layer's mixer and FFN add into
  bool opens_block = false; // the partial sum entering the layer is closed before its mixer adds in
  int64_t attn_closed = 0;  // closed sources of the mixer's read (0: the input is the partial sum itself)
  int64_t mlp_closed = 0;   // closed sources of the FFN's read

  bool kda() const { return mixer == MixerKind::Kda; }
  bool moe() const { return ffn == FfnKind::Moe; }
};

// One AttnRes read: before layer `layer`'s mixer (Attn), before its FFN (Mlp), or the output read (Out,
// layer = L).
struct ReadPlan {
  enum Kind { Attn, Mlp, Out };
  Kind kind;
  int64_t layer;
};

struct StackPlan {
  bool attn_res = false;
  std::vector<LayerPlan> layers;  // [L]
  int64_t out_closed = 0;         // closed sources of the output read
  // Per block b, in walk order, the reads whose closed sources are exactly closed[0 : b + 1]: the FFN read of
  // the block's first layer, both reads of each later layer, and the output read after the last block. They
  // share their closed sources, so a decode step scores those sources once for all of them (two-phase reads);
  // the mixer read of a block's first layer sees one source less and is not in any group.
  std::vector<std::vector<ReadPlan>> block_reads;

  static StackPlan build(const ModelConfig& c);
  int64_t size() const { return static_cast<int64_t>(layers.size()); }
  const LayerPlan& operator[](int64_t i) const { return layers[static_cast<size_t>(i)]; }
  int64_t num_kda() const { return kda_layers; }
  int64_t num_mla() const { return size() - kda_layers; }
  int64_t num_moe() const { return moe_layers; }

 private:
  int64_t kda_layers = 0, moe_layers = 0;
};

}  // namespace lm::model
