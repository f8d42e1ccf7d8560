#pragma once
// Host side of TMA (hopper.cuh): tensor maps of bf16 tiles and fp32 reduction targets (cuTensorMapEncodeTiled,
// fetched through the runtime so that nothing links libcuda), 128-byte swizzle, zero fill out of bounds. Used by
// the .cu files of ops/moe/cuda and ops/attention/cuda.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/error_type.hpp"

namespace lm::cu {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn tensor_map_encoder() {
  static EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || !f)
      throw Error("cuda: cuTensorMapEncodeTiled is not available");
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// rank-R tensor of `type`: dims[0] innermost (contiguous), strides in bytes for dims 1..R-1, box in elements
// (box[0] * element size <= 128 bytes for the 128-byte swizzle).
inline CUtensorMap tiled_tensor_map(CUtensorMapDataType type, const void* base, int rank, const uint64_t* dims,
                                    const uint64_t* strides_bytes, const uint32_t* box) {
  CUtensorMap m;
  cuuint64_t d[5], s[4];
  cuuint32_t b[5], e[5];
  for (int i = 0; i < rank; ++i) d[i] = dims[i], b[i] = box[i], e[i] = 1;
  for (int i = 0; i + 1 < rank; ++i) s[i] = strides_bytes[i];
  const CUresult r = tensor_map_encoder()(&m, type, cuuint32_t(rank), const_cast<void*>(base), d, s, b, e,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw Error("cuda: cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ")");
  return m;
}
inline CUtensorMap bf16_tensor_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides_bytes,
                                   const uint32_t* box) {
  return tiled_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, base, rank, dims, strides_bytes, box);
}

// [rows, cols] bf16 row-major as boxes of 64 columns (128 bytes, the swizzle's width) by box_rows rows.
inline CUtensorMap bf16_row_map(const void* base, int64_t rows, int64_t cols, int box_rows) {
  const uint64_t dims[2] = {uint64_t(cols), uint64_t(rows)}, strides[1] = {uint64_t(cols) * 2};
  const uint32_t box[2] = {64u, uint32_t(box_rows)};
  return bf16_tensor_map(base, 2, dims, strides, box);
}

}  // namespace lm::cu
