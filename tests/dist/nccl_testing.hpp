#pragma once
// Helpers of the NCCL tests (tests/dist/*_cuda.cpp): why a test cannot run here (no NCCL, no GPU, more ranks on
// the host than GPUs: the same answer on every rank, so all skip together), the communicator of the job's ranks
// (one per binary, on this rank's GPU), and device buffers poisoned with 0xff.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dist/comm.hpp"
#include "dist/nccl.hpp"

namespace lm::nccl_testing {

// Empty when the NCCL tests can run; else why not. Collective over dist::world() on its first call.
inline std::string cannot_run() {
  static const std::string why = [] {
    if (!dist::built_with_nccl()) return std::string("longmoe was built without NCCL");
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      return std::string("no CUDA device");
    }
    const int local = dist::local_processes(dist::world());
    if (local > n) return fmt::format("{} ranks on this host but {} GPU(s): NCCL takes one GPU per rank", local, n);
    return std::string();
  }();
  return why;
}

// The job's communicator (every rank on its own GPU), made on first use.
inline dist::DeviceComm& shared_comm() {
  static const std::unique_ptr<dist::DeviceComm> c = [] {
    dist::use_local_device(dist::world());
    return dist::DeviceComm::make(dist::world());
  }();
  return *c;
}

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) {
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess || cudaMemset(p, 0xff, bytes ? bytes : 1) != cudaSuccess)
      throw std::runtime_error("test: cudaMalloc failed");
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void* at(size_t byte) const { return static_cast<char*>(p) + byte; }
  void up_at(const std::vector<uint8_t>& b, size_t byte) const {
    if (!b.empty() && cudaMemcpy(at(byte), b.data(), b.size(), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("test: copy to the device failed");
  }
  void up(const std::vector<uint8_t>& b) const { up_at(b, 0); }
  std::vector<uint8_t> down(size_t bytes) const {
    std::vector<uint8_t> b(bytes);
    if (bytes && cudaMemcpy(b.data(), p, bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
      throw std::runtime_error("test: copy to the host failed");
    return b;
  }
};

}  // namespace lm::nccl_testing
