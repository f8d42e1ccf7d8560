#pragma once
// How the rows of a batch split into sequences: B sequences of T tokens ([B, T] row-major), or one
// packed run of documents with boundaries cu_seqlens = {0, T_0, T_0 + T_1, ..., rows} (B == 1).
// KDA state and attention never cross a boundary; everything else is per row.
#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "ops/attention/attention.hpp"
#include "ops/kda/kda.hpp"

namespace lm::model {

struct Seqs {
  int64_t B = 1, T = 0;
  std::vector<int64_t> cu;  // empty: B x T

  static Seqs batch(int64_t B, int64_t T) { return Seqs{B, T, {}}; }
  static Seqs packed(std::vector<int64_t> cu_seqlens) {
    LM_CHECK(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0, "cu_seqlens must start at 0 and hold N + 1 entries");
    for (size_t i = 1; i < cu_seqlens.size(); ++i)
      LM_CHECK(cu_seqlens[i] >= cu_seqlens[i - 1], "cu_seqlens must not decrease");
    Seqs s;
    s.B = 1;
    s.T = cu_seqlens.back();
    s.cu = std::move(cu_seqlens);
    return s;
  }
  int64_t rows() const { return B * T; }
  int64_t num_seqs() const { return cu.empty() ? B : static_cast<int64_t>(cu.size()) - 1; }
  int64_t seq_begin(int64_t n) const { return cu.empty() ? n * T : cu[n]; }
  int64_t seq_len(int64_t n) const { return cu.empty() ? T : cu[n + 1] - cu[n]; }

  kda::Dims kda_dims(int64_t H, int64_t K, int64_t V) const {
    kda::Dims d{B, T, H, K, V};
    if (!cu.empty()) d.cu_seqlens = cu.data(), d.N = num_seqs();
    return d;
  }
  kda::ConvDims conv_dims(int64_t C, int64_t W) const {
    kda::ConvDims d{B, T, C, W};
    if (!cu.empty()) d.cu_seqlens = cu.data(), d.N = num_seqs();
    return d;
  }
  ops::AttnDims attn_dims(int64_t H, int64_t Dk, int64_t Dv) const {
    ops::AttnDims d;
    d.B = B, d.T = T, d.H = H, d.Hkv = H, d.Dk = Dk, d.Dv = Dv;
    if (!cu.empty()) d.cu_seqlens = cu.data(), d.N = num_seqs();
    return d;
  }
};

}  // namespace lm::model
