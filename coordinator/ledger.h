// The run's exactly-once ledger: per step of the surviving history, how many
// micro-batches completed (finished by every block), how many blocks took
// their optimizer step and how many micro-batch gradients they applied. A
// checkpoint and the end of the run both require every step to have exactly
// M, K and K x M; summary.json reports the totals.
#ifndef INTERLOCK_COORDINATOR_LEDGER_H_
#define INTERLOCK_COORDINATOR_LEDGER_H_

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace interlock {

// Exactly-once accounting of the run, written to summary.json: every step
// of the surviving history applied M micro-batch gradients on every block.
struct Accounting {
  int64_t microbatches_per_step = 0;  // M
  // Completions (micro-batches finished by every block) and optimizer steps
  // of the run's final history, over all steps (restored ones included).
  int64_t microbatches_applied = 0;
  int64_t block_steps = 0;
  // Steps whose completions or block gradients were not exactly M (each
  // is an error; listed for the report).
  std::vector<int64_t> steps_not_exactly_once;
  int64_t recoveries = 0;
  // Micro-batches run again after a restore (their first run was undone).
  int64_t microbatches_replayed = 0;
  // Repeats a worker acknowledged without applying them.
  int64_t duplicates_acknowledged = 0;
  int64_t resumed_from_step = -1;  // -1: not resumed
  int64_t checkpoints = 0;
  int64_t failovers = 0;
  // Coordinators started again that adopted the live workers (journal).
  int64_t adoptions = 0;
};

class Ledger {
 public:
  Ledger(int64_t steps, int blocks, int microbatches);

  // Steps [0, steps) were restored from a checkpoint: applied once each.
  void Restored(int64_t steps);
  // The chain restarts at `from`: what steps from there on had applied is
  // undone (counted as replayed) and runs again.
  void ResetFrom(int64_t from);

  void OnCompletion(int64_t step) { ++completions_[step]; }
  // Block `block` took its optimizer step of `step` with `microbatches`
  // gradients. Returns whether a skipped update (non-finite values) is new:
  // a replay skips the same steps again and each counts once.
  bool OnBlockStep(int block, int64_t step, int microbatches, bool skipped);
  void OnDuplicate() { ++acc_.duplicates_acknowledged; }

  bool AppliedOnce(int64_t step) const;
  // INTERNAL naming the first step before `steps` not applied exactly once.
  absl::Status CheckThrough(int64_t steps) const;
  // The totals over the first `steps` steps; INTERNAL when one of them was
  // not applied exactly once.
  absl::Status Close(int64_t steps);

  // Steps every block has stepped.
  int64_t MinStepsDone() const;
  // Per block: steps whose update it skipped.
  std::vector<int64_t> SkippedPerBlock() const;

  Accounting& accounting() { return acc_; }
  const Accounting& accounting() const { return acc_; }

 private:
  const int k_;
  const int m_;
  std::vector<int> completions_;
  std::vector<int> block_steps_;
  std::vector<int64_t> block_grads_;
  std::vector<int64_t> steps_done_;  // per block
  // (step, block) whose update the block skipped (nonfinite_policy); steps
  // before a resumed checkpoint are not included.
  std::set<std::pair<int64_t, int>> skipped_;
  Accounting acc_;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_LEDGER_H_
