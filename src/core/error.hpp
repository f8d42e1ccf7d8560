#pragma once
// Errors are messages, never crashes: every failure the user can cause (bad file, bad shape,
// bad flag) throws lm::Error with a sentence that names the file, tensor or field involved.
#include <fmt/format.h>

#include <string>

#include "core/error_type.hpp"

namespace lm {

template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace lm

// LM_CHECK(cond, "fmt", args...): user-facing precondition; throws lm::Error.
#define LM_CHECK(cond, ...)                  \
  do {                                       \
    if (!(cond)) [[unlikely]] ::lm::fail(__VA_ARGS__); \
  } while (0)
