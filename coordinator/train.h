// A training run: builds the engine (engine_factory), then a runner submits
// the plan's micro-batches (run_plan) within the window and drains what comes
// back into the exactly-once ledger (ledger), the virtual clock (run_clock)
// and the step records (step_records); checkpoints and recovery are
// run_recovery's, the files it leaves behind run_report's. No LibTorch in
// its API.
#ifndef INTERLOCK_COORDINATOR_TRAIN_H_
#define INTERLOCK_COORDINATOR_TRAIN_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/run_result.h"
#include "coordinator/train_options.h"
#include "proto/config.pb.h"

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

// Loads the data, builds the engine and trains. Locks
// `options.out_dir` (and a separate checkpoint folder) for the whole run.
absl::StatusOr<TrainResult> Train(const interlock::v1::RunConfig& config,
                                  const TrainOptions& options);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_TRAIN_H_
