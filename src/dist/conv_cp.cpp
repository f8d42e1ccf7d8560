#include "dist/conv_cp.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace lm::dist {

namespace {
void check(const kda::ConvDims& d) {
  LM_CHECK(!d.cu_seqlens, "context-parallel conv: packed (varlen) batches are not supported; give B sequences");
  LM_CHECK(d.T >= d.W - 1, "context-parallel conv: a segment of {} rows is shorter than the {} rows of the halo", d.T,
           d.W - 1);
}
}  // namespace

template <class F>
void conv_cp_forward(Comm& comm, const F* x, const F* w, const F* cache, F* y, const kda::ConvDims& d, bool silu,
                     std::vector<F>& halo_out) {
  check(d);
  const size_t nh = size_t(d.B * d.C * (d.W - 1));
  std::vector<F> last(nh), all(size_t(comm.size()) * nh);
  kda::short_conv_final_cache<F>(x, nullptr, last.data(), d);  // (T >= W - 1: the rows themselves)
  comm.all_gather(last.data(), nh * sizeof(F), all.data());
  const int r = comm.rank();
  halo_out.assign(nh, F(0));
  if (r > 0) std::copy_n(all.data() + size_t(r - 1) * nh, nh, halo_out.data());
  else if (cache) std::copy_n(cache, nh, halo_out.data());
  kda::short_conv_forward<F>(x, w, halo_out.data(), y, d, silu);
}

template <class F>
void conv_cp_backward(Comm& comm, const F* x, const F* w, const std::vector<F>& halo, const F* dy, F* dx, F* dw,
                      F* dcache, const kda::ConvDims& d, bool silu) {
  check(d);
  const size_t nh = size_t(d.B * d.C * (d.W - 1));
  LM_CHECK(halo.size() == nh, "context-parallel conv backward: the halo does not match this call (forward first)");
  std::vector<F> dh(nh), all(size_t(comm.size()) * nh);
  kda::short_conv_backward<F>(x, w, halo.data(), dy, dx, dw, dh.data(), d, silu);
  comm.all_gather(dh.data(), nh * sizeof(F), all.data());
  const int r = comm.rank(), R = comm.size();
  const int64_t W1 = d.W - 1;
  if (r + 1 < R) {  // the next rank's halo was this rank's last W−1 rows
    const F* g = all.data() + size_t(r + 1) * nh;
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t c = 0; c < d.C; ++c)
        for (int64_t j = 0; j < W1; ++j) dx[(b * d.T + d.T - W1 + j) * d.C + c] += g[(b * d.C + c) * W1 + j];
  }
  if (dcache) std::copy_n(all.data(), nh, dcache);  // rank 0's halo is the initial cache
}

template void conv_cp_forward<float>(Comm&, const float*, const float*, const float*, float*, const kda::ConvDims&,
                                     bool, std::vector<float>&);
template void conv_cp_forward<double>(Comm&, const double*, const double*, const double*, double*,
                                      const kda::ConvDims&, bool, std::vector<double>&);
template void conv_cp_backward<float>(Comm&, const float*, const float*, const std::vector<float>&, const float*,
                                      float*, float*, float*, const kda::ConvDims&, bool);
template void conv_cp_backward<double>(Comm&, const double*, const double*, const std::vector<double>&,
                                       const double*, double*, double*, double*, const kda::ConvDims&, bool);

}  // namespace lm::dist
