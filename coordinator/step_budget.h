// How many steps a time budget buys a run: a short calibration run, then
// the virtual clock's simulator for each mode and wire codec. `compare`
// uses it for its evaluation cadence and for budget-fitted schedules (each
// mode runs the steps its budget buys, its learning-rate schedule spanning
// them), `train --fit-schedule` for one run.
#ifndef INTERLOCK_COORDINATOR_STEP_BUDGET_H_
#define INTERLOCK_COORDINATOR_STEP_BUDGET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "analysis/simulate.h"
#include "coordinator/train_options.h"
#include "proto/config.pb.h"

namespace interlock {

// One run to predict: its mode and wire codecs (the rest is the
// calibration's config).
struct BudgetRun {
  ModeSpec mode;
  interlock::v1::WireSpec wire;
};

// Steps of calibration runs.
constexpr int64_t kCalibrationSteps = 6;

// A run's mode as the simulator names it.
ModeSpec ModeOf(const interlock::v1::RunConfig& config);

// Trains `calibration` (the config of runs[0]) for kCalibrationSteps in
// `scratch_dir` (removed after) with `options`' engine, then predicts each
// run's steps within options.budget (wall and virtual time; the smaller
// when both are set), at least 1 and at most `cap`. Fails when the
// calibration does.
absl::StatusOr<std::vector<int64_t>> StepsInBudget(
    const interlock::v1::RunConfig& calibration,
    const std::vector<BudgetRun>& runs, const TrainOptions& options,
    int64_t cap, const std::string& scratch_dir);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_STEP_BUDGET_H_
