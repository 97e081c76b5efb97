// Channels and servers as both services set them up: explicit message
// limits, keepalive, and the transport security of rpc/security.
#ifndef INTERLOCK_RPC_CHANNEL_H_
#define INTERLOCK_RPC_CHANNEL_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "rpc/security.h"

namespace interlock {

// Keepalive: a dead or frozen peer is noticed within about
// kKeepaliveTimeMs + kKeepaliveTimeoutMs, not after TCP's minutes.
constexpr int kKeepaliveTimeMs = 1000;
constexpr int kKeepaliveTimeoutMs = 2000;

// A channel to one peer with explicit message limits and keepalive, TLS when
// `security` has certificates, and the bearer token on every call when it
// has one.
std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address, int64_t max_message_bytes,
    const TransportSecurity& security = {});

// gRPC wants an IPv6 literal in brackets before ":port"; getaddrinfo (the
// metrics exposer) wants it without.
std::string Unbracketed(const std::string& host);
// "host:port" for a gRPC listening port, bracketing an IPv6 literal.
std::string GrpcAddress(const std::string& host, int port);

// The health service a worker answers SERVING from start to shutdown,
// configured or not (the name Kubernetes' liveness probe asks for).
constexpr char kLivenessService[] = "liveness";

// grpc.health.v1.Health/Check of `service` ("" for the server as a whole)
// over `channel`: the ServingStatus the server answers (1 = SERVING), or the
// call's error. A real call, so a peer that died is noticed even while the
// channel still looks connected.
absl::StatusOr<int> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                const std::string& service,
                                absl::Time deadline);

// Server-side limits and keepalive policy. A compressed message is held to
// the same limit once inflated.
void ConfigureServerBuilder(grpc::ServerBuilder& builder,
                            int64_t max_message_bytes);

// A server of one `service` on host:`port` (0: a free one, written to
// `*bound`) with ConfigureServerBuilder's limits and `security`'s
// credentials; never sharing a port with another process (no
// SO_REUSEPORT). UNAVAILABLE naming `what` and the address when it cannot
// listen.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(
    grpc::Service* service, const std::string& host, int port,
    const TransportSecurity& security, int64_t max_message_bytes,
    const std::string& what, int* bound);

}  // namespace interlock

#endif  // INTERLOCK_RPC_CHANNEL_H_
