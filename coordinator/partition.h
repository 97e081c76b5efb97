// Balanced partitions: `partition: "auto"` in a model spec and the
// `interlock partition` command. The cut itself is plan/partition.h's
// (exact, from per-unit costs); this measures the unit costs when no unit
// profile is given: a short run of the config with one unit per block,
// 1-way (every unit then has its head and nothing crosses a boundary
// backward), in process on one thread so each operation is timed alone.
#ifndef INTERLOCK_COORDINATOR_PARTITION_H_
#define INTERLOCK_COORDINATOR_PARTITION_H_

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "analysis/simulate.h"
#include "analysis/unit_costs.h"
#include "proto/config.pb.h"

namespace interlock {

// Steps of the profiling run.
inline constexpr int64_t kProfileSteps = 8;

// Trains `profiling` (a config of one unit per block, no 'auto' cut) into
// `dir` and returns the unit profile it wrote: the service an 'auto' cut
// calls (train.h's UnitsByTraining).
using UnitMeasurer = std::function<absl::StatusOr<Profile>(
    const interlock::v1::RunConfig& profiling, const std::string& dir)>;

// A balanced cut and what it was chosen from.
struct PartitionChoice {
  std::vector<int> counts;
  std::vector<double> block_costs;  // seconds per micro-batch
  UnitCosts unit_costs;
  Profile units;       // the unit profile
  std::string source;  // where the unit costs came from, for people
};

// The balanced cut of `config`'s model into `blocks` blocks, from the unit
// profile at `profile` (a folder or profile.json) when given, else from a
// profiling run `measure` writes to `dir` (empty: a temporary folder,
// removed after). Errors name what is wrong: K, the profile, the model.
absl::StatusOr<PartitionChoice> ChoosePartition(
    const interlock::v1::RunConfig& config, int blocks,
    const std::string& profile, const std::string& dir,
    const UnitMeasurer& measure);

// When config.model.partition is "auto": replaces it with the balanced cut
// into model.blocks blocks, from model.partition_profile or a profiling run
// in `dir` (as ChoosePartition), and logs it. Otherwise does
// nothing.
absl::Status ResolveAutoPartition(interlock::v1::RunConfig& config,
                                  const std::string& dir,
                                  const UnitMeasurer& measure);

struct PartitionCommand {
  std::string config_path;
  int blocks = 0;
  std::string profile;  // a unit profile; empty: measure
  std::string out_dir;  // keeps the profiling run (DIR/units); may be empty
  LinkModel link;
};

// `interlock partition`: the cut, the block costs and the step time the
// simulator predicts per mode on `out`; errors on `err`. Returns the exit
// code (2 for bad arguments, 1 for any other failure).
int PartitionMain(const PartitionCommand& command, const UnitMeasurer& measure,
                  std::ostream& out, std::ostream& err);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_PARTITION_H_
