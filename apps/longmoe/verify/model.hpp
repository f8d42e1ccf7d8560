#pragma once
#include <string>

namespace lm::app {
// Verifies a golden model directory (config.json, model.safetensors, inputs.safetensors,
// expected.safetensors); prints a table and returns the number of failed comparisons.
// Throws lm::Error when the directory cannot be read.
int verify_model_dir(const std::string& dir, double tol_override, bool f64);
}  // namespace lm::app
