// Partitions of a model's units into blocks (ARCHITECTURE: balanced
// partitions): parsing partition strings such as "3,2,2,rest", and choosing a
// balanced cut from measured unit costs (`partition: "auto"`, `interlock
// partition`).
//
// A unit is the stem / embedding, one residual block / decoder layer /
// hidden layer, the classifier, or one TorchScript unit of a scripted model.
// A block of units i..j costs the sum of its units' costs plus the cost of
// the head on unit j's output (the auxiliary head, or the model's own loss
// for the last block). Unit costs come from a unit profile
// (analysis/unit_costs.h).
//
// Pure logic: no LibTorch, no gRPC, no protobuf.
#ifndef INTERLOCK_PLAN_PARTITION_H_
#define INTERLOCK_PLAN_PARTITION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace interlock {

// The partition value that asks for a balanced cut.
inline constexpr char kAutoPartition[] = "auto";

// Parses a partition string such as "1,2,2,rest" over `units` units into K
// unit counts. An empty string splits evenly into `blocks` blocks; with a
// string, `blocks` > 0 must equal its count. Errors name model.partition
// or model.blocks.
absl::StatusOr<std::vector<int>> ParsePartition(const std::string& partition,
                                                int units, int blocks);

// "2,3,1".
std::string PartitionString(const std::vector<int>& counts);

// Per-unit costs, seconds per micro-batch: `unit[u]` is what unit u costs
// in any block (forward, backward, its share of the optimizer step),
// `head[u]` what a block ending at unit u pays for its head.
struct UnitCosts {
  std::vector<double> unit;
  std::vector<double> head;
};

// The cost of every block of the cut `counts`.
std::vector<double> BlockCosts(const UnitCosts& costs,
                               const std::vector<int>& counts);

// The contiguous cut into `blocks` blocks whose most expensive block costs
// least (exact: dynamic programming over all cuts). Among cuts with that
// maximum it takes the one with the least sum of squared block costs (the
// other blocks as even as they can be), then the first in lexicographic
// order of counts. INVALID_ARGUMENT for blocks < 1, more blocks than units,
// mismatched sizes or a negative or non-finite cost.
absl::StatusOr<std::vector<int>> BalancedPartition(const UnitCosts& costs,
                                                   int blocks);

}  // namespace interlock

#endif  // INTERLOCK_PLAN_PARTITION_H_
