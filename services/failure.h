// A failure already reported to the coordinator, carried on the status that
// ends a stream. Block k reports what it saw on its control stream and ends
// its incoming stream with that status marked; block k-1 then stops without
// a second report that would blame block k, and the coordinator can name the
// culprit from its own stream's end whichever arrives first. The gRPC edge
// (rpc/status) carries the mark as the status details.
#ifndef INTERLOCK_SERVICES_FAILURE_H_
#define INTERLOCK_SERVICES_FAILURE_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "proto/worker.pb.h"

namespace interlock {

inline constexpr char kFailurePayload[] =
    "type.googleapis.com/interlock.v1.Failure";

// `f` as a status: its code, "block B (address): message", and the mark.
inline absl::Status ReportedStatus(const interlock::v1::Failure& f) {
  absl::Status s(
      static_cast<absl::StatusCode>(f.code()),
      absl::StrCat("block ", f.block(),
                   f.address().empty() ? "" : " (" + f.address() + ")", ": ",
                   f.message()));
  if (s.ok()) s = absl::UnknownError(s.message());
  s.SetPayload(kFailurePayload, absl::Cord(f.SerializeAsString()));
  return s;
}

// The failure a status carries, if it is marked as reported.
inline std::optional<interlock::v1::Failure> ReportedFailure(
    const absl::Status& s) {
  auto payload = s.GetPayload(kFailurePayload);
  if (!payload) return std::nullopt;
  interlock::v1::Failure f;
  if (!f.ParseFromString(std::string(*payload))) return std::nullopt;
  return f;
}

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_FAILURE_H_
