// The NCCL device communicator (nccl.hpp) and the choice of this process's GPU; without NCCL, stubs that throw.
//
// Legend: R ranks, r this rank; bytes per rank as in nccl.hpp.
#include "dist/nccl.hpp"

#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "core/error.hpp"

#ifdef LONGMOE_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include "core/cuda/check.hpp"
#include "core/cuda/stream.hpp"
#endif

namespace lm::dist {

namespace {

std::string host_name() {
  char name[HOST_NAME_MAX + 1] = {};
  LM_CHECK(gethostname(name, sizeof name - 1) == 0, "gethostname failed: {}", std::strerror(errno));
  return name;
}

// This process's index among the job's processes whose `key` equals its own, and their number (collective).
std::pair<int, int> index_among(Comm& host, const std::string& key) {
  const std::vector<char> all = host.all_gather_v(key.c_str(), key.size() + 1);  // (split at the zeros)
  int index = -1, count = 0, r = 0;
  for (size_t o = 0; o < all.size(); o += std::strlen(all.data() + o) + 1, ++r) {
    if (key != all.data() + o) continue;
    if (r == host.rank()) index = count;
    ++count;
  }
  LM_CHECK(index >= 0 && r == host.size(), "nccl: the keys of {} ranks came back as {}", host.size(), r);
  return {index, count};
}

}  // namespace

int local_processes(Comm& host) { return index_among(host, host_name()).second; }

#ifndef LONGMOE_HAVE_NCCL

bool built_with_nccl() { return false; }
[[noreturn]] static void no_nccl() {
  throw Error("longmoe was built without NCCL (none was found beside CUDA at build time; set LONGMOE_NCCL_ROOT)");
}
int use_local_device(Comm&) { no_nccl(); }
struct DeviceComm::Impl {};
DeviceComm::DeviceComm(std::unique_ptr<Impl> p) : p_(std::move(p)) {}
DeviceComm::~DeviceComm() = default;
std::unique_ptr<DeviceComm> DeviceComm::make(Comm&) { no_nccl(); }
int DeviceComm::rank() const { no_nccl(); }
int DeviceComm::size() const { no_nccl(); }
std::string DeviceComm::name() const { no_nccl(); }
void* DeviceComm::stream() const { no_nccl(); }
void DeviceComm::all_reduce_sum(void*, size_t, DType) { no_nccl(); }
void DeviceComm::reduce_scatter_sum(const void*, void*, size_t, DType) { no_nccl(); }
void DeviceComm::all_gather(const void*, void*, size_t) { no_nccl(); }
void DeviceComm::all_gather_v(const void*, void*, const std::vector<size_t>&) { no_nccl(); }
void DeviceComm::all_to_all_v(const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&) { no_nccl(); }
void DeviceComm::broadcast(void*, size_t, int) { no_nccl(); }
void DeviceComm::barrier() { no_nccl(); }
void DeviceComm::wait_for(void*) { no_nccl(); }
void DeviceComm::join(void*) { no_nccl(); }
void DeviceComm::synchronize() { no_nccl(); }
void DeviceComm::abort() {}
void abort_job_and_devices(int code) { abort_job(code); }

#else

bool built_with_nccl() { return true; }

namespace {

constexpr cu::Checker ck{"nccl"};

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
  }
  throw Error("nccl: unknown dtype");
}

}  // namespace

int use_local_device(Comm& host) {
  const std::string name = host_name();
  const auto [index, count] = index_among(host, name);
  int n = 0;
  ck(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  // Fewer GPUs visible than processes is fine where each process sees a GPU of its own (CUDA_VISIBLE_DEVICES set per
  // process): told by the first visible GPU's PCI bus id (gathered on every rank, so the gathers stay collective).
  char bus[64] = {};
  if (n > 0) ck(cudaDeviceGetPCIBusId(bus, sizeof bus, 0), "cudaDeviceGetPCIBusId");
  const int sharing = index_among(host, name + "/" + bus).second;
  const bool own = count <= n;
  LM_CHECK(own || (n > 0 && sharing == 1), "{} processes of this job run on host {}, which has {} GPU(s) visible to "
           "each: NCCL takes one GPU per process (start at most {} there)", count, name, n, n);
  ck(cudaSetDevice(own ? index : 0), "cudaSetDevice");
  return own ? index : 0;
}

struct DeviceComm::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t in = nullptr, out = nullptr;  // wait_for's and join's
  int* token = nullptr;                     // barrier's one element (device)
  int rank = 0, size = 1, version = 0;
  bool aborted = false;

  // Every live communicator of the process, for abort_job_and_devices.
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::set<Impl*>& live() {
    static std::set<Impl*> s;
    return s;
  }

  void ok(ncclResult_t r, const char* what) const {
    if (r == ncclSuccess) return;
    std::string msg = fmt::format("NCCL {} failed: {}", what, ncclGetErrorString(r));
    const char* last = comm ? ncclGetLastError(comm) : nullptr;
    if (last && *last) msg += fmt::format(" ({})", last);
    throw Error(msg);
  }
  void usable(const char* what) const {
    LM_CHECK(!aborted, "nccl: {} on a communicator that was aborted (an earlier error)", what);
  }
  void do_abort() {
    if (aborted) return;
    aborted = true;
    if (comm) ncclCommAbort(comm);
    comm = nullptr;
  }
  ~Impl() {
    {
      std::lock_guard<std::mutex> g(mu());
      live().erase(this);
    }
    // A communicator with collectives still in flight (an error path) is aborted rather than waited for.
    if (comm) {
      if (stream && cudaStreamQuery(stream) == cudaSuccess)
        ncclCommDestroy(comm);
      else
        ncclCommAbort(comm);
    }
    cudaGetLastError();  // (a stream still busy leaves cudaErrorNotReady)
    if (token) cudaFree(token);
    for (cudaEvent_t e : {in, out})
      if (e) cudaEventDestroy(e);
    if (stream) cudaStreamDestroy(stream);
  }
};

