// Exclusive use of a run's folders (--out, --checkpoint-dir).
#ifndef INTERLOCK_COORDINATOR_FOLDER_LOCK_H_
#define INTERLOCK_COORDINATOR_FOLDER_LOCK_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace interlock {

// An exclusive lock on a run's folder (--out, --checkpoint-dir): two runs
// sharing one would write over each other's files and resume from each
// other's live checkpoints. An advisory flock on DIR/.interlock.lock, which
// names the holder's pid; the kernel drops it when the holder dies, so a
// killed run's folder can be used again at once.
class FolderLock {
 public:
  // Creates `dir` if needed and locks it, or fails at once with
  // FAILED_PRECONDITION naming the folder and the holder (`flag` names the
  // option the folder came from, for the message).
  static absl::StatusOr<std::unique_ptr<FolderLock>> Acquire(
      const std::string& dir, const std::string& flag);
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;

 private:
  explicit FolderLock(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_FOLDER_LOCK_H_
