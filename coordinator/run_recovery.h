// A run's checkpoints and recovery (docs/RELIABILITY.md): resuming from the
// checkpoint folder, taking a checkpoint at a step boundary, and after a
// worker failure waiting for the workers, restoring the newest checkpoint
// and telling the runner where to replay from.
#ifndef INTERLOCK_COORDINATOR_RUN_RECOVERY_H_
#define INTERLOCK_COORDINATOR_RUN_RECOVERY_H_

#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/engine.h"
#include "coordinator/metrics.h"
#include "coordinator/run_checkpoints.h"
#include "coordinator/run_journal.h"
#include "coordinator/run_state.h"
#include "coordinator/train_options.h"
#include "proto/config.pb.h"

namespace interlock {

// Where a resumed run starts.
struct ResumePoint {
  int64_t step = 0;           // 0: from the beginning
  double wall_seconds = 0.0;  // training time before it
  // The checkpoint's records of steps the clock had not placed yet.
  std::vector<std::string> pending_records;
};

class RunRecovery {
 public:
  // `seal_key`: the run's token; checkpoints are signed with it and must
  // carry its signature to be loaded (empty: checksums only).
  RunRecovery(const interlock::v1::RunConfig& config,
              const CheckpointOptions& options, const std::string& out_dir,
              std::string seal_key, Engine& engine, RunState& state,
              CoordinatorMetrics* metrics)
      : c_(config),
        o_(options),
        out_dir_(out_dir),
        seal_key_(std::move(seal_key)),
        engine_(engine),
        state_(state),
        metrics_(metrics) {}

  // The run's journal (workers that live on their own; null: none) and,
  // when the engine adopted the live workers it names, the journal read at
  // the start: Resume continues from it instead of a checkpoint.
  void SetJournal(RunJournal* journal,
                  const interlock::v1::RunJournal* adopted) {
    journal_ = journal;
    adopted_ = adopted;
  }
  // Records the newest step boundary every block passed and the clock
  // placed in the journal, when it moved on (after each event).
  void Journal();
  // The topology changed at `step` (a join, a leave, a fail-over), with the
  // chain idle: records it at once, with the records the virtual clock has
  // not placed yet, so that a coordinator started before the next step
  // completes adopts the new topology (its workers hold snapshots from
  // `step` on, not before).
  void JournalBoundary(int64_t step);
  // The run finished: nothing is left to adopt.
  void CloseJournal() {
    if (journal_) journal_->Remove();
  }

  // Opens the checkpoint folder (if the run has one) and, when there is a
  // checkpoint to resume from, restores the engine, the ledger, the clock's
  // base and the evaluations from it.
  absl::StatusOr<ResumePoint> Resume();
  // Whether a checkpoint is due after `steps` of the run's `total` steps:
  // every `every` steps, and after the last so that `interlock export` can
  // take the trained network.
  bool Due(int64_t steps, int64_t total) const {
    return checkpoints_ && o_.every > 0 &&
           (steps % o_.every == 0 || steps == total);
  }
  // A checkpoint of `steps` completed steps (the chain is idle). Returns its
  // folder.
  absl::StatusOr<std::string> Take(int64_t steps);
  // A stop request needs a checkpoint folder: opens it if the run has one
  // but has not opened it yet. False: there is none.
  absl::StatusOr<bool> CanStop();

  // After `failure`: waits for the workers, restores the newest checkpoint
  // (or the initial state) and returns the step to continue from. A worker
  // failing again meanwhile restarts the attempt, within the same deadline.
  // Returns `failure` itself when it cannot be recovered from.
  absl::StatusOr<int64_t> Recover(const absl::Status& failure);
  // A step completed: the recoveries so far made progress.
  void Progressed() { recoveries_without_progress_ = 0; }

 private:
  absl::Status Open(const std::string& dir);
  // Opens the checkpoint folder and, unless the workers were adopted,
  // restores the newest checkpoint.
  absl::StatusOr<ResumePoint> OpenAndResume();
  // The coordinator's part of a checkpoint at `steps` (steps, cursor,
  // times, accounting, evaluations; no files, no pending records).
  interlock::v1::CheckpointManifest Manifest(int64_t steps);
  // Continues the run's state (clock, ledger, evaluations) from `mf`.
  ResumePoint ResumeFrom(const interlock::v1::CheckpointManifest& mf);

  const interlock::v1::RunConfig& c_;
  const CheckpointOptions& o_;
  const std::string out_dir_;
  const std::string seal_key_;
  Engine& engine_;
  RunState& state_;
  CoordinatorMetrics* metrics_;
  // Null without a checkpoint folder.
  std::unique_ptr<RunCheckpoints> checkpoints_;
  std::string dir_;
  int recoveries_without_progress_ = 0;
  RunJournal* journal_ = nullptr;
  const interlock::v1::RunJournal* adopted_ = nullptr;
  // The step the journal last recorded.
  int64_t journaled_step_ = -1;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RUN_RECOVERY_H_
