#pragma once
// Collectives between the GPUs of a job over NCCL (the library of the CUDA install, or PyTorch's): the device
// counterpart of Comm (comm.hpp), one GPU per process. Rank r of the host communicator is rank r here; NCCL's unique
// id is made by rank 0 and broadcast over the host communicator (MPI, or a single process).
//
// Every call is collective (all ranks, same order, same sizes unless a call says otherwise) and takes device
// pointers. The calls only enqueue: each runs on the communicator's own CUDA stream (non-blocking, so kernels of the
// compute stream run beside it), ordered against a compute stream with events:
//   comm.wait_for(s);   // what follows on the comm stream waits for the work queued on s so far
//   comm.join(s);       // what follows on s waits for the collectives queued so far
// (s null: the ambient stream of core/cuda/stream.hpp, the legacy default stream unless a StreamScope is active.)
// Host buffers stay valid until the call returns; device buffers until the comm stream has passed the call.
// Errors: lm::Error with NCCL's error string (and its last-error text); an asynchronous NCCL failure (a peer gone)
// is reported by synchronize(). abort() ends this rank's part of every collective in flight.
//
// Without NCCL at build time make() throws ("built without NCCL") and built_with_nccl() is false.
//
// Legend: n elements per rank, R = size() ranks; bytes in bytes.
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "dist/comm.hpp"

namespace lm::dist {

bool built_with_nccl();

// This process's GPU: its index among the job's processes on its host (host names gathered over `host`), or the one
// GPU it sees where each process sees a different one (CUDA_VISIBLE_DEVICES set per process). Sets the CUDA device
// and returns it; lm::Error when processes would share a GPU (NCCL takes one per rank). Collective over `host`; call
// it before anything allocates on a GPU.
int use_local_device(Comm& host);
// Processes of the job on this host (by host name; collective over `host`).
int local_processes(Comm& host);

// Aborts every DeviceComm of this process, then abort_job(code) (comm.hpp): the job's error path, so that no rank
// waits forever in a collective of either kind. Returns when the job is one process.
void abort_job_and_devices(int code);

class DeviceComm {
 public:
  // A communicator of the ranks of `host`, on the current CUDA device. Collective over `host`. NVLink multicast
  // (NVLS) stays off unless NCCL_NVLS_ENABLE is set: on the shared machines it can take the host's GPUs down.
  static std::unique_ptr<DeviceComm> make(Comm& host);
  ~DeviceComm();
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  int rank() const;
  int size() const;
  std::string name() const;  // "NCCL 2.28.9 (4 ranks)"
  void* stream() const;      // the cudaStream_t the collectives run on

  // x [n] = Σ over ranks of x [n] (F32, F64, BF16, F16, I32, I64), in place.
  void all_reduce_sum(void* x, size_t n, DType t);
  // recv [n] = Σ over ranks of this rank's block of send [R · n]. In place when recv == send + rank · n.
  void reduce_scatter_sum(const void* send, void* recv, size_t n, DType t);
  // recv [R · bytes] = every rank's send [bytes] in rank order. In place when send == recv + rank · bytes.
  void all_gather(const void* send, void* recv, size_t bytes);
  // recv = every rank's send, concatenated in rank order; bytes[r] is rank r's size (the same list on every rank;
  // sizes may differ and be 0). recv holds Σ bytes.
  void all_gather_v(const void* send, void* recv, const std::vector<size_t>& bytes);
  // Rank r sends send_bytes[j] bytes (contiguous, in rank order) to rank j and receives recv_bytes[j] from it
  // (recv in rank order): grouped send/receive; rank j's send_bytes[r] must equal rank r's recv_bytes[j].
  void all_to_all_v(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                    const std::vector<size_t>& recv_bytes);
  // x [bytes] = root's x [bytes], on every rank.
  void broadcast(void* x, size_t bytes, int root);
  // Returns once every rank has reached it and every collective queued before it has finished.
  void barrier();

  // Ordering against a compute stream (null: the ambient stream); see the header comment.
  void wait_for(void* compute);
  void join(void* compute);
  // The host waits for the comm stream; lm::Error (the communicator aborted) on an asynchronous NCCL error.
  void synchronize();
  // Ends this rank's part of the collectives in flight and makes the communicator unusable (an error path: the job
  // is ending). Idempotent.
  void abort();

 private:
  struct Impl;
  explicit DeviceComm(std::unique_ptr<Impl> p);
  friend void abort_job_and_devices(int code);
  std::unique_ptr<Impl> p_;
};

}  // namespace lm::dist
