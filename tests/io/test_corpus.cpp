// Corpus readers: text files and paragraphs, folders (recursive, sorted, hidden skipped), JSONL with
// line-numbered errors, the Brown corpus's tag stripping (synthetic fixture; the real corpus if present).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/env.hpp"
#include "io/corpus.hpp"
#include "testing.hpp"

namespace {

namespace fs = std::filesystem;
using namespace lm::io;

const fs::path kRepo = fs::path(LONGMOE_SOURCE_DIR);

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("lm_corpus_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path write(const std::string& rel, const std::string& content) const {
    const fs::path p = path / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << content;
    return p;
  }
};

using lm::testing::error_of;

TEST(Corpus, TextFileAndParagraphs) {
  TempDir t("text");
  const auto f = t.write("a.txt", "First para\nline two\n\n \t\n\nSecond\n\n\n   \nThird  \n");
  EXPECT_EQ(read_text_file(f.string()), std::vector<std::string>{"First para\nline two\n\n \t\n\nSecond\n\n\n   \nThird  \n"});
  EXPECT_EQ(read_text_file(f.string(), true),
            (std::vector<std::string>{"First para\nline two", "Second", "Third  "}));
  EXPECT_TRUE(read_text_file(t.write("blank.txt", " \n\n\t").string()).empty());
  EXPECT_EQ(split_paragraphs("a\r\n\r\nb"), (std::vector<std::string>{"a\r", "b"}));
  const std::string err = error_of([&] { read_text_file((t.path / "nope.txt").string()); });
  EXPECT_NE(err.find("nope.txt"), std::string::npos) << err;
  EXPECT_NE(error_of([&] { read_text_file(t.path.string()); }).find("directory"), std::string::npos);
}

TEST(Corpus, FolderIsRecursiveSortedAndSkipsHidden) {
  TempDir t("folder");
  t.write("b.txt", "bee");
  t.write("a/z.txt", "zed");
  t.write("a/c.txt", "sea\n\nsecond");
  t.write(".hidden", "no");
  t.write(".git/config", "no");
  t.write("a/.swp", "no");
  t.write("empty.txt", "");
  EXPECT_EQ(read_text_folder(t.path.string()), (std::vector<std::string>{"sea\n\nsecond", "zed", "bee"}));
  EXPECT_EQ(read_text_folder(t.path.string(), true), (std::vector<std::string>{"sea", "second", "zed", "bee"}));
  EXPECT_EQ(detect_corpus_format(t.path.string()), CorpusFormat::Folder);
  TempDir e("folder_empty");
  EXPECT_NE(error_of([&] { read_text_folder(e.path.string()); }).find("no files"), std::string::npos);
}

TEST(Corpus, Jsonl) {
  TempDir t("jsonl");
  const auto good = t.write("good.jsonl", "{\"text\": \"one\\nline\", \"id\": 1}\n\n  \n{\"text\": \"two \\u00e9\"}\r\n"
                                          "{\"text\": \"\"}\n{\"text\": \"three\"}");
  EXPECT_EQ(read_jsonl(good.string()), (std::vector<std::string>{"one\nline", "two \xC3\xA9", "three"}));
  EXPECT_EQ(detect_corpus_format(good.string()), CorpusFormat::Jsonl);
  EXPECT_EQ(read_corpus(good.string()).size(), 3u);

  struct Bad {
    std::string content, expect;
  };
  const std::vector<Bad> bads = {
      {"{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": \"unterminated}\n", "bad.jsonl:3: not valid JSON"},
      {"{\"text\": \"ok\"}\n{\"body\": \"x\"}\n", "bad.jsonl:2: the object has no \"text\" field"},
      {"\n\n\n{\"text\": 5}\n", "bad.jsonl:4: field \"text\" is number"},
      {"[\"text\"]\n", "bad.jsonl:1: expected a JSON object"},
      {"{\"text\": \"a\"} trailing\n", "bad.jsonl:1: not valid JSON"},
      {"\n \n", "holds no documents"},
  };
  for (const auto& b : bads) {
    const auto p = t.write("bad.jsonl", b.content);
    const std::string err = error_of([&] { read_jsonl(p.string()); });
    EXPECT_NE(err.find(b.expect), std::string::npos) << "got: " << err << "\nwanted: " << b.expect;
  }
}

