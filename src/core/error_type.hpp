#pragma once
// lm::Error on its own, without fmt: for the CUDA sources (fmt's v9 headers do not compile under nvcc) and
// core/cuda/check.hpp. Everything else includes core/error.hpp, which adds LM_CHECK and lm::fail(fmt, ...).
#include <stdexcept>
#include <string>

namespace lm {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

}  // namespace lm
