// The whole KDA operator from raw inputs (what fla's chunk_kda computes with the in-kernel L2 norm,
// gate and β sigmoid): preprocess, core recurrence (reference or chunked), and the chain back.
//
// Legend: B batch, T tokens, H heads, K key dim, V value dim; rows = B·T.
#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "ops/kda/kda.hpp"

namespace lm::kda {

namespace {

// Processed inputs of the core: unit-norm q, k; β in (0, 1); g the log decay.
template <class F>
struct Prepared {
  std::vector<F> q, k, beta, g;
};

template <class F>
Prepared<F> prepare(const FusedInputs<F>& in, const Dims& d) {
  const int64_t rows = d.B * d.T;
  Prepared<F> p;
  p.q.resize(rows * d.H * d.K);
  p.k.resize(rows * d.H * d.K);
  p.g.resize(rows * d.H * d.K);
  p.beta.resize(rows * d.H);
  l2norm_forward(in.q, p.q.data(), rows * d.H, d.K);
  l2norm_forward(in.k, p.k.data(), rows * d.H, d.K);
  sigmoid_forward(in.beta_raw, p.beta.data(), rows * d.H);
  gate_forward(in.g_raw, in.A_log, in.dt_bias, p.g.data(), rows, d.H, d.K, in.gate);
  return p;
}

template <class F>
CoreInputs<F> core_inputs(const FusedInputs<F>& in, const Prepared<F>& p) {
  CoreInputs<F> c;
  c.q = p.q.data();
  c.k = p.k.data();
  c.v = in.v;
  c.g = p.g.data();
  c.beta = p.beta.data();
  c.h0 = in.h0;
  c.scale = in.scale;
  return c;
}

}  // namespace

template <class F>
void fused_forward(const FusedInputs<F>& in, const Dims& d, F* o, F* ht, CorePath core, DiagPath diag,
                   F* chunk_states) {
  check_dims(d);
  const Prepared<F> p = prepare(in, d);
  const CoreInputs<F> c = core_inputs(in, p);
  if (core == CorePath::Reference) reference_forward(c, d, o, ht);
  else chunk_forward(c, d, o, ht, diag, in.gate, chunk_states);
}

template <class F>
void fused_backward(const FusedInputs<F>& in, const Dims& d, const F* do_, const F* dht, const FusedGrads<F>& gr,
                    CorePath core, DiagPath diag, const F* chunk_states) {
  check_dims(d);
  LM_CHECK(gr.dq && gr.dk && gr.dv && gr.dg_raw && gr.dbeta_raw && gr.dA_log && gr.ddt_bias,
           "fused_backward: every gradient except dh0 must be given");
  const int64_t rows = d.B * d.T, nqk = rows * d.H * d.K;
  const Prepared<F> p = prepare(in, d);
  const CoreInputs<F> c = core_inputs(in, p);
  std::vector<F> dqn(nqk), dkn(nqk), dg(nqk), db(rows * d.H);
  CoreGrads<F> cg{dqn.data(), dkn.data(), gr.dv, dg.data(), db.data(), gr.dh0};
  if (core == CorePath::Reference) reference_backward(c, d, do_, dht, cg);
  else chunk_backward(c, d, do_, dht, cg, diag, in.gate, chunk_states);
  l2norm_backward(in.q, dqn.data(), gr.dq, rows * d.H, d.K);
  l2norm_backward(in.k, dkn.data(), gr.dk, rows * d.H, d.K);
  sigmoid_backward(in.beta_raw, db.data(), gr.dbeta_raw, rows * d.H);
  std::fill_n(gr.dA_log, d.H, F(0));
  std::fill_n(gr.ddt_bias, d.H * d.K, F(0));
  gate_backward(in.g_raw, in.A_log, in.dt_bias, dg.data(), gr.dg_raw, gr.dA_log, gr.ddt_bias, rows, d.H, d.K, in.gate);
}

template void fused_forward<float>(const FusedInputs<float>&, const Dims&, float*, float*, CorePath, DiagPath,
                                   float*);
template void fused_forward<double>(const FusedInputs<double>&, const Dims&, double*, double*, CorePath, DiagPath,
                                    double*);
template void fused_backward<float>(const FusedInputs<float>&, const Dims&, const float*, const float*,
                                    const FusedGrads<float>&, CorePath, DiagPath, const float*);
template void fused_backward<double>(const FusedInputs<double>&, const Dims&, const double*, const double*,
                                     const FusedGrads<double>&, CorePath, DiagPath, const double*);

}  // namespace lm::kda
