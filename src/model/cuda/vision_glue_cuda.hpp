#pragma once
// The gathers and scatters of the vision tower on the GPU (model/cuda/vision.cpp; the CPU forms are VisionTower's
// add_position, merge and unmerge, model/vision.cpp) and of the splice of its features into the text rows (SPEC §9).
// Index arrays are built once per batch on the host (GpuVisionTower) and live on the device. Plain C++ (no CUDA
// types); device pointers; stream is a cudaStream_t as void*.
//
// Legend: L patches, D tower width, M merged rows, S = mh·mw slots per merged row, G rows of the resized position
//         tables of the batch (one table per distinct (h, w), concatenated), F frames of the time table, n rows of a
//         text batch, d text width, Mf feature rows.
// Every reduction sums in a fixed order (no atomics), so results do not depend on scheduling.
#include <cstdint>

namespace lm::model::cuda {

// x fp32 [L, D] += pos fp32 [G, D] row pos_row[r] (+ time fp32 [F, D] row frame[r] when frame[r] >= 0).
void vision_add_position(float* x, const float* pos, const int32_t* pos_row, const float* time, const int32_t* frame,
                         int64_t L, int64_t D, void* stream = nullptr);
// The transpose for the position tables: dpos fp32 [G, D] row j = Σ dx fp32 [L, D] rows src[k], k in
// [start[j], start[j + 1]) (written, not accumulated). start int32 [G + 1], src int32 [L].
void vision_position_grad(const float* dx, const int32_t* start, const int32_t* src, float* dpos, int64_t G,
                          int64_t D, void* stream = nullptr);

// m bf16 [M, S·D]: slot s of merged row j = the mean over frames f < frames[j] of y bf16 [L, D] row
// first[j·S + s] + f·stride[j] (fp32 sum, one rounding).
void vision_merge(const void* y, const int32_t* first, const int32_t* frames, const int32_t* stride, void* m,
                  int64_t M, int64_t S, int64_t D, void* stream = nullptr);
// Its transpose: dy fp32 [L, D] row r = dm bf16 [M, S·D] row-slot cell[r] (= j·S + s, a D-wide piece) / frames of
// that merged row (frames int32 [L], per patch).
void vision_unmerge(const void* dm, const int32_t* cell, const int32_t* frames, float* dy, int64_t L, int64_t D,
                    void* stream = nullptr);

// The splice: h fp32 [n, d] row pos[j] = features row j (bf16 when feat_bf16, else fp32) [Mf, d].
void splice_rows(float* h, const int32_t* pos, const void* features, bool feat_bf16, int64_t Mf, int64_t d,
                 void* stream = nullptr);
// Its transpose: dfeat fp32 [Mf, d] row j = dh fp32 [n, d] row pos[j], and that row of dh is zeroed (a placeholder's
// embedding row is replaced, so it gets no gradient).
void splice_rows_backward(float* dh, const int32_t* pos, float* dfeat, int64_t Mf, int64_t d, void* stream = nullptr);

}  // namespace lm::model::cuda
