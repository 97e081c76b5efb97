// The run driver's side of checkpoints: where they live, which one a run
// resumes from, whether it belongs to this run's configuration, taking one
// from an engine and restoring an engine from one, and cutting the run's
// report files back to a checkpoint so they continue without duplicates.
#ifndef INTERLOCK_COORDINATOR_RUN_CHECKPOINTS_H_
#define INTERLOCK_COORDINATOR_RUN_CHECKPOINTS_H_

#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/checkpoint.h"
#include "coordinator/engine.h"
#include "proto/config.pb.h"

namespace interlock {

class RunCheckpoints {
 public:
  // Opens `dir` (created if needed; unfinished temporaries removed and
  // logged). With a `seal_key` (the run's token) checkpoints are
  // signed, and unsigned or wrongly signed ones are refused.
  static absl::StatusOr<std::unique_ptr<RunCheckpoints>> Open(
      const std::string& dir, int keep, const std::string& seal_key = "");

  // The checkpoint to resume from: `resume` if given (a checkpoint folder,
  // or a folder of them: the newest that verifies), else the newest in this
  // store; nullopt when there is none. Damaged checkpoints are reported on
  // the log and skipped in favour of the previous complete one; when
  // checkpoints exist but none verifies, that is an error.
  absl::StatusOr<std::optional<Checkpoint>> FindResume(
      const std::string& resume) const;

  // Writes the engine's state (training must be idle at a step boundary)
  // with `manifest` (step, cursor, times, accounting filled in by the
  // caller). Returns the checkpoint's folder.
  absl::StatusOr<std::string> Take(Engine& engine,
                                   interlock::v1::CheckpointManifest manifest);

  const std::string& dir() const { return store_.root(); }

 private:
  RunCheckpoints(CheckpointStore store, std::string seal_key)
      : store_(std::move(store)), seal_key_(std::move(seal_key)) {}
  CheckpointStore store_;
  std::string seal_key_;
};

// OK when `manifest` is of a run with exactly this configuration (after
// defaults and command-line overrides); otherwise FAILED_PRECONDITION
// naming the fields that differ.
absl::Status CheckSameRun(const interlock::v1::CheckpointManifest& manifest,
                          const interlock::v1::RunConfig& config,
                          const std::string& where);

// Restores every block of `engine` from `checkpoint`.
absl::Status Restore(Engine& engine, const Checkpoint& checkpoint);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RUN_CHECKPOINTS_H_
