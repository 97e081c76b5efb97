#include "worker/worker_service.h"

#include <grpcpp/alarm.h>

#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "rpc/frames.h"
#include "rpc/status.h"
#include "rpc/worker_client.h"
#include "worker/reactors.h"
#include "worker/state_reactors.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

class StreamReactor;
class ControlReactor;

// What WorkerCore holds of an incoming stream.
class ReactorSink : public UpstreamSink {
 public:
  explicit ReactorSink(StreamReactor* r) : reactor_(r) {}
  void Send(const UpFrame& msg) override;
  void Finish(const absl::Status& status) override;
  // The core accepted the stream's first message: read on.
  void Accepted();
  // The time to send a first message is up.
  void ProofTimeout();
  void Orphan() { reactor_.Orphan(); }

 private:
  ReactorHandle<StreamReactor> reactor_;
};

// What WorkerCore holds of a control stream.
class ControlReactorSink : public ControlSink {
 public:
  explicit ControlReactorSink(ControlReactor* r) : reactor_(r) {}
  void Send(v1::ControlEvent event) override;
  void Finish(const absl::Status& status) override;
  void Orphan() { reactor_.Orphan(); }

 private:
  ReactorHandle<ControlReactor> reactor_;
};

// The stream reads and writes frames as raw byte buffers (rpc/frames.h).
using RawStream = grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>;
using RefusedStream = Refused<RawStream>;

// An incoming stream. It reaches the core's live stream only once its first
// message names the configured run (WorkerCore::OnFirstDown); until then it
// disturbs nothing, and it is ended if that message does not come in time.
class StreamReactor : public QueuedWrites<RawStream, grpc::ByteBuffer> {
 public:
  StreamReactor(WorkerCore* core, std::atomic<int>* open)
      : core_(core), open_(open) {
    sink_ = std::make_shared<ReactorSink>(this);
    StartRead(&in_);
    // The alarm holds the sink, not the reactor: it may fire after OnDone.
    proof_alarm_.Set(std::chrono::system_clock::now() +
                         core_->options().stream_proof_timeout,
                     [sink = sink_](bool fired) {
                       if (fired) sink->ProofTimeout();
                     });
  }

  void Accepted() {
    std::lock_guard<std::mutex> l(mu_);
    if (finishing_) return;
    StartRead(&in_);
  }

  void ProofTimeout() {
    std::lock_guard<std::mutex> l(mu_);
    if (first_seen_) return;
    FinishLocked(absl::DeadlineExceededError(absl::StrCat(
        "stream: no message naming the configured run within ",
        core_->options().stream_proof_timeout.count(), " ms of opening")));
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The upstream half-closed or went away: end our side too, once the
      // messages it sent are handled (a refusal among them is its status).
      core_->OnDownClosed(sink_);
      return;
    }
    // Only the header is parsed here; the tensors keep referencing the
    // received slices.
    absl::StatusOr<DownFrame> msg = DownFrameOf(in_);
    in_.Clear();
    std::lock_guard<std::mutex> l(mu_);
    if (finishing_) return;  // ended meanwhile: read no more
    if (!msg.ok()) {
      FinishLocked(msg.status());
      return;
    }
    if (!first_seen_) {
      // The next read starts once the core accepted this one: an unproven
      // stream holds at most one message.
      first_seen_ = true;
      core_->OnFirstDown(sink_, *std::move(msg),
                         [sink = sink_] { sink->Accepted(); });
      return;
    }
    core_->OnDown(sink_, *std::move(msg));
    StartRead(&in_);
  }

  void OnDone() override {
    core_->Detach(sink_.get());
    sink_->Orphan();
    open_->fetch_sub(1);
    delete this;  // cancels the alarm if it is still pending
  }

 private:
  WorkerCore* core_;
  std::atomic<int>* open_;
  std::shared_ptr<ReactorSink> sink_;
  grpc::Alarm proof_alarm_;
  grpc::ByteBuffer in_;
  bool first_seen_ = false;  // the first message arrived; guarded by mu_
};

// The control stream: events the core sends, in order, until the
// coordinator cancels it or a newer one replaces it.
class ControlReactor
    : public QueuedWrites<grpc::ServerWriteReactor<v1::ControlEvent>,
                          v1::ControlEvent> {
 public:
  ControlReactor(WorkerCore* core, std::atomic<int>* open,
                 const v1::ControlRequest& request)
      : core_(core), open_(open) {
    sink_ = std::make_shared<ControlReactorSink>(this);
    core_->OpenControl(request, sink_);
  }

  // The coordinator went away or cancelled: a write-only call learns it
  // only here, and must still finish.
  void OnCancel() override {
    FinishOnce(absl::CancelledError("control stream cancelled"));
  }

  void OnDone() override {
    core_->CloseControl(sink_.get());
    sink_->Orphan();
    open_->fetch_sub(1);
    delete this;
  }

 private:
  WorkerCore* core_;
  std::atomic<int>* open_;
  std::shared_ptr<ControlReactorSink> sink_;
};

void ReactorSink::Send(const UpFrame& msg) {
  grpc::ByteBuffer buffer = ToByteBuffer(msg);
  reactor_.With([&](StreamReactor* r) { r->Enqueue(std::move(buffer)); });
}

void ReactorSink::Finish(const absl::Status& status) {
  reactor_.With([&](StreamReactor* r) { r->FinishOnce(status); });
}

