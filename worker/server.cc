#include "worker/server.h"

#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "rpc/channel.h"
#include "rpc/rendezvous.h"

namespace interlock {

constexpr char kServiceName[] = "interlock.v1.Worker";
// kLivenessService (rpc/channel.h) is what a liveness or startup probe asks;
// the empty name and kServiceName mean "holds a block".

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::Start(
    const WorkerServerOptions& options) {
  // gRPC would take "-5" or "99999" as a service name or wrap it to another
  // port; main names the flag, this is the last line of defence.
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("port ", options.port, " is not in 0..65535"));
  }
  if (options.metrics_port < -1 || options.metrics_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics port ", options.metrics_port, " is not in -1..65535"));
  }
  if (options.host.empty()) {
    return absl::InvalidArgumentError("empty listening address");
  }
  std::unique_ptr<WorkerServer> s(new WorkerServer());
  WorkerOptions core_options;
  core_options.max_message_bytes = options.max_message_bytes;
  core_options.max_model_bytes = options.max_model_bytes;
  core_options.device = options.device;
  core_options.collective_host = options.collective_host;
  core_options.store_client =
      [security = options.security](const std::string& address) {
        return std::shared_ptr<KeyValueClient>(
            std::make_shared<RendezvousClient>(address, security));
      };
  s->core_ = std::make_unique<WorkerCore>(core_options, &s->metrics_,
                                          GrpcLinkFactory(options.security));
  WorkerServiceOptions service_options;
  service_options.token = options.security.token;
  service_options.max_concurrent_streams = options.max_concurrent_streams;
  service_options.unauthenticated = s->metrics_.unauthenticated();
  s->service_ =
      std::make_unique<WorkerService>(s->core_.get(), service_options);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(builder, options.max_message_bytes);
  // gRPC sets SO_REUSEPORT by default: a second worker on the same port
  // would start and the kernel would hand it a share of the connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(GrpcAddress(options.host, options.port),
                           ServerCredentialsFor(options.security), &s->port_);
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || s->port_ == 0) {
    s->server_.reset();
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", GrpcAddress(options.host, options.port),
        " (the port is in use, or the address is not one of this machine's)"));
  }
  // The health service needs no token (Kubernetes probes send none); it
  // tells only whether a block is configured. No reflection service.
  // NOT_SERVING until a block is configured: probes and the coordinator
  // can tell a fresh replica from a ready one.
  auto* health = s->server_->GetHealthCheckService();
  health->SetServingStatus("", false);
  health->SetServingStatus(kServiceName, false);
  health->SetServingStatus(kLivenessService, true);
  if (options.on_released) s->core_->set_on_released(options.on_released);
  s->core_->set_on_configured(
      [health, told = options.on_configured](bool serving) {
        health->SetServingStatus("", serving);
        health->SetServingStatus(kServiceName, serving);
        if (told) told(serving);
      });

  if (options.metrics_port >= 0) {
    auto exposer = HttpExposer::Start(
        Unbracketed(options.metrics_host.empty() ? options.host
                                                 : options.metrics_host),
        options.metrics_port, s->metrics_.registry(), options.metrics_token);
    if (!exposer.ok()) return exposer.status();
    s->exposer_ = std::move(*exposer);
    s->metrics_port_ = s->exposer_->port();
  }
  return s;
}

void WorkerServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  if (server_) {
    auto* health = server_->GetHealthCheckService();
    health->SetServingStatus("", false);
    health->SetServingStatus(kServiceName, false);
    health->SetServingStatus(kLivenessService, false);
    server_->Shutdown(std::chrono::system_clock::now() +
                      absl::ToChronoSeconds(grace));
  }
  core_->Shutdown();
}

WorkerServer::~WorkerServer() { Shutdown(absl::ZeroDuration()); }

}  // namespace interlock
