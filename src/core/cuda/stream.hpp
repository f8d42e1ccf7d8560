#pragma once
// The stream a null stream argument means. Every CUDA entry point of longmoe resolves its `void* stream` through
// cu::stream(): a null one is the legacy default stream, unless a StreamScope is active on this thread, when it is
// the scope's stream. The GPU model runs its whole walk on "the null stream", so a StreamScope moves the walk onto
// a stream that can be captured into a CUDA graph (the legacy stream cannot be captured), without threading a
// stream through every call.
#include <cuda_runtime_api.h>

namespace lm::cu {

inline cudaStream_t& ambient_stream() {
  thread_local cudaStream_t s = nullptr;
  return s;
}

inline cudaStream_t stream(void* s) { return s ? static_cast<cudaStream_t>(s) : ambient_stream(); }

// While alive, null streams on this thread mean `s`.
class StreamScope {
 public:
  explicit StreamScope(cudaStream_t s) : prev_(ambient_stream()) { ambient_stream() = s; }
  ~StreamScope() { ambient_stream() = prev_; }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  cudaStream_t prev_;
};

}  // namespace lm::cu