void ReactorSink::Accepted() {
  reactor_.With([](StreamReactor* r) { r->Accepted(); });
}

void ReactorSink::ProofTimeout() {
  reactor_.With([](StreamReactor* r) { r->ProofTimeout(); });
}

void ControlReactorSink::Send(v1::ControlEvent event) {
  reactor_.With([&](ControlReactor* r) { r->Enqueue(std::move(event)); });
}

void ControlReactorSink::Finish(const absl::Status& status) {
  reactor_.With([&](ControlReactor* r) { r->FinishOnce(status); });
}

// A link to the next block: the stream keeps its channel alive until it is
// done.
class GrpcLink : public DownstreamLink {
 public:
  explicit GrpcLink(std::shared_ptr<StreamClient> stream)
      : stream_(std::move(stream)) {}
  ~GrpcLink() override { stream_->Cancel(); }
  void Send(const DownFrame& msg) override { stream_->Send(msg); }
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

grpc::ServerWriteReactor<v1::StateChunk>* WorkerService::SaveState(
    grpc::CallbackServerContext* ctx, const v1::SaveStateRequest* request) {
  if (absl::Status s = Authenticate(ctx); !s.ok()) {
    return new Refused<grpc::ServerWriteReactor<v1::StateChunk>>(s);
  }
  return NewSaveReactor(core_, *request);
}

grpc::ServerReadReactor<v1::StateChunk>* WorkerService::LoadState(
    grpc::CallbackServerContext* ctx, v1::LoadStateResponse* response) {
  if (absl::Status s = Authenticate(ctx); !s.ok()) {
    return new Refused<grpc::ServerReadReactor<v1::StateChunk>>(s);
  }
  // A state is buffered whole before it is checked and loaded: one at a
  // time bounds that memory by one block's state.
  if (loading_.exchange(true)) {
    return new Refused<grpc::ServerReadReactor<v1::StateChunk>>(
        absl::ResourceExhaustedError(
            "worker: another load_state is in progress (one at a time)"));
  }
  return NewLoadReactor(core_, response, &loading_);
}

grpc::ServerReadReactor<v1::ModelFileChunk>* WorkerService::PutModelFile(
    grpc::CallbackServerContext* ctx, v1::PutModelFileResponse* response) {
  if (absl::Status s = Authenticate(ctx); !s.ok()) {
    return new Refused<grpc::ServerReadReactor<v1::ModelFileChunk>>(s);
  }
  // A file is buffered whole before it is kept: one at a time bounds that
  // memory by --max_model_bytes.
  if (putting_.exchange(true)) {
    return new Refused<grpc::ServerReadReactor<v1::ModelFileChunk>>(
        absl::ResourceExhaustedError(
            "worker: another put_model_file is in progress (one at a time)"));
  }
  return NewPutModelFileReactor(core_, response, &putting_);
}

grpc::ServerUnaryReactor* WorkerService::Release(
    grpc::CallbackServerContext* ctx, const v1::ReleaseRequest* request,
    v1::ReleaseResponse* /*response*/) {
  auto* reactor = ctx->DefaultReactor();
  if (absl::Status s = Authenticate(ctx); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  core_->Release(*request, [reactor](absl::Status s) {
    reactor->Finish(ToGrpcStatus(s));
  });
  return reactor;
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

absl::Status WorkerService::AdmitStream(grpc::CallbackServerContext* ctx) {
  RETURN_IF_ERROR(Authenticate(ctx));
  if (open_streams_.fetch_add(1) >= options_.max_concurrent_streams) {
    open_streams_.fetch_sub(1);
    return absl::ResourceExhaustedError(
        absl::StrCat("worker: ", options_.max_concurrent_streams,
                     " streams already open (--max_concurrent_streams)"));
  }
  return absl::OkStatus();
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
WorkerService::Stream(grpc::CallbackServerContext* ctx) {
  if (absl::Status s = AdmitStream(ctx); !s.ok()) return new RefusedStream(s);
  return new StreamReactor(core_, &open_streams_);
}

// Counted with the streams: an unproven control call holds a slot until the
// core has checked its run.
grpc::ServerWriteReactor<v1::ControlEvent>* WorkerService::Control(
    grpc::CallbackServerContext* ctx, const v1::ControlRequest* request) {
  if (absl::Status s = AdmitStream(ctx); !s.ok()) {
    return new Refused<grpc::ServerWriteReactor<v1::ControlEvent>>(s);
  }
  return new ControlReactor(core_, &open_streams_, *request);
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

grpc::ServerUnaryReactor* WorkerService::Identify(
    grpc::CallbackServerContext* ctx, const v1::IdentifyRequest*,
    v1::IdentifyResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  absl::Status s = Authenticate(ctx);
  if (s.ok()) response->set_instance_id(core_->instance_id());
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

WorkerCore::LinkFactory GrpcLinkFactory(const TransportSecurity& security) {
  return [security](const std::string& address, int64_t max_bytes,
                    std::function<void(UpFrame)> on_message,
                    std::function<void(absl::Status)> on_done)
             -> std::unique_ptr<DownstreamLink> {
    WorkerClient next("next block", address, max_bytes, security);
    StreamClient::Handlers h;
    h.on_message = std::move(on_message);
    h.on_done = [on_done = std::move(on_done)](const grpc::Status& s) {
      on_done(FromGrpcStatus(s));
    };
    return std::make_unique<GrpcLink>(next.OpenStream(std::move(h)));
  };
}

}  // namespace interlock
