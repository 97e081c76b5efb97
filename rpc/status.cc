#include "rpc/status.h"

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "services/failure.h"

namespace interlock {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  std::string msg(s.message());
  if (msg.size() > 4096) msg.resize(4096);
  // A reported failure travels as the status details (a trailer).
  auto failure = s.GetPayload(kFailurePayload);
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), msg,
                      failure ? std::string(*failure) : std::string());
}

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()),
                   s.error_message());
  if (!s.error_details().empty()) {
    out.SetPayload(kFailurePayload, absl::Cord(s.error_details()));
  }
  return out;
}

absl::Status CallFailed(absl::string_view who, absl::string_view call,
                        const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(
      static_cast<absl::StatusCode>(s.error_code()),
      absl::StrCat(who, ": ", call, " failed: ", s.error_message()));
}

bool IsTransient(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

}  // namespace interlock
