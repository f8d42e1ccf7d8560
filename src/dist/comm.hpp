#pragma once
// Collectives between the processes of a job: one interface over a single process and MPI (OpenMPI from Debian,
// started by `mpirun`), so the trainer never knows the transport. Every call is collective: all ranks make it, in
// the same order, with the same sizes (all_gather_v excepted). Reductions are deterministic for a given world
// size (MPI's algorithm for a communicator and a message size is fixed).
//
// Legend: n elements per rank, R = size() ranks.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lm::dist {

// A collective started by a non-blocking call: its buffers stay untouched by the caller until wait() returns.
// Destroying one that was not waited for waits for it.
class Pending {
 public:
  virtual ~Pending() = default;
  // Lets it progress (MPI moves non-blocking collectives on inside its calls); true once it has completed.
  virtual bool test() = 0;
  virtual void wait() = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "single process", "MPI (4 ranks)"

  // x [n] = Σ over ranks of x [n], on every rank.
  virtual void all_reduce_sum(float* x, size_t n) = 0;
  virtual void all_reduce_sum(double* x, size_t n) = 0;
  virtual void all_reduce_sum(int64_t* x, size_t n) = 0;
  // recv [R · n] = every rank's send [n] in rank order (bytes per rank).
  virtual void all_gather(const void* send, size_t bytes, void* recv) = 0;
  // Each rank's `bytes` (sizes may differ), concatenated in rank order.
  virtual std::vector<char> all_gather_v(const void* send, size_t bytes) = 0;
  // recv [n] = Σ over ranks of send [R · n]'s block of this rank.
  virtual void reduce_scatter_sum(const float* send, float* recv, size_t n) = 0;
  // Each rank sends send_bytes[j] bytes (contiguous, in rank order) to rank j and receives recv_bytes[j] from it.
  virtual void all_to_all_v(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                            const std::vector<size_t>& recv_bytes) = 0;
  virtual void broadcast(void* x, size_t bytes, int root) = 0;
  virtual void barrier() = 0;

  // Non-blocking all_reduce_sum: x [n] holds the sum once the Pending completes. By default the blocking call
  // (a Pending already complete); MPI's run on a thread of their own (in the order they were started, on a
  // duplicate of the communicator) while the caller computes.
  virtual std::unique_ptr<Pending> iall_reduce_sum(float* x, size_t n);
  // The ranks of the same `color` as a communicator of their own, ranked by `key` (then by rank here); collective
  // over this one. lm::Error from a communicator that cannot split.
  virtual std::unique_ptr<Comm> split(int color, int key);
};

// The job's communicator, made on first use: MPI when this process was started by an MPI launcher (mpirun sets
// OMPI_COMM_WORLD_SIZE or PMI_SIZE) and longmoe was built with MPI, else a single process. lm::Error when a
// launcher started it but longmoe has no MPI. MPI is finalised at exit.
Comm& world();
bool built_with_mpi();
// A communicator of one process (tests, and engines that run alone).
Comm& single();
// After an error on this process of a job of several (MPI started): ends every process of the job with `code`
// (MPI_Abort), so none waits forever in a collective. Returns when the job is one process.
void abort_job(int code);

}  // namespace lm::dist
