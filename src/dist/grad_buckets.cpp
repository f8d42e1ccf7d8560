#include "dist/grad_buckets.hpp"

#include <algorithm>

namespace lm::dist {

GradBuckets::GradBuckets(Comm& comm, std::vector<Array> arrays, size_t bucket_bytes)
    : comm_(comm), arrays_(std::move(arrays)) {
  std::stable_sort(arrays_.begin(), arrays_.end(), [](const Array& a, const Array& b) { return a.phase < b.phase; });
  size_t bytes = 0;
  for (size_t i = 0; i < arrays_.size(); ++i) {
    if (buckets_.empty() || bytes >= bucket_bytes) {
      buckets_.emplace_back();
      buckets_.back().first = i;
      bytes = 0;
    }
    Bucket& b = buckets_.back();
    b.end = i + 1;
    b.phase = arrays_[i].phase;
    bytes += arrays_[i].n * sizeof(float);
  }
}

void GradBuckets::start(Bucket& b) {
  size_t n = 0;
  for (size_t i = b.first; i < b.end; ++i) n += arrays_[i].n;
  b.buf.resize(n);
  float* p = b.buf.data();
  for (size_t i = b.first; i < b.end; ++i) p = std::copy_n(arrays_[i].data, arrays_[i].n, p);
  b.pending = comm_.iall_reduce_sum(b.buf.data(), n);
  stats_.bytes += double(n * sizeof(float));
}

void GradBuckets::ready(int64_t phase) {
  if (next_ == 0) stats_ = Stats{};
  for (size_t k = 0; k < next_; ++k) buckets_[k].pending->test();
  // (early: the backward still has phases to run after this one)
  const bool early = !arrays_.empty() && phase < arrays_.back().phase;
  while (next_ < buckets_.size() && buckets_[next_].phase <= phase) {
    start(buckets_[next_++]);
    if (early) ++stats_.started_early, stats_.bytes_early = stats_.bytes;
  }
}

void GradBuckets::finish() {
  if (next_ == 0) stats_ = Stats{};
  for (size_t k = 0; k < next_; ++k) stats_.done_early += buckets_[k].pending->test();
  while (next_ < buckets_.size()) start(buckets_[next_++]);
  const auto t0 = std::chrono::steady_clock::now();
  for (Bucket& b : buckets_) {
    b.pending->wait();
    b.pending.reset();
    const float* p = b.buf.data();
    for (size_t i = b.first; i < b.end; ++i) {
      std::copy_n(p, arrays_[i].n, arrays_[i].data);
      p += arrays_[i].n;
    }
  }
  stats_.wait_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stats_.buckets = int64_t(buckets_.size());
  next_ = 0;
}

}  // namespace lm::dist
