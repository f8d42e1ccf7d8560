// `longmoe params`: parameter counts, FLOPs per token, decode memory and training memory per device
// for a config.json (SPEC §8). Human-readable table by default, --json for machines.
#include "core/error.hpp"
#include <fmt/format.h>

#include <cstdio>
#include <numeric>

#include "apps/longmoe/commands.hpp"
#include "io/json.hpp"
#include "model/accounting.hpp"

namespace {

using lm::model::Component;

struct Options {
  std::string config;
  // 0 = not given (every one of these must be >= 1 when given)
  int64_t context = 0, gpus = 0, dp = 0, ep = 0, pp = 0, tp = 0, cp = 0;
  int64_t micro_batch = 1;
  int64_t batch = 1;              // sequences served together (the inference estimate)
  int64_t prefill_chunk = 16384;  // tokens per prefill chunk on the GPU
  int64_t seq = 8192;
  std::string optimizer = "adamw";
  std::string recompute = "none";
  int zero = 1;
  bool json = false;
  int cache_bytes = 2;  // bytes per cached MLA / conv value: 2 (bf16, GPU) or 4 (fp32, the CPU session)
  double gpu_memory = 139.8;  // GiB of the device the one-GPU training plan is made for (an H200)
  double host_memory = 64;    // GiB of pinned host memory it may use (GpuModel::plan_memory: half the host's)
};

std::string bytes_str(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024.0 && u < 5) b /= 1024.0, ++u;
  return u == 0 ? fmt::format("{:.0f} B", b) : fmt::format("{:.2f} {}", b, units[u]);
}

