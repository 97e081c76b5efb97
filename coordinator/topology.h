// The cluster's topology (DESIGN §2.4): which worker hosts which replica of
// which block, and how each step's micro-batches are routed through the
// replicas. The one place that parses --workers and --replicas and that
// chooses routes.
#ifndef INTERLOCK_COORDINATOR_TOPOLOGY_H_
#define INTERLOCK_COORDINATOR_TOPOLOGY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace interlock {

// Worker addresses by block, then replica.
using Topology = std::vector<std::vector<std::string>>;

// --workers: blocks in order, separated by ','; the replicas of a block by
// '+' (e.g. "a:1+a:2,b:1,c:1"). Empty addresses, a repeated address and
// empty blocks are errors naming the flag.
absl::StatusOr<Topology> ParseWorkers(const std::string& flag);

// One replica per block at these addresses.
Topology OnePerBlock(const std::vector<std::string>& addresses);

// --replicas: one count per block ("2,1,1,1"), each at least 1.
absl::StatusOr<std::vector<int>> ParseReplicas(const std::string& flag);

// Replica counts of a topology.
std::vector<int> ReplicaCounts(const Topology& t);
// Whether some block has more than one replica.
bool Replicated(const std::vector<int>& replicas);

// Checks replica counts against a run: one count per block, and no more
// replicas of a block than micro-batches per step (each replica runs at
// least one micro-batch of every step, or it would never reach the step's
// reduction).
// Errors start with `what` (the flag the counts came from).
absl::Status CheckReplicas(const std::vector<int>& replicas, int num_blocks,
                           int microbatches,
                           const std::string& what = "replicas");

// The routes of one step: routes[m * K + k] is the replica of block k that
// runs micro-batch m. Each block's M micro-batches are split over its
// replicas in proportion to `weights[k]` (empty: equal), every replica
// getting at least one, and interleaved; the replica that takes an extra
// micro-batch rotates with the step. Deterministic: a function of its
// arguments only.
std::vector<int32_t> RouteStep(
    int64_t step, int microbatches, const std::vector<int>& replicas,
    const std::vector<std::vector<double>>& weights = {});

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_TOPOLOGY_H_
