#include "io/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "io/file.hpp"

namespace lm::io {

namespace {

constexpr uint64_t kMaxHeader = 100ull << 20;  // same cap as the reference implementation

struct Mapping {
  void* addr = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (addr && size) munmap(addr, size);
  }
};

}  // namespace

SafeTensorsFile SafeTensorsFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // (a FIFO must not block the open)
  LM_CHECK(fd >= 0, "cannot open safetensors file '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("'{}' is not a regular file", path);
  }
  auto map = std::make_shared<Mapping>();
  map->size = static_cast<size_t>(st.st_size);
  if (map->size > 0) {
    // Copy-on-write: get() hands out zero-copy views of this mapping, and a caller that writes into
    // one (e.g. updates a loaded weight in place) gets a private page instead of a SIGSEGV; the file
    // never changes. MAP_NORESERVE keeps a checkpoint larger than RAM + swap mappable.
    map->addr = mmap(nullptr, map->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE, fd, 0);
    if (map->addr == MAP_FAILED) {
      map->addr = nullptr;
      ::close(fd);
      fail("cannot map '{}': {}", path, std::strerror(errno));
    }
  }
  ::close(fd);
  SafeTensorsFile f;
  f.path_ = path;
  f.owner_ = map;
  f.parse(static_cast<const char*>(map->addr), map->size);
  return f;
}

SafeTensorsFile SafeTensorsFile::from_bytes(std::shared_ptr<const std::vector<char>> bytes, const std::string& label) {
  LM_CHECK(bytes != nullptr, "'{}': no bytes given", label);
  SafeTensorsFile f;
  f.path_ = label;
  f.owner_ = bytes;
  f.parse(bytes->data(), bytes->size());
  return f;
}

void SafeTensorsFile::parse(const char* base, size_t size) {
  const std::string& p = path_;
  LM_CHECK(size >= 8, "'{}' is not a safetensors file: {} bytes, shorter than the 8-byte header length", p, size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(base[i]);
  LM_CHECK(n >= 2 && n <= kMaxHeader, "'{}': implausible safetensors header length {} (file is {} bytes)", p, n, size);
  LM_CHECK(n <= size - 8, "'{}' is truncated: header says {} bytes of JSON but only {} follow", p, n, size - 8);
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(base + 8, base + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    fail("'{}': safetensors header is not valid JSON: {}", p, e.what());
  }
  LM_CHECK(h.is_object(), "'{}': safetensors header must be a JSON object", p);
  data_ = base + 8 + n;
  const size_t data_size = size - 8 - n;

  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      LM_CHECK(v.is_object(), "'{}': __metadata__ must be an object of strings", p);
      for (auto m = v.begin(); m != v.end(); ++m) {
        LM_CHECK(m.value().is_string(), "'{}': __metadata__ entry '{}' is not a string", p, m.key());
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    LM_CHECK(!name.empty(), "'{}': a tensor has an empty name", p);
    LM_CHECK(v.is_object(), "'{}': entry for tensor '{}' is not an object", p, name);
    LM_CHECK(v.contains("dtype") && v["dtype"].is_string(), "'{}': tensor '{}' has no dtype string", p, name);
    LM_CHECK(v.contains("shape") && v["shape"].is_array(), "'{}': tensor '{}' has no shape array", p, name);
    LM_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
             "'{}': tensor '{}' needs data_offsets [begin, end]", p, name);
    TensorInfo ti;
    ti.name = name;
    const std::string dt = v["dtype"].get<std::string>();
    LM_CHECK(dtype_from_name(dt, ti.dtype), "'{}': tensor '{}' has unsupported dtype '{}'", p, name, dt);
    // numel_nz (the product with zero dims counted as 1) bounds the strides of the tensor, so an
    // empty tensor such as [0, 2^39, 2^39] cannot overflow int64 stride arithmetic later.
    uint64_t numel = 1, numel_nz = 1;
    for (const auto& d : v["shape"]) {
      LM_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
               "'{}': tensor '{}' has a shape entry that is not a non-negative integer", p, name);
      const uint64_t x = d.get<uint64_t>();
      LM_CHECK(x < (1ull << 40) && (x == 0 || numel_nz <= (1ull << 50) / x), "'{}': tensor '{}' has an absurd shape",
               p, name);
      numel *= x;
      numel_nz *= std::max<uint64_t>(x, 1);
      ti.shape.push_back(static_cast<int64_t>(x));
    }
    for (const auto& o : v["data_offsets"])
      LM_CHECK(o.is_number_unsigned() || (o.is_number_integer() && o.get<int64_t>() >= 0),
               "'{}': tensor '{}' has a bad data offset", p, name);
    ti.begin = v["data_offsets"][0].get<uint64_t>();
    ti.end = v["data_offsets"][1].get<uint64_t>();
    LM_CHECK(ti.begin <= ti.end, "'{}': tensor '{}' has data_offsets begin {} > end {}", p, name, ti.begin, ti.end);
    LM_CHECK(ti.end <= data_size, "'{}' is truncated: tensor '{}' ends at byte {} but the data section has {} bytes", p,
             name, ti.end, data_size);
    LM_CHECK(ti.end - ti.begin == numel * dtype_size(ti.dtype),
             "'{}': tensor '{}' is {} {} of shape {} ({} bytes) but its byte range holds {}", p, name, numel, dt,
             shape_str(ti.shape), numel * dtype_size(ti.dtype), ti.end - ti.begin);
    infos_.push_back(std::move(ti));
  }
  // Byte ranges of non-empty tensors must not overlap (a tensor aliasing another is a corrupt file).
  // Empty tensors occupy no bytes and may sit anywhere, including inside another tensor's range.
  std::vector<const TensorInfo*> order;
  for (const auto& t : infos_)
    if (t.end > t.begin) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < order.size(); ++i)
    LM_CHECK(order[i]->begin >= order[i - 1]->end, "'{}': tensors '{}' and '{}' overlap in the file", p,
             order[i - 1]->name, order[i]->name);
  std::sort(infos_.begin(), infos_.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (size_t i = 0; i < infos_.size(); ++i) index_[infos_[i].name] = i;
}

