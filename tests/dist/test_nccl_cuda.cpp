// The NCCL device communicator (dist/nccl.hpp): every collective at the world size this binary runs at (alone: one
// rank; under `mpiexec -n N` with N GPUs on the host: N ranks, one GPU each), with values whose sums are exact in
// every dtype, in place and out of place; the ordering against the compute stream; the argument errors and a
// communicator that was aborted. Skips without a GPU, without NCCL, or with more ranks on the host than GPUs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/half.hpp"
#include "dist/comm.hpp"
#include "dist/nccl.hpp"
#include "nccl_testing.hpp"

using namespace lm;

namespace {

using nccl_testing::Dev;
using nccl_testing::shared_comm;

#define REQUIRE_NCCL()                                          \
  if (const std::string why = nccl_testing::cannot_run(); !why.empty()) GTEST_SKIP() << why; \
  dist::DeviceComm& dc = shared_comm();                         \
  const int R = dc.size(), me = dc.rank()

// Integer-valued inputs in dtype t (every partial sum of up to 8 ranks below 256: exact in bf16).
template <class T>
std::vector<uint8_t> encode(const std::vector<double>& x) {
  std::vector<uint8_t> b(x.size() * sizeof(T));
  for (size_t i = 0; i < x.size(); ++i) {
    T v;
    if constexpr (std::is_same_v<T, uint16_t>) v = f32_to_bf16(float(x[i]));
    else v = T(x[i]);
    std::memcpy(b.data() + i * sizeof(T), &v, sizeof(T));
  }
  return b;
}
std::vector<uint8_t> encode(const std::vector<double>& x, DType t) {
  switch (t) {
    case DType::F32: return encode<float>(x);
    case DType::F64: return encode<double>(x);
    case DType::BF16: return encode<uint16_t>(x);
    case DType::I32: return encode<int32_t>(x);
    case DType::I64: return encode<int64_t>(x);
    default: throw Error("test: no encoder");
  }
}

TEST(Nccl, AllReduceSumsEveryDtype) {
  REQUIRE_NCCL();
  EXPECT_NE(dc.name().find("NCCL"), std::string::npos) << dc.name();
  for (DType t : {DType::F32, DType::BF16, DType::F64, DType::I32, DType::I64}) {
    const size_t n = 1003;
    std::vector<double> x(n), want(n, 0);
    for (size_t i = 0; i < n; ++i) {
      x[i] = me + 1 + double(i % 7);
      for (int r = 0; r < R; ++r) want[i] += r + 1 + double(i % 7);
    }
    Dev d(n * dtype_size(t));
    d.up(encode(x, t));
    dc.all_reduce_sum(d.p, n, t);
    dc.all_reduce_sum(d.p, 0, t);  // (nothing)
    dc.synchronize();
    EXPECT_EQ(d.down(n * dtype_size(t)), encode(want, t)) << dtype_name(t);
  }
}

TEST(Nccl, ReduceScatterInPlaceAndOutOfPlace) {
  REQUIRE_NCCL();
  for (DType t : {DType::F32, DType::BF16}) {
    const size_t n = 517, es = dtype_size(t);
    auto value = [](int r, size_t i) { return double((r + 1) * int(i % 5 + 1)); };  // (partial sums < 256)
    std::vector<double> x(size_t(R) * n), want(n, 0);
    for (size_t i = 0; i < x.size(); ++i) x[i] = value(me, i);
    for (size_t i = 0; i < n; ++i)
      for (int r = 0; r < R; ++r) want[i] += value(r, size_t(me) * n + i);
    Dev send(x.size() * es), recv(n * es), inplace(x.size() * es);
    send.up(encode(x, t));
    inplace.up(encode(x, t));
    dc.reduce_scatter_sum(send.p, recv.p, n, t);
    dc.reduce_scatter_sum(inplace.p, inplace.at(size_t(me) * n * es), n, t);
    dc.synchronize();
    EXPECT_EQ(recv.down(n * es), encode(want, t)) << dtype_name(t);
    const std::vector<uint8_t> all = inplace.down(x.size() * es);
    const auto mine = all.begin() + long(size_t(me) * n * es);
    EXPECT_EQ(std::vector<uint8_t>(mine, mine + long(n * es)), encode(want, t)) << dtype_name(t) << " in place";
  }
}

// Rank r's k-th byte of a gathered block.
uint8_t pattern(int r, size_t k) { return uint8_t(r * 16 + int(k % 16) + int(k / 16) * 3); }

TEST(Nccl, AllGatherInPlaceAndOutOfPlace) {
  REQUIRE_NCCL();
  const size_t b = 1001;
  std::vector<uint8_t> mine(b), want(size_t(R) * b);
  for (size_t k = 0; k < b; ++k) mine[k] = pattern(me, k);
  for (int r = 0; r < R; ++r)
    for (size_t k = 0; k < b; ++k) want[size_t(r) * b + k] = pattern(r, k);
  Dev send(b), recv(size_t(R) * b), inplace(size_t(R) * b);
  send.up(mine);
  inplace.up_at(mine, size_t(me) * b);
  dc.all_gather(send.p, recv.p, b);
  dc.all_gather(inplace.at(size_t(me) * b), inplace.p, b);
  dc.synchronize();
  EXPECT_EQ(recv.down(want.size()), want);
  EXPECT_EQ(inplace.down(want.size()), want);
}

TEST(Nccl, AllGatherVOfUnevenSizes) {
  REQUIRE_NCCL();
  std::vector<size_t> bytes;
  for (int r = 0; r < R; ++r) bytes.push_back(r == 1 ? 0 : size_t(13 + 7 * r));  // (rank 1 sends nothing)
  std::vector<uint8_t> mine(bytes[size_t(me)]), want;
  for (size_t k = 0; k < mine.size(); ++k) mine[k] = pattern(me, k);
  for (int r = 0; r < R; ++r)
    for (size_t k = 0; k < bytes[size_t(r)]; ++k) want.push_back(pattern(r, k));
  Dev send(mine.size()), recv(want.size());
  send.up(mine);
  dc.all_gather_v(send.p, recv.p, bytes);
  dc.synchronize();
  EXPECT_EQ(recv.down(want.size()), want);
  EXPECT_THROW(dc.all_gather_v(send.p, recv.p, std::vector<size_t>(size_t(R) + 1, 1)), Error);
}

TEST(Nccl, AllToAllVOfUnevenSizes) {
  REQUIRE_NCCL();
  // Rank r sends 3 + (r + 2j) % 5 bytes to rank j, byte k of them (r·31 + j·7 + k) mod 256.
  auto size = [](int from, int to) { return size_t(3 + (from + 2 * to) % 5); };
  auto byte = [](int from, int to, size_t k) { return uint8_t(from * 31 + to * 7 + int(k)); };
  std::vector<size_t> sb, rb;
  std::vector<uint8_t> out, want;
  for (int j = 0; j < R; ++j) {
    sb.push_back(size(me, j)), rb.push_back(size(j, me));
    for (size_t k = 0; k < size(me, j); ++k) out.push_back(byte(me, j, k));
    for (size_t k = 0; k < size(j, me); ++k) want.push_back(byte(j, me, k));
  }
  Dev send(out.size()), recv(want.size());
  send.up(out);
  dc.all_to_all_v(send.p, sb, recv.p, rb);
  dc.synchronize();
  EXPECT_EQ(recv.down(want.size()), want);
  EXPECT_THROW(dc.all_to_all_v(send.p, std::vector<size_t>(size_t(R) + 1, 0), recv.p, rb), Error);
  std::vector<size_t> self_mismatch = rb;
  self_mismatch[size_t(me)] += 1;  // (every rank: no rank enters NCCL)
  EXPECT_THROW(dc.all_to_all_v(send.p, sb, recv.p, self_mismatch), Error);
}

TEST(Nccl, BroadcastFromEveryRootAndBarrier) {
  REQUIRE_NCCL();
  for (int root = 0; root < R; ++root) {
    const size_t b = 777;
    std::vector<uint8_t> x(b), want(b);
    for (size_t k = 0; k < b; ++k) x[k] = pattern(me, k), want[k] = pattern(root, k);
    Dev d(b);
    d.up(x);
    dc.broadcast(d.p, b, root);
    dc.synchronize();
    EXPECT_EQ(d.down(b), want) << "root " << root;
  }
  Dev d(16);
  try {
    dc.broadcast(d.p, 16, R);
    FAIL() << "a root outside the ranks went through";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("root"), std::string::npos) << e.what();
  }
  dc.barrier();
  dc.barrier();
}

