#include "io/checkpoint.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "io/file.hpp"
#include "io/json.hpp"

namespace lm::io {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::string resolve_checkpoint(const std::string& path) {
  const auto is_checkpoint = [](const fs::path& d) {
    return fs::exists(d / "config.json") && (fs::exists(d / kSingleFileName) || fs::exists(d / kIndexFileName));
  };
  const fs::path p(path);
  if (is_checkpoint(p)) return p.string();
  // A run folder: the checkpoint `latest` names, or the states a kill can leave (train/run_dir.cpp): `latest`
  // naming a folder that a same-step save had renamed aside to .old-<name> when it died, or no `latest` yet
  // while complete step-* folders exist (they appear complete, by rename): the newest of them.
  if (fs::exists(p / "latest")) {
    std::ifstream in(p / "latest");
    std::string rel;
    std::getline(in, rel);
    const fs::path r(rel);
    LM_CHECK(!rel.empty() && r.is_relative() && std::find(r.begin(), r.end(), "..") == r.end(),
             "'{}': 'latest' names '{}', which is not a folder inside the run", path, rel);
    if (is_checkpoint(p / r)) return (p / r).string();
    const fs::path aside = (p / r).parent_path() / (".old-" + r.filename().string());
    LM_CHECK(is_checkpoint(aside), "'{}': 'latest' names '{}', which is not a checkpoint", path, rel);
    return aside.string();
  }
  std::vector<fs::path> steps;
  std::error_code ec;
  if (fs::is_directory(p / "ckpt", ec))
    for (const auto& e : fs::directory_iterator(p / "ckpt", ec))
      if (e.path().filename().string().rfind("step-", 0) == 0 && is_checkpoint(e.path())) steps.push_back(e.path());
  if (!steps.empty()) return std::max_element(steps.begin(), steps.end())->string();
  fail("'{}' is neither a checkpoint folder (config.json + model.safetensors) nor a run folder with 'latest'", path);
}

Checkpoint Checkpoint::open(const std::string& path) {
  std::error_code ec;
  Checkpoint ck;
  ck.path_ = path;
  fs::path index;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / kIndexFileName, ec)) {
      index = dir / kIndexFileName;
    } else if (fs::exists(dir / kSingleFileName, ec)) {
      ck.shards_.push_back(SafeTensorsFile::open((dir / kSingleFileName).string()));
    } else {
      fail("'{}' holds no checkpoint: neither {} nor {} is there", path, kIndexFileName, kSingleFileName);
    }
  } else if (ends_with(path, ".json")) {
    index = path;
  } else {
    LM_CHECK(fs::exists(path, ec), "checkpoint '{}' does not exist", path);
    ck.shards_.push_back(SafeTensorsFile::open(path));
  }

  if (index.empty()) {  // single file: every tensor lives in shard 0
    for (const auto& t : ck.shards_[0].tensors()) ck.where_[t.name] = 0;
    return ck;
  }

  const std::string ip = index.string();
  const json j = load_json_file(ip);
  LM_CHECK(j.is_object(), "'{}': a checkpoint index must be a JSON object", ip);
  LM_CHECK(j.contains("weight_map"), "'{}': missing required field 'weight_map'", ip);
  const json& wm = j.at("weight_map");
  LM_CHECK(wm.is_object(), "'{}': field 'weight_map' must be an object of tensor name -> shard file, got {}", ip,
           wm.type_name());
  LM_CHECK(!wm.empty(), "'{}': field 'weight_map' lists no tensors", ip);
  if (j.contains("metadata"))
    LM_CHECK(j.at("metadata").is_object() || j.at("metadata").is_null(), "'{}': field 'metadata' must be an object",
             ip);

  const fs::path dir = index.parent_path();
  std::map<std::string, size_t> shard_of_file;  // file name (as in the index) -> shard
  std::vector<std::string> shard_names;
  for (auto it = wm.begin(); it != wm.end(); ++it) {
    const std::string& name = it.key();
    LM_CHECK(it.value().is_string(), "'{}': weight_map entry for tensor '{}' must be a file name string, got {}", ip,
             name, it.value().type_name());
    const std::string file = it.value().get<std::string>();
    LM_CHECK(!file.empty() && file != "." && file != ".." && file.find('/') == std::string::npos &&
                 file.find('\\') == std::string::npos,
             "'{}': tensor '{}' is mapped to '{}', which is not a plain file name in the checkpoint folder", ip, name,
             file);
    auto [pos, inserted] = shard_of_file.emplace(file, shard_names.size());
    if (inserted) {
      const fs::path sp = dir / file;
      LM_CHECK(fs::is_regular_file(sp, ec), "'{}': tensor '{}' is mapped to shard '{}', which does not exist", ip,
               name, sp.string());
      shard_names.push_back(file);
      ck.shards_.push_back(SafeTensorsFile::open(sp.string()));
    }
    const SafeTensorsFile& shard = ck.shards_[pos->second];
    LM_CHECK(shard.contains(name), "'{}': tensor '{}' is mapped to '{}', but that shard has no such tensor", ip, name,
             shard.path());
    ck.where_[name] = pos->second;
  }
  // The shards must hold nothing the index does not account for (a sign of a mixed or stale set).
  for (size_t s = 0; s < ck.shards_.size(); ++s)
    for (const auto& t : ck.shards_[s].tensors()) {
      auto it = ck.where_.find(t.name);
      LM_CHECK(it != ck.where_.end(), "'{}' holds tensor '{}', which the index '{}' does not list",
               ck.shards_[s].path(), t.name, ip);
      LM_CHECK(it->second == s, "tensor '{}' is in both '{}' and '{}'; the index '{}' names the latter", t.name,
               ck.shards_[s].path(), ck.shards_[it->second].path(), ip);
    }
  return ck;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> r;
  r.reserve(where_.size());
  for (const auto& [n, s] : where_) r.push_back(n);
  return r;
}

