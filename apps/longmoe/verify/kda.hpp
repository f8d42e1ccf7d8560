#pragma once
// `longmoe verify FILE`: checks the KDA operator against a golden op file (format:
// ../shared/golden/README.md): runs the fused operator on the stored inputs and compares every stored
// output and gradient. The file reading lives here, beside the verb, not in the operator (ops/ does no I/O).
#include <string>
#include <vector>

#include "ops/kda/kda.hpp"

namespace lm::io {
class SafeTensorsFile;
}

namespace lm::app {

struct VerifyRow {
  std::string name;
  std::string shape;
  double err = 0;  // relative RMS error vs the stored expectation
  double tol = 0;
  bool pass() const { return err < tol; }
};

struct VerifyOptions {
  kda::DiagPath diag = kda::DiagPath::Auto;
  kda::CorePath core = kda::CorePath::Chunked;
  bool f64 = false;   // run in float64 instead of fp32
  double tol = 1e-4;  // golden README: fp32 op outputs and gradients
};

// True when the file holds the tensors of a KDA op golden (q, k, v, g, beta, A_log, dt_bias, ...).
bool is_kda_golden(const io::SafeTensorsFile& f);

// Throws lm::Error on malformed content (missing tensors, inconsistent shapes, bad metadata).
std::vector<VerifyRow> verify_golden(const io::SafeTensorsFile& f, const VerifyOptions& opt, std::string* summary);

}  // namespace lm::app
