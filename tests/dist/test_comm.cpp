// The job's communicator (dist/comm.hpp): every collective against what it must give, for whatever world size the
// test runs at (ctest runs this binary alone, then under mpirun with 2 and 4 ranks: MpiRanks2.Dist, MpiRanks4.Dist).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/error.hpp"
#include "dist/comm.hpp"

using namespace lm;

TEST(Comm, EveryCollective) {
  dist::Comm& w = dist::world();
  const int R = w.size(), r = w.rank();
  ASSERT_GE(R, 1);
  ASSERT_LT(r, R);
  // all-reduce: x[i] = r + 1 + i on rank r sums to R(R+1)/2 + R·i.
  std::vector<float> f(1000);
  std::vector<double> d(3);
  std::vector<int64_t> n(5);
  for (size_t i = 0; i < f.size(); ++i) f[i] = float(r + 1 + int(i));
  for (size_t i = 0; i < d.size(); ++i) d[i] = 0.5 * (r + 1) + double(i);
  for (size_t i = 0; i < n.size(); ++i) n[i] = (int64_t(1) << 40) * (r + 1) + int64_t(i);
  w.all_reduce_sum(f.data(), f.size());
  w.all_reduce_sum(d.data(), d.size());
  w.all_reduce_sum(n.data(), n.size());
  const int64_t tri = int64_t(R) * (R + 1) / 2;
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(f[i], float(tri + int64_t(R) * int64_t(i))) << i;
  for (size_t i = 0; i < d.size(); ++i) EXPECT_EQ(d[i], 0.5 * double(tri) + double(R) * double(i));
  for (size_t i = 0; i < n.size(); ++i) EXPECT_EQ(n[i], (int64_t(1) << 40) * tri + int64_t(R) * int64_t(i));
  // all-gather: rank order.
  const int32_t mine[2] = {r, 10 * r};
  std::vector<int32_t> all(size_t(2 * R));
  w.all_gather(mine, sizeof(mine), all.data());
  for (int q = 0; q < R; ++q) {
    EXPECT_EQ(all[size_t(2 * q)], q);
    EXPECT_EQ(all[size_t(2 * q + 1)], 10 * q);
  }
  // all-gather of sizes that differ: rank q gives q + 1 bytes of value q.
  const std::vector<char> v = w.all_gather_v(std::vector<char>(size_t(r + 1), char(r)).data(), size_t(r + 1));
  ASSERT_EQ(v.size(), size_t(tri));
  size_t o = 0;
  for (int q = 0; q < R; ++q)
    for (int k = 0; k <= q; ++k) EXPECT_EQ(v[o++], char(q));
  // reduce-scatter: send[j] = (r + 1)(j + 1); rank r receives Σ_q (q + 1)(r·m + i + 1) = tri·(r·m + i + 1).
  const size_t m = 7;
  std::vector<float> send(m * size_t(R)), recv(m);
  for (size_t j = 0; j < send.size(); ++j) send[j] = float((r + 1) * int(j + 1));
  w.reduce_scatter_sum(send.data(), recv.data(), m);
  for (size_t i = 0; i < m; ++i) EXPECT_EQ(recv[i], float(tri * int64_t(size_t(r) * m + i + 1)));
  // all-to-all with sizes: rank r sends j + 1 bytes of value 16r + j to rank j.
  std::vector<size_t> sb, rb;
  std::vector<char> out, in;
  for (int j = 0; j < R; ++j) {
    sb.push_back(size_t(j + 1)), rb.push_back(size_t(r + 1));
    out.insert(out.end(), size_t(j + 1), char(16 * r + j));
  }
  in.resize(size_t(R) * size_t(r + 1));
  w.all_to_all_v(out.data(), sb, in.data(), rb);
  for (int q = 0; q < R; ++q)
    for (int k = 0; k <= r; ++k) EXPECT_EQ(in[size_t(q * (r + 1) + k)], char(16 * q + r));
  // broadcast from the last rank.
  std::vector<int64_t> b(4, r == R - 1 ? 42 : -1);
  w.broadcast(b.data(), b.size() * sizeof(int64_t), R - 1);
  for (int64_t x : b) EXPECT_EQ(x, 42);
  w.barrier();
  EXPECT_THROW(w.broadcast(b.data(), 8, R), Error);
}

TEST(Comm, SingleProcessIsAlwaysThere) {
  dist::Comm& s = dist::single();
  EXPECT_EQ(s.size(), 1);
  EXPECT_EQ(s.rank(), 0);
  float x = 3;
  s.all_reduce_sum(&x, 1);
  EXPECT_EQ(x, 3.f);
}

// Non-blocking all-reduce: the sum once waited for, several under way at once (progressed by test()); and groups
// split off the job (rank parity here): their collectives stay inside the group.
TEST(Comm, NonBlockingAllReduceAndSplitGroups) {
  dist::Comm& w = dist::world();
  const int R = w.size(), r = w.rank();
  std::vector<float> a(100, float(r + 1)), b(3, 2.0f);
  auto pa = w.iall_reduce_sum(a.data(), a.size());
  auto pb = w.iall_reduce_sum(b.data(), b.size());
  pb->test();
  pa->wait();
  pb->wait();
  EXPECT_TRUE(pa->test());
  EXPECT_EQ(a[99], float(R * (R + 1) / 2));
  EXPECT_EQ(b[0], 2.0f * float(R));
  const std::unique_ptr<dist::Comm> g = w.split(r % 2, r);
  EXPECT_EQ(g->size(), (R + 1 - r % 2) / 2);
  EXPECT_EQ(g->rank(), r / 2);
  int64_t x = r;  // the ranks of my parity: r % 2, r % 2 + 2, ...
  g->all_reduce_sum(&x, 1);
  int64_t want = 0;
  for (int q = r % 2; q < R; q += 2) want += q;
  EXPECT_EQ(x, want);
  EXPECT_EQ(dist::single().split(0, 0)->size(), 1);
}