size_t Checkpoint::shard_index(const std::string& name) const {
  auto it = where_.find(name);
  LM_CHECK(it != where_.end(), "checkpoint '{}' has no tensor named '{}'", path_, name);
  return it->second;
}

const TensorInfo& Checkpoint::info(const std::string& name) const { return shards_[shard_index(name)].info(name); }
Tensor Checkpoint::get(const std::string& name) const { return shards_[shard_index(name)].get(name); }
Tensor Checkpoint::get_as(const std::string& name, DType dt, const Shape& expect) const {
  return shards_[shard_index(name)].get_as(name, dt, expect);
}
const std::string& Checkpoint::file_of(const std::string& name) const { return shards_[shard_index(name)].path(); }

uint64_t Checkpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& [name, s] : where_) {
    const TensorInfo& t = shards_[s].info(name);
    n += t.end - t.begin;
  }
  return n;
}

std::vector<std::string> save_checkpoint(const std::string& dir, const NamedTensors& tensors, uint64_t max_shard_bytes,
                                         const std::map<std::string, std::string>& metadata) {
  LM_CHECK(max_shard_bytes > 0, "saving checkpoint '{}': the shard size limit must be positive", dir);
  LM_CHECK(!tensors.empty(), "saving checkpoint '{}': no tensors to save", dir);
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    LM_CHECK(!name.empty() && name != "__metadata__", "saving checkpoint '{}': invalid tensor name '{}'", dir, name);
    LM_CHECK(seen.insert(name).second, "saving checkpoint '{}': tensor '{}' given twice", dir, name);
    LM_CHECK(t.defined(), "saving checkpoint '{}': tensor '{}' is undefined", dir, name);
  }

  // Greedy packing in the given order.
  std::vector<NamedTensors> shards(1);
  uint64_t bytes = 0;
  for (const auto& nt : tensors) {
    const uint64_t b = nt.second.nbytes();
    if (!shards.back().empty() && bytes + b > max_shard_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(nt);
    bytes += b;
  }

  std::error_code ec;
  fs::create_directories(dir, ec);
  LM_CHECK(fs::is_directory(dir, ec), "saving checkpoint: cannot create folder '{}'", dir);
  const fs::path d(dir);
  // Retire the previous checkpoint's entry points first: from here until the new index (or single
  // file) is in place, the folder holds no loadable checkpoint rather than a mix of old and new.
  for (const char* f : {kIndexFileName, kSingleFileName}) {
    fs::remove(d / f, ec);
    LM_CHECK(!ec, "saving checkpoint: cannot remove the previous '{}': {}", (d / f).string(), ec.message());
  }
  fsync_dir(d.string());

  std::map<std::string, std::string> md = metadata;
  md.emplace("format", "pt");
  std::vector<std::string> written;
  if (shards.size() == 1) {
    const std::string p = (d / kSingleFileName).string();
    save_safetensors(p, shards[0], md);
    written.push_back(p);
    return written;
  }

  std::map<std::string, std::pair<std::string, uint64_t>> wm;
  const size_t n = shards.size();
  for (size_t s = 0; s < n; ++s) {
    const std::string file = shard_file_name(s, n);
    const std::string p = (d / file).string();
    save_safetensors(p, shards[s], md);
    written.push_back(p);
    for (const auto& [name, t] : shards[s]) wm[name] = {file, t.nbytes()};
  }
  written.push_back(write_checkpoint_index(dir, wm));  // last: only now does the folder name the new shards
  return written;
}

std::string shard_file_name(size_t s, size_t n) { return fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, n); }

std::string write_checkpoint_index(const std::string& dir,
                                   const std::map<std::string, std::pair<std::string, uint64_t>>& weight_map) {
  json wm = json::object();
  uint64_t total = 0;
  for (const auto& [name, where] : weight_map) {
    wm[name] = where.first;
    total += where.second;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", wm}};
  const std::string ip = (fs::path(dir) / kIndexFileName).string();
  write_file_atomic(ip, index.dump(2) + "\n");
  return ip;
}

}  // namespace lm::io
