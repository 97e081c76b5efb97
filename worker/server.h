// The worker's server: gRPC builder, health service, metrics exposer and
// graceful shutdown around WorkerCore and WorkerService.
#ifndef INTERLOCK_WORKER_SERVER_H_
#define INTERLOCK_WORKER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "metrics/http_exposer.h"
#include "rpc/security.h"
#include "worker/metrics.h"
#include "worker/worker_core.h"
#include "worker/worker_service.h"

namespace interlock {

struct WorkerServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;           // 0: any free port
  int metrics_port = -1;  // -1: no metrics endpoint; 0: any free port
  // Address of the metrics endpoint; empty: `host`.
  std::string metrics_host;
  // Non-empty: /metrics requires "Authorization: Bearer <metrics_token>".
  std::string metrics_token;
  int64_t max_message_bytes = 256 << 20;
  // WorkerOptions::max_model_bytes.
  int64_t max_model_bytes = int64_t{1} << 30;
  // Stream calls open at once; more are refused with RESOURCE_EXHAUSTED.
  int max_concurrent_streams = 8;
  // Bearer token and TLS for the server and for the link to the next block.
  TransportSecurity security;
  // Where configured blocks run (services/device.h).
  c10::Device device = c10::Device(c10::kCPU);
  // WorkerOptions::collective_host.
  std::string collective_host;
  // WorkerCore::set_on_released.
  std::function<void(const std::string& run_id, int64_t generation)>
      on_released;
  // Told whenever a block is configured (true) or its run ends (false).
  std::function<void(bool)> on_configured;
};

class WorkerServer {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(
      const WorkerServerOptions& options);
  ~WorkerServer();

  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  // Health goes NOT_SERVING first, then in-flight calls get `grace` to end.
  void Shutdown(absl::Duration grace = absl::Seconds(5));
  void Wait() { server_->Wait(); }

 private:
  WorkerServer() = default;
  WorkerMetrics metrics_;
  std::unique_ptr<WorkerCore> core_;
  std::unique_ptr<WorkerService> service_;
  // Null until BuildAndStart succeeded: Start's error paths destroy a
  // half-built server, and Shutdown must not touch what is missing.
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HttpExposer> exposer_;
  int port_ = 0;
  int metrics_port_ = -1;
  bool shut_down_ = false;
};

}  // namespace interlock

#endif  // INTERLOCK_WORKER_SERVER_H_
