// What a run leaves about its virtual clock: the per-block profile that
// `interlock simulate` predicts from, and the pipeline timeline (Chrome trace
// events and a Gantt picture) that shows where each block worked or waited.
#ifndef INTERLOCK_ANALYSIS_TIMELINE_H_
#define INTERLOCK_ANALYSIS_TIMELINE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "analysis/virtual_clock.h"

namespace interlock {

struct RunInfo {
  std::string name;
  std::string mode;  // as shown to people, e.g. "2-way furthest"
  bool e2e = false;
  int n = 1;
  bool sum_rule = false;
  int batch_size = 0;
  std::string wire;            // RunProfile.wire
  std::vector<int> partition;  // units per block (empty: not known)
  int64_t steps = 0;
  double mean_step_wall = 0.0;
  double mean_step_virtual = 0.0;
  // Per block, the calibrated pass ratios (RunClock::SharedExtra and
  // InputShare); a block beyond them or with -1 has none.
  std::vector<double> shared_extra;
  std::vector<double> input_share;
};

// profile.json: per-block mean durations (per micro-batch; optimizer per
// step and replica; the first step left out when there are more), trained
// parameters, link bytes and model, and the
// run's mean step times.
absl::Status WriteProfile(const PipelineSim& sim, const RunInfo& info,
                          const std::string& path);

// DIR/timeline.json (Chrome trace event format: one track per block, or
// per replica where a block has several; spans for forward, head, backward,
// optimizer, reduction and waiting) over the kept steps, and
// DIR/timeline.png (gnuplot) over a few steps after the first.
absl::Status WriteTimeline(const PipelineSim& sim, const RunInfo& info,
                           const std::string& dir);

// A gnuplot string literal.
std::string GnuplotQuote(const std::string& s);

// Runs gnuplot on a script; the error names gnuplot's exit and output.
absl::Status RunGnuplot(const std::string& script_path);

}  // namespace interlock

#endif  // INTERLOCK_ANALYSIS_TIMELINE_H_
