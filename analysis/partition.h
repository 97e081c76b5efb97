// Partitions of a model's units into blocks (DESIGN §3): parsing partition
// strings such as "3,2,2,rest", and choosing a balanced cut from measured
// unit costs (`partition: "auto"`, `interlock partition`).
//
// A unit is the stem / embedding, one residual block / decoder layer /
// hidden layer, or the classifier. A block of units i..j costs the sum of
// its units' costs plus the cost of the head on unit j's output (the
// auxiliary head, or the model's own loss for the last block). A unit
// profile is the profile.json of a run with one unit per block (its
// `partition` is all ones), which gives both per unit.
//
// No LibTorch and no gRPC here.
#ifndef INTERLOCK_ANALYSIS_PARTITION_H_
#define INTERLOCK_ANALYSIS_PARTITION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "analysis/simulate.h"

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

// The unit costs of a unit profile. INVALID_ARGUMENT naming the file when
// it is not one (its run had blocks of several units).
absl::StatusOr<UnitCosts> UnitCostsOf(const Profile& units);

// The block-level profile of the cut `counts` of a unit profile, as if a run
// with that partition had measured it: costs summed over each block's
// units, the head and message sizes of its last unit. `counts` must cover
// the profile's units.
Profile CutProfile(const Profile& units, const std::vector<int>& counts);

}  // namespace interlock

#endif  // INTERLOCK_ANALYSIS_PARTITION_H_