DeviceComm::DeviceComm(std::unique_ptr<Impl> p) : p_(std::move(p)) {}
DeviceComm::~DeviceComm() = default;

std::unique_ptr<DeviceComm> DeviceComm::make(Comm& host) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // (kept when set: see nccl.hpp)
  auto p = std::make_unique<Impl>();
  p->rank = host.rank(), p->size = host.size();
  p->ok(ncclGetVersion(&p->version), "get version");
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (p->rank == 0) p->ok(ncclGetUniqueId(&id), "get unique id");
  host.broadcast(&id, sizeof id, 0);
  // High priority: the collectives' few blocks get SMs as soon as they are queued, beside the backward's kernels.
  int least = 0, greatest = 0;
  ck(cudaDeviceGetStreamPriorityRange(&least, &greatest), "stream priorities");
  ck(cudaStreamCreateWithPriority(&p->stream, cudaStreamNonBlocking, greatest), "cudaStreamCreate");
  ck(cudaEventCreateWithFlags(&p->in, cudaEventDisableTiming), "cudaEventCreate");
  ck(cudaEventCreateWithFlags(&p->out, cudaEventDisableTiming), "cudaEventCreate");
  ck(cudaMalloc(reinterpret_cast<void**>(&p->token), sizeof(int)), "cudaMalloc");
  ck(cudaMemset(p->token, 0, sizeof(int)), "cudaMemset");
  p->ok(ncclCommInitRank(&p->comm, p->size, id, p->rank), "init (ncclCommInitRank)");
  {
    std::lock_guard<std::mutex> g(Impl::mu());
    Impl::live().insert(p.get());
  }
  return std::unique_ptr<DeviceComm>(new DeviceComm(std::move(p)));
}

int DeviceComm::rank() const { return p_->rank; }
int DeviceComm::size() const { return p_->size; }
std::string DeviceComm::name() const {
  const int v = p_->version;
  return fmt::format("NCCL {}.{}.{} ({} rank{})", v / 10000, v / 100 % 100, v % 100, p_->size,
                     p_->size == 1 ? "" : "s");
}
void* DeviceComm::stream() const { return p_->stream; }

void DeviceComm::all_reduce_sum(void* x, size_t n, DType t) {
  p_->usable("all_reduce");
  if (n == 0) return;
  p_->ok(ncclAllReduce(x, x, n, nccl_type(t), ncclSum, p_->comm, p_->stream), "all_reduce");
}

void DeviceComm::reduce_scatter_sum(const void* send, void* recv, size_t n, DType t) {
  p_->usable("reduce_scatter");
  if (n == 0) return;
  p_->ok(ncclReduceScatter(send, recv, n, nccl_type(t), ncclSum, p_->comm, p_->stream), "reduce_scatter");
}

void DeviceComm::all_gather(const void* send, void* recv, size_t bytes) {
  p_->usable("all_gather");
  if (bytes == 0) return;
  p_->ok(ncclAllGather(send, recv, bytes, ncclUint8, p_->comm, p_->stream), "all_gather");
}

