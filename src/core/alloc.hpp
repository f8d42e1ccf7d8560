#pragma once
// 64-byte aligned host memory (one cache line, one AVX-512 vector) and a pluggable device allocator
// so core/ does not link the CUDA runtime; the CUDA layer installs its hooks at start-up.
#include <cstddef>
#include <memory>
#include <string>

#include "core/dtype.hpp"

namespace lm {

inline constexpr size_t kAlign = 64;

void* aligned_alloc_bytes(size_t bytes);  // throws lm::Error on failure; never returns null
void aligned_free(void* p) noexcept;

// The machine's physical memory in bytes (0 when unknown).
size_t physical_memory_bytes();
// Before a large allocation: lm::Error naming `what`, the bytes it needs and the machine's memory when `need` is
// more than the machine has (an allocation that could only end in swapping or the OOM killer).
void check_host_memory(size_t need, const std::string& what);

struct DeviceAllocator {
  void* (*alloc)(size_t bytes) = nullptr;
  void (*free)(void* p) = nullptr;
  void (*memset0)(void* p, size_t bytes) = nullptr;
  void (*copy)(void* dst, Device dst_dev, const void* src, Device src_dev, size_t bytes) = nullptr;
};
void set_device_allocator(Device d, const DeviceAllocator& a);
const DeviceAllocator& device_allocator(Device d);  // throws if none installed (no GPU build)

// Owned buffer on a device; shared by Tensors and views.
struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  Device device = Device::CPU;
  std::shared_ptr<void> keepalive;  // non-owning buffers (mmap) keep their owner alive here
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  static std::shared_ptr<Buffer> allocate(size_t bytes, Device d, bool zero);
  static std::shared_ptr<Buffer> wrap(void* ptr, size_t bytes, Device d, std::shared_ptr<void> owner);
};

}  // namespace lm
