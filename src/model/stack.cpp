// The stack plan (see stack.hpp): the one place where the SPEC §1/§6 wiring is decided.
#include "model/stack.hpp"

namespace lm::model {

StackPlan StackPlan::build(const ModelConfig& c) {
  StackPlan p;
  const int64_t L = c.num_hidden_layers;
  p.attn_res = c.has_attn_res();
  const int64_t bs = p.attn_res ? *c.attn_res_block_size : 0;
  int64_t closed = 0;  // closed blocks so far
  for (int64_t i = 0; i < L; ++i) {
    LayerPlan lp;
    lp.index = i;
    lp.mixer = c.is_kda(i) ? MixerKind::Kda : MixerKind::Mla;
    lp.ffn = c.is_moe(i) ? FfnKind::Moe : FfnKind::Dense;
    lp.mixer_slot = lp.kda() ? p.kda_layers++ : i - p.kda_layers;
    lp.moe_slot = lp.moe() ? p.moe_layers++ : -1;
    if (p.attn_res) {
      lp.opens_block = i % bs == 0;  // a block is bs layers; the embedding closes with layer 0
      lp.attn_closed = closed;
      if (lp.opens_block) ++closed;
      lp.mlp_closed = closed;
      lp.block = closed - 1;
    }
    p.layers.push_back(lp);
  }
  if (!p.attn_res) return p;
  p.out_closed = closed;
  p.block_reads.resize(static_cast<size_t>(closed));
  for (const LayerPlan& lp : p.layers) {
    auto& group = p.block_reads[static_cast<size_t>(lp.block)];
    if (!lp.opens_block) group.push_back({ReadPlan::Attn, lp.index});
    group.push_back({ReadPlan::Mlp, lp.index});
  }
  p.block_reads.back().push_back({ReadPlan::Out, L});
  return p;
}

}  // namespace lm::model
