#pragma once
// JSON config reading with errors that name the file and the field.
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/error.hpp"

namespace lm::io {

using json = nlohmann::json;

json load_json_file(const std::string& path);  // throws naming the file and the parse position

// Typed field access; `ctx` names the file (and section) for error messages.
template <class T>
T get_required(const json& j, const std::string& key, const std::string& ctx) {
  LM_CHECK(j.is_object() && j.contains(key) && !j[key].is_null(), "{}: missing required field '{}'", ctx, key);
  try {
    return j[key].get<T>();
  } catch (const json::exception&) {
    fail("{}: field '{}' has the wrong type ({})", ctx, key, j[key].type_name());
  }
}

template <class T>
std::optional<T> get_optional(const json& j, const std::string& key, const std::string& ctx) {
  if (!j.is_object() || !j.contains(key) || j[key].is_null()) return std::nullopt;
  try {
    return j[key].get<T>();
  } catch (const json::exception&) {
    fail("{}: field '{}' has the wrong type ({})", ctx, key, j[key].type_name());
  }
}

// Throws unless `j` is an object whose keys are all in `known` (the error lists them): a misspelt
// option must not be silently ignored.
void check_known_fields(const json& j, std::initializer_list<const char*> known, const std::string& ctx);

template <class T>
T get_or(const json& j, const std::string& key, const T& dflt, const std::string& ctx) {
  auto v = get_optional<T>(j, key, ctx);
  return v ? *v : dflt;
}

}  // namespace lm::io
