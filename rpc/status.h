// gRPC edge helpers shared by both services: status conversion, channel and
// server arguments (message limits, keepalive).
#ifndef INTERLOCK_RPC_STATUS_H_
#define INTERLOCK_RPC_STATUS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "rpc/security.h"

namespace interlock {

// Both code sets follow google.rpc.Code, so the conversion is a cast.
inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  std::string msg(s.message());
  if (msg.size() > 4096) msg.resize(4096);
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), msg);
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      s.error_message());
}

// Keepalive: a dead or frozen peer is noticed within about
// kKeepaliveTimeMs + kKeepaliveTimeoutMs, not after TCP's minutes.
constexpr int kKeepaliveTimeMs = 2000;
constexpr int kKeepaliveTimeoutMs = 3000;

// A channel to one peer with explicit message limits and keepalive, TLS when
// `security` has certificates, and the bearer token on every call when it
// has one.
std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address, int64_t max_message_bytes,
    const TransportSecurity& security = {});

// Server-side limits and keepalive policy. A compressed message is held to
// the same limit once inflated.
void ConfigureServerBuilder(grpc::ServerBuilder& builder,
                            int64_t max_message_bytes);

}  // namespace interlock

#endif  // INTERLOCK_RPC_STATUS_H_
