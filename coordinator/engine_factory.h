// Builds the engine a run drives: the in-process chain, a local cluster of
// worker processes on loopback, or remote workers. The one place that knows
// how each is set up and torn down.
#ifndef INTERLOCK_COORDINATOR_ENGINE_FACTORY_H_
#define INTERLOCK_COORDINATOR_ENGINE_FACTORY_H_

#include <functional>
#include <iostream>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/engine.h"
#include "coordinator/local_cluster.h"
#include "coordinator/membership.h"
#include "coordinator/metrics.h"
#include "coordinator/resolved_run.h"
#include "coordinator/train_options.h"
#include "proto/config.pb.h"
#include "services/data.h"

namespace interlock {

// The engine with what it runs on. Destruction shuts the engine down and
// stops a local cluster's workers.
class RunEngine {
 public:
  ~RunEngine();
  RunEngine(const RunEngine&) = delete;
  RunEngine& operator=(const RunEngine&) = delete;

  Engine& engine() { return *engine_; }
  // The cluster's bearer token (empty: none or in-process): checkpoints
  // are signed with it.
  const std::string& seal_key() const { return seal_key_; }

 private:
  friend absl::StatusOr<std::unique_ptr<RunEngine>> MakeEngine(
      const ResolvedRun&, const DataShape&, const EngineOptions&, int,
      CoordinatorMetrics*);
  RunEngine() = default;

  std::unique_ptr<LocalCluster> local_;
  // The membership service (with --coordinator_port), outliving the engine
  // that reads it.
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<CoordinatorServer> coordinator_;
  std::unique_ptr<Engine> engine_;
  std::string seal_key_;
  std::function<void(LocalCluster*)> on_cluster_;
};

// `window`: micro-batches in flight (workers bound their queues by it);
// `metrics` (may be null) is told which workers are up; `log` hears about
// restarted workers.
absl::StatusOr<std::unique_ptr<RunEngine>> MakeEngine(
    const ResolvedRun& run, const DataShape& shape,
    const EngineOptions& options, int window, CoordinatorMetrics* metrics);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_ENGINE_FACTORY_H_
