#include "dist/moe_ep.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace lm::dist {

ExpertExchange expert_exchange(Comm& comm, const int64_t* offsets, int64_t E) {
  ExpertExchange x;
  x.R = comm.size(), x.rank = comm.rank(), x.E = E;
  LM_CHECK(E >= 1 && E % x.R == 0, "expert parallel: {} ranks do not divide the {} experts", x.R, E);
  x.El = E / x.R;
  const int R = x.R;
  const int64_t El = x.El;
  // counts[j·El + e]: this rank's rows for expert j·El + e; arriving: cnt[s·El + e], rank s's rows for local e.
  std::vector<int64_t> counts(static_cast<size_t>(E)), cnt(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) counts[size_t(e)] = offsets[e + 1] - offsets[e];
  const std::vector<size_t> bytes(size_t(R), size_t(El) * sizeof(int64_t));
  comm.all_to_all_v(counts.data(), bytes, cnt.data(), bytes);
  x.send_rows.assign(size_t(R), 0), x.recv_rows.assign(size_t(R), 0);
  x.local_offsets.assign(size_t(El) + 1, 0);
  for (int j = 0; j < R; ++j)
    for (int64_t e = 0; e < El; ++e) {
      x.send_rows[size_t(j)] += counts[size_t(j * El + e)];
      x.recv_rows[size_t(j)] += cnt[size_t(j * El + e)];
      x.local_offsets[size_t(e) + 1] += cnt[size_t(j * El + e)];
    }
  for (int64_t e = 0; e < El; ++e) x.local_offsets[size_t(e) + 1] += x.local_offsets[size_t(e)];
  // Rank s's rows arrive expert by expert; in the grouped order they follow the earlier ranks' rows of that expert.
  std::vector<int64_t> next(x.local_offsets.begin(), x.local_offsets.end() - 1);
  x.grouped.reserve(size_t(x.rows()));
  for (int s = 0; s < R; ++s)
    for (int64_t e = 0; e < El; ++e)
      for (int64_t i = 0; i < cnt[size_t(s * El + e)]; ++i) x.grouped.push_back(next[size_t(e)]++);
  return x;
}

namespace {
std::vector<size_t> row_bytes(const std::vector<int64_t>& rows, int64_t w, size_t elem) {
  std::vector<size_t> b(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) b[j] = size_t(rows[j]) * size_t(w) * elem;
  return b;
}
}  // namespace

template <class F>
void to_experts(Comm& comm, const ExpertExchange& x, const F* rows, int64_t w, F* grouped) {
  std::vector<F> arrived(size_t(x.rows()) * size_t(w));
  comm.all_to_all_v(rows, row_bytes(x.send_rows, w, sizeof(F)), arrived.data(), row_bytes(x.recv_rows, w, sizeof(F)));
  for (size_t i = 0; i < x.grouped.size(); ++i)
    std::copy_n(arrived.data() + i * size_t(w), w, grouped + size_t(x.grouped[i]) * size_t(w));
}

template <class F>
void from_experts(Comm& comm, const ExpertExchange& x, const F* grouped, int64_t w, F* rows) {
  std::vector<F> back(size_t(x.rows()) * size_t(w));
  for (size_t i = 0; i < x.grouped.size(); ++i)
    std::copy_n(grouped + size_t(x.grouped[i]) * size_t(w), w, back.data() + i * size_t(w));
  comm.all_to_all_v(back.data(), row_bytes(x.recv_rows, w, sizeof(F)), rows, row_bytes(x.send_rows, w, sizeof(F)));
}

template void to_experts<float>(Comm&, const ExpertExchange&, const float*, int64_t, float*);
template void to_experts<double>(Comm&, const ExpertExchange&, const double*, int64_t, double*);
template void from_experts<float>(Comm&, const ExpertExchange&, const float*, int64_t, float*);
template void from_experts<double>(Comm&, const ExpertExchange&, const double*, int64_t, double*);

}  // namespace lm::dist
