#include "io/file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.hpp"

namespace lm::io {

namespace fs = std::filesystem;

std::string read_file(const std::string& path) {
  std::error_code ec;
  LM_CHECK(fs::exists(path, ec), "file '{}' does not exist", path);
  LM_CHECK(!fs::is_directory(path, ec), "'{}' is a directory, not a file", path);
  // Only regular files: a FIFO or a device would block or never end.
  LM_CHECK(fs::is_regular_file(path, ec), "'{}' is not a regular file", path);
  std::ifstream in(path, std::ios::binary);
  LM_CHECK(in.good(), "cannot open '{}': {}", path, std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  LM_CHECK(!in.bad(), "reading '{}' failed", path);
  return std::move(ss).str();
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  const fs::path target(path);
  const fs::path dir = target.parent_path();
  std::string tmpl = (dir.empty() ? fs::path(".") : dir).string() + "/." + target.filename().string() + ".tmp.XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const int fd = ::mkstemp(buf.data());
  LM_CHECK(fd >= 0, "cannot create a temporary file next to '{}': {}", path, std::strerror(errno));
  const std::string tmp(buf.data());
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail("writing '{}' failed: {}", path, std::strerror(e));
    }
    done += static_cast<size_t>(w);
  }
  ::fchmod(fd, 0644);
  const int sync_rc = ::fsync(fd);
  const int sync_errno = errno;
  const int close_rc = ::close(fd);  // always closed, even when fsync failed
  const int close_errno = errno;
  if (sync_rc != 0 || close_rc != 0) {
    ::unlink(tmp.c_str());
    fail("flushing '{}' failed: {}", path, std::strerror(sync_rc != 0 ? sync_errno : close_errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    fail("cannot move the finished file into place at '{}': {}", path, std::strerror(e));
  }
  fsync_dir(dir.string());
}

}  // namespace lm::io
