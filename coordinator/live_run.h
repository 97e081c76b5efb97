// A run's live workers as a coordinator started again adopts them
// (docs/RELIABILITY.md: the coordinator can die too): the run's id, the
// generation to configure them under, the topology and the step boundary
// whose snapshots they continue from.
#ifndef INTERLOCK_COORDINATOR_LIVE_RUN_H_
#define INTERLOCK_COORDINATOR_LIVE_RUN_H_

#include <cstdint>
#include <string>

#include "plan/topology.h"

namespace interlock {

struct LiveRun {
  std::string run_id;
  int64_t generation = 0;
  Topology workers;
  int64_t step = 0;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_LIVE_RUN_H_
