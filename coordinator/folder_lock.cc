#include "coordinator/folder_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace interlock {

absl::StatusOr<std::unique_ptr<FolderLock>> FolderLock::Acquire(
    const std::string& dir, const std::string& flag) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat(flag, ": cannot create ", dir, ": ", ec.message()));
  }
  const std::string path = dir + "/.interlock.lock";
  // Close-on-exec: a worker started by a local cluster must not inherit
  // (and so keep) the lock.
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    return absl::PermissionDeniedError(absl::StrCat(
        flag, ": cannot open the lock file ", path, ": ", std::strerror(err)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    close(fd);
    if (err == EWOULDBLOCK) {
      int64_t pid = 0;
      const bool known =
          n > 0 && absl::SimpleAtoi(absl::StripAsciiWhitespace(buf), &pid);
      return absl::FailedPreconditionError(absl::StrCat(
          flag, ": ", dir, " is in use by another run",
          known ? absl::StrCat(" (pid ", pid, ")") : "", "; wait for it to ",
          "finish or choose another ", flag, " (lock: ", path, ")"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": cannot lock ", path, ": ", std::strerror(err)));
  }
  // The holder, for the message above. Only informative: a full disk must
  // not stop the run here (its own writes will say so).
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) == 0) {
    if (pwrite(fd, pid.data(), pid.size(), 0) < 0) {
      // Ignored, see above.
    }
  }
  return std::unique_ptr<FolderLock>(new FolderLock(fd));
}

FolderLock::~FolderLock() { close(fd_); }

}  // namespace interlock
