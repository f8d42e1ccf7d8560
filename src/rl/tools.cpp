#include "rl/tools.hpp"

#include <algorithm>
#include <cctype>
#include <numeric>

#include <fmt/format.h>

namespace lm::rl {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// The text between <tag> and </tag> (the first pair); nullopt without an opening tag; `error` set when it is
// not closed.
std::optional<std::string_view> between(std::string_view s, std::string_view tag, std::string& error) {
  const std::string open = fmt::format("<{}>", tag), close = fmt::format("</{}>", tag);
  const size_t a = s.find(open);
  if (a == std::string_view::npos) return std::nullopt;
  const size_t b = s.find(close, a + open.size());
  if (b == std::string_view::npos) {
    error = fmt::format("{} is not closed by {}", open, close);
    return std::nullopt;
  }
  return s.substr(a + open.size(), b - a - open.size());
}

// Exact rationals p/q (q > 0, reduced) with 64-bit overflow checks.
struct Q {
  int64_t p = 0, q = 1;
};
bool mul_ok(int64_t a, int64_t b, int64_t& r) { return !__builtin_mul_overflow(a, b, &r); }
bool add_ok(int64_t a, int64_t b, int64_t& r) { return !__builtin_add_overflow(a, b, &r); }
bool norm(Q& x) {
  if (x.q == 0 || x.p == INT64_MIN) return false;
  if (x.q < 0) {
    if (x.p == INT64_MIN || x.q == INT64_MIN) return false;
    x.p = -x.p, x.q = -x.q;
  }
  const int64_t g = std::gcd(x.p < 0 ? -x.p : x.p, x.q);
  if (g > 1) x.p /= g, x.q /= g;
  return true;
}

// Recursive descent: expr = term (('+'|'-') term)*, term = factor (('*'|'/') factor)*,
// factor = '-' factor | '(' expr ')' | digits.
class Calc {
 public:
  explicit Calc(std::string_view s) : s_(s) {}
  bool run(Q& out) {
    if (!expr(out)) return false;
    skip();
    if (i_ != s_.size()) return fail(fmt::format("unexpected '{}' at position {}", s_[i_], i_ + 1));
    return true;
  }
  std::string error;

 private:
  bool fail(std::string m) {
    if (error.empty()) error = std::move(m);
    return false;
  }
  void skip() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t')) ++i_;
  }
  bool expr(Q& x) {
    if (!term(x)) return false;
    for (;;) {
      skip();
      if (i_ >= s_.size() || (s_[i_] != '+' && s_[i_] != '-')) return true;
      const char op = s_[i_++];
      Q y;
      if (!term(y)) return false;
      int64_t a, b, qq;
      if (!mul_ok(x.p, y.q, a) || !mul_ok(y.p, x.q, b) || !mul_ok(x.q, y.q, qq)) return fail("a number beyond 64 bits");
      if (op == '-') {
        if (b == INT64_MIN) return fail("a number beyond 64 bits");
        b = -b;
      }
      int64_t p;
      if (!add_ok(a, b, p)) return fail("a number beyond 64 bits");
      x = Q{p, qq};
      if (!norm(x)) return fail("a number beyond 64 bits");
    }
  }
  bool term(Q& x) {
    if (!factor(x)) return false;
    for (;;) {
      skip();
      if (i_ >= s_.size() || (s_[i_] != '*' && s_[i_] != '/')) return true;
      const char op = s_[i_++];
      Q y;
      if (!factor(y)) return false;
      if (op == '/') {
        if (y.p == 0) return fail("division by zero");
        std::swap(y.p, y.q);
        if (!norm(y)) return fail("a number beyond 64 bits");
      }
      int64_t p, qq;
      if (!mul_ok(x.p, y.p, p) || !mul_ok(x.q, y.q, qq)) return fail("a number beyond 64 bits");
      x = Q{p, qq};
      if (!norm(x)) return fail("a number beyond 64 bits");
    }
  }
  bool factor(Q& x) {
    skip();
    if (i_ >= s_.size()) return fail("the expression ends where a number was expected");
    const char c = s_[i_];
    if (c == '-') {
      ++i_;
      if (!factor(x)) return false;
      if (x.p == INT64_MIN) return fail("a number beyond 64 bits");
      x.p = -x.p;
      return true;
    }
    if (c == '(') {
      if (++depth_ > 64) return fail("more than 64 levels of parentheses");
      ++i_;
      if (!expr(x)) return false;
      skip();
      if (i_ >= s_.size() || s_[i_] != ')') return fail("a '(' is not closed");
      ++i_, --depth_;
      return true;
    }
    if (!std::isdigit(static_cast<unsigned char>(c)))
      return fail(fmt::format("unexpected '{}' at position {} (only integers, + - * / and parentheses)", c, i_ + 1));
    int64_t v = 0;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) {
      if (!mul_ok(v, 10, v) || !add_ok(v, s_[i_] - '0', v)) return fail("a number beyond 64 bits");
      ++i_;
    }
    x = Q{v, 1};
    return true;
  }
  std::string_view s_;
  size_t i_ = 0;
  int depth_ = 0;
};

