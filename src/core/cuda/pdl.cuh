#pragma once
// Programmatic dependent launch (Hopper): a kernel launched by launch_pdl may start while the kernel before it on
// the stream is still running, and do what does not depend on it (a decode step's weight loads: the weights are
// not written by the step) before it waits. Without it every kernel of a small step pays its ramp-up and its
// predecessor's tail (a batch-1 decode step runs ~160 kernels; on the few-row products alone it gave +3.6%
// tokens/s, session 44, H100).
//
// The contract, on both sides:
//   - a kernel launched by launch_pdl calls pdl_wait() in every thread before it reads anything an earlier kernel
//     wrote, and before it ends (its completion then implies its predecessors' completion, which the kernels
//     after it rely on);
//   - any kernel may call pdl_launch_dependents() (early: after it has been scheduled everywhere) to let the next
//     kernel, if launched by launch_pdl, start; the next kernel's pdl_wait() still waits for this grid to end
//     and its writes to be visible. Without the call, the next kernel starts when this one ends.
// In a captured CUDA graph the attribute becomes a programmatic edge. LONGMOE_PDL=0 launches plainly.
#include <cuda_runtime.h>

#include <utility>

#include "core/env.hpp"

namespace lm::cu {

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::); }

template <class... KernelArgs, class... Args>
inline cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                              Args&&... args) {
  static const bool on = env::pdl();
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = s;
  cfg.attrs = &attr, cfg.numAttrs = on ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace lm::cu
