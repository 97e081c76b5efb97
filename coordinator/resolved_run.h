// A run resolved once: its config with defaults applied, the model spec
// completed from its files (a scripted model's manifest), validated, an
// 'auto' cut chosen, and what follows from it (the blocks, the wire codec,
// each block's replicas and device) checked against the engine's flags.
// The engines, the runner, the virtual clock and the reports take it as
// given and check none of it again.
#ifndef INTERLOCK_COORDINATOR_RESOLVED_RUN_H_
#define INTERLOCK_COORDINATOR_RESOLVED_RUN_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/partition.h"
#include "coordinator/train_options.h"
#include "proto/config.pb.h"
#include "services/wire_codec.h"

namespace interlock {

struct ResolvedRun {
  interlock::v1::RunConfig config;
  int blocks = 0;
  WireCodec codec;
  // Replicas of each block: the --workers topology's counts, --replicas
  // (a local cluster's processes, or what the in-process clock models), or
  // one each.
  std::vector<int> replicas;
  // Each block's device (in process and a local cluster's workers); empty
  // for remote workers, which choose their own.
  std::vector<c10::Device> devices;
};

// `units_dir`: where an 'auto' cut's profiling run writes (empty: a
// temporary folder); `measure` runs it.
absl::StatusOr<ResolvedRun> ResolveRun(const interlock::v1::RunConfig& config,
                                       const EngineOptions& engine,
                                       const std::string& units_dir,
                                       const UnitMeasurer& measure);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RESOLVED_RUN_H_
