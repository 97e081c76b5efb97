// The coordinator's gRPC service (proto/worker.proto, service Coordinator):
// a thin adapter over Membership, and the server that hosts it next to a
// run that drives a cluster.
#ifndef INTERLOCK_COORDINATOR_COORDINATOR_SERVICE_H_
#define INTERLOCK_COORDINATOR_COORDINATOR_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/membership.h"
#include "proto/worker.grpc.pb.h"
#include "rpc/security.h"

namespace interlock {

class CoordinatorServer {
 public:
  // Listens on host:port (port 0: any free one). Calls need the bearer
  // token of `security` when it has one; refusals are counted by
  // `membership`. A registering address is asked who it is (Identify) with
  // `client` (the run's token and TLS towards workers) before it is
  // accepted: nothing that does not answer as a worker costs the run a
  // drain.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(
      const std::string& host, int port, const TransportSecurity& security,
      const TransportSecurity& client, Membership* membership);
  ~CoordinatorServer();

  int port() const { return port_; }

 private:
  class Service;
  CoordinatorServer() = default;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_COORDINATOR_SERVICE_H_
