#pragma once
// HF checkpoints of one or many safetensors shards, read and written as one name -> tensor map.
//
// Layout (the HF convention):
//   dir/model.safetensors                                  one file, or
//   dir/model-00001-of-0000N.safetensors ... + dir/model.safetensors.index.json
//       {"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file name}}
// The index is authoritative and is checked against the shards when opened: every entry must name
// an existing shard that holds the tensor, and every tensor of a listed shard must be in the index.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "io/safetensors.hpp"

namespace lm::io {

inline constexpr const char* kSingleFileName = "model.safetensors";
inline constexpr const char* kIndexFileName = "model.safetensors.index.json";

// A checkpoint folder (config.json + model.safetensors or its index) is returned as it is; a training
// run folder (a `latest` file naming ckpt/step-N) stands for its newest checkpoint. Throws otherwise.
std::string resolve_checkpoint(const std::string& path);

class Checkpoint {
 public:
  // `path`: a directory (its index if present, else its model.safetensors), an index .json file,
  // or one .safetensors file. Throws lm::Error naming the file (and tensor) on any inconsistency.
  static Checkpoint open(const std::string& path);

  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  std::vector<std::string> names() const;  // sorted
  size_t size() const { return where_.size(); }
  const TensorInfo& info(const std::string& name) const;
  Tensor get(const std::string& name) const;  // zero-copy view of the mapped shard when possible
  Tensor get_as(const std::string& name, DType dt, const Shape& expect = {}) const;
  // File (full path) holding `name`.
  const std::string& file_of(const std::string& name) const;

  const std::string& path() const { return path_; }  // what open() was given
  const std::vector<SafeTensorsFile>& shards() const { return shards_; }
  uint64_t total_bytes() const;  // sum of tensor data bytes

 private:
  size_t shard_index(const std::string& name) const;
  std::string path_;
  std::vector<SafeTensorsFile> shards_;
  std::map<std::string, size_t> where_;
};

// Writes `tensors` into `dir` (created if needed) as shards of at most `max_shard_bytes` tensor bytes
// each (a larger tensor gets a shard of its own), in the given order. One shard -> model.safetensors
// and no index; several -> model-0000k-of-0000N.safetensors plus the index, written last. Each file
// is written atomically. Before writing, the previous checkpoint's entry points in `dir` (its index
// and model.safetensors) are removed, so a crash leaves either no checkpoint or the complete new one,
// never an index mixing old and new shards. `metadata` goes into every shard's __metadata__ (plus
// "format": "pt"). Returns the files written (shards, then the index).
std::vector<std::string> save_checkpoint(const std::string& dir, const NamedTensors& tensors, uint64_t max_shard_bytes,
                                         const std::map<std::string, std::string>& metadata = {});
// The pieces of that layout, for shards written by several processes: shard s of n's file name
// (model-0000<s+1>-of-0000<n>.safetensors), and the index of `weight_map` (tensor -> (file, data bytes)), written
// atomically into dir; returns its path.
std::string shard_file_name(size_t s, size_t n);
std::string write_checkpoint_index(const std::string& dir,
                                   const std::map<std::string, std::pair<std::string, uint64_t>>& weight_map);

}  // namespace lm::io
