#pragma once
// Gradients summed over the ranks in buckets while the backward still runs (the DDP idea): every array is tagged
// with the phase of the backward after which it is final (phases counted from 0 in the order the backward reaches
// them). The arrays, in phase order, fill buckets of about `bucket_bytes`; ready(p) says phases 0..p are done: each
// bucket whose arrays are all final is packed and its all-reduce started (Comm::iall_reduce_sum), and the ones under
// way are let progress. finish() starts what is left, waits for every bucket and writes the sums back into the
// arrays. Without any ready() call it is the all-reduce after the backward, in the same buckets.
// Each element's sum is the one all_reduce_sum gives; for a given world size and bucket layout it is deterministic.
//
// Legend: R ranks; bucket k holds arrays [first_k, end_k) of the phase-sorted list, n_k floats.
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "dist/comm.hpp"

namespace lm::dist {

class GradBuckets {
 public:
  struct Array {
    float* data;
    size_t n;
    int64_t phase;  // final once the backward has passed this phase
  };
  // What the last step did: its buckets, those started while the backward still had phases to run and the bytes
  // they carried, those whose reduction had ended when finish() came (wholly hidden), and the time finish() spent
  // waiting (the reduction the backward did not hide).
  struct Stats {
    int64_t buckets = 0, started_early = 0, done_early = 0;
    double bytes = 0, bytes_early = 0;
    double wait_seconds = 0;
  };

  // `arrays` must outlive this object (their pointers are kept); comm too.
  GradBuckets(Comm& comm, std::vector<Array> arrays, size_t bucket_bytes);

  void ready(int64_t phase);
  void finish();
  const Stats& stats() const { return stats_; }
  size_t num_buckets() const { return buckets_.size(); }

 private:
  struct Bucket {
    size_t first = 0, end = 0;  // arrays_[first, end)
    int64_t phase = 0;          // its last array's phase
    std::vector<float> buf;
    std::unique_ptr<Pending> pending;
  };
  void start(Bucket& b);
  Comm& comm_;
  std::vector<Array> arrays_;  // by phase
  std::vector<Bucket> buckets_;
  size_t next_ = 0;  // the first bucket not started
  Stats stats_;
};

}  // namespace lm::dist
