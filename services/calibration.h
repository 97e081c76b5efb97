// When a block calibrates its backward passes: the virtual clock needs the
// cost of a parameter-only, a shared and an input-only pass (profile.json),
// so a few micro-batches run all three extra (services/trainer.cc). Anything
// that times steady steps (train --profile-ops) starts after them.
#ifndef INTERLOCK_SERVICES_CALIBRATION_H_
#define INTERLOCK_SERVICES_CALIBRATION_H_

#include <cstdint>

namespace interlock {

// Micro-batches kCalibrateAfter .. kCalibrateAfter + kCalibrations - 1 that a
// block (other than block 0) trains in this process are calibrated; the first
// ones are left out (allocations, cold caches).
inline constexpr int64_t kCalibrateAfter = 4;
inline constexpr int64_t kCalibrations = 3;

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_CALIBRATION_H_
