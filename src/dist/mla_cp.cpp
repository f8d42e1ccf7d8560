#include "dist/mla_cp.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "ops/attention/attention.hpp"
#include "ops/gemm/gemm.hpp"

namespace lm::dist {

template <class F>
void mla_cp_forward(Comm& comm, const F* latent, const F* q, const F* W_kvb, F* o, const MlaCpDims& d, F scale,
                    MlaCpSaved<F>& s) {
  LM_CHECK(d.T >= 1 && d.H >= 1 && d.Rl >= 1, "context-parallel MLA: empty shape");
  const int64_t R = comm.size(), r = comm.rank(), T = d.T, H = d.H, Dq = d.Dn + d.Dr, Dkv = d.Dn + d.Dv,
                RD = d.Rl + d.Dr, end = (r + 1) * T;
  std::vector<F> all(size_t(R * T * RD));
  comm.all_gather(latent, size_t(T * RD) * sizeof(F), all.data());
  s.lat.assign(all.begin(), all.begin() + end * RD);
  // Keys and values of positions [0, end) from their latents.
  std::vector<F> kv(size_t(end * H * Dkv));
  ops::gemm(false, true, end, H * Dkv, d.Rl, F(1), s.lat.data(), RD, W_kvb, d.Rl, F(0), kv.data(), H * Dkv);
  s.k.resize(size_t(end * H * Dq)), s.v.resize(size_t(end * H * d.Dv));
  ops::mla_split_kv(kv.data(), s.lat.data() + d.Rl, RD, s.k.data(), s.v.data(), end, H, d.Dn, d.Dr, d.Dv);
  s.q.assign(size_t(end * H * Dq), F(0));
  std::copy_n(q, T * H * Dq, s.q.data() + (end - T) * H * Dq);
  s.o.resize(size_t(end * H * d.Dv)), s.lse.resize(size_t(end * H));
  ops::AttnDims ad;
  ad.B = 1, ad.T = end, ad.H = H, ad.Dk = Dq, ad.Dv = d.Dv;
  ops::attention_forward(s.q.data(), s.k.data(), s.v.data(), s.o.data(), s.lse.data(), ad, scale);
  std::copy_n(s.o.data() + (end - T) * H * d.Dv, T * H * d.Dv, o);
}

template <class F>
void mla_cp_backward(Comm& comm, const F* W_kvb, const F* do_, F* dq, F* dlatent, F* dW_kvb, const MlaCpDims& d,
                     F scale, const MlaCpSaved<F>& s) {
  const int64_t R = comm.size(), r = comm.rank(), T = d.T, H = d.H, Dq = d.Dn + d.Dr, Dkv = d.Dn + d.Dv,
                RD = d.Rl + d.Dr, end = (r + 1) * T;
  LM_CHECK(s.lat.size() == size_t(end * RD), "context-parallel MLA backward: the saved state does not match this call");
  std::vector<F> dop(size_t(end * H * d.Dv), F(0));  // the padding rows carry no gradient
  std::copy_n(do_, T * H * d.Dv, dop.data() + (end - T) * H * d.Dv);
  std::vector<F> dqp(s.q.size()), dk(s.k.size()), dv(s.v.size());
  ops::AttnDims ad;
  ad.B = 1, ad.T = end, ad.H = H, ad.Dk = Dq, ad.Dv = d.Dv;
  ops::attention_backward(s.q.data(), s.k.data(), s.v.data(), s.o.data(), s.lse.data(), dop.data(), dqp.data(),
                          dk.data(), dv.data(), ad, scale);
  std::copy_n(dqp.data() + (end - T) * H * Dq, T * H * Dq, dq);
  // dk_nope and dv back through W_kvb; dk_r summed over the heads.
  std::vector<F> dkv(size_t(end * H * Dkv)), dlat(size_t(R * T * RD), F(0));
  ops::mla_merge_dkv(dk.data(), dv.data(), dkv.data(), dlat.data() + d.Rl, RD, end, H, d.Dn, d.Dr, d.Dv);
  ops::gemm(false, false, end, d.Rl, H * Dkv, F(1), dkv.data(), H * Dkv, W_kvb, d.Rl, F(0), dlat.data(), RD);
  if (dW_kvb) ops::gemm(true, false, H * Dkv, d.Rl, end, F(1), dkv.data(), H * Dkv, s.lat.data(), RD, F(1), dW_kvb, d.Rl);
  // Every rank's contributions to every latent row, summed; this rank keeps its own rows.
  comm.all_reduce_sum(dlat.data(), dlat.size());
  std::copy_n(dlat.data() + r * T * RD, T * RD, dlatent);
}

template void mla_cp_forward<float>(Comm&, const float*, const float*, const float*, float*, const MlaCpDims&, float,
                                    MlaCpSaved<float>&);
template void mla_cp_forward<double>(Comm&, const double*, const double*, const double*, double*, const MlaCpDims&,
                                     double, MlaCpSaved<double>&);
template void mla_cp_backward<float>(Comm&, const float*, const float*, float*, float*, float*, const MlaCpDims&, float,
                                     const MlaCpSaved<float>&);
template void mla_cp_backward<double>(Comm&, const double*, const double*, double*, double*, double*,
                                      const MlaCpDims&, double, const MlaCpSaved<double>&);

}  // namespace lm::dist
