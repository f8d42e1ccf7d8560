// `longmoe verify DIR` for golden/vision/<case>/ (see vision.hpp): the tower + projector on the stored pixels.
#include "apps/longmoe/verify/vision.hpp"

#include <cstdio>
#include <filesystem>

#include "core/error.hpp"
#include "io/checkpoint.hpp"
#include "io/safetensors.hpp"
#include "model/vision.hpp"

namespace lm::app {

namespace {

namespace fs = std::filesystem;

template <class F>
int run(const std::string& dir, double tol, bool reference) {
  const auto cfg = model::VisionConfig::load((fs::path(dir) / "config.json").string());
  model::ParamStore<F> ps(model::vision_param_specs(cfg));
  ps.load(io::Checkpoint::open((fs::path(dir) / "model.safetensors").string()));
  const auto inputs = io::SafeTensorsFile::open((fs::path(dir) / "inputs.safetensors").string());
  const auto& pi = inputs.info("pixel_values");
  const int64_t p = cfg.patch_size;
  LM_CHECK(pi.shape.size() == 4 && pi.shape[1] == 3 && pi.shape[2] == p && pi.shape[3] == p,
           "'{}': pixel_values must be [L, 3, {}, {}], got {}", inputs.path(), p, p, shape_str(pi.shape));
  const int64_t L = pi.shape[0];
  const Tensor px = inputs.get_as("pixel_values", dtype_of<F>, pi.shape).contiguous();
  const auto& gi = inputs.info("grid_thws");
  LM_CHECK(gi.shape.size() == 2 && gi.shape[1] == 3, "'{}': grid_thws must be [N, 3], got {}", inputs.path(),
           shape_str(gi.shape));
  const Tensor thw = inputs.get_as("grid_thws", DType::I32, gi.shape).contiguous();
  const model::VisionBatch b =
      model::VisionBatch::make(cfg, thw.data<int32_t>(), gi.shape[0], L, inputs.path() + ": grid_thws");
  const auto expected = io::SafeTensorsFile::open((fs::path(dir) / "expected.safetensors").string());

  model::VisionTrace<F> tr;
  if constexpr (sizeof(F) == 8) {
    if (reference) tr = model::vision_reference_forward(cfg, ps, px.data<double>(), b);
  }
  if (tr.features.empty()) {
    model::VisionTower<F> tower(cfg, ps);
    model::Buf<F> feats(b.merged() * cfg.text_hidden_size);
    tower.forward(px.data<F>(), b, feats.data(), &tr);
  }

  const int64_t D = cfg.hidden_size, M = b.merged();
  std::printf("%s: vision tower + projector, %ld blocks, D %ld, %ld heads x %ld, %ld media (%ld patches, %ld merged "
              "rows), %s\n",
              dir.c_str(), static_cast<long>(cfg.num_layers), static_cast<long>(D), static_cast<long>(cfg.num_heads),
              static_cast<long>(cfg.head_dim()), static_cast<long>(b.size()), static_cast<long>(L),
              static_cast<long>(M), reference ? "float64 reference" : sizeof(F) == 8 ? "float64" : "fp32");
  std::printf("  %-14s %-18s %12s %10s  %s\n", "tensor", "shape", "rel_rms", "tol", "result");
  int failures = 0, compared = 0;
  auto compare = [&](const std::string& name, const model::Buf<F>& got, const Shape& shape) {
    if (!expected.contains(name)) return;
    const Tensor ref = expected.get_as(name, DType::F64, shape).contiguous();
    std::vector<double> x(got.begin(), got.end());
    LM_CHECK(static_cast<int64_t>(x.size()) == ref.numel(), "'{}': {} has {} values, the engine made {}",
             expected.path(), name, ref.numel(), x.size());
    const double err = rel_rms(ref.data<double>(), x.data(), ref.numel());
    const bool ok = err < tol;
    failures += !ok;
    ++compared;
    std::printf("  %-14s %-18s %12.3e %10.1e  %s\n", name.c_str(), shape_str(shape).c_str(), err, tol,
                ok ? "pass" : "FAIL");
  };
  compare("patch_embed", tr.patch_embed, {L, D});
  for (size_t i = 0; i < tr.blocks.size(); ++i) compare("block." + std::to_string(i), tr.blocks[i], {L, D});
  compare("tower_out", tr.tower_out, {L, D});
  compare("merged", tr.merged, {M, cfg.merged_dim()});
  compare("features", tr.features, {M, cfg.text_hidden_size});
  LM_CHECK(compared > 0, "'{}' holds none of patch_embed, block.{{i}}, tower_out, merged, features", expected.path());
  return failures;
}

}  // namespace

bool is_vision_dir(const std::string& dir) {
  const fs::path in = fs::path(dir) / "inputs.safetensors";
  std::error_code ec;
  if (!fs::exists(in, ec)) return false;
  return io::SafeTensorsFile::open(in.string()).contains("pixel_values");
}

int verify_vision_dir(const std::string& dir, double tol_override, bool f64, bool reference) {
  const double tol = tol_override > 0 ? tol_override : 1e-4;  // golden README: fp32, every tensor
  return f64 || reference ? run<double>(dir, tol, reference) : run<float>(dir, tol, false);
}

}  // namespace lm::app
