// A run's results as the messages of its files (proto/report.proto), written
// by analysis/run_files.h: summary.json, eval.jsonl and --dump_params lines.
#ifndef INTERLOCK_COORDINATOR_RUN_REPORT_H_
#define INTERLOCK_COORDINATOR_RUN_REPORT_H_

#include <string>
#include <vector>

#include "coordinator/train.h"
#include "proto/config.pb.h"
#include "proto/report.pb.h"

namespace at {
class Tensor;  // torch::Tensor; LibTorch stays out of this header
}  // namespace at

namespace interlock {

// summary.json of a run of `config` over `blocks` blocks; `mode` as shown to
// people ("2-way furthest").
interlock::v1::RunSummary SummaryOf(const interlock::v1::RunConfig& config,
                                    const std::string& mode, int blocks,
                                    const TrainResult& result);

// eval.jsonl: one line per head and evaluation.
std::vector<interlock::v1::EvalLine> EvalLinesOf(
    const std::vector<EvalPoint>& evals);

// Appends the --dump_params line of one tensor (values as doubles) to `out`.
void AppendParamDump(const std::string& name, const at::Tensor& tensor,
                     std::string* out);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RUN_REPORT_H_
