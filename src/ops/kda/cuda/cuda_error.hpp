#pragma once
// Transitional: lm::Error and the CUDA error check now live in core/cuda/check.hpp (and core/error_type.hpp);
// include that instead. Kept for model/cuda/glue.cu until it moves over.
#include "core/cuda/check.hpp"
