#include "dist/kda_cp.hpp"

#include <algorithm>
#include <cstring>

#include "core/error.hpp"

namespace lm::dist {

namespace {

// y [K, V] = M [K, K] · x [K, V] (+ b), accumulated in double.
template <class F>
void affine(const F* M, const F* x, const F* b, F* y, int64_t K, int64_t V) {
  std::vector<double> acc(static_cast<size_t>(V));
  for (int64_t i = 0; i < K; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t l = 0; l < K; ++l) {
      const double m = static_cast<double>(M[i * K + l]);
      for (int64_t j = 0; j < V; ++j) acc[static_cast<size_t>(j)] += m * static_cast<double>(x[l * V + j]);
    }
    for (int64_t j = 0; j < V; ++j) y[i * V + j] = static_cast<F>(acc[static_cast<size_t>(j)] + (b ? static_cast<double>(b[i * V + j]) : 0.0));
  }
}
// y [K, V] = Mᵀ x + g.
template <class F>
void affine_t(const F* M, const F* x, const F* g, F* y, int64_t K, int64_t V) {
  std::vector<double> acc(static_cast<size_t>(K * V), 0.0);
  for (int64_t i = 0; i < K; ++i)
    for (int64_t l = 0; l < K; ++l) {
      const double m = static_cast<double>(M[i * K + l]);  // (Mᵀ)[l, i]
      for (int64_t j = 0; j < V; ++j) acc[static_cast<size_t>(l * V + j)] += m * static_cast<double>(x[i * V + j]);
    }
  for (int64_t e = 0; e < K * V; ++e) y[e] = static_cast<F>(acc[static_cast<size_t>(e)] + static_cast<double>(g[e]));
}

void check(const kda::Dims& d) {
  kda::check_dims(d);
  LM_CHECK(!d.cu_seqlens, "context-parallel KDA: packed (varlen) batches are not supported; give B sequences");
}

}  // namespace

template <class F>
void kda_cp_forward(Comm& comm, const kda::CoreInputs<F>& in, const kda::Dims& d, F* o, F* ht, kda::DiagPath path,
                    kda::GateParams gate, KdaCpSaved<F>& saved) {
  check(d);
  const int R = comm.size(), r = comm.rank();
  const int64_t B = d.B, H = d.H, K = d.K, V = d.V, BH = B * H, rows = B * d.T;
  const size_t nM = size_t(BH * K * K), nS = size_t(BH * K * V);
  // This segment's transition: from the identity with zero values over K value channels.
  std::vector<F> eye(nM, F(0)), zeros(size_t(rows * H * K), F(0)), scratch(size_t(rows * H * std::max(K, V)));
  for (int64_t p = 0; p < BH; ++p)
    for (int64_t i = 0; i < K; ++i) eye[size_t(p * K * K + i * K + i)] = F(1);
  std::vector<F> mine(nM + nS);
  kda::CoreInputs<F> t = in;
  t.v = zeros.data(), t.h0 = eye.data();
  kda::Dims dk = d;
  dk.V = K;
  kda::chunk_forward(t, dk, scratch.data(), mine.data(), path, gate);
  t = in, t.h0 = nullptr;  // and its zero-start final state
  kda::chunk_forward(t, d, scratch.data(), mine.data() + nM, path, gate);
  std::vector<F> all(size_t(R) * (nM + nS));
  comm.all_gather(mine.data(), mine.size() * sizeof(F), all.data());
  // Start states by the scan: S_{j+1} = M_j S_j + B_j from S_0 = h0.
  std::vector<F> S(nS, F(0)), next(nS);
  if (in.h0) std::copy_n(in.h0, nS, S.data());
  saved.M.assign(size_t(R) * nM, F(0));
  for (int j = 0; j < R; ++j) {
    const F* Mj = all.data() + size_t(j) * (nM + nS);
    std::copy_n(Mj, nM, saved.M.data() + size_t(j) * nM);
    if (j == r) saved.S0 = S;
    for (int64_t p = 0; p < BH; ++p)
      affine(Mj + p * K * K, S.data() + p * K * V, Mj + nM + p * K * V, next.data() + p * K * V, K, V);
    S.swap(next);
  }
  if (ht) std::copy_n(S.data(), nS, ht);
  t = in, t.h0 = saved.S0.data();
  kda::chunk_forward(t, d, o, static_cast<F*>(nullptr), path, gate);
}

