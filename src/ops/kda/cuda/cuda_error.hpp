#pragma once
// lm::Error for the .cu files of this folder. core/error.hpp pulls in fmt, whose v9 headers do not compile
// under nvcc in C++20; this is the same class, token for token (one definition across translation units),
// so a caller's catch (const lm::Error&) sees it. Never include both headers in one file.
#include <stdexcept>
#include <string>

namespace lm {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

}  // namespace lm
