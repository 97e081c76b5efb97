#include "rpc/rendezvous.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "rpc/channel.h"
#include "rpc/status.h"

namespace interlock {

// The thin adapter: checks the token, then asks the store.
class RendezvousServer::Service final : public v1::Rendezvous::CallbackService {
 public:
  Service(KeyValueStore* store, std::string token, std::string id)
      : store_(store), token_(std::move(token)), id_(std::move(id)) {}

  grpc::ServerUnaryReactor* Store(grpc::CallbackServerContext* ctx,
                                  const v1::StoreRequest* request,
                                  v1::StoreResponse* response) override {
    auto* reactor = ctx->DefaultReactor();
    absl::Status s = CheckBearer(ctx->client_metadata(), token_);
    if (!s.ok()) {
      refused_.fetch_add(1);
    } else {
      s = Apply(*request, response);
      response->set_store_id(id_);
    }
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  int64_t refused() const { return refused_.load(); }

 private:
  absl::Status Apply(const v1::StoreRequest& r, v1::StoreResponse* out) {
    const bool one_key = r.op() != v1::StoreRequest::CHECK &&
                         r.op() != v1::StoreRequest::NUM_KEYS;
    if (one_key && r.keys_size() != 1) {
      return absl::InvalidArgumentError("store: this call takes one key");
    }
    if (r.keys_size() > 1024) {
      return absl::InvalidArgumentError("store: more than 1024 keys");
    }
    const std::string key = r.keys_size() > 0 ? r.keys(0) : "";
    switch (r.op()) {
      case v1::StoreRequest::SET:
        return store_->Set(key, r.value());
      case v1::StoreRequest::GET: {
        auto v = store_->Get(key);
        if (!v.ok()) return v.status();
        out->set_found(v->has_value());
        if (v->has_value()) out->set_value(**v);
        return absl::OkStatus();
      }
      case v1::StoreRequest::ADD: {
        auto v = store_->Add(key, r.amount());
        if (!v.ok()) return v.status();
        out->set_number(*v);
        return absl::OkStatus();
      }
      case v1::StoreRequest::COMPARE_SET: {
        auto v = store_->CompareSet(key, r.expected(), r.value());
        if (!v.ok()) return v.status();
        out->set_value(*v);
        return absl::OkStatus();
      }
      case v1::StoreRequest::CHECK: {
        auto v = store_->Check(
            std::vector<std::string>(r.keys().begin(), r.keys().end()));
        if (!v.ok()) return v.status();
        out->set_found(*v);
        return absl::OkStatus();
      }
      case v1::StoreRequest::DELETE: {
        auto v = store_->Delete(key);
        if (!v.ok()) return v.status();
        out->set_found(*v);
        return absl::OkStatus();
      }
      case v1::StoreRequest::NUM_KEYS: {
        auto v = store_->NumKeys();
        if (!v.ok()) return v.status();
        out->set_number(*v);
        return absl::OkStatus();
      }
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("store: unknown operation ", r.op()));
    }
  }

  KeyValueStore* const store_;
  const std::string token_;
  const std::string id_;
  std::atomic<int64_t> refused_{0};
};

absl::StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::Start(
    const std::string& host, int port, const TransportSecurity& security) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous store: port ", port, " outside [0, 65535]"));
  }
  std::unique_ptr<RendezvousServer> s(new RendezvousServer());
  ASSIGN_OR_RETURN(std::string id, RandomToken(8));
  s->service_ =
      std::make_unique<Service>(&s->store_, security.token, std::move(id));
  ASSIGN_OR_RETURN(s->server_,
                   StartServer(s->service_.get(), host, port, security, 4 << 20,
                               "rendezvous store", &s->port_));
  return s;
}

RendezvousServer::~RendezvousServer() {
  // No grace: a member waiting on this store must fail at once.
  if (server_) server_->Shutdown(std::chrono::system_clock::now());
}

