// The parts of a run that the runner, its checkpoints and its recovery share:
// the plan, the exactly-once ledger, the virtual clock, the step records,
// the evaluations so far and the training time.
#ifndef INTERLOCK_COORDINATOR_RUN_STATE_H_
#define INTERLOCK_COORDINATOR_RUN_STATE_H_

#include <chrono>
#include <vector>

#include "coordinator/ledger.h"
#include "coordinator/run_clock.h"
#include "coordinator/run_plan.h"
#include "coordinator/run_result.h"
#include "coordinator/step_records.h"

namespace interlock {

// Training time: wall time since the start plus an earlier run's time (on
// resume), evaluation excluded.
class RunTimer {
 public:
  void Start(double offset) {
    offset_ = offset;
    start_ = std::chrono::steady_clock::now();
  }
  double offset() const { return offset_; }
  double Elapsed() const {
    return offset_ + std::chrono::duration<double>(
                         std::chrono::steady_clock::now() - start_)
                         .count();
  }
  double Training() const { return Elapsed() - eval_seconds_; }
  void AddEvaluation(double seconds) { eval_seconds_ += seconds; }

 private:
  std::chrono::steady_clock::time_point start_ =
      std::chrono::steady_clock::now();
  double offset_ = 0.0;
  double eval_seconds_ = 0.0;
};

struct RunState {
  RunState(RunPlan p, LinkModel link, std::vector<int> replicas,
           CoordinatorMetrics* metrics)
      : plan(std::move(p)),
        ledger(plan.steps(), plan.blocks(), plan.microbatches()),
        clock(link, std::move(replicas)),
        records(plan, clock, metrics) {}
  // The records refer to the plan and the clock: the state stays in place.
  RunState(const RunState&) = delete;
  RunState& operator=(const RunState&) = delete;
  RunPlan plan;
  Ledger ledger;
  RunClock clock;
  StepRecords records;
  RunTimer timer;
  std::vector<EvalPoint> evals;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RUN_STATE_H_
