#include "analysis/unit_costs.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace interlock {

absl::StatusOr<UnitCosts> UnitCostsOf(const Profile& p) {
  if (p.partition.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        p.path,
        ": records no partition (a profile from before unit costs); measure "
        "one with `interlock partition --config C --blocks K --out DIR`"));
  }
  for (int c : p.partition) {
    if (c != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          p.path, ": a run with partition ", PartitionString(p.partition),
          ", not one unit per block, so it holds no unit costs; give the "
          "unit profile of `interlock partition --out DIR` (DIR/units/) or "
          "of a run with partition \"auto\""));
    }
  }
  if (!p.mode.e2e && p.mode.n != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        p.path,
        ": a unit profile must come from a 1-way or E2E run (its "
        "backward passes then cost what they cost in any cut), not ",
        p.mode.Label()));
  }
  UnitCosts out;
  for (const BlockProfile& b : p.per_block) {
    out.unit.push_back(b.forward + b.backward + b.optimizer / p.microbatches);
    out.head.push_back(b.head);
  }
  return out;
}

Profile CutProfile(const Profile& units, const std::vector<int>& counts) {
  Profile out = units;
  out.blocks = static_cast<int>(counts.size());
  out.partition = counts;
  out.per_block.clear();
  out.parameters.clear();
  out.down_bytes.clear();
  out.up_bytes.clear();
  out.replicas.clear();
  size_t next = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    BlockProfile b;
    int64_t parameters = 0;
    for (int i = 0; i < counts[k]; ++i, ++next) {
      const BlockProfile& u = units.per_block[next];
      b.forward += u.forward;
      b.backward += u.backward;
      b.optimizer += u.optimizer;
      b.input_grad += std::max(0.0, u.input_grad);
      if (!units.parameters.empty()) parameters += units.parameters[next];
    }
    b.head = units.per_block[next - 1].head;
    out.per_block.push_back(b);
    if (!units.parameters.empty()) out.parameters.push_back(parameters);
    if (k + 1 < counts.size()) {
      out.down_bytes.push_back(units.down_bytes[next - 1]);
      out.up_bytes.push_back(units.up_bytes[next - 1]);
    }
  }
  return out;
}

}  // namespace interlock
