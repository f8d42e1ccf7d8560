// GLU feed-forward blocks (SPEC §4): the dense FFN of the first layers, the shared experts, and the
// per-expert computation of the routed experts.
//
// Legend: rows tokens, din input width (d, or the latent l for routed experts), I intermediate width.
//   ab = [x W_gateᵀ | x W_upᵀ]   [rows, 2I]  (two GEMMs writing the halves of one buffer)
//   h  = GLU(ab)                 [rows, I]   (SiTU-GLU or SwiGLU)
//   y  = h W_downᵀ               [rows, din]
#include "model/layers.hpp"
#include "model/linear.hpp"

namespace lm::model {

ops::GluParams glu_params(const ModelConfig& c) {
  if (!c.is_situ()) return ops::GluParams::swiglu();
  return ops::GluParams::situ(c.activation_situ_beta.value_or(4.0), c.activation_situ_linear_beta.value_or(0.0));
}

template <class F>
void glu_ffn_forward(const F* x, int64_t rows, int64_t din, int64_t I, const F* Wg, const F* Wu, const F* Wd,
                     const ops::GluParams& p, F* y, bool accumulate, GluFfnActs<F>& a) {
  a.ab.resize(rows * 2 * I);
  a.h.resize(rows * I);
  if (rows == 0) return;
  linear_forward(x, Wg, a.ab.data(), rows, din, I, false, din, 2 * I);
  linear_forward(x, Wu, a.ab.data() + I, rows, din, I, false, din, 2 * I);
  ops::glu_forward(a.ab.data(), a.h.data(), rows, I, p);
  linear_forward(a.h.data(), Wd, y, rows, I, din, accumulate);
}

template <class F>
void glu_ffn_backward(const F* x, int64_t rows, int64_t din, int64_t I, const F* Wg, const F* Wu, const F* Wd,
                      const ops::GluParams& p, const F* dy, F* dx, bool accumulate_dx, F* dWg, F* dWu, F* dWd,
                      GluFfnActs<F>& a) {
  if (rows == 0) return;
  Buf<F> dh(rows * I), dab(rows * 2 * I);
  linear_backward(a.h.data(), Wd, dy, dh.data(), dWd, rows, I, din);
  ops::glu_backward(a.ab.data(), dh.data(), dab.data(), rows, I, p);
  linear_backward(x, Wg, dab.data(), dx, dWg, rows, din, I, accumulate_dx, din, 2 * I);
  linear_backward(x, Wu, dab.data() + I, dx, dWu, rows, din, I, true, din, 2 * I);
}

template <class F>
DenseFfn<F>::DenseFfn(const ModelConfig& c, ParamStore<F>& ps, const std::string& prefix, int64_t width)
    : d_(c.hidden_size), I_(width), p_(glu_params(c)) {
  Wg = &ps.at(prefix + ".gate_proj.weight");
  Wu = &ps.at(prefix + ".up_proj.weight");
  Wd = &ps.at(prefix + ".down_proj.weight");
}

template <class F>
void DenseFfn<F>::forward(const F* x, F* y, const Seqs& s, bool accumulate) {
  x_.assign(x, x + s.rows() * d_);
  glu_ffn_forward(x, s.rows(), d_, I_, Wg->w(), Wu->w(), Wd->w(), p_, y, accumulate, a_);
}

template <class F>
void DenseFfn<F>::backward(const F* dy, F* dx, const Seqs& s, bool accumulate_dx) {
  glu_ffn_backward(x_.data(), s.rows(), d_, I_, Wg->w(), Wu->w(), Wd->w(), p_, dy, dx, accumulate_dx, Wg->g(), Wu->g(),
                   Wd->g(), a_);
}

#define LM_INST(F)                                                                                                    \
  template void glu_ffn_forward<F>(const F*, int64_t, int64_t, int64_t, const F*, const F*, const F*,                \
                                   const ops::GluParams&, F*, bool, GluFfnActs<F>&);                                  \
  template void glu_ffn_backward<F>(const F*, int64_t, int64_t, int64_t, const F*, const F*, const F*,               \
                                    const ops::GluParams&, const F*, F*, bool, F*, F*, F*, GluFfnActs<F>&);           \
  template class DenseFfn<F>;
LM_INST(float)
LM_INST(double)
#undef LM_INST

}  // namespace lm::model