template <class F>
void kda_cp_backward(Comm& comm, const kda::CoreInputs<F>& in, const kda::Dims& d, const F* do_, const F* dht,
                     const kda::CoreGrads<F>& gr, kda::DiagPath path, kda::GateParams gate, const KdaCpSaved<F>& saved) {
  check(d);
  const int R = comm.size(), r = comm.rank();
  const int64_t B = d.B, H = d.H, K = d.K, V = d.V, BH = B * H, rows = B * d.T;
  const size_t nM = size_t(BH * K * K), nS = size_t(BH * K * V);
  LM_CHECK(saved.S0.size() == nS && saved.M.size() == size_t(R) * nM,
           "context-parallel KDA backward: the saved states do not match this call (forward first, same shapes)");
  kda::CoreInputs<F> t = in;
  t.h0 = saved.S0.data();
  // g_r: what this segment's own outputs make of ∂L/∂S_r (no final-state gradient).
  std::vector<F> sq(size_t(rows * H * K)), sk(sq.size()), sg(sq.size()), sv(size_t(rows * H * V)),
      sb(size_t(rows * H)), g_mine(nS);
  kda::CoreGrads<F> scratch{sq.data(), sk.data(), sv.data(), sg.data(), sb.data(), g_mine.data()};
  kda::chunk_backward(t, d, do_, static_cast<const F*>(nullptr), scratch, path, gate);
  std::vector<F> g_all(size_t(R) * nS);
  comm.all_gather(g_mine.data(), nS * sizeof(F), g_all.data());
  // G_R = dht; G_j = g_j + M_jᵀ G_{j+1}, down to G_0.
  std::vector<F> G(nS, F(0)), prev(nS), G_next_mine;
  if (dht) std::copy_n(dht, nS, G.data());
  for (int j = R - 1; j >= 0; --j) {
    if (j == r) G_next_mine = G;  // G_{r+1}
    for (int64_t p = 0; p < BH; ++p)
      affine_t(saved.M.data() + size_t(j) * nM + p * K * K, G.data() + p * K * V, g_all.data() + size_t(j) * nS + p * K * V,
               prev.data() + p * K * V, K, V);
    G.swap(prev);
  }
  kda::CoreGrads<F> g2 = gr;
  std::vector<F> dh0_seg(nS);
  g2.dh0 = dh0_seg.data();  // (= G_r; the whole sequence's dh0 is G_0)
  kda::chunk_backward(t, d, do_, G_next_mine.data(), g2, path, gate);
  if (gr.dh0) std::copy_n(G.data(), nS, gr.dh0);
}

template void kda_cp_forward<float>(Comm&, const kda::CoreInputs<float>&, const kda::Dims&, float*, float*,
                                    kda::DiagPath, kda::GateParams, KdaCpSaved<float>&);
template void kda_cp_forward<double>(Comm&, const kda::CoreInputs<double>&, const kda::Dims&, double*, double*,
                                     kda::DiagPath, kda::GateParams, KdaCpSaved<double>&);
template void kda_cp_backward<float>(Comm&, const kda::CoreInputs<float>&, const kda::Dims&, const float*,
                                     const float*, const kda::CoreGrads<float>&, kda::DiagPath, kda::GateParams,
                                     const KdaCpSaved<float>&);
template void kda_cp_backward<double>(Comm&, const kda::CoreInputs<double>&, const kda::Dims&, const double*,
                                      const double*, const kda::CoreGrads<double>&, kda::DiagPath, kda::GateParams,
                                      const KdaCpSaved<double>&);

}  // namespace lm::dist
