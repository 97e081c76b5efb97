// The files a run writes, through their one schema (proto/report.proto) and
// protobuf's JSON utilities: metrics.jsonl and eval.jsonl (one compact JSON
// object a line), summary.json and profile.json (indented). Keys are the
// proto field names; see report.proto for the number types and non-finite
// values. Readers ignore keys they do not know (files of newer versions).
#ifndef INTERLOCK_ANALYSIS_RUN_FILES_H_
#define INTERLOCK_ANALYSIS_RUN_FILES_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/report.pb.h"

namespace interlock {

// One JSON line (no newline) of a message: a metrics.jsonl or eval.jsonl
// line, or a --dump_params tensor.
std::string JsonLine(const google::protobuf::Message& message);
// A message from one JSON object; INVALID_ARGUMENT with protobuf's reason.
absl::Status ParseJson(absl::string_view json,
                       google::protobuf::Message* message);

// A metrics.jsonl line (JsonLine writes one).
absl::StatusOr<interlock::v1::MetricsLine> ParseMetricsLine(
    absl::string_view json);

// Every line of a JSON-lines file; DATA_LOSS naming the path and line for
// one that is not a `Line`, NOT_FOUND for a missing file.
absl::StatusOr<std::vector<interlock::v1::MetricsLine>> ReadMetrics(
    const std::string& path);
absl::StatusOr<std::vector<interlock::v1::EvalLine>> ReadEval(
    const std::string& path);

// Keeps the lines of metrics.jsonl whose step satisfies `keep`, as written
// (the file is rewritten through a temporary and a rename). Lines that are
// not a metrics line (cut short by a crash) are dropped. A missing file is
// fine; one that is not a regular file (a device, a folder) is refused.
absl::Status CutMetricsLines(const std::string& path,
                             const std::function<bool(int64_t)>& keep);

// eval.jsonl, one line per element.
absl::Status WriteEval(const std::string& path,
                       const std::vector<interlock::v1::EvalLine>& lines);

// summary.json, written to PATH.tmp and renamed, so a reader never sees half
// of it.
absl::Status WriteSummary(const std::string& path,
                          const interlock::v1::RunSummary& summary);
// NOT_FOUND for a file that cannot be read, INVALID_ARGUMENT naming the path
// for one that does not parse as a summary.
absl::StatusOr<interlock::v1::RunSummary> ReadSummary(const std::string& path);

absl::Status WriteProfileFile(const std::string& path,
                              const interlock::v1::RunProfile& profile);
// NOT_FOUND for a file that cannot be read, INVALID_ARGUMENT ("not a JSON
// object ...") for one that does not parse as a profile.
absl::StatusOr<interlock::v1::RunProfile> ReadProfileFile(
    const std::string& path);

}  // namespace interlock

#endif  // INTERLOCK_ANALYSIS_RUN_FILES_H_
