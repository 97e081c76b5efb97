#include "rpc/coordinator_client.h"

#include <algorithm>
#include <thread>

#include "proto/worker.grpc.pb.h"
#include "rpc/channel.h"
#include "rpc/status.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

constexpr int64_t kMaxBytes = 1 << 20;

}  // namespace

absl::StatusOr<v1::RegisterResponse> RegisterWithCoordinator(
    const std::string& coordinator, const TransportSecurity& security,
    const v1::RegisterRequest& request, absl::Time deadline) {
  auto stub =
      v1::Coordinator::NewStub(MakeChannel(coordinator, kMaxBytes, security));
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(
        std::min(deadline, absl::Now() + absl::Seconds(10))));
    ctx.set_wait_for_ready(true);
    v1::RegisterResponse response;
    const grpc::Status s = stub->Register(&ctx, request, &response);
    if (s.ok()) return response;
    const absl::Status status = FromGrpcStatus(s);
    // Unreachable, or reachable before its run started: try again.
    const bool retry =
        absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
    if (!retry || absl::Now() >= deadline) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

absl::StatusOr<int64_t> LeaveCoordinator(const std::string& coordinator,
                                         const TransportSecurity& security,
                                         const std::string& address,
                                         absl::Time deadline) {
  auto stub =
      v1::Coordinator::NewStub(MakeChannel(coordinator, kMaxBytes, security));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::LeaveRequest request;
  request.set_address(address);
  v1::LeaveResponse response;
  const grpc::Status s = stub->Leave(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response.generation();
}

}  // namespace interlock
