#include "io/json.hpp"

#include <fstream>
#include <sstream>

namespace lm::io {

json load_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LM_CHECK(in.good(), "cannot open JSON file '{}'", path);
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::parse_error& e) {
    fail("'{}' is not valid JSON: {}", path, e.what());
  }
}

void check_known_fields(const json& j, std::initializer_list<const char*> known, const std::string& ctx) {
  LM_CHECK(j.is_object(), "{}: expected a JSON object, got {}", ctx, j.type_name());
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool ok = false;
    std::string list;
    for (const char* k : known) ok = ok || it.key() == k, list += (list.empty() ? "" : ", ") + std::string(k);
    LM_CHECK(ok, "{}: unknown field '{}' (known: {})", ctx, it.key(), list);
  }
}

}  // namespace lm::io
