#include "worker/worker_service.h"

#include <deque>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "rpc/status.h"
#include "rpc/stream.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

class StreamReactor;

// What WorkerCore holds of a stream: outlives the reactor safely.
class ReactorSink : public UpstreamSink {
 public:
  explicit ReactorSink(StreamReactor* r) : reactor_(r) {}
  void Send(v1::UpMessage msg) override;
  void Finish(const absl::Status& status) override;
  void Orphan() {
    std::lock_guard<std::mutex> l(mu_);
    reactor_ = nullptr;
  }

 private:
  std::mutex mu_;
  StreamReactor* reactor_;
};

// A stream refused before it reaches the core.
class RefusedStream
    : public grpc::ServerBidiReactor<v1::DownMessage, v1::UpMessage> {
 public:
  explicit RefusedStream(const absl::Status& s) { Finish(ToGrpcStatus(s)); }
  void OnDone() override { delete this; }
};

class StreamReactor
    : public grpc::ServerBidiReactor<v1::DownMessage, v1::UpMessage> {
 public:
  StreamReactor(WorkerCore* core, std::atomic<int>* open)
      : core_(core), open_(open) {
    sink_ = std::make_shared<ReactorSink>(this);
    core_->Attach(sink_);
    StartRead(&in_);
  }

  void Enqueue(v1::UpMessage msg) {
    std::lock_guard<std::mutex> l(mu_);
    if (finishing_) return;
    queue_.push_back(std::move(msg));
    if (!writing_) {
      writing_ = true;
      StartWrite(&queue_.front());
    }
  }

  void FinishOnce(const absl::Status& s) {
    std::lock_guard<std::mutex> l(mu_);
    if (finishing_) return;
    finishing_ = true;
    final_ = ToGrpcStatus(s);
    if (!writing_) Finish(final_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The upstream half-closed or went away: end our side too.
      FinishOnce(absl::OkStatus());
      return;
    }
    core_->OnDown(sink_, std::move(in_));
    in_.Clear();
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> l(mu_);
    queue_.pop_front();
    if (ok && !queue_.empty()) {
      StartWrite(&queue_.front());
      return;
    }
    writing_ = false;
    if (!ok) {
      queue_.clear();
      if (!finishing_) {
        finishing_ = true;
        final_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed");
      }
    }
    if (finishing_) Finish(final_);
  }

  void OnDone() override {
    core_->Detach(sink_.get());
    sink_->Orphan();
    open_->fetch_sub(1);
    delete this;
  }

 private:
  WorkerCore* core_;
  std::atomic<int>* open_;
  std::shared_ptr<ReactorSink> sink_;
  v1::DownMessage in_;
  std::mutex mu_;
  std::deque<v1::UpMessage> queue_;
  bool writing_ = false;
  bool finishing_ = false;
  grpc::Status final_;
};

void ReactorSink::Send(v1::UpMessage msg) {
  std::lock_guard<std::mutex> l(mu_);
  if (reactor_) reactor_->Enqueue(std::move(msg));
}

void ReactorSink::Finish(const absl::Status& status) {
  std::lock_guard<std::mutex> l(mu_);
  if (reactor_) reactor_->FinishOnce(status);
}

// A link to the next block: channel, stub and stream kept alive together
// until the stream is done.
class GrpcLink : public DownstreamLink {
 public:
  struct Holder {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::Worker::Stub> stub;
  };
  explicit GrpcLink(std::shared_ptr<StreamClient> stream)
      : stream_(std::move(stream)) {}
  ~GrpcLink() override { stream_->Cancel(); }
  void Send(v1::DownMessage msg) override { stream_->Send(std::move(msg)); }
  void Close() override { stream_->CloseWrites(); }

 private:
  std::shared_ptr<StreamClient> stream_;
};

}  // namespace

absl::Status WorkerService::Authenticate(grpc::CallbackServerContext* ctx) {
  absl::Status s = CheckBearer(ctx->client_metadata(), options_.token);
  if (!s.ok() && options_.unauthenticated) {
    options_.unauthenticated->Increment();
  }
  return s;
}

grpc::ServerUnaryReactor* WorkerService::Configure(
    grpc::CallbackServerContext* ctx, const v1::ConfigureRequest* request,
    v1::ConfigureResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  if (absl::Status s = Authenticate(ctx); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  core_->Configure(
      *request, [reactor, response](absl::StatusOr<v1::ConfigureResponse> r) {
        if (r.ok()) *response = *std::move(r);
        reactor->Finish(ToGrpcStatus(r.status()));
      });
  return reactor;
}

grpc::ServerBidiReactor<v1::DownMessage, v1::UpMessage>* WorkerService::Stream(
    grpc::CallbackServerContext* ctx) {
  if (absl::Status s = Authenticate(ctx); !s.ok()) {
    return new RefusedStream(s);
  }
  if (open_streams_.fetch_add(1) >= options_.max_concurrent_streams) {
    open_streams_.fetch_sub(1);
    return new RefusedStream(absl::ResourceExhaustedError(
        absl::StrCat("worker: ", options_.max_concurrent_streams,
                     " streams already open (--max_concurrent_streams)")));
  }
  return new StreamReactor(core_, &open_streams_);
}

grpc::ServerUnaryReactor* WorkerService::GetState(
    grpc::CallbackServerContext* ctx, const v1::GetStateRequest* request,
    v1::GetStateResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  if (absl::Status s = Authenticate(ctx); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  core_->GetState(*request,
                  [reactor, response](absl::StatusOr<v1::GetStateResponse> r) {
                    if (r.ok()) *response = *std::move(r);
                    reactor->Finish(ToGrpcStatus(r.status()));
                  });
  return reactor;
}

WorkerCore::LinkFactory GrpcLinkFactory(const TransportSecurity& security) {
  return [security](const std::string& address, int64_t max_bytes,
                    std::function<void(v1::UpMessage)> on_message,
                    std::function<void(absl::Status)> on_done)
             -> std::unique_ptr<DownstreamLink> {
    auto holder = std::make_shared<GrpcLink::Holder>();
    holder->channel = MakeChannel(address, max_bytes, security);
    holder->stub = v1::Worker::NewStub(holder->channel);
    StreamClient::Handlers h;
    h.on_message = std::move(on_message);
    // The holder lives until the stream is done.
    h.on_done = [holder, on_done = std::move(on_done)](const grpc::Status& s) {
      on_done(FromGrpcStatus(s));
    };
    return std::make_unique<GrpcLink>(
        StreamClient::Open(holder->stub.get(), std::move(h)));
  };
}

}  // namespace interlock
