#include "rpc/status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace interlock {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  std::string msg(s.message());
  if (msg.size() > 4096) msg.resize(4096);
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), msg);
}

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      s.error_message());
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
