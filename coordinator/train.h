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
#include "coordinator/folder_lock.h"
#include "coordinator/partition.h"
#include "coordinator/run_result.h"
#include "coordinator/train_options.h"
#include "proto/config.pb.h"

namespace interlock {

// Loads the data, builds the engine and trains. Locks
// `options.out_dir` (and a separate checkpoint folder) for the whole run.
// The config is resolved once (resolved_run.h) and everything after takes
// it as given.
absl::StatusOr<TrainResult> Train(const interlock::v1::RunConfig& config,
                                  const TrainOptions& options);

// Measures a model's units for an 'auto' cut: trains the profiling config
// (resolved on its own, one unit per block) in process into the folder and
// reads back its unit profile.
UnitMeasurer UnitsByTraining();

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_TRAIN_H_
