#pragma once
// The CUDA benchmarks of `longmoe bench {kda,attention,moe} --device cuda` (bench/cuda/*.cu, built into the CLI
// when nvcc is found). Plain C++. Each prints its table and "RESULT key value" lines; returns 0, or 2 without a
// CUDA device.
#include <cstdio>

namespace lm::bench_cuda {

// KDA forward / forward+backward (bounded and softplus), the bounded/exact ratios, decode; `prof`: one forward +
// backward of the first shape only (for a profiler).
int kda(int reps, bool prof);
// Causal MLA attention forward / forward+backward and the absorbed decode.
int attention(int reps);
// Grouped expert GEMMs (plain and GLU-fused) and the routing path.
int moe(int reps);

// RESULT lines are also written to `f` (null: stdout only), e.g. for bench/peer_attention_moe.py.
void set_results_file(FILE* f);

}  // namespace lm::bench_cuda
