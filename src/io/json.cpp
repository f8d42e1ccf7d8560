#include "io/json.hpp"

#include <fstream>
#include <sstream>

#include "io/file.hpp"

namespace lm::io {

json load_json_file(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {  // parse errors, and numbers out of range such as 1e400
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
