#include "analysis/checked_write.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"

namespace interlock {
namespace {

// A failed write: a full disk or quota is RESOURCE_EXHAUSTED, anything else
// DATA_LOSS (the file is not what the run meant to write).
absl::Status WriteError(int err, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::DataLossError(message);
}

absl::Status OpenError(int err, const std::string& path) {
  return absl::PermissionDeniedError(
      absl::StrCat("cannot create ", path, ": ", std::strerror(err)));
}

// All of `bytes`, retrying short writes and interruptions.
absl::Status WriteAll(int fd, absl::string_view bytes,
                      const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return WriteError(errno, absl::StrCat("writing ", path));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// NFS and some file systems report a failed write only at close.
absl::Status CloseChecked(int fd, const std::string& path) {
  if (close(fd) != 0) return WriteError(errno, absl::StrCat("closing ", path));
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteFileChecked(const std::string& path, absl::string_view bytes,
                              bool sync) {
  const int fd =
      open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return OpenError(errno, path);
  absl::Status s = WriteAll(fd, bytes, path);
  if (s.ok() && sync && fsync(fd) != 0) {
    s = WriteError(errno, absl::StrCat("fsync of ", path));
  }
  if (!s.ok()) {
    close(fd);
    return s;
  }
  return CloseChecked(fd, path);
}

absl::Status WriteFileReplacing(const std::string& path,
                                absl::string_view bytes) {
  const std::string temp = path + ".tmp";
  std::error_code ec;
  absl::Status st = WriteFileChecked(temp, bytes);
  if (st.ok()) {
    std::filesystem::rename(temp, path, ec);
    if (ec) st = absl::DataLossError(absl::StrCat(path, ": ", ec.message()));
  }
  // A failed write leaves nothing behind: the old file, if any, stays whole.
  if (!st.ok()) std::filesystem::remove(temp, ec);
  return st;
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) close(fd_);
}

absl::Status AppendFile::Open(const std::string& path, bool append) {
  path_ = path;
  fd_ = open(path.c_str(),
             O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC),
             0644);
  if (fd_ < 0) return OpenError(errno, path);
  return absl::OkStatus();
}

absl::Status AppendFile::Append(absl::string_view line) {
  return WriteAll(fd_, absl::StrCat(line, "\n"), path_);
}

absl::Status AppendFile::Close() {
  if (fd_ < 0) return absl::OkStatus();
  const int fd = fd_;
  fd_ = -1;
  return CloseChecked(fd, path_);
}

}  // namespace interlock
