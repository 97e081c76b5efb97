// The in-process engine: K block hosts (services/block_host.h) joined in
// memory, either all on the calling thread ("sequential", the reference's
// simulated mode) or one thread per block ("threaded").
#ifndef INTERLOCK_COORDINATOR_INPROCESS_ENGINE_H_
#define INTERLOCK_COORDINATOR_INPROCESS_ENGINE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/engine.h"
#include "coordinator/train.h"
#include "proto/config.pb.h"

namespace interlock {

// `devices`: one per block of the model.
absl::StatusOr<std::unique_ptr<Engine>> MakeInProcessEngine(
    const interlock::v1::RunConfig& config, const DataShape& shape,
    Schedule schedule, const std::vector<c10::Device>& devices);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_INPROCESS_ENGINE_H_
