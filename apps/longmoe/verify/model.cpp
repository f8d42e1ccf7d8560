// `longmoe verify DIR`: a golden model directory (config.json, model.safetensors, inputs.safetensors,
// expected.safetensors; format in ../shared/golden/README.md). Runs the whole model on the stored ids
// and compares logits, every layer's hidden state, the final hidden state and the MoE selections.
#include "apps/longmoe/verify/model.hpp"

#include <cstdio>
#include <filesystem>

#include "core/error.hpp"
#include "io/checkpoint.hpp"
#include "io/safetensors.hpp"
#include "model/model.hpp"

namespace lm::app {

namespace {

template <class F>
int run(const std::string& dir, double tol) {
  namespace fs = std::filesystem;
  const auto cfg = model::ModelConfig::load((fs::path(dir) / "config.json").string());
  auto m = std::make_unique<model::Model<F>>(cfg);
  m->params().load(io::Checkpoint::open((fs::path(dir) / "model.safetensors").string()));
  const auto inputs = io::SafeTensorsFile::open((fs::path(dir) / "inputs.safetensors").string());
  const auto& ii = inputs.info("input_ids");
  LM_CHECK(ii.shape.size() == 2, "'{}': input_ids must be [B, T], got {}", inputs.path(), shape_str(ii.shape));
  const int64_t B = ii.shape[0], T = ii.shape[1];
  const Tensor ids = inputs.get_as("input_ids", DType::I32, ii.shape).contiguous();
  const auto expected = io::SafeTensorsFile::open((fs::path(dir) / "expected.safetensors").string());

  model::ForwardResult<F> out;
  m->forward(ids.data<int32_t>(), model::Seqs::batch(B, T), model::ForwardOptions{true, true, true}, &out);

  const int64_t rows = B * T, d = cfg.hidden_size, V = cfg.vocab_size;
  int failures = 0;
  std::printf("%s: %s model, %ld layers (%ld KDA, %ld MLA), B=%ld T=%ld, %s\n", dir.c_str(),
              cfg.has_attn_res() ? "AttnRes" : "plain-residual", static_cast<long>(cfg.num_hidden_layers),
              static_cast<long>(cfg.num_kda_layers()), static_cast<long>(cfg.num_mla_layers()), static_cast<long>(B),
              static_cast<long>(T), sizeof(F) == 8 ? "float64" : "fp32");
  std::printf("  %-14s %-18s %12s %10s  %s\n", "tensor", "shape", "rel_rms", "tol", "result");
  auto compare = [&](const std::string& name, const model::Buf<F>& got, const Shape& shape) {
    if (!expected.contains(name)) return;
    const Tensor ref = expected.get_as(name, DType::F64, shape);
    Tensor x = Tensor::empty(shape, DType::F64);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<double>()[i] = static_cast<double>(got[i]);
    const double err = rel_rms(ref, x);
    const bool ok = err < tol;
    failures += !ok;
    std::printf("  %-14s %-18s %12.3e %10.1e  %s\n", name.c_str(), shape_str(shape).c_str(), err, tol,
                ok ? "pass" : "FAIL");
  };
  compare("logits", out.logits, {B, T, V});
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) compare("hidden." + std::to_string(i), out.hidden[i], {B, T, d});
  compare("final_hidden", out.final_hidden, {B, T, d});
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    const std::string name = "topk_idx." + std::to_string(i);
    if (!expected.contains(name)) continue;
    const int64_t k = cfg.num_experts_per_token;
    const Tensor ref = expected.get_as(name, DType::I32, {rows, k}).contiguous();
    LM_CHECK(static_cast<int64_t>(out.topk[i].size()) == rows * k, "'{}': layer {} is not a MoE layer here", dir, i);
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < k; ++j)
        if (ref.data<int32_t>()[r * k + j] != out.topk[i][r * k + j]) {
          ++bad;
          break;
        }
    failures += bad != 0;
    std::printf("  %-14s %-18s %12s %10s  %s (%ld of %ld rows differ)\n", name.c_str(),
                shape_str({rows, k}).c_str(), "-", "exact", bad ? "FAIL" : "pass", static_cast<long>(bad),
                static_cast<long>(rows));
  }
  return failures;
}

}  // namespace

int verify_model_dir(const std::string& dir, double tol_override, bool f64) {
  // The bar (1e-4) is tighter than the golden README's fp32 allowance (1e-3) for logits.
  const double tol = tol_override > 0 ? tol_override : 1e-4;
  return f64 ? run<double>(dir, tol) : run<float>(dir, tol);
}

}  // namespace lm::app