TEST(Corpus, BrownFixture) {
  const fs::path dir = kRepo / "tests/data/brown";
  const auto docs = read_brown(dir.string());
  ASSERT_EQ(docs.size(), 2u);  // ca01, cb02; README is not a Brown file
  EXPECT_EQ(docs[0],
            "The Fulton County said \"no evidence\" was found by Ivan Allen Jr.\n"
            "It cost $1-1/2 million (about 4%); yet the jury said: 'fine'!\n"
            "Headline here\n"
            "He asked, \"Why -- and/or when?\" \"Fine,\" she said.");
  EXPECT_EQ(docs[1], "A second file.");
  EXPECT_EQ(detect_corpus_format(dir.string()), CorpusFormat::Brown);
  EXPECT_EQ(read_corpus(dir.string()), docs);
  // The npm tarball's own layout (package/ca01...) is found from the folder above.
  TempDir t("brown_pkg");
  fs::create_directories(t.path / "package");
  for (const char* f : {"ca01", "cb02"}) fs::copy_file(dir / f, t.path / "package" / f);
  EXPECT_EQ(read_corpus(t.path.string()), docs);
}

TEST(Corpus, BrownErrors) {
  TempDir t("brown_bad");
  t.write("ca01", "\n\tGood/jj words/nns ./.\n\n\tthen/rb a/at bare token here/rb\n");
  const std::string err = error_of([&] { read_brown(t.path.string()); });
  EXPECT_NE(err.find("ca01:4: token 'bare'"), std::string::npos) << err;
  TempDir e("brown_none");
  EXPECT_NE(error_of([&] { read_brown(e.path.string()); }).find("no Brown corpus files"), std::string::npos);
  EXPECT_THROW(read_corpus(e.path.string(), parse_corpus_format("brown")), lm::Error);
  EXPECT_THROW(parse_corpus_format("csv"), lm::Error);
  EXPECT_NE(error_of([] { read_corpus("/nonexistent/corpus"); }).find("/nonexistent/corpus"), std::string::npos);
}

TEST(Corpus, RealBrown) {
  std::string dir;
  if (const std::string e = lm::env::brown_dir(""); !e.empty()) dir = e;
  else if (fs::exists(kRepo / "data/brown")) dir = (kRepo / "data/brown").string();
  if (dir.empty()) GTEST_SKIP() << "Brown corpus not found (set LONGMOE_BROWN_DIR or run scripts/fetch_brown.sh data/brown)";
  const auto docs = read_brown(dir);
  ASSERT_EQ(docs.size(), 500u);
  const std::string first =
      "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent primary election produced "
      "\"no evidence\" that any irregularities took place.\nThe jury further said";
  EXPECT_EQ(docs[0].substr(0, first.size()), first);
  EXPECT_NE(docs[0].find("by Mayor-nominate Ivan Allen Jr.\n"), std::string::npos);
  EXPECT_NE(docs[0].find("reports was received,\" the jury said"), std::string::npos);
  size_t bytes = 0;
  for (const auto& d : docs) {
    bytes += d.size();
    // No tags left: a tag would show as /xx after a word.
    for (const char* tag : {"/at ", "/nn ", "/in ", "/vbd ", "/np ", "/jj ", "/,"})
      ASSERT_EQ(d.find(tag), std::string::npos) << tag;
    ASSERT_EQ(d.find(" ."), std::string::npos);
    ASSERT_EQ(d.find(" ,"), std::string::npos);
    ASSERT_EQ(d.find(";;"), std::string::npos);
    ASSERT_EQ(d.find("\"??"), std::string::npos);
    ASSERT_EQ(d.find("``"), std::string::npos);
  }
  EXPECT_GT(bytes, 5'000'000u);
  EXPECT_LT(bytes, 6'500'000u);
}

}  // namespace
