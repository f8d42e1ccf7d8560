// `longmoe version`: build facts users paste into bug reports.
#include <cstdio>

#include "apps/longmoe/commands.hpp"
#include "core/parallel.hpp"

namespace {
lm::app::Register reg({"version", "Print version and build facts", [](CLI::App&) {
                         return [] {
                           std::printf("longmoe 0.1.0 (C++20, %d threads", lm::num_threads());
#if defined(LONGMOE_HAVE_CUDA)
                           std::printf(", CUDA");
#endif
                           std::printf(")\n");
                           return 0;
                         };
                       }});
}  // namespace
