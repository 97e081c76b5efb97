#include "coordinator/coordinator_service.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "rpc/channel.h"
#include "rpc/status.h"
#include "rpc/worker_client.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

// A leaver waits for the next step boundary; longer than this, it asks
// again.
constexpr absl::Duration kMaxLeaveWait = absl::Minutes(10);
// A worker answers Identify at once; a registration that waits longer is
// refused (the worker retries).
constexpr absl::Duration kIdentifyDeadline = absl::Seconds(2);

}  // namespace

class CoordinatorServer::Service : public v1::Coordinator::CallbackService {
 public:
  // `authenticated`: callers proved themselves (a token or mutual TLS);
  // only then does Register tell a joiner the run's id and generation.
  Service(Membership* membership, std::string token, TransportSecurity client,
          bool authenticated)
      : membership_(membership),
        token_(std::move(token)),
        client_(std::move(client)),
        authenticated_(authenticated) {}

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override {
    auto* reactor = ctx->DefaultReactor();
    if (absl::Status s = Authorize(ctx); !s.ok()) {
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    if (absl::Status s = membership_->Admit(
            request->block(), request->address(), request->config_sha256());
        !s.ok()) {
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    // Who answers at the address, asked off the reactor (a call to a
    // worker that does not answer takes up to its deadline).
    std::thread([membership = membership_, client = client_, reactor, response,
                 req = *request, reveal = authenticated_] {
      WorkerClient probe("registering worker", req.address(), 1 << 20, client);
      absl::StatusOr<std::string> id =
          probe.Identify(absl::Now() + kIdentifyDeadline);
      absl::Status s;
      if (!id.ok()) {
        membership->Refused("gone");
        s = absl::UnavailableError(absl::StrCat(
            "register: nothing answers as a worker at ",
            req.address().substr(0, 64), " (", id.status().message(), ")"));
      } else {
        auto r = membership->Register(req.block(), req.address(),
                                      req.config_sha256(), *id);
        if (r.ok() && reveal) {
          response->set_run_id(r->run_id);
          response->set_generation(r->generation);
        }
        s = r.status();
      }
      reactor->Finish(ToGrpcStatus(s));
    }).detach();
    return reactor;
  }

  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx,
                                  const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override {
    auto* reactor = ctx->DefaultReactor();
    if (absl::Status s = Authorize(ctx); !s.ok()) {
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    // The answer waits for a step boundary: never block a reaction.
    absl::Time deadline = absl::Now() + kMaxLeaveWait;
    const auto client = ctx->deadline();
    if (client != std::chrono::system_clock::time_point::max()) {
      deadline = std::min(deadline, absl::FromChrono(client));
    }
    std::thread([this, reactor, response, address = request->address(),
                 deadline] {
      auto g = membership_->Leave(address, deadline);
      if (g.ok()) response->set_generation(*g);
      reactor->Finish(ToGrpcStatus(g.status()));
    }).detach();
    return reactor;
  }

 private:
  absl::Status Authorize(grpc::CallbackServerContext* ctx) {
    absl::Status s = CheckBearer(ctx->client_metadata(), token_);
    if (!s.ok()) membership_->Refused("token");
    return s;
  }

  Membership* const membership_;
  const std::string token_;
  const TransportSecurity client_;
  const bool authenticated_;
};

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const std::string& host, int port, const TransportSecurity& security,
    const TransportSecurity& client, Membership* membership) {
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer());
  s->service_ = std::make_unique<Service>(
      membership, security.token, client,
      !security.token.empty() || !security.ca_pem.empty());
  ASSIGN_OR_RETURN(s->server_,
                   StartServer(s->service_.get(), host, port, security, 1 << 20,
                               "--coordinator_port", &s->port_));
  return s;
}

CoordinatorServer::~CoordinatorServer() {
  if (server_)
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(2));
}

}  // namespace interlock
