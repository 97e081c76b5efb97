// Test-set evaluation through every head of the chain.
#ifndef INTERLOCK_COORDINATOR_EVALUATION_H_
#define INTERLOCK_COORDINATOR_EVALUATION_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/engine.h"
#include "coordinator/metrics.h"
#include "coordinator/run_result.h"
#include "services/data.h"

namespace interlock {

// Runs `test` through the chain in batches of `batch_size` (training must be
// idle) and returns each head's mean loss and accuracy (and perplexity for
// text), aux heads first. `metrics` (may be null) gets each head's figures.
absl::StatusOr<std::vector<HeadResult>> EvaluateHeads(
    Engine& engine, const Dataset& test, int64_t batch_size, bool text,
    CoordinatorMetrics* metrics);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_EVALUATION_H_
