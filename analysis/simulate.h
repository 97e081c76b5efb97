// `interlock simulate`: predicts step time, utilisation and idle time per
// block for every mode from a run's measured profile (profile.json), for the
// measured number of blocks or the same model cut into K blocks of equal
// cost, by replaying the schedule on the virtual clock (virtual_clock.h).
//
// Costs per block and micro-batch: forward, head (none for E2E's inner
// blocks), the parameter backward pass, and the input-gradient-only passes
// the mode needs (PipelineShape::EarlyCount). One such pass costs what the
// profile measured per pass at that block; where the profile's mode ran none
// there, it costs the calibrated share of the parameter pass the profile
// records (BlockCosts.input_share) or kInputOnlyShare of it. A parameter
// pass that also yields an upstream entry's input gradient
// (PipelineShape::Shared) costs (1 + BlockCosts.shared_extra, or
// kSharedInputShare) parameter passes.
// Per-micro-batch costs and message bytes scale by M_profile / M.
//
// Replicas (ARCHITECTURE: replicas): a block with R replicas is R tracks on the
// clock, each running the micro-batches routed to it; its reduction costs what
// the link model gives for its bytes (PipelineShape::ReductionSeconds, from the
// trained parameter counts the profile records).
#ifndef INTERLOCK_ANALYSIS_SIMULATE_H_
#define INTERLOCK_ANALYSIS_SIMULATE_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "analysis/virtual_clock.h"

namespace interlock {

// Cost of an input-gradient-only pass relative to the parameter backward
// pass, where the profile did not measure one.
inline constexpr double kInputOnlyShare = 0.5;
// Extra cost, relative to the parameter pass, of a parameter pass that also
// yields the block input's gradient, where the profile did not calibrate
// it: the parameter pass already runs the chain back to the block's first
// layers, which alone add their input gradient. Calibrated on blocks 1-3 of
// the ready K = 4 configs: 0.06-0.40 (ResNet), 0-0.10 (Transformer).
inline constexpr double kSharedInputShare = 0.25;
// Steps replayed per prediction and the warm-up excluded from the mean.
inline constexpr int64_t kSimSteps = 20;
inline constexpr int64_t kSimWarmup = 5;

// A training mode: E2E, or n-way interlocking with a rule.
struct ModeSpec {
  bool e2e = false;
  int n = 1;
  bool sum = false;  // SUM rule (FURTHEST otherwise)

  // "e2e", "2-way furthest", "2-way sum" (as `interlock train` prints it).
  std::string Label() const;
  // Folder name: "e2e", "2way", "2sum".
  std::string Dir() const;
  bool operator==(const ModeSpec& o) const {
    return e2e == o.e2e && (e2e || (n == o.n && sum == o.sum));
  }
};

// Parses a comma-separated list such as "e2e,1,2,3,2sum,3sum" (N means
// FURTHEST, Nsum the SUM rule) for a model of `blocks` blocks. Errors
// (INVALID_ARGUMENT) name the entry that is wrong.
absl::StatusOr<std::vector<ModeSpec>> ParseModes(absl::string_view list,
                                                 int blocks);

// profile.json of a run: per-block mean costs and message sizes.
struct Profile {
  std::string path;
  int blocks = 0;
  int microbatches = 1;
  int64_t batch_size = 0;
  ModeSpec mode;
  int64_t input_bytes = 0;
  std::vector<int64_t> down_bytes;  // K-1
  std::vector<int64_t> up_bytes;    // K-1
  LinkModel link;
  // The wire codecs the byte counts are of ("fp32", "bf16:int8"); empty in
  // profiles from before codecs (fp32).
  std::string wire;
  std::vector<BlockProfile> per_block;
  // Trained parameters per block; empty when the profile has none (older
  // profiles): a reduction then costs only its latency.
  std::vector<int64_t> parameters;
  // Per block, the calibrated pass ratios (BlockCosts.shared_extra and
  // input_share); -1 where the profile has none.
  std::vector<double> shared_extra;
  std::vector<double> input_share;
  std::vector<int> replicas;  // the run's (empty: one each)
  // Units per block of the run (empty in older profiles); all ones in a
  // unit profile (analysis/unit_costs.h).
  std::vector<int> partition;
  bool ring_reduction = false;
  double step_wall = 0.0;
  double step_virtual = 0.0;
};

// Reads DIR/profile.json (or the file itself when `path` names one).
// NOT_FOUND for a missing file, INVALID_ARGUMENT naming the field for a
// malformed one.
absl::StatusOr<Profile> LoadProfile(const std::string& path);

// Replicas per block for a prediction (empty: one each) and their
// reduction (RING, else ORDERED).
struct ReplicaSpec {
  std::vector<int> replicas;
  bool ring = false;
};
// The profile's own.
ReplicaSpec ProfileReplicas(const Profile& profile);

// The pipeline of `mode` with `blocks` blocks and `microbatches` micro-batches
// per step, costs taken from the profile: the measured ones when the number
// of blocks matches, else the model cut into equal blocks (parameters too).
struct ScaledPipeline {
  PipelineShape shape;
  std::vector<BlockProfile> costs;
};
ScaledPipeline ScaleProfile(const Profile& profile, int blocks,
                            int microbatches, const LinkModel& link,
                            const ModeSpec& mode,
                            const ReplicaSpec& replicas = {});

// Replays kSimSteps steps of the scaled pipeline.
SimResult PredictMode(const Profile& profile, int blocks, int microbatches,
                      const LinkModel& link, const ModeSpec& mode,
                      const ReplicaSpec& replicas = {});

// Every mode worth a row for K blocks: E2E, 1..K FURTHEST, and SUM for the
// widths where it costs something else than FURTHEST.
std::vector<ModeSpec> ModesFor(int blocks);

struct SimulateOptions {
  std::string profile;    // run folder or profile.json
  int blocks = 0;         // 0: the profile's
  int microbatches = 0;   // 0: the profile's
  bool has_mode = false;  // a mode was chosen (marked in the table)
  ModeSpec mode;
  bool sum_rule = false;    // --rule sum (sweep, chosen mode)
  double bandwidth = -1.0;  // bytes/s; < 0: the profile's link
  double latency = -1.0;    // seconds; < 0: the profile's link
  // --replicas as given (empty: the profile's when K is, else one each);
  // checked against K and M.
  std::vector<int> replicas;
  std::string reduction;  // "ordered", "ring" or empty (the profile's)
  // A cut such as "3,2,2,rest" of a unit profile's units to predict for
  // (empty: the profile's own blocks).
  std::string partition;
  bool sweep = false;
};

// Runs the command: tables on `out`, warnings and errors on `err`. Returns
// the exit code (2 for bad arguments, 1 for an unreadable profile).
int SimulateMain(const SimulateOptions& options, std::ostream& out,
                 std::ostream& err);

}  // namespace interlock

#endif  // INTERLOCK_ANALYSIS_SIMULATE_H_