// The collectives wait for what the compute stream queued before wait_for (data copied in behind 8 GiB of memsets),
// and the compute stream for them after join (a copy out queued right behind them): out of order, the gather would
// read zeros or the copy the poison.
TEST(Nccl, OrderedAgainstTheComputeStream) {
  REQUIRE_NCCL();
  const size_t n = 4096, big = size_t(1) << 30;
  Dev slow(big), x(n * 4), y(size_t(R) * n * 4), out(n * 4);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), n * 4), cudaSuccess);
  for (size_t i = 0; i < n; ++i) pinned[i] = float(me + 1);
  ASSERT_EQ(cudaMemset(x.p, 0, n * 4), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int rep = 0; rep < 8; ++rep) ASSERT_EQ(cudaMemsetAsync(slow.p, rep, big, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(x.p, pinned, n * 4, cudaMemcpyHostToDevice, nullptr), cudaSuccess);
  dc.wait_for(nullptr);
  dc.all_reduce_sum(x.p, n, DType::F32);
  dc.all_gather(x.p, y.p, n * 4);
  dc.join(nullptr);
  ASSERT_EQ(cudaMemcpyAsync(out.p, y.at(size_t(me) * n * 4), n * 4, cudaMemcpyDeviceToDevice, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), out.p, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, std::vector<float>(n, float(R * (R + 1) / 2)));
  cudaFreeHost(pinned);
}

TEST(Nccl, AnAbortedCommunicatorRefusesCalls) {
  if (const std::string why = nccl_testing::cannot_run(); !why.empty()) GTEST_SKIP() << why;
  auto c = dist::DeviceComm::make(dist::world());
  Dev d(64);
  c->all_reduce_sum(d.p, 16, DType::F32);
  c->synchronize();
  c->abort();
  c->abort();  // (idempotent)
  try {
    c->all_reduce_sum(d.p, 16, DType::F32);
    FAIL() << "an aborted communicator took a collective";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("aborted"), std::string::npos) << e.what();
  }
}

TEST(Nccl, WithoutNcclEverythingSaysSo) {
  if (dist::built_with_nccl()) GTEST_SKIP() << "built with NCCL";
  try {
    dist::DeviceComm::make(dist::single());
    FAIL() << "made a communicator without NCCL";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("without NCCL"), std::string::npos) << e.what();
  }
}

}  // namespace
