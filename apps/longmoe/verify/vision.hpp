#pragma once
// `longmoe verify DIR` for a vision golden (golden/vision/<case>/: config.json with a vision_config,
// model.safetensors, inputs.safetensors with pixel_values and grid_thws, expected.safetensors; format in
// ../shared/golden/README.md): runs the tower and projector and compares patch_embed, block.{i}, tower_out,
// merged and features.
#include <string>

namespace lm::app {

// True when `dir` holds a vision golden (its inputs.safetensors has pixel_values).
bool is_vision_dir(const std::string& dir);

// Prints one row per tensor and returns the number of failed comparisons; lm::Error when the folder cannot be
// read. f64: the fast path in float64; reference: the float64 definition (vision_reference_forward) instead.
int verify_vision_dir(const std::string& dir, double tol_override, bool f64, bool reference = false);

}  // namespace lm::app
