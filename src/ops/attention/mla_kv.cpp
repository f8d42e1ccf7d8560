// MLA's per-head keys and values from the decompressed latent, and the transpose (ops/attention/attention.hpp).
#include <algorithm>

#include "ops/attention/attention.hpp"

namespace lm::ops {

template <class F>
void mla_split_kv(const F* kv, const F* k_r, int64_t ld_kr, F* k, F* v, int64_t rows, int64_t H, int64_t Dn,
                  int64_t Dr, int64_t Dv) {
  const int64_t Dq = Dn + Dr, Dkv = Dn + Dv;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const F* src = kv + (r * H + h) * Dkv;
      F* kh = k + (r * H + h) * Dq;
      std::copy_n(src, Dn, kh);
      std::copy_n(k_r + r * ld_kr, Dr, kh + Dn);
      std::copy_n(src + Dn, Dv, v + (r * H + h) * Dv);
    }
}

template <class F>
void mla_merge_dkv(const F* dk, const F* dv, F* dkv, F* dk_r, int64_t ld_dkr, int64_t rows, int64_t H, int64_t Dn,
                   int64_t Dr, int64_t Dv) {
  const int64_t Dq = Dn + Dr, Dkv = Dn + Dv;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const F* g = dk + (r * H + h) * Dq;
      F* dst = dkv + (r * H + h) * Dkv;
      std::copy_n(g, Dn, dst);
      std::copy_n(dv + (r * H + h) * Dv, Dv, dst + Dn);
      F* dkr = dk_r + r * ld_dkr;
      for (int64_t j = 0; j < Dr; ++j) dkr[j] += g[Dn + j];
    }
}

template void mla_split_kv<float>(const float*, const float*, int64_t, float*, float*, int64_t, int64_t, int64_t,
                                  int64_t, int64_t);
template void mla_split_kv<double>(const double*, const double*, int64_t, double*, double*, int64_t, int64_t, int64_t,
                                   int64_t, int64_t);
template void mla_merge_dkv<float>(const float*, const float*, float*, float*, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, int64_t);
template void mla_merge_dkv<double>(const double*, const double*, double*, double*, int64_t, int64_t, int64_t,
                                    int64_t, int64_t, int64_t);

}  // namespace lm::ops
