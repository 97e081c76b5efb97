#include "coordinator/resolved_run.h"

#include "absl/strings/str_cat.h"
#include "plan/replica_routes.h"
#include "plan/status_macros.h"
#include "plan/topology.h"
#include "services/config.h"
#include "services/device.h"
#include "services/models.h"

namespace interlock {

absl::StatusOr<ResolvedRun> ResolveRun(const v1::RunConfig& config_in,
                                       const EngineOptions& engine,
                                       const std::string& units_dir,
                                       const UnitMeasurer& measure) {
  v1::RunConfig config = config_in;
  ApplyDefaults(config);
  // The spec the workers are sent describes the model on its own (a
  // scripted model's manifest), read once here.
  RETURN_IF_ERROR(ResolveModelSpec(config.mutable_model()));
  RETURN_IF_ERROR(ValidateRunConfig(config));
  RETURN_IF_ERROR(ResolveAutoPartition(config, units_dir, measure));
  ASSIGN_OR_RETURN(const int k, NumBlocks(config.model()));
  ASSIGN_OR_RETURN(WireCodec codec, WireCodec::ForRun(config));
  ResolvedRun run{std::move(config), k, std::move(codec), {}, {}};
  const int m = run.config.training().microbatches();

  const bool cluster = engine.kind == EngineKind::kCluster;
  const bool remote = cluster && !engine.workers.empty();
  if (remote && !engine.devices.empty()) {
    return absl::InvalidArgumentError(
        "--device: remote workers run their blocks where their own --device "
        "says; it applies in process and to a local cluster only");
  }
  if (remote && !engine.replicas.empty()) {
    return absl::InvalidArgumentError(
        "--replicas: with --workers, list each block's replicas there "
        "(A1+A2,B,...)");
  }
  if (remote) {
    if (static_cast<int>(engine.workers.size()) != k) {
      return absl::InvalidArgumentError(
          absl::StrCat("--workers: ", engine.workers.size(),
                       " blocks of addresses for a model of ", k, " blocks"));
    }
    run.replicas = ReplicaCounts(engine.workers);
    RETURN_IF_ERROR(CheckReplicas(run.replicas, k, m, "--workers"));
  } else {
    run.replicas = engine.replicas;
    if (run.replicas.empty()) run.replicas.assign(k, 1);
    RETURN_IF_ERROR(CheckReplicas(run.replicas, k, m, "--replicas"));
    ASSIGN_OR_RETURN(run.devices, BlockDevices("--device", engine.devices, k));
  }
  return run;
}

}  // namespace interlock
