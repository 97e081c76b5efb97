// Replica counts per block and the routes of a step's micro-batches through
// the replicas (docs/ARCHITECTURE.md, "Replicas and membership"). On the
// ground floor because the coordinator stamps these routes, the worker
// checks its part of them and the virtual clock replays them;
// plan/topology.h builds the cluster's topology on top of it.
#ifndef INTERLOCK_PLAN_REPLICA_ROUTES_H_
#define INTERLOCK_PLAN_REPLICA_ROUTES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace interlock {

// --replicas: one count per block ("2,1,1,1"), each at least 1.
absl::StatusOr<std::vector<int>> ParseReplicas(const std::string& flag);

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

// Checks block `block`'s part of a step's routes (routes[m * K + k]), as a
// worker that knows only its own block's `replicas` and the next block's
// `next_replicas` can: M * K entries; each micro-batch on one of its
// replicas and on one of the next block's (the last block has none); every
// replica of the block with a micro-batch, or it would never reach the
// step's reduction and its peers would wait for it there. Empty routes are
// a topology without replicas here or downstream. INVALID_ARGUMENT, the
// message starting with `where`.
absl::Status CheckBlockRoutes(absl::Span<const int32_t> routes,
                              int microbatches, int num_blocks, int block,
                              int replicas, int next_replicas,
                              const std::string& where);

// Every block's part of `routes` against the whole topology `replicas`.
absl::Status CheckRoutes(absl::Span<const int32_t> routes, int microbatches,
                         const std::vector<int>& replicas,
                         const std::string& where);

}  // namespace interlock

#endif  // INTERLOCK_PLAN_REPLICA_ROUTES_H_
