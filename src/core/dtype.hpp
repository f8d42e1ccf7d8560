#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/half.hpp"

namespace lm {

enum class DType : uint8_t { F32, F64, BF16, F16, I32, I64 };
enum class Device : uint8_t { CPU, CUDA };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::F64: case DType::I64: return 8;
    case DType::BF16: case DType::F16: return 2;
  }
  return 0;
}

// Names as safetensors spells them.
constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
  }
  return "?";
}

// Returns false for names longmoe does not handle (e.g. "U8", "F8_E4M3").
bool dtype_from_name(std::string_view name, DType& out);

constexpr bool dtype_is_float(DType t) { return t == DType::F32 || t == DType::F64 || t == DType::BF16 || t == DType::F16; }

template <class T> struct dtype_of_t;
template <> struct dtype_of_t<float> { static constexpr DType value = DType::F32; };
template <> struct dtype_of_t<double> { static constexpr DType value = DType::F64; };
template <> struct dtype_of_t<bf16> { static constexpr DType value = DType::BF16; };
template <> struct dtype_of_t<f16> { static constexpr DType value = DType::F16; };
template <> struct dtype_of_t<int32_t> { static constexpr DType value = DType::I32; };
template <> struct dtype_of_t<int64_t> { static constexpr DType value = DType::I64; };
template <class T> constexpr DType dtype_of = dtype_of_t<T>::value;

constexpr std::string_view device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

}  // namespace lm
