#pragma once
// What a mixer layer keeps per sequence between inference calls, described by the layer itself so that an
// engine allocates and accounts for caches without knowing the layer kinds (vLLM's habit):
//   KDA:  states "S" [H, K, V] and "conv" [3, HK, W-1] (the last W-1 inputs of the q, k, v short convs);
//   MLA:  no state, one latent row [RMSNorm_kv(c) ; k_r] of R + Dr values appended per token.
// FFN and MoE layers keep nothing. The dtypes are what a device engine stores (fp32 KDA states, bf16 latent
// rows: SPEC §3); the CPU engine keeps everything in fp32.
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace lm::model {

struct CacheSpec {
  struct State {
    std::string name;
    std::vector<int64_t> shape;
    DType dtype = DType::F32;
    int64_t numel() const {
      int64_t n = 1;
      for (int64_t s : shape) n *= s;
      return n;
    }
  };
  std::vector<State> states;   // fixed size per sequence, zero for an empty sequence
  int64_t row_width = 0;       // values appended per token (0: none)
  DType row_dtype = DType::F32;
};

// One layer's cache of one sequence on the CPU: the states of its spec and the rows so far [T, row_width].
template <class F>
struct LayerCache {
  std::vector<std::vector<F>> states;
  std::vector<F> rows;
  int64_t row_width = 0;

  static LayerCache empty(const CacheSpec& s) {
    LayerCache c;
    for (const auto& st : s.states) c.states.emplace_back(static_cast<size_t>(st.numel()), F(0));
    c.row_width = s.row_width;
    return c;
  }
  int64_t tokens() const { return row_width ? static_cast<int64_t>(rows.size()) / row_width : 0; }
  bool operator==(const LayerCache&) const = default;
  // Values held / allocated (the rows grow in steps).
  int64_t size() const {
    int64_t n = static_cast<int64_t>(rows.size());
    for (const auto& s : states) n += static_cast<int64_t>(s.size());
    return n;
  }
  int64_t capacity() const {
    int64_t n = static_cast<int64_t>(rows.capacity());
    for (const auto& s : states) n += static_cast<int64_t>(s.capacity());
    return n;
  }
};

}  // namespace lm::model