const TensorInfo& SafeTensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  LM_CHECK(it != index_.end(), "'{}' has no tensor named '{}'", path_, name);
  return infos_[it->second];
}

std::vector<std::string> SafeTensorsFile::names() const {
  std::vector<std::string> r;
  for (const auto& t : infos_) r.push_back(t.name);
  return r;
}

Tensor SafeTensorsFile::get(const std::string& name) const {
  const TensorInfo& ti = info(name);
  const char* src = data_ + ti.begin;
  const size_t bytes = ti.end - ti.begin;
  if (reinterpret_cast<uintptr_t>(src) % dtype_size(ti.dtype) == 0 && bytes > 0) {
    auto owner = std::const_pointer_cast<void>(owner_);
    return Tensor::from_blob(const_cast<char*>(src), ti.shape, ti.dtype, owner);
  }
  Tensor t = Tensor::empty(ti.shape, ti.dtype);
  if (bytes) std::memcpy(t.raw(), src, bytes);
  return t;
}

Tensor SafeTensorsFile::get_as(const std::string& name, DType dt, const Shape& expect) const {
  const TensorInfo& ti = info(name);
  LM_CHECK(expect.empty() || ti.shape == expect, "'{}': tensor '{}' has shape {}, expected {}", path_, name,
           shape_str(ti.shape), shape_str(expect));
  LM_CHECK(dtype_is_float(ti.dtype) == dtype_is_float(dt), "'{}': tensor '{}' is {}, expected a {} tensor", path_, name,
           dtype_name(ti.dtype), dtype_is_float(dt) ? "floating-point" : "integer");
  Tensor t = get(name);
  return t.dtype() == dt ? t : t.to(dt);
}

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  std::set<std::string> seen;
  size_t offset = 0;
  for (const auto& [name, t] : tensors) {
    LM_CHECK(!name.empty() && name != "__metadata__", "cannot save a tensor named '{}' to '{}'", name, path);
    LM_CHECK(seen.insert(name).second, "tensor '{}' given twice when saving '{}'", name, path);
    LM_CHECK(t.defined(), "tensor '{}' is undefined when saving '{}'", name, path);
    LM_CHECK(t.device() == Device::CPU, "tensor '{}' is on {}; copy it to the CPU before saving '{}'", name,
             device_name(t.device()), path);
    nlohmann::ordered_json e;
    e["dtype"] = std::string(dtype_name(t.dtype()));
    e["shape"] = t.shape();
    e["data_offsets"] = {offset, offset + t.nbytes()};
    offset += t.nbytes();
    h[name] = e;
  }
  std::string header;
  try {
    header = h.dump();
  } catch (const nlohmann::json::exception& e) {  // e.g. a name or metadata value that is not UTF-8
    fail("cannot save '{}': a tensor name or metadata entry is not valid UTF-8 ({})", path, e.what());
  }
  while ((8 + header.size()) % 8) header.push_back(' ');  // keep the data section 8-byte aligned
  std::string out;
  out.reserve(8 + header.size() + offset);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += header;
  for (const auto& [name, t] : tensors) {
    const Tensor c = t.contiguous();
    out.append(static_cast<const char*>(c.raw()), c.nbytes());
  }
  write_file_atomic(path, out);
}

}  // namespace lm::io
