#include "analysis/run_files.h"

#include <google/protobuf/util/json_util.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "analysis/checked_write.h"
#include "plan/status_macros.h"

namespace interlock {
namespace {

namespace fs = std::filesystem;
using interlock::v1::EvalLine;
using interlock::v1::MetricsLine;
using interlock::v1::RunProfile;
using interlock::v1::RunSummary;

// Every field is printed, zeros and empty lists included: the keys of a file
// do not depend on its values.
std::string ToJson(const google::protobuf::Message& message, bool indent) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = indent;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  // Printing a message of a linked-in type cannot fail.
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return text.str();
}

template <typename Line>
absl::StatusOr<std::vector<Line>> ReadLines(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::vector<Line> out;
  std::string text;
  for (int64_t number = 1; std::getline(in, text); ++number) {
    if (text.empty()) continue;
    Line line;
    if (auto st = ParseJson(text, &line); !st.ok()) {
      return absl::DataLossError(
          absl::StrCat(path, ":", number, ": ", st.message()));
    }
    out.push_back(std::move(line));
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return out;
}

// A whole file of one JSON object; INVALID_ARGUMENT naming the path for one
// that is not a `Message`.
template <typename Message>
absl::StatusOr<Message> ReadJsonFile(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string text, ReadText(path));
  Message message;
  if (auto st = ParseJson(text, &message); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", st.message()));
  }
  return message;
}

}  // namespace

std::string JsonLine(const google::protobuf::Message& message) {
  return ToJson(message, /*indent=*/false);
}

absl::Status ParseJson(absl::string_view json,
                       google::protobuf::Message* message) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  const auto st = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), message,
      options);
  if (!st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a JSON object of ", message->GetDescriptor()->name(),
                     " fields (", st.message().as_string(), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<MetricsLine> ParseMetricsLine(absl::string_view json) {
  MetricsLine line;
  RETURN_IF_ERROR(ParseJson(json, &line));
  return line;
}

absl::StatusOr<std::vector<MetricsLine>> ReadMetrics(const std::string& path) {
  return ReadLines<MetricsLine>(path);
}

absl::StatusOr<std::vector<EvalLine>> ReadEval(const std::string& path) {
  return ReadLines<EvalLine>(path);
}

absl::Status CutMetricsLines(const std::string& path,
                             const std::function<bool(int64_t)>& keep) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return absl::OkStatus();
  // A device would be read forever (/dev/zero) or not at all.
  if (!fs::is_regular_file(path, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": not a regular file; cannot continue it"));
  }
  std::ifstream in(path);
  if (!in) {
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot be read"));
  }
  std::string out;
  std::string text;
  while (std::getline(in, text)) {
    auto line = ParseMetricsLine(text);
    // Lines cut short by a crash are dropped.
    if (!line.ok()) continue;
    if (keep(static_cast<int64_t>(line->step()))) {
      absl::StrAppend(&out, text, "\n");
    }
  }
  if (in.bad()) {
    return absl::DataLossError(absl::StrCat(path, ": read error"));
  }
  return WriteFileReplacing(path, out);
}

absl::Status WriteEval(const std::string& path,
                       const std::vector<EvalLine>& lines) {
  std::string text;
  for (const EvalLine& line : lines)
    absl::StrAppend(&text, JsonLine(line), "\n");
  return WriteFileChecked(path, text);
}

absl::Status WriteSummary(const std::string& path, const RunSummary& summary) {
  return WriteFileReplacing(path, ToJson(summary, /*indent=*/true) + "\n");
}

absl::StatusOr<RunSummary> ReadSummary(const std::string& path) {
  return ReadJsonFile<RunSummary>(path);
}

absl::Status WriteProfileFile(const std::string& path,
                              const RunProfile& profile) {
  return WriteFileChecked(path, ToJson(profile, /*indent=*/true) + "\n");
}

absl::StatusOr<RunProfile> ReadProfileFile(const std::string& path) {
  return ReadJsonFile<RunProfile>(path);
}

}  // namespace interlock
