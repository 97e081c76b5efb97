// The in-process engine: K block hosts (services/block_host.h) joined in
// memory, either all on the calling thread ("sequential", the reference's
// simulated mode) or one thread per block ("threaded").
#ifndef INTERLOCK_COORDINATOR_INPROCESS_ENGINE_H_
#define INTERLOCK_COORDINATOR_INPROCESS_ENGINE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/engine.h"
#include "coordinator/resolved_run.h"
#include "coordinator/train.h"
#include "proto/config.pb.h"

namespace interlock {

// Each block on `run.devices`' device.
absl::StatusOr<std::unique_ptr<Engine>> MakeInProcessEngine(
    const ResolvedRun& run, const DataShape& shape, Schedule schedule);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_INPROCESS_ENGINE_H_
