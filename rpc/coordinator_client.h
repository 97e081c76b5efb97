// A worker's calls to the coordinator's membership service (ARCHITECTURE:
// replicas): join a block's replicas when started with --coordinator, leave on
// SIGTERM.
#ifndef INTERLOCK_RPC_COORDINATOR_CLIENT_H_
#define INTERLOCK_RPC_COORDINATOR_CLIENT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/worker.pb.h"
#include "rpc/security.h"

namespace interlock {

// Register, retried while the coordinator is unreachable (it may start
// after the worker) until `deadline`; a refusal is returned at once.
absl::StatusOr<interlock::v1::RegisterResponse> RegisterWithCoordinator(
    const std::string& coordinator, const TransportSecurity& security,
    const interlock::v1::RegisterRequest& request, absl::Time deadline);

// Leave: returns once the coordinator took `address` out of the topology
// (the generation without it).
absl::StatusOr<int64_t> LeaveCoordinator(const std::string& coordinator,
                                         const TransportSecurity& security,
                                         const std::string& address,
                                         absl::Time deadline);

}  // namespace interlock

#endif  // INTERLOCK_RPC_COORDINATOR_CLIENT_H_
