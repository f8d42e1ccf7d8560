// libFuzzer target: arbitrary bytes -> SafeTensorsFile::from_bytes -> every tensor read back and
// converted to every dtype. lm::Error is the expected answer to bad input; any other exception, a
// crash or a sanitizer report is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "core/tensor.hpp"
#include "io/safetensors.hpp"

namespace {

[[noreturn]] void broken(const char* what, const std::string& name) {
  std::fprintf(stderr, "fuzz_safetensors: invariant broken: %s (tensor '%s')\n", what, name.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* p = reinterpret_cast<const char*>(data);
  auto bytes = std::make_shared<const std::vector<char>>(p, p + size);
  try {
    const lm::io::SafeTensorsFile f = lm::io::SafeTensorsFile::from_bytes(bytes, "fuzz-input");
    for (const lm::io::TensorInfo& ti : f.tensors()) {
      const lm::Tensor t = f.get(ti.name);
      if (t.shape() != ti.shape || t.dtype() != ti.dtype) broken("get() shape/dtype differ from the header", ti.name);
      if (t.nbytes() != ti.end - ti.begin) broken("byte count differs from data_offsets", ti.name);
      if (ti.end > size) broken("tensor extends past the input", ti.name);
      const lm::Tensor d = t.to(lm::DType::F64);
      volatile double sink = 0;
      for (int64_t i = 0; i < d.numel(); ++i) sink = sink + d.data<double>()[i];
      if (d.numel() > 0 && d.item(d.numel() - 1) != t.item(t.numel() - 1) &&
          d.item(d.numel() - 1) == d.item(d.numel() - 1))  // NaN compares unequal to itself
        broken("item() disagrees with to(F64)", ti.name);
      // Every other conversion, including float -> int of NaN/inf and out-of-range values.
      for (lm::DType dt : {lm::DType::F32, lm::DType::BF16, lm::DType::F16, lm::DType::I32, lm::DType::I64})
        (void)t.to(dt);
      // get_as within the same kind, with the shape check.
      (void)f.get_as(ti.name, lm::dtype_is_float(ti.dtype) ? lm::DType::F32 : lm::DType::I64, ti.shape);
    }
  } catch (const lm::Error&) {
    // Rejected with a message: the expected outcome for malformed input.
  }
  return 0;
}
