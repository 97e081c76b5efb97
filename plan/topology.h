// The cluster's topology (ARCHITECTURE: replicas): which worker hosts which
// replica of which block. The one place that parses --workers; --replicas and
// the routes of each step's micro-batches through the replicas are in
// plan/replica_routes.h (shared with the virtual clock).
#ifndef INTERLOCK_PLAN_TOPOLOGY_H_
#define INTERLOCK_PLAN_TOPOLOGY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "plan/replica_routes.h"

namespace interlock {

// Worker addresses by block, then replica.
using Topology = std::vector<std::vector<std::string>>;

// --workers: blocks in order, separated by ','; the replicas of a block by
// '+' (e.g. "a:1+a:2,b:1,c:1"). Empty addresses, a repeated address and
// empty blocks are errors naming the flag.
absl::StatusOr<Topology> ParseWorkers(const std::string& flag);

// One replica per block at these addresses.
Topology OnePerBlock(const std::vector<std::string>& addresses);

// Replica counts of a topology.
std::vector<int> ReplicaCounts(const Topology& t);

}  // namespace interlock

#endif  // INTERLOCK_PLAN_TOPOLOGY_H_
