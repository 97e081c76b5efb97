// Statuses at the gRPC edge: the one conversion each way, and which codes a
// caller may retry.
#ifndef INTERLOCK_RPC_STATUS_H_
#define INTERLOCK_RPC_STATUS_H_

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace interlock {

// Both code sets follow google.rpc.Code, so the conversion is a cast. The
// message is bounded: it goes back to whoever sent the request. A failure
// marked as reported (services/failure.h) travels as the status details.
grpc::Status ToGrpcStatus(const absl::Status& s);
absl::Status FromGrpcStatus(const grpc::Status& s);

// A failed call as its caller reports it: the code the peer (or gRPC) gave,
// kept, and the message prefixed with who was called and which call, e.g.
// "worker 2 (10.0.0.7:5002): get_state failed: unknown run".
absl::Status CallFailed(absl::string_view who, absl::string_view call,
                        const grpc::Status& s);

// Whether trying again may succeed once the peer is back: it was
// unreachable, went away or timed out (UNAVAILABLE, ABORTED,
// DEADLINE_EXCEEDED, CANCELLED), or the call broke without a status of
// its own (UNKNOWN, what gRPC reports for a peer dying mid-reply). Refusals
// that name a fault in the request or the run (INVALID_ARGUMENT,
// FAILED_PRECONDITION, DATA_LOSS, UNAUTHENTICATED, ...) are final.
bool IsTransient(const absl::Status& s);

}  // namespace interlock

#endif  // INTERLOCK_RPC_STATUS_H_
