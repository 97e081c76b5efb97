// The run's per-step records: the loss reports of every completed
// micro-batch summed per step and block, each step recorded once, in order,
// as soon as the virtual clock has placed it: a metrics.jsonl line, the
// coordinator's metrics, the progress line. Steps a recovery replays are
// not recorded again (the replay computes the same values).
#ifndef INTERLOCK_COORDINATOR_STEP_RECORDS_H_
#define INTERLOCK_COORDINATOR_STEP_RECORDS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "analysis/checked_write.h"
#include "coordinator/metrics.h"
#include "coordinator/progress.h"
#include "coordinator/run_clock.h"
#include "coordinator/run_plan.h"

namespace interlock {

struct LossReport;

class StepRecords {
 public:
  StepRecords(const RunPlan& plan, RunClock& clock, CoordinatorMetrics* metrics)
      : plan_(plan), clock_(clock), metrics_(metrics) {}

  // Opens OUT/metrics.jsonl (`out_dir` empty: no file). A run resumed at
  // `start` keeps the lines of earlier steps, drops the later ones (they run
  // again; returned as a count) and adds `pending`, the checkpoint's records
  // of steps the clock had not placed yet.
  absl::StatusOr<int64_t> Open(const std::string& out_dir, int64_t start,
                               const std::vector<std::string>& pending);
  absl::Status Close() { return file_.Close(); }
  // Records start at `step`, after `wall_offset` seconds of an earlier run.
  void StartAt(int64_t step, double wall_offset);
  void SetProgress(Progress* progress) { progress_ = progress; }

  void SetLearningRate(int64_t step, double lr) { lrs_[step] = lr; }
  // A micro-batch of `step` completed with these reports, at `wall` seconds
  // of training. Returns whether a step not recorded before completed.
  bool OnCompletion(int64_t step, const std::vector<LossReport>& reports,
                    double wall);
  // Records the steps that completed and that the clock has placed.
  absl::Status EmitReady();
  // The chain restarts at `from`: what was in flight is forgotten; records
  // of earlier steps waiting for the clock stay.
  void ResetFrom(int64_t from);
  // For a checkpoint at `steps`: the records of completed steps the clock
  // has not placed yet, without a virtual time.
  std::vector<std::string> Pending(int64_t steps) const;

  // Steps whose micro-batches all completed / that were recorded.
  int64_t completed() const { return completed_; }
  int64_t recorded() const { return next_emit_; }
  // Mean wall time per step after the first step this process trained.
  double MeanStepWall(int64_t steps) const;
  // The last recorded step's mean loss per block (NaN: no head).
  const std::vector<double>& last_losses() const { return last_losses_; }

 private:
  // Sums the loss reports of one step's micro-batches per block.
  struct StepAgg {
    int done = 0;
    std::vector<double> loss_sum;
    std::vector<int> loss_n;
    double wall = 0.0;  // training time when the last micro-batch completed
  };
  std::vector<double> MeanLosses(const StepAgg& agg) const;
  // One line of metrics.jsonl (no newline).
  std::string Line(int64_t s, const StepAgg& agg, double virt) const;
  absl::Status Emit(int64_t s, const StepAgg& agg);

  const RunPlan& plan_;
  RunClock& clock_;
  CoordinatorMetrics* metrics_;
  Progress* progress_ = nullptr;
  AppendFile file_;
  std::map<int64_t, StepAgg> steps_;
  std::map<int64_t, double> lrs_;
  int64_t completed_ = 0;
  int64_t next_emit_ = 0;
  double wall_offset_ = 0.0;
  double first_wall_ = 0.0, last_wall_ = 0.0, prev_wall_ = 0.0;
  std::vector<double> last_losses_;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_STEP_RECORDS_H_