std::string params_str(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.2f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

std::string flops_str(double f) {
  if (f >= 1e12) return fmt::format("{:.3f} TFLOP", f / 1e12);
  if (f >= 1e9) return fmt::format("{:.3f} GFLOP", f / 1e9);
  if (f >= 1e6) return fmt::format("{:.3f} MFLOP", f / 1e6);
  return fmt::format("{:.0f} FLOP", f);
}

lm::model::ParallelPlan make_plan(const lm::model::ModelConfig& c, const Options& o) {
  lm::model::ParallelPlan p;
  for (auto [v, n] : {std::pair{o.gpus, "--gpus"}, std::pair{o.dp, "--dp"}, std::pair{o.ep, "--ep"},
                      std::pair{o.pp, "--pp"}, std::pair{o.tp, "--tp"}, std::pair{o.cp, "--cp"},
                      std::pair{o.context, "--context"}})
    LM_CHECK(v >= 0 && v <= (int64_t{1} << 40), "{} {} must be >= 1", n, v);
  p.tp = o.tp ? o.tp : 1;
  p.pp = o.pp ? o.pp : 1;
  p.cp = o.cp ? o.cp : 1;
  if (o.dp) {
    p.dp = o.dp;
    if (o.gpus)
      LM_CHECK(p.dp * p.cp * p.tp * p.pp == o.gpus, "--gpus {} != --dp {} x --cp {} x --pp {} x --tp {}", o.gpus, p.dp,
               p.cp, p.pp, p.tp);
  } else if (o.gpus) {
    LM_CHECK(o.gpus % (p.cp * p.tp * p.pp) == 0, "--gpus {} is not a multiple of --cp {} x --tp {} x --pp {}", o.gpus,
             p.cp, p.tp, p.pp);
    p.dp = o.gpus / (p.cp * p.tp * p.pp);
  }
  if (o.ep) {
    p.ep = o.ep;
  } else {
    p.ep = c.num_experts > 0 ? std::gcd(p.dp * p.cp * p.tp, c.num_experts) : 1;
  }
  p.micro_batch = o.micro_batch;
  p.seq_len = o.seq;
  LM_CHECK(o.optimizer == "adamw" || o.optimizer == "muon", "--optimizer must be adamw or muon, got '{}'", o.optimizer);
  p.optimizer = o.optimizer == "adamw" ? lm::model::Optimizer::AdamW : lm::model::Optimizer::Muon;
  LM_CHECK(o.recompute == "none" || o.recompute == "full", "--recompute must be none or full, got '{}'", o.recompute);
  p.recompute = o.recompute == "none" ? lm::model::Recompute::None : lm::model::Recompute::Full;
  p.zero1 = o.zero != 0;
  p.validate(c);
  return p;
}

std::string layer_summary(const lm::model::ModelConfig& c) {
  std::string s = fmt::format("{} layers ({} KDA + {} MLA; {} dense FFN + {} MoE), d {}, vocab {}", c.num_hidden_layers,
                              c.num_kda_layers(), c.num_mla_layers(), c.num_dense_ffn_layers(), c.num_moe_layers(),
                              c.hidden_size, c.vocab_size);
  if (c.num_experts > 0) {
    s += fmt::format(", {} experts top-{} + {} shared", c.num_experts, c.num_experts_per_token, c.num_shared_experts);
    if (c.routed_expert_hidden_size) s += fmt::format(", latent {}", *c.routed_expert_hidden_size);
  }
  if (c.attn_res_block_size) s += fmt::format(", AttnRes blocks of {}", *c.attn_res_block_size);
  return s;
}

int run(const Options& o) {
  using namespace lm::model;
  const ModelConfig c = ModelConfig::load(o.config);
  const int64_t context = o.context ? o.context : c.max_position_embeddings.value_or(131072);
  LM_CHECK(o.seq >= 1 && o.micro_batch >= 1, "--seq and --micro-batch must be >= 1");
  const ParallelPlan plan = make_plan(c, o);
  const ParamCounts pc = count_params(c);
  const FlopsPerToken fl = flops_per_token(c, o.seq, context);
  LM_CHECK(o.cache_bytes == 2 || o.cache_bytes == 4, "--cache-bytes must be 2 or 4, got {}", o.cache_bytes);
  const DecodeMemory dm = decode_memory(c, context, o.cache_bytes);
  const TrainingMemory tm = training_memory(c, plan);
  LM_CHECK(o.batch >= 1 && o.prefill_chunk >= 1, "--batch {} and --prefill-chunk {} must be >= 1", o.batch,
           o.prefill_chunk);
  const InferenceMemory im = inference_memory(c, context, o.batch, o.prefill_chunk);
  const TrainingTraffic tt = training_traffic(c, plan);

  if (o.json) {
    lm::io::json j;
    j["config"] = o.config;
    j["layers"] = {{"total", c.num_hidden_layers}, {"kda", c.num_kda_layers()}, {"mla", c.num_mla_layers()},
                   {"dense_ffn", c.num_dense_ffn_layers()}, {"moe", c.num_moe_layers()}};
    lm::io::json comps = lm::io::json::object();
    for (int i = 0; i < kNumTextComponents; ++i) {
      const auto comp = static_cast<Component>(i);
      comps[std::string(component_name(comp))] = {{"total", pc[comp].total}, {"activated", pc[comp].activated}};
    }
    if (c.vision) {
      const VisionParamCounts vp = count_vision_params(*c.vision);
      j["vision"] = {{"tower", vp.tower}, {"projector", vp.projector}, {"total", vp.total()},
                     {"blocks", c.vision->num_layers}, {"hidden_size", c.vision->hidden_size},
                     {"checkpoint_total", pc.total + vp.total()}};
    }
    j["params"] = {{"total", pc.total},
                   {"activated", pc.activated},
                   {"activated_matmul", pc.activated_matmul},
                   {"trainable", pc.trainable},
                   {"components", comps}};
    j["flops_per_token"] = {{"seq_len", fl.seq_len},
                            {"context", fl.context},
                            {"matmul_fwd", fl.matmul_fwd},
                            {"mla_attention_fwd_train", fl.mla_attn_fwd_train},
                            {"kda_attention_fwd", fl.kda_attn_fwd},
                            {"train", fl.train},
                            {"decode", fl.decode}};
    j["decode_memory"] = {{"context", dm.context},
                          {"cache_bytes_per_value", dm.cache_bytes},
                          {"mla_bytes_per_token", dm.mla_bytes_per_token},
                          {"mla_bytes_per_seq", dm.mla_bytes_per_seq},
                          {"kda_state_bytes_per_seq", dm.kda_state_bytes_per_seq},
                          {"conv_state_bytes_per_seq", dm.conv_state_bytes_per_seq},
                          {"total_bytes_per_seq", dm.total_bytes_per_seq},
                          {"weight_bytes_bf16", dm.weight_bytes}};
    j["inference_memory"] = {{"context", context},
                             {"batch", o.batch},
                             {"prefill_chunk", o.prefill_chunk},
                             {"weight_bytes", im.weights},
                             {"kda_cache_bytes", im.kda_caches},
                             {"mla_cache_bytes", im.mla_cache},
                             {"activation_bytes", im.activations},
                             {"workspace_bytes", im.workspace},
                             {"total_bytes", im.total()}};
    j["training_traffic_bytes_per_gpu_step"] = {{"dp", tt.dp}, {"ep", tt.ep}, {"cp", tt.cp}, {"pp", tt.pp},
                                                 {"tp", tt.tp}, {"total", tt.total()}};
    j["training_memory"] = {
        {"plan",
         {{"gpus", plan.gpus()},
          {"dp", plan.dp},
          {"cp", plan.cp},
          {"ep", plan.ep},
          {"pp", plan.pp},
          {"tp", plan.tp},
          {"micro_batch", plan.micro_batch},
          {"seq_len", plan.seq_len},
          {"optimizer", std::string(optimizer_name(plan.optimizer))},
          {"zero1", plan.zero1},
          {"recompute", std::string(recompute_name(plan.recompute))}}},
        {"stage", tm.stage},
        {"stage_layers", tm.stage_layers},
        {"dense_params_per_device", tm.dense_params},
        {"expert_params_per_device", tm.expert_params},
        {"weight_bytes", tm.weight_bytes},
        {"grad_bytes", tm.grad_bytes},
        {"master_bytes", tm.master_bytes},
        {"optimizer_bytes", tm.optimizer_bytes},
        {"activation_bytes", tm.activation_bytes},
        {"total_bytes", tm.total_bytes},
        {"assumptions", tm.assumptions}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }

  std::string out;
  auto line = [&out](const std::string& s) { out += s + "\n"; };
  line(fmt::format("longmoe params: {}", o.config));
  line("  " + layer_summary(c));
  line("");
  line(fmt::format("{:<28}{:>16}{:>16}", "Parameters", "total", "activated"));
  for (int i = 0; i < kNumTextComponents; ++i) {
    const auto comp = static_cast<Component>(i);
    if (pc[comp].total == 0) continue;
    line(fmt::format("  {:<26}{:>16}{:>16}", component_name(comp), params_str(static_cast<double>(pc[comp].total)),
                     comp == Component::Embedding ? std::string("-")
                                                  : params_str(static_cast<double>(pc[comp].activated))));
  }
  line(fmt::format("  {:<26}{:>16}{:>16}", "TOTAL", params_str(static_cast<double>(pc.total)),
                   params_str(static_cast<double>(pc.activated))));
  line(fmt::format("  exact: {} total, {} activated, {} activated GEMM weights, {} trainable", pc.total, pc.activated,
                   pc.activated_matmul, pc.trainable));
  line(fmt::format("  activated = per token, without the input embedding; routed experts counted {} of {} per MoE "
                   "layer",
                   c.num_experts_per_token, c.num_experts));
  if (c.vision) {
    const VisionConfig& v = *c.vision;
    const VisionParamCounts vp = count_vision_params(v);
    line("");
    line(fmt::format("Vision (SPEC §9; not in the text totals above): {} blocks, D {}, {} heads x {}, "
                     "I {}, position table {}x{}, {}x{} merge into d {}",
                     v.num_layers, v.hidden_size, v.num_heads, v.head_dim(), v.intermediate_size, v.init_pos_emb_height,
                     v.init_pos_emb_width, v.merge_h, v.merge_w, v.text_hidden_size));
    line(fmt::format("  {:<26}{:>16}", "vision_tower", params_str(static_cast<double>(vp.tower))));
    line(fmt::format("  {:<26}{:>16}", "mm_projector", params_str(static_cast<double>(vp.projector))));
    line(fmt::format("  exact: {} tower, {} projector, {} together", vp.tower, vp.projector, vp.total()));
    line(fmt::format("  checkpoint (K3 layout: language_model.*, vision_tower.*, mm_projector.*): {} = {} parameters",
                     params_str(static_cast<double>(pc.total + vp.total())), pc.total + vp.total()));
  }
  line("");
  line("FLOPs per token");
  line(fmt::format("  training at seq {:<10}  {:>16}  = 3 x ({} matmul [2 x {} weights] + {} MLA attn + {} KDA)",
                   o.seq, flops_str(fl.train), flops_str(fl.matmul_fwd),
                   params_str(static_cast<double>(pc.activated_matmul)), flops_str(fl.mla_attn_fwd_train),
                   flops_str(fl.kda_attn_fwd)));
  line(fmt::format("  decode at context {:<9} {:>16}  (forward, absorbed MLA over the cache, KDA recurrence)", context,
                   flops_str(fl.decode)));
  line("");
  line(fmt::format("Decode memory (MLA and conv caches {}-byte values, KDA state fp32)", dm.cache_bytes));
  line(fmt::format("  {:<34}{:>14}  ({} values x {} B x {} MLA layers)", "MLA cache per token",
                   bytes_str(static_cast<double>(dm.mla_bytes_per_token)), c.mla_cache_dim(), dm.cache_bytes,
                   c.num_mla_layers()));
  line(fmt::format("  {:<34}{:>14}", fmt::format("MLA cache per sequence @ {}", context),
                   bytes_str(static_cast<double>(dm.mla_bytes_per_seq))));
  line(fmt::format("  {:<34}{:>14}  ({} x {} x {} x 4 B x {} KDA layers)", "KDA state per sequence",
                   bytes_str(static_cast<double>(dm.kda_state_bytes_per_seq)), c.kda_num_heads, c.kda_head_dim,
                   c.kda_head_dim, c.num_kda_layers()));
  line(fmt::format("  {:<34}{:>14}  (q,k,v x {} channels x {} past inputs)", "KDA conv cache per sequence",
                   bytes_str(static_cast<double>(dm.conv_state_bytes_per_seq)), c.kda_key_dim(),
                   c.kda_conv_kernel - 1));
  line(fmt::format("  {:<34}{:>14}", "total per sequence", bytes_str(static_cast<double>(dm.total_bytes_per_seq))));
  line(fmt::format("  {:<34}{:>14}", "weights (bf16, all parameters)", bytes_str(static_cast<double>(dm.weight_bytes))));
  line("");
  line(fmt::format("Inference memory on one GPU (--device cuda: bf16 weights, fp32 KDA states, bf16 latent pool): "
                   "context {}, batch {}, prefill chunk {}", context, o.batch, o.prefill_chunk));
  line(fmt::format("  {:<34}{:>14}", "weights (bf16 + small fp32)", bytes_str(im.weights)));
  line(fmt::format("  {:<34}{:>14}", "KDA states and conv inputs", bytes_str(im.kda_caches)));
  line(fmt::format("  {:<34}{:>14}", "MLA latent pool", bytes_str(im.mla_cache)));
  line(fmt::format("  {:<34}{:>14}  (one layer's, shared by the layers)", "prefill activations",
                   bytes_str(im.activations)));
  line(fmt::format("  {:<34}{:>14}  (CUDA context, cuBLAS workspaces)", "workspace", bytes_str(im.workspace)));
  line(fmt::format("  {:<34}{:>14}", "total", bytes_str(im.total())));
  line("");
  line(fmt::format("Training memory per device: {} GPU(s) = dp {} x cp {} x pp {} x tp {}, ep {}; micro-batch {} x seq "
                   "{}; {}{}; recompute {}",
                   plan.gpus(), plan.dp, plan.cp, plan.pp, plan.tp, plan.ep, plan.micro_batch, plan.seq_len,
                   optimizer_name(plan.optimizer), plan.zero1 ? " + ZeRO-1" : "", recompute_name(plan.recompute)));
  line(fmt::format("  largest pipeline stage: {} ({} layers); per device {} dense + {} expert parameters", tm.stage,
                   tm.stage_layers, params_str(tm.dense_params), params_str(tm.expert_params)));
  line(fmt::format("  {:<34}{:>14}", "weights (bf16)", bytes_str(tm.weight_bytes)));
  line(fmt::format("  {:<34}{:>14}", "gradients (fp32)", bytes_str(tm.grad_bytes)));
  line(fmt::format("  {:<34}{:>14}", "master weights (fp32)", bytes_str(tm.master_bytes)));
  line(fmt::format("  {:<34}{:>14}", fmt::format("optimizer state ({})", optimizer_name(plan.optimizer)),
                   bytes_str(tm.optimizer_bytes)));
  line(fmt::format("  {:<34}{:>14}  ({} per token per layer before tp)", "activations",
                   bytes_str(tm.activation_bytes), bytes_str(tm.activation_bytes_per_token_layer)));
  line(fmt::format("  {:<34}{:>14}", "total", bytes_str(tm.total_bytes)));
  line("  assumptions:");
  for (const auto& a : tm.assumptions) line("    - " + a);
  line("");
  {  // what `train --device cuda` plans (GpuModel::plan_memory): micro-batch x seq tokens on one device
    const int64_t rows = plan.micro_batch * plan.seq_len;
    line(fmt::format("Training on one GPU (train / bench model --device cuda, AdamW): {} tokens on {:.1f} GiB "
                     "(--gpu-memory, less 3%), {:.1f} GiB of pinned host memory (--host-memory)", rows, o.gpu_memory,
                     o.host_memory));
    try {
      const GpuTrainingMemory g =
          gpu_training_plan(c, rows, 0.97 * o.gpu_memory * 1073741824.0, o.host_memory * 1073741824.0);
      line("  " + gpu_training_summary(g, c));
    } catch (const lm::Error& e) {
      line(fmt::format("  does not fit: {}", e.what()));
    }
    line("");
  }
  line(fmt::format("Communication per GPU per step (one micro-batch of {} x {} tokens per replica; see "
                   "model::training_traffic)", plan.micro_batch, plan.seq_len));
  line(fmt::format("  {:<34}{:>14}  ({})", "data parallel", bytes_str(tt.dp),
                   plan.zero1 ? "fp32 gradients reduce-scattered, bf16 weights all-gathered" : "fp32 all-reduce"));
  line(fmt::format("  {:<34}{:>14}  (dispatch + combine, forward and backward)", "expert parallel (all-to-all)",
                   bytes_str(tt.ep)));
  line(fmt::format("  {:<34}{:>14}  (KDA segment states, MLA latents)", "context parallel", bytes_str(tt.cp)));
  line(fmt::format("  {:<34}{:>14}", "pipeline (stage boundaries)", bytes_str(tt.pp)));
  line(fmt::format("  {:<34}{:>14}", "tensor parallel", bytes_str(tt.tp)));
  line(fmt::format("  {:<34}{:>14}", "total", bytes_str(tt.total())));
  std::fputs(out.c_str(), stdout);
  return 0;
}

lm::app::Register reg({"params", "Parameter counts, FLOPs per token, decode and training memory of a config",
                       [](CLI::App& sub) {
                         auto o = std::make_shared<Options>();
                         sub.add_option("--config", o->config, "config.json (or a folder holding one)")->required();
                         sub.add_option("--context", o->context,
                                        "decode context length in tokens (default: max_position_embeddings, else 131072)");
                         sub.add_option("--gpus", o->gpus, "devices for the training estimate (default dp*pp*tp)");
                         sub.add_option("--dp", o->dp, "data-parallel size (default gpus / (pp*tp))");
                         sub.add_option("--ep", o->ep, "expert-parallel size (default gcd(dp*tp, num_experts))");
                         sub.add_option("--pp", o->pp, "pipeline-parallel stages (default 1)");
                         sub.add_option("--tp", o->tp, "tensor-parallel size (default 1)");
                         sub.add_option("--cp", o->cp, "context-parallel size: ranks per sequence (default 1)");
                         sub.add_option("--micro-batch", o->micro_batch, "sequences per micro-batch (default 1)");
                         sub.add_option("--batch", o->batch, "sequences served together, inference estimate (default 1)");
                         sub.add_option("--prefill-chunk", o->prefill_chunk,
                                        "tokens per GPU prefill chunk, inference estimate (default 16384)");
                         sub.add_option("--seq", o->seq, "training sequence length (default 8192)");
                         sub.add_option("--optimizer", o->optimizer, "adamw (default) or muon");
                         sub.add_option("--recompute", o->recompute, "activation recomputation: none (default) or full");
                         sub.add_option("--zero", o->zero, "1 (default): shard master weights and optimizer state "
                                                           "over data-parallel replicas; 0: replicate");
                         sub.add_option("--gpu-memory", o->gpu_memory,
                                        "GiB of the GPU the one-GPU training plan is made for (default 139.8: H200)");
                         sub.add_option("--host-memory", o->host_memory,
                                        "GiB of pinned host memory that plan may keep states in (default 64: half "
                                        "of the H200 machine's 128; train uses half of its host's)");
                         sub.add_flag("--json", o->json, "machine-readable output");
                         sub.add_option("--cache-bytes", o->cache_bytes,
                                        "bytes per cached MLA/conv value in the decode memory: 2 (bf16, default) or "
                                        "4 (fp32, as the CPU inference session stores them)");
                         return [o] { return run(*o); };
                       }});

}  // namespace