void DeviceComm::all_gather_v(const void* send, void* recv, const std::vector<size_t>& bytes) {
  p_->usable("all_gather_v");
  LM_CHECK(bytes.size() == size_t(p_->size), "all_gather_v: {} sizes for {} ranks", bytes.size(), p_->size);
  // One broadcast per rank from its own buffer into its place in recv, all in one group.
  char* out = static_cast<char*>(recv);
  p_->ok(ncclGroupStart(), "group start");
  size_t off = 0;
  for (int r = 0; r < p_->size; ++r) {
    const size_t b = bytes[size_t(r)];
    if (b) {
      const void* src = r == p_->rank ? send : out + off;
      const ncclResult_t e = ncclBroadcast(src, out + off, b, ncclUint8, r, p_->comm, p_->stream);
      if (e != ncclSuccess) {
        ncclGroupEnd();
        p_->ok(e, "all_gather_v (broadcast)");
      }
    }
    off += b;
  }
  p_->ok(ncclGroupEnd(), "all_gather_v");
}

void DeviceComm::all_to_all_v(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                              const std::vector<size_t>& recv_bytes) {
  p_->usable("all_to_all_v");
  const auto R = size_t(p_->size), me = size_t(p_->rank);
  LM_CHECK(send_bytes.size() == R && recv_bytes.size() == R, "all_to_all_v: {} send and {} receive sizes for {} ranks",
           send_bytes.size(), recv_bytes.size(), R);
  LM_CHECK(send_bytes[me] == recv_bytes[me], "all_to_all_v: rank {} sends itself {} bytes but receives {}", me,
           send_bytes[me], recv_bytes[me]);
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  std::vector<size_t> so(R + 1, 0), ro(R + 1, 0);
  for (size_t j = 0; j < R; ++j) so[j + 1] = so[j] + send_bytes[j], ro[j + 1] = ro[j] + recv_bytes[j];
  if (send_bytes[me])  // this rank's own block: a copy on the comm stream
    ck(cudaMemcpyAsync(out + ro[me], in + so[me], send_bytes[me], cudaMemcpyDeviceToDevice, p_->stream),
       "all_to_all_v self copy");
  p_->ok(ncclGroupStart(), "group start");
  for (size_t j = 0; j < R; ++j) {
    if (j == me) continue;
    ncclResult_t e = ncclSuccess;
    if (send_bytes[j]) e = ncclSend(in + so[j], send_bytes[j], ncclUint8, int(j), p_->comm, p_->stream);
    if (e == ncclSuccess && recv_bytes[j])
      e = ncclRecv(out + ro[j], recv_bytes[j], ncclUint8, int(j), p_->comm, p_->stream);
    if (e != ncclSuccess) {
      ncclGroupEnd();
      p_->ok(e, "all_to_all_v (send/recv)");
    }
  }
  p_->ok(ncclGroupEnd(), "all_to_all_v");
}

void DeviceComm::broadcast(void* x, size_t bytes, int root) {
  p_->usable("broadcast");
  LM_CHECK(root >= 0 && root < p_->size, "broadcast: root {} of {} ranks", root, p_->size);
  if (bytes == 0) return;
  p_->ok(ncclBroadcast(x, x, bytes, ncclUint8, root, p_->comm, p_->stream), "broadcast");
}

void DeviceComm::barrier() {
  p_->usable("barrier");
  p_->ok(ncclAllReduce(p_->token, p_->token, 1, ncclInt32, ncclSum, p_->comm, p_->stream), "barrier");
  synchronize();
}

void DeviceComm::wait_for(void* compute) {
  ck(cudaEventRecord(p_->in, cu::stream(compute)), "cudaEventRecord");
  ck(cudaStreamWaitEvent(p_->stream, p_->in, 0), "cudaStreamWaitEvent");
}

void DeviceComm::join(void* compute) {
  ck(cudaEventRecord(p_->out, p_->stream), "cudaEventRecord");
  ck(cudaStreamWaitEvent(cu::stream(compute), p_->out, 0), "cudaStreamWaitEvent");
}

// Polls the stream and NCCL's asynchronous error (a peer that died leaves the collective waiting forever).
void DeviceComm::synchronize() {
  p_->usable("synchronize");
  for (;;) {
    const cudaError_t e = cudaStreamQuery(p_->stream);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) ck(e, "comm stream");
    ncclResult_t async = ncclSuccess;
    p_->ok(ncclCommGetAsyncError(p_->comm, &async), "get async error");
    if (async != ncclSuccess && async != ncclInProgress) {
      const std::string msg = fmt::format("NCCL collective failed: {} ({}); the communicator was aborted",
                                          ncclGetErrorString(async), ncclGetLastError(p_->comm));
      p_->do_abort();
      throw Error(msg);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void DeviceComm::abort() { p_->do_abort(); }

void abort_job_and_devices(int code) {
  {
    std::lock_guard<std::mutex> g(DeviceComm::Impl::mu());
    for (DeviceComm::Impl* c : DeviceComm::Impl::live()) c->do_abort();
  }
  abort_job(code);
}

#endif

}  // namespace lm::dist
