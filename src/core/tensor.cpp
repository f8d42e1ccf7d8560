#include "core/tensor.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

namespace lm {

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (int i = static_cast<int>(s.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

static void check_shape(const Shape& s) {
  for (int64_t d : s) LM_CHECK(d >= 0, "negative dimension in shape {}", shape_str(s));
}

Tensor Tensor::empty(const Shape& shape, DType dt, Device dev) {
  check_shape(shape);
  Tensor t;
  t.buf_ = Buffer::allocate(static_cast<size_t>(shape_numel(shape)) * dtype_size(dt), dev, false);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dt;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dt, Device dev) {
  check_shape(shape);
  Tensor t;
  t.buf_ = Buffer::allocate(static_cast<size_t>(shape_numel(shape)) * dtype_size(dt), dev, true);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dt;
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dt) {
  Tensor t = empty(shape, dt);
  t.fill(value);
  return t;
}

Tensor Tensor::from_blob(void* ptr, const Shape& shape, DType dt, std::shared_ptr<void> owner, Device dev) {
  check_shape(shape);
  Tensor t;
  t.buf_ = Buffer::wrap(ptr, static_cast<size_t>(shape_numel(shape)) * dtype_size(dt), dev, std::move(owner));
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dt;
  return t;
}

int64_t Tensor::dim(int i) const {
  const int n = ndim();
  if (i < 0) i += n;
  LM_CHECK(i >= 0 && i < n, "dimension {} out of range for a {}-d tensor", i, n);
  return shape_[i];
}

bool Tensor::is_contiguous() const { return strides_ == contiguous_strides(shape_) || numel() <= 1; }

Tensor Tensor::view(const Shape& shape) const {
  LM_CHECK(is_contiguous(), "view() of a non-contiguous tensor {}", describe());
  Shape s = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      LM_CHECK(infer < 0, "view(): more than one -1 in {}", shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      LM_CHECK(s[i] >= 0, "view(): bad dimension in {}", shape_str(shape));
      known *= s[i];
    }
  }
  if (infer >= 0) {
    LM_CHECK(known > 0 && numel() % known == 0, "view(): cannot infer -1 of {} for {} elements", shape_str(shape),
             numel());
    s[infer] = numel() / known;
  }
  LM_CHECK(shape_numel(s) == numel(), "view(): shape {} does not match {} elements of {}", shape_str(s), numel(),
           describe());
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::slice(int d, int64_t start, int64_t end) const {
  if (d < 0) d += ndim();
  LM_CHECK(d >= 0 && d < ndim(), "slice(): dimension {} out of range for {}", d, describe());
  LM_CHECK(0 <= start && start <= end && end <= shape_[d], "slice(): range [{}, {}) out of bounds for dim {} of {}",
           start, end, d, describe());
  Tensor t = *this;
  t.offset_ += start * strides_[d];
  t.shape_[d] = end - start;
  return t;
}

Tensor Tensor::select(int d, int64_t index) const {
  if (d < 0) d += ndim();
  LM_CHECK(d >= 0 && d < ndim(), "select(): dimension {} out of range for {}", d, describe());
  LM_CHECK(index >= 0 && index < shape_[d], "select(): index {} out of range for dim {} of {}", index, d, describe());
  Tensor t = *this;
  t.offset_ += index * strides_[d];
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::transpose(int d0, int d1) const {
  if (d0 < 0) d0 += ndim();
  if (d1 < 0) d1 += ndim();
  LM_CHECK(d0 >= 0 && d0 < ndim() && d1 >= 0 && d1 < ndim(), "transpose(): bad dims for {}", describe());
  Tensor t = *this;
  std::swap(t.shape_[d0], t.shape_[d1]);
  std::swap(t.strides_[d0], t.strides_[d1]);
  return t;
}

namespace {

template <class T>
double load_as_double(const void* p) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>) return static_cast<float>(*static_cast<const T*>(p));
  else return static_cast<double>(*static_cast<const T*>(p));
}

double load(DType dt, const void* p) {
  switch (dt) {
    case DType::F32: return load_as_double<float>(p);
    case DType::F64: return load_as_double<double>(p);
    case DType::BF16: return load_as_double<bf16>(p);
    case DType::F16: return load_as_double<f16>(p);
    case DType::I32: return load_as_double<int32_t>(p);
    case DType::I64: return load_as_double<int64_t>(p);
  }
  return 0;
}

// Float -> integer conversion as a defined operation: truncation toward zero, saturating at the
// type's range, NaN -> 0. (A plain static_cast of NaN or an out-of-range value is undefined.)
template <class I>
I to_int_saturating(double v) {
  constexpr double lo = static_cast<double>(std::numeric_limits<I>::min());  // -2^31 / -2^63, exact
  if (std::isnan(v)) return 0;
  if (v <= lo) return std::numeric_limits<I>::min();
  if (v >= -lo) return std::numeric_limits<I>::max();
  return static_cast<I>(v);
}

void store(DType dt, void* p, double v) {
  switch (dt) {
    case DType::F32: *static_cast<float*>(p) = static_cast<float>(v); break;
    case DType::F64: *static_cast<double*>(p) = v; break;
    case DType::BF16: *static_cast<bf16*>(p) = bf16(static_cast<float>(v)); break;
    case DType::F16: *static_cast<f16*>(p) = f16(static_cast<float>(v)); break;
    case DType::I32: *static_cast<int32_t*>(p) = to_int_saturating<int32_t>(v); break;
    case DType::I64: *static_cast<int64_t*>(p) = to_int_saturating<int64_t>(v); break;
  }
}

// Visits every element of a strided tensor in row-major order with its byte address.
template <class F>
void for_each_offset(const Shape& shape, const Shape& strides, F&& f) {
  const int n = static_cast<int>(shape.size());
  const int64_t total = shape_numel(shape);
  if (total == 0) return;
  std::vector<int64_t> idx(n, 0);
  int64_t off = 0;
  for (int64_t e = 0; e < total; ++e) {
    f(e, off);
    for (int d = n - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        off += strides[d];
        break;
      }
      off -= strides[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}

}  // namespace

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  LM_CHECK(device() == Device::CPU, "clone() of a {} tensor: copy it to the CPU first", device_name(device()));
  Tensor t = empty(shape_, dtype_);
  t.copy_from(*this);
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  LM_CHECK(src.shape_ == shape_, "copy_from(): shape {} into {}", shape_str(src.shape_), shape_str(shape_));
  if (device() != Device::CPU || src.device() != Device::CPU) {
    LM_CHECK(dtype_ == src.dtype_ && is_contiguous() && src.is_contiguous(),
             "device copies need equal dtypes and contiguous tensors ({} <- {})", describe(), src.describe());
    const Device dd = device(), sd = src.device();
    device_allocator(dd == Device::CPU ? sd : dd).copy(raw(), dd, src.raw(), sd, nbytes());
    return;
  }
  const size_t es = dtype_size(dtype_), ss = dtype_size(src.dtype_);
  if (dtype_ == src.dtype_ && is_contiguous() && src.is_contiguous()) {
    std::memcpy(raw(), src.raw(), nbytes());
    return;
  }
  char* dst = static_cast<char*>(raw());
  const char* s = static_cast<const char*>(src.raw());
  std::vector<int64_t> doff(static_cast<size_t>(numel()));
  for_each_offset(shape_, strides_, [&](int64_t e, int64_t off) { doff[e] = off; });
  if (dtype_ == src.dtype_) {
    for_each_offset(src.shape_, src.strides_, [&](int64_t e, int64_t off) {
      std::memcpy(dst + doff[e] * static_cast<int64_t>(es), s + off * static_cast<int64_t>(ss), es);
    });
  } else {
    for_each_offset(src.shape_, src.strides_, [&](int64_t e, int64_t off) {
      store(dtype_, dst + doff[e] * static_cast<int64_t>(es), load(src.dtype_, s + off * static_cast<int64_t>(ss)));
    });
  }
}

Tensor Tensor::to(DType dt) const {
  if (dt == dtype_) return *this;
  LM_CHECK(device() == Device::CPU, "dtype conversion of a {} tensor is not supported on the host", device_name(device()));
  Tensor t = empty(shape_, dt);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device dev) const {
  if (dev == device()) return *this;
  Tensor src = contiguous();
  Tensor t = empty(shape_, dtype_, dev);
  t.copy_from(src);
  return t;
}

void Tensor::fill(double value) {
  LM_CHECK(device() == Device::CPU, "fill() on a {} tensor", device_name(device()));
  char* p = static_cast<char*>(raw());
  const int64_t es = static_cast<int64_t>(dtype_size(dtype_));
  for_each_offset(shape_, strides_, [&](int64_t, int64_t off) { store(dtype_, p + off * es, value); });
}

void Tensor::zero() {
  if (is_contiguous()) {
    if (device() == Device::CPU) std::memset(raw(), 0, nbytes());
    else device_allocator(device()).memset0(raw(), nbytes());
  } else {
    fill(0.0);
  }
}

double Tensor::item(int64_t flat) const {
  LM_CHECK(device() == Device::CPU, "item() on a {} tensor", device_name(device()));
  LM_CHECK(flat >= 0 && flat < numel(), "item({}) out of range for {}", flat, describe());
  int64_t off = 0, rem = flat;
  for (int d = ndim() - 1; d >= 0; --d) {
    off += (rem % shape_[d]) * strides_[d];
    rem /= shape_[d];
  }
  return load(dtype_, static_cast<const char*>(raw()) + off * static_cast<int64_t>(dtype_size(dtype_)));
}

std::string Tensor::describe() const {
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " " + std::string(device_name(device()));
}

template <class T>
static double rel_rms_impl(const T* ref, const T* x, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double r = static_cast<double>(ref[i]), d = r - static_cast<double>(x[i]);
    num += d * d;
    den += r * r;
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}
double rel_rms(const double* ref, const double* x, int64_t n) { return rel_rms_impl(ref, x, n); }
double rel_rms(const float* ref, const float* x, int64_t n) { return rel_rms_impl(ref, x, n); }

double rel_rms(const Tensor& ref, const Tensor& x) {
  LM_CHECK(ref.shape() == x.shape(), "rel_rms: shape {} vs {}", shape_str(ref.shape()), shape_str(x.shape()));
  const Tensor a = ref.to(DType::F64).contiguous(), b = x.to(DType::F64).contiguous();
  return rel_rms_impl(a.data<double>(), b.data<double>(), a.numel());
}

}  // namespace lm
