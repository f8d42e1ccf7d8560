#pragma once
// Tensor: a strided view of a Buffer. Shapes and strides are in elements; row-major by default.
// Ops take raw pointers plus dims; Tensor is the container at module and file boundaries.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/alloc.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"

namespace lm {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);
Shape contiguous_strides(const Shape& s);

class Tensor {
 public:
  Tensor() = default;

  static Tensor empty(const Shape& shape, DType dt = DType::F32, Device dev = Device::CPU);
  static Tensor zeros(const Shape& shape, DType dt = DType::F32, Device dev = Device::CPU);
  static Tensor full(const Shape& shape, double value, DType dt = DType::F32);
  // Wraps memory owned elsewhere; `owner` keeps it alive (e.g. an mmap'ed file).
  static Tensor from_blob(void* ptr, const Shape& shape, DType dt, std::shared_ptr<void> owner,
                          Device dev = Device::CPU);
  template <class T>
  static Tensor from_vector(const std::vector<T>& v, const Shape& shape) {
    LM_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape), "from_vector: {} values for shape {}", v.size(),
             shape_str(shape));
    Tensor t = empty(shape, dtype_of<T>);
    std::copy(v.begin(), v.end(), t.data<T>());
    return t;
  }

  bool defined() const { return buf_ != nullptr; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const;  // negative i counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return buf_ ? buf_->device : Device::CPU; }
  bool is_contiguous() const;

  void* raw() const { return static_cast<char*>(buf_->ptr) + offset_ * static_cast<int64_t>(dtype_size(dtype_)); }
  template <class T>
  T* data() const {
    LM_CHECK(dtype_of<T> == dtype_, "tensor holds {}, accessed as {}", dtype_name(dtype_), dtype_name(dtype_of<T>));
    return static_cast<T*>(raw());
  }

  // Views (share storage).
  Tensor view(const Shape& shape) const;  // requires contiguous; one -1 allowed
  Tensor slice(int dim, int64_t start, int64_t end) const;
  Tensor select(int dim, int64_t index) const;
  Tensor transpose(int d0, int d1) const;

  // Copies.
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(DType dt) const;     // CPU conversion between any two dtypes (float ones round-to-nearest)
  Tensor to(Device dev) const;   // host <-> device copy of a contiguous tensor
  void copy_from(const Tensor& src);  // same shape; converts dtype on CPU
  void fill(double value);
  void zero();

  // Reads element `flat` (row-major logical index) as double; for tests and tools, not hot loops.
  double item(int64_t flat = 0) const;

  std::string describe() const;  // e.g. "F32[2, 3] cpu"

 private:
  std::shared_ptr<Buffer> buf_;
  int64_t offset_ = 0;  // in elements
  Shape shape_, strides_;
  DType dtype_ = DType::F32;
};

// Relative RMS error rms(ref - x) / rms(ref), accumulated in double. The golden metric.
double rel_rms(const Tensor& ref, const Tensor& x);
double rel_rms(const double* ref, const double* x, int64_t n);
double rel_rms(const float* ref, const float* x, int64_t n);

}  // namespace lm
