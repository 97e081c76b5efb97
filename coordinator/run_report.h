// What a run leaves behind when it ends: the digests of every block's
// parameters, and the report files in its --out folder (eval.jsonl,
// summary.json, profile.json, the timeline).
#ifndef INTERLOCK_COORDINATOR_RUN_REPORT_H_
#define INTERLOCK_COORDINATOR_RUN_REPORT_H_

#include <string>

#include "absl/status/status.h"
#include "coordinator/engine.h"
#include "coordinator/run_clock.h"
#include "coordinator/run_result.h"
#include "proto/config.pb.h"

namespace interlock {

// The mode as people read it: "e2e", "2-way furthest", "3-way sum".
std::string ModeName(const interlock::v1::RunConfig& config);

// Fills the result's per-block and overall digests from the engine's state
// (training idle) and, with `dump_params`, every parameter's values.
absl::Status DigestState(Engine& engine, bool dump_params, TrainResult& result);

// Writes eval.jsonl, summary.json (through a temporary and a rename) and,
// when this process trained any step, profile.json and the timeline. Every
// write is checked: a full disk fails the run, naming the file.
absl::Status WriteRunFiles(const interlock::v1::RunConfig& config,
                           const TrainResult& result, const RunClock& clock,
                           const std::string& out_dir);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RUN_REPORT_H_
