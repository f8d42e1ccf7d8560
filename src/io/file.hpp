#pragma once
// Whole-file reads and atomic writes, the two file operations every other io/ reader and writer
// (safetensors, checkpoints, tokenizer, corpora, configs, plots) is built on.
//
// Atomic write: temp file in the same folder, fsync, rename over the target, fsync of the folder, so a
// reader (or a crash) sees the old file or the new one, never a mix; on failure the temp file is removed.
#include <string>

namespace lm::io {

// The whole file as bytes; throws lm::Error naming the file when it is missing, a directory or unreadable.
std::string read_file(const std::string& path);

// Writes `bytes` to `path` atomically (temp + fsync + rename + fsync dir); throws lm::Error naming the file.
void write_file_atomic(const std::string& path, const std::string& bytes);

// fsync of a folder (its entries: a rename or removal inside it becomes durable); "" is the current folder.
// Best effort: a folder that cannot be opened is left alone.
void fsync_dir(const std::string& dir);

}  // namespace lm::io
