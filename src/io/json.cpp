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

}  // namespace lm::io
