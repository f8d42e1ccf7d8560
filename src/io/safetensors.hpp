#pragma once
// safetensors: 8-byte little-endian header length N, N bytes of JSON header
//   {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str: str}}
// then the raw little-endian data; offsets are relative to the end of the header.
// Reading memory-maps the file and validates everything before any tensor is handed out.
// Writing is atomic: temp file in the same folder, fsync, rename, fsync of the folder.
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.hpp"

namespace lm::io {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  size_t begin = 0, end = 0;  // byte offsets into the data section
};

class SafeTensorsFile {
 public:
  // Throws lm::Error naming the file (and tensor) on any malformed or truncated content.
  static SafeTensorsFile open(const std::string& path);
  // Same validation over bytes already in memory (used by the fuzzer); `label` names them in errors.
  static SafeTensorsFile from_bytes(std::shared_ptr<const std::vector<char>> bytes, const std::string& label);

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return infos_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  std::vector<std::string> names() const;

  // Zero-copy view of the mapped bytes when aligned for the dtype, else an aligned copy.
  Tensor get(const std::string& name) const;
  // get() converted to `dt` and checked against an expected shape (empty = any shape).
  Tensor get_as(const std::string& name, DType dt, const Shape& expect = {}) const;

 private:
  void parse(const char* data, size_t size);
  std::string path_;
  std::shared_ptr<const void> owner_;  // the mapping or the byte vector
  const char* data_ = nullptr;         // start of the data section
  std::vector<TensorInfo> infos_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// Writes tensors (any dtype, CPU, any strides) atomically. Names must be unique and non-empty.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace lm::io