std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

}  // namespace

ParsedTurn parse_turn(std::string_view text) {
  ParsedTurn t;
  if (auto body = between(text, "tool_call", t.error)) {
    io::json j;
    try {
      j = io::json::parse(*body);
    } catch (const std::exception&) {
      t.error = "the tool call is not valid JSON (expected {\"name\": ..., \"arguments\": {...}})";
      return t;
    }
    if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) {
      t.error = "the tool call needs a string \"name\"";
      return t;
    }
    if (j.contains("arguments") && !j["arguments"].is_object()) {
      t.error = "the tool call's \"arguments\" must be an object";
      return t;
    }
    t.call = ToolCall{j["name"].get<std::string>(), j.value("arguments", io::json::object())};
    return t;
  }
  if (!t.error.empty()) return t;
  if (auto a = between(text, "answer", t.error)) t.answer = std::string(trim(*a));
  return t;
}

ToolResult calculator(std::string_view e) {
  if (e.size() > 256) return {false, "the expression is longer than 256 characters"};
  if (trim(e).empty()) return {false, "the expression is empty"};
  Calc c(e);
  Q x;
  if (!c.run(x)) return {false, c.error};
  return {true, x.q == 1 ? std::to_string(x.p) : fmt::format("{}/{}", x.p, x.q)};
}

ToolResult search(std::string_view doc, std::string_view query) {
  std::vector<std::string> words;
  {
    std::string w;
    for (char c : lower(query) + " ")
      if (std::isalnum(static_cast<unsigned char>(c))) w += c;
      else if (!w.empty()) words.push_back(w), w.clear();
  }
  if (words.empty()) return {false, "the query has no words"};
  if (words.size() > 16) return {false, "the query has more than 16 words"};
  std::vector<std::string> hits;
  size_t b = 0;
  while (b < doc.size() && hits.size() < 3) {
    size_t e = doc.find_first_of(".!?\n", b);
    e = e == std::string_view::npos ? doc.size() : e + 1;
    const std::string_view sent = trim(doc.substr(b, e - b));
    const std::string low = lower(sent);
    bool all = !sent.empty();
    for (const std::string& w : words) {  // whole words
      bool found = false;
      for (size_t p = low.find(w); p != std::string::npos && !found; p = low.find(w, p + 1)) {
        const bool left = p == 0 || !std::isalnum(static_cast<unsigned char>(low[p - 1]));
        const bool right = p + w.size() == low.size() || !std::isalnum(static_cast<unsigned char>(low[p + w.size()]));
        found = left && right;
      }
      all = all && found;
    }
    if (all) hits.emplace_back(sent);
    b = e;
  }
  if (hits.empty()) return {true, "no match"};
  std::string r;
  for (const auto& h : hits) r += (r.empty() ? "" : "\n") + h;
  return {true, r};
}

const std::vector<std::string>& Toolbox::names() {
  static const std::vector<std::string> n = {"calculator", "search"};
  return n;
}

ToolResult Toolbox::call(const ToolCall& c) const {
  auto arg = [&](const char* key) -> std::optional<std::string> {
    if (!c.arguments.is_object() || !c.arguments.contains(key) || !c.arguments[key].is_string()) return std::nullopt;
    return c.arguments[key].get<std::string>();
  };
  if (c.name == "calculator") {
    const auto e = arg("expression");
    if (!e) return {false, "calculator needs a string argument \"expression\""};
    return calculator(*e);
  }
  if (c.name == "search") {
    const auto q = arg("query");
    if (!q) return {false, "search needs a string argument \"query\""};
    return search(document_, *q);
  }
  return {false, fmt::format("unknown tool '{}' (tools: calculator, search; there is no shell, network or file "
                             "access)", c.name.substr(0, 64))};
}

std::string tool_result_text(const ToolResult& r) {
  return "<tool_result>" + (r.ok ? r.text : "error: " + r.text) + "</tool_result>";
}

}  // namespace lm::rl
