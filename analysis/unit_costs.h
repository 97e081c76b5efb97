// Unit costs from a measured unit profile: the profile.json of a run with
// one unit per block (its `partition` is all ones), which gives what each
// unit and the head on its output cost; and the block-level profile a cut of
// those units would have. The cut itself is chosen in plan/partition.h.
#ifndef INTERLOCK_ANALYSIS_UNIT_COSTS_H_
#define INTERLOCK_ANALYSIS_UNIT_COSTS_H_

#include <vector>

#include "absl/status/statusor.h"
#include "analysis/simulate.h"
#include "plan/partition.h"

namespace interlock {

// The unit costs of a unit profile. INVALID_ARGUMENT naming the file when
// it is not one (its run had blocks of several units).
absl::StatusOr<UnitCosts> UnitCostsOf(const Profile& units);

// The block-level profile of the cut `counts` of a unit profile, as if a run
// with that partition had measured it: costs summed over each block's
// units, the head and message sizes of its last unit. `counts` must cover
// the profile's units.
Profile CutProfile(const Profile& units, const std::vector<int>& counts);

}  // namespace interlock

#endif  // INTERLOCK_ANALYSIS_UNIT_COSTS_H_
