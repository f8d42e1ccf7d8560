#pragma once
// The one CUDA error check: a failed CUDA call becomes lm::Error("<who>: <what>: <CUDA's error string>"), so a
// caller sees a message naming the component and the call, never a crash. Host code; for the .cu files and
// the CUDA-side .cpp files alike (no fmt, see core/error_type.hpp).
//
//   constexpr cu::Checker check{"glu cuda"};    // once per file: the component's name
//   check(cudaMemsetAsync(...), "dw zero");     // throws unless cudaSuccess
//   check.fail("x and w are required");         // throws lm::Error("glu cuda: x and w are required")
#include <cuda_runtime_api.h>

#include <string>

#include "core/error_type.hpp"

namespace lm::cu {

struct Checker {
  const char* who;
  [[noreturn]] void fail(const std::string& message) const { throw Error(std::string(who) + ": " + message); }
  void operator()(cudaError_t e, const char* what) const {
    if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(e));
  }
};

}  // namespace lm::cu
