#include "core/alloc.hpp"

#include <cstdlib>
#include <cstring>

#include <unistd.h>

#include "core/error.hpp"

namespace lm {

void* aligned_alloc_bytes(size_t bytes) {
  const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded == 0 ? kAlign : rounded);
  LM_CHECK(p != nullptr, "out of host memory allocating {} bytes", bytes);
  return p;
}

void aligned_free(void* p) noexcept { std::free(p); }

size_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

void check_host_memory(size_t need, const std::string& what) {
  const size_t have = physical_memory_bytes();
  LM_CHECK(have == 0 || need <= have, "{} needs {:.2f} GiB of host memory, more than this machine's {:.2f} GiB", what,
           static_cast<double>(need) / 1073741824.0, static_cast<double>(have) / 1073741824.0);
}

namespace {
DeviceAllocator g_alloc[2];
}

void set_device_allocator(Device d, const DeviceAllocator& a) { g_alloc[static_cast<int>(d)] = a; }

const DeviceAllocator& device_allocator(Device d) {
  const DeviceAllocator& a = g_alloc[static_cast<int>(d)];
  LM_CHECK(a.alloc != nullptr, "no allocator for device '{}': this build has no CUDA support or no GPU was initialised",
           device_name(d));
  return a;
}

Buffer::~Buffer() {
  if (keepalive || ptr == nullptr) return;
  if (device == Device::CPU) aligned_free(ptr);
  else device_allocator(device).free(ptr);
}

std::shared_ptr<Buffer> Buffer::allocate(size_t bytes, Device d, bool zero) {
  auto b = std::make_shared<Buffer>();
  b->bytes = bytes;
  b->device = d;
  if (d == Device::CPU) {
    b->ptr = aligned_alloc_bytes(bytes);
    if (zero) std::memset(b->ptr, 0, bytes);
  } else {
    const auto& a = device_allocator(d);
    b->ptr = a.alloc(bytes == 0 ? 1 : bytes);
    if (zero && bytes) a.memset0(b->ptr, bytes);
  }
  return b;
}

std::shared_ptr<Buffer> Buffer::wrap(void* ptr, size_t bytes, Device d, std::shared_ptr<void> owner) {
  auto b = std::make_shared<Buffer>();
  b->ptr = ptr;
  b->bytes = bytes;
  b->device = d;
  b->keepalive = owner ? std::move(owner) : std::shared_ptr<void>(ptr, [](void*) {});
  return b;
}

bool dtype_from_name(std::string_view n, DType& out) {
  for (DType t : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64}) {
    if (n == dtype_name(t)) {
      out = t;
      return true;
    }
  }
  return false;
}

}  // namespace lm
