// What a run leaves behind when it ends: the digests of every block's
// parameters, and its files in --out as the messages of proto/report.proto
// (written by analysis/run_files.h): eval.jsonl, summary.json, --dump_params
// lines, profile.json and the timeline.
#ifndef INTERLOCK_COORDINATOR_RUN_REPORT_H_
#define INTERLOCK_COORDINATOR_RUN_REPORT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/engine.h"
#include "coordinator/run_clock.h"
#include "coordinator/run_result.h"
#include "proto/config.pb.h"
#include "proto/report.pb.h"

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

// summary.json of a run of `config` over `blocks` blocks; `mode` as shown to
// people ("2-way furthest").
interlock::v1::RunSummary SummaryOf(const interlock::v1::RunConfig& config,
                                    const std::string& mode, int blocks,
                                    const TrainResult& result);

// eval.jsonl: one line per head and evaluation.
std::vector<interlock::v1::EvalLine> EvalLinesOf(
    const std::vector<EvalPoint>& evals);

// Appends the --dump_params line of one tensor (values as doubles) to `out`.
void AppendParamDump(const std::string& name, const torch::Tensor& tensor,
                     std::string* out);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RUN_REPORT_H_
