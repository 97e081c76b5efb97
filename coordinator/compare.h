// `interlock compare`: trains several modes of one config on the same data
// order and seed, each into DIR/<mode>/ (with several wire codecs, every
// mode with each: DIR/<mode>-<codecs>/; with several seeds, every mode once
// per seed: DIR/<mode>-seed<S>/), then has the report and plots written
// from their run files (analysis/compare_report.h).
#ifndef INTERLOCK_COORDINATOR_COMPARE_H_
#define INTERLOCK_COORDINATOR_COMPARE_H_

#include <atomic>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/train.h"

namespace interlock {

struct CompareOptions {
  std::string config_path;
  std::string modes;  // "e2e,1,2,2sum" (see ParseModes)
  // Wire codecs, each run with every mode: "fp32,bf16,int8" (see
  // ParseWireName); empty: the config's codecs, and rows named by mode only.
  std::string wire;
  std::string out_dir;
  int64_t steps = -1;  // >= 0 overrides the config's steps
  int64_t seed = -1;   // >= 0 overrides the config's seed
  // "1,2,3": every mode once per seed (instead of `seed`); the report adds
  // each mode's mean and standard deviation over them. Empty: one run per
  // mode.
  std::string seeds;
  int threads_per_block = 0;
  // With a budget: each mode's learning-rate schedule spans the steps the
  // budget buys it (predicted from a calibration run), and the mode runs
  // exactly those steps, so every mode warms up and anneals within its own
  // budget and none is cut short by the config's steps or epochs. False:
  // every mode runs the config's schedule and stops at the budget.
  bool fit_schedule = true;
  // Engine, schedule, budgets, link model, progress and cluster settings of
  // every mode's run; out_dir and progress_label are set per mode.
  TrainOptions train;
  // As typed, for the report.
  std::string command_line;
  // Set by a signal handler: no further mode is started.
  const std::atomic<bool>* interrupted = nullptr;
};

// Parses --seeds ("1,2,3"): integers >= 0, none twice. Errors
// (INVALID_ARGUMENT) name the entry.
absl::StatusOr<std::vector<int64_t>> ParseSeeds(absl::string_view list);

// Runs the command; progress and errors go to options.train.log. Returns the
// exit code: 0, 2 for bad arguments, 1 for any other failure (a failed mode
// or plot; the report is still written when at least the runs were tried).
int CompareMain(const CompareOptions& options);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_COMPARE_H_