int64_t RendezvousServer::refused() const { return service_->refused(); }

RendezvousClient::RendezvousClient(const std::string& address,
                                   const TransportSecurity& security,
                                   absl::Duration deadline)
    : address_(address),
      deadline_(deadline),
      stub_(v1::Rendezvous::NewStub(MakeChannel(address, 4 << 20, security))) {}

absl::StatusOr<v1::StoreResponse> RendezvousClient::Call(
    const v1::StoreRequest& request) {
  // A connection that fails is tried again for up to a second (this
  // machine's loopback has refused a fresh server's first connection under
  // load), not longer: a store that is gone must fail a member soon.
  const absl::Time retry_until = absl::Now() + absl::Seconds(1);
  v1::StoreResponse response;
  grpc::Status s;
  for (absl::Duration pause = absl::Milliseconds(20);;
       pause = std::min(pause * 2, absl::Milliseconds(200))) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline_));
    response.Clear();
    s = stub_->Store(&ctx, request, &response);
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE ||
        absl::Now() + pause > retry_until) {
      break;
    }
    absl::SleepFor(pause);
  }
  if (!s.ok()) {
    return CallFailed(absl::StrCat("rendezvous store ", address_),
                      v1::StoreRequest::Op_Name(request.op()), s);
  }
  std::lock_guard<std::mutex> l(mu_);
  if (store_id_.empty()) store_id_ = response.store_id();
  if (response.store_id() != store_id_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rendezvous store ", address_, " restarted: its keys are gone"));
  }
  return response;
}

namespace {

v1::StoreRequest Request(v1::StoreRequest::Op op, const std::string& key) {
  v1::StoreRequest r;
  r.set_op(op);
  if (!key.empty() || op != v1::StoreRequest::NUM_KEYS) r.add_keys(key);
  return r;
}

}  // namespace

absl::Status RendezvousClient::Set(const std::string& key,
                                   const std::string& value) {
  v1::StoreRequest r = Request(v1::StoreRequest::SET, key);
  r.set_value(value);
  return Call(r).status();
}

absl::StatusOr<std::optional<std::string>> RendezvousClient::Get(
    const std::string& key) {
  auto r = Call(Request(v1::StoreRequest::GET, key));
  if (!r.ok()) return r.status();
  if (!r->found()) return std::optional<std::string>();
  return std::optional<std::string>(r->value());
}

absl::StatusOr<int64_t> RendezvousClient::Add(const std::string& key,
                                              int64_t amount) {
  v1::StoreRequest q = Request(v1::StoreRequest::ADD, key);
  q.set_amount(amount);
  auto r = Call(q);
  if (!r.ok()) return r.status();
  return r->number();
}

absl::StatusOr<std::string> RendezvousClient::CompareSet(
    const std::string& key, const std::string& expected,
    const std::string& desired) {
  v1::StoreRequest q = Request(v1::StoreRequest::COMPARE_SET, key);
  q.set_expected(expected);
  q.set_value(desired);
  auto r = Call(q);
  if (!r.ok()) return r.status();
  return r->value();
}

absl::StatusOr<bool> RendezvousClient::Check(
    const std::vector<std::string>& keys) {
  v1::StoreRequest q;
  q.set_op(v1::StoreRequest::CHECK);
  for (const auto& k : keys) q.add_keys(k);
  auto r = Call(q);
  if (!r.ok()) return r.status();
  return r->found();
}

absl::StatusOr<bool> RendezvousClient::Delete(const std::string& key) {
  auto r = Call(Request(v1::StoreRequest::DELETE, key));
  if (!r.ok()) return r.status();
  return r->found();
}

absl::StatusOr<int64_t> RendezvousClient::NumKeys() {
  v1::StoreRequest q;
  q.set_op(v1::StoreRequest::NUM_KEYS);
  auto r = Call(q);
  if (!r.ok()) return r.status();
  return r->number();
}

}  // namespace interlock
