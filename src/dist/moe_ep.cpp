#include "dist/moe_ep.hpp"

#include <cmath>
#include <cstring>

#include "core/error.hpp"

namespace lm::dist {

int64_t expert_capacity(int64_t m, int64_t k, int64_t E, double factor) {
  LM_CHECK(m >= 0 && k >= 1 && E >= 1 && factor >= 0 && std::isfinite(factor),
           "expert capacity: bad arguments (m {}, k {}, E {}, factor {})", m, k, E, factor);
  if (factor == 0) return std::max<int64_t>(m, 1);
  const auto c = static_cast<int64_t>(std::ceil(factor * double(m) * double(k) / double(E)));
  return std::clamp<int64_t>(c, 1, std::max<int64_t>(m, 1));
}

void plan_dispatch(const Comm& comm, const int64_t* offsets, int64_t E, int64_t capacity, ExpertDispatch& x) {
  x.R = comm.size(), x.rank = comm.rank(), x.E = E, x.C = capacity;
  LM_CHECK(E >= 1 && E % x.R == 0, "expert parallel: {} ranks do not divide the {} experts", x.R, E);
  LM_CHECK(capacity >= 1, "expert parallel: capacity {} rows", capacity);
  x.El = E / x.R;
  x.offsets.assign(offsets, offsets + E + 1);
  x.dropped = 0;
  for (int64_t e = 0; e < E; ++e) x.dropped += offsets[e + 1] - offsets[e] - x.sent(e);
}

namespace {

// One rank's message: El counts, then El blocks of C rows of w values.
size_t header_bytes(const ExpertDispatch& x) { return size_t(x.El) * sizeof(int64_t); }
template <class F>
size_t block_bytes(const ExpertDispatch& x, int64_t w) {
  return size_t(x.C) * size_t(w) * sizeof(F);
}

}  // namespace

template <class F>
void dispatch(Comm& comm, ExpertDispatch& x, const F* rows, int64_t w, std::vector<F>& grouped) {
  const size_t R = size_t(x.R), El = size_t(x.El), hb = header_bytes(x), bb = block_bytes<F>(x, w);
  const size_t msg = hb + El * bb, rb = size_t(w) * sizeof(F);
  x.send_buf.resize(R * msg);  // (padding keeps what an earlier call left: initialised, never read)
  x.recv_buf.resize(R * msg);
  for (size_t j = 0; j < R; ++j)
    for (size_t e = 0; e < El; ++e) {
      const int64_t g = int64_t(j * El + e), n = x.sent(g);
      char* m = x.send_buf.data() + j * msg;
      std::memcpy(m + e * sizeof(int64_t), &n, sizeof(int64_t));
      if (n) std::memcpy(m + hb + e * bb, rows + x.offsets[size_t(g)] * w, size_t(n) * rb);
    }
  comm.all_to_all_v(x.send_buf.data(), std::vector<size_t>(R, msg), x.recv_buf.data(), std::vector<size_t>(R, msg));
  x.recv.assign(R * El, 0);
  x.local_offsets.assign(El + 1, 0);
  for (size_t s = 0; s < R; ++s)
    for (size_t e = 0; e < El; ++e) {
      int64_t n = 0;
      std::memcpy(&n, x.recv_buf.data() + s * msg + e * sizeof(int64_t), sizeof(int64_t));
      LM_CHECK(n >= 0 && n <= x.C, "expert parallel: rank {} sent {} rows for a capacity of {}", s, n, x.C);
      x.recv[s * El + e] = n;
      x.local_offsets[e + 1] += n;
    }
  for (size_t e = 0; e < El; ++e) x.local_offsets[e + 1] += x.local_offsets[e];
  grouped.resize(size_t(x.rows()) * size_t(w));
  // Expert e's rows: every source's block in rank order.
  for (size_t e = 0; e < El; ++e) {
    char* out = reinterpret_cast<char*>(grouped.data() + x.local_offsets[e] * w);
    for (size_t s = 0; s < R; ++s) {
      const size_t n = size_t(x.recv[s * El + e]) * rb;
      std::memcpy(out, x.recv_buf.data() + s * msg + hb + e * bb, n);
      out += n;
    }
  }
}

template <class F>
void combine(Comm& comm, ExpertDispatch& x, const F* grouped, int64_t w, F* rows) {
  const size_t R = size_t(x.R), El = size_t(x.El), bb = block_bytes<F>(x, w);
  const size_t msg = El * bb, rb = size_t(w) * sizeof(F);
  x.send_buf.resize(R * msg);
  x.recv_buf.resize(R * msg);
  for (size_t e = 0; e < El; ++e) {
    const char* in = reinterpret_cast<const char*>(grouped + x.local_offsets[e] * w);
    for (size_t s = 0; s < R; ++s) {
      const size_t n = size_t(x.recv[s * El + e]) * rb;
      std::memcpy(x.send_buf.data() + s * msg + e * bb, in, n);
      in += n;
    }
  }
  comm.all_to_all_v(x.send_buf.data(), std::vector<size_t>(R, msg), x.recv_buf.data(), std::vector<size_t>(R, msg));
  for (size_t j = 0; j < R; ++j)
    for (size_t e = 0; e < El; ++e) {
      const size_t g = j * El + e;
      const int64_t n = x.sent(int64_t(g)), all = x.offsets[g + 1] - x.offsets[g];
      F* out = rows + x.offsets[g] * w;
      std::memcpy(out, x.recv_buf.data() + j * msg + e * bb, size_t(n) * rb);
      std::fill(out + n * w, out + all * w, F(0));  // dropped: no expert output, no gradient
    }
}

template void dispatch<float>(Comm&, ExpertDispatch&, const float*, int64_t, std::vector<float>&);
template void dispatch<double>(Comm&, ExpertDispatch&, const double*, int64_t, std::vector<double>&);
template void combine<float>(Comm&, ExpertDispatch&, const float*, int64_t, float*);
template void combine<double>(Comm&, ExpertDispatch&, const double*, int64_t, double*);

}  // namespace lm::dist
