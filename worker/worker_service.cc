#include "worker/worker_service.h"

#include <grpcpp/alarm.h>

#include <deque>
#include <exception>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "rpc/state_chunks.h"
#include "rpc/status.h"
#include "rpc/worker_client.h"

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
  // The core accepted the stream's first message: read on.
  void Accepted();
  // The time to send a first message is up.
  void ProofTimeout();
  void Orphan() {
    std::lock_guard<std::mutex> l(mu_);
    reactor_ = nullptr;
  }

 private:
  std::mutex mu_;
  StreamReactor* reactor_;
};

// A streaming call refused before it reaches the core.
template <typename Reactor>
class Refused : public Reactor {
 public:
  explicit Refused(const absl::Status& s) { this->Finish(ToGrpcStatus(s)); }
  void OnDone() override { delete this; }
};
using RefusedStream =
    Refused<grpc::ServerBidiReactor<v1::DownMessage, v1::UpMessage>>;

// An incoming stream. It reaches the core's live stream only once its first
// message names the configured run (WorkerCore::OnFirstDown); until then it
// disturbs nothing, and it is ended if that message does not come in time.
class StreamReactor
    : public grpc::ServerBidiReactor<v1::DownMessage, v1::UpMessage> {
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
    FinishLocked(s);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The upstream half-closed or went away: end our side too, once the
      // messages it sent are handled (a refusal among them is its status).
      core_->OnDownClosed(sink_);
      return;
    }
    std::lock_guard<std::mutex> l(mu_);
    if (finishing_) return;  // ended meanwhile: read no more
    if (!first_seen_) {
      // The next read starts once the core accepted this one: an unproven
      // stream holds at most one message.
      first_seen_ = true;
      core_->OnFirstDown(sink_, std::move(in_),
                         [sink = sink_] { sink->Accepted(); });
      in_.Clear();
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
    delete this;  // cancels the alarm if it is still pending
  }

 private:
  void FinishLocked(const absl::Status& s) {
    if (finishing_) return;
    finishing_ = true;
    final_ = ToGrpcStatus(s);
    if (!writing_) Finish(final_);
  }

  WorkerCore* core_;
  std::atomic<int>* open_;
  std::shared_ptr<ReactorSink> sink_;
  grpc::Alarm proof_alarm_;
  v1::DownMessage in_;
  std::mutex mu_;
  std::deque<v1::UpMessage> queue_;
  bool writing_ = false;
  bool finishing_ = false;
  bool first_seen_ = false;  // the first message arrived
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

void ReactorSink::Accepted() {
  std::lock_guard<std::mutex> l(mu_);
  if (reactor_) reactor_->Accepted();
}

void ReactorSink::ProofTimeout() {
  std::lock_guard<std::mutex> l(mu_);
  if (reactor_) reactor_->ProofTimeout();
}

// A link to the next block: the stream keeps its channel alive until it is
// done.
class GrpcLink : public DownstreamLink {
 public:
  explicit GrpcLink(std::shared_ptr<StreamClient> stream)
      : stream_(std::move(stream)) {}
  ~GrpcLink() override { stream_->Cancel(); }
  void Send(v1::DownMessage msg) override { stream_->Send(std::move(msg)); }
  void Close() override { stream_->CloseWrites(); }

 private:
  std::shared_ptr<StreamClient> stream_;
};

// SaveState: the core serialises the block on its executor; the archive is
// then written in chunks, one write in flight at a time.
class SaveReactor : public grpc::ServerWriteReactor<v1::StateChunk> {
 public:
  SaveReactor(WorkerCore* core, const v1::SaveStateRequest& request)
      : chunk_bytes_(request.chunk_bytes() > 0 ? request.chunk_bytes()
                                               : kDefaultStateChunkBytes) {
    core->SaveState(request, [this](absl::StatusOr<BlockStateArchive> r) {
      if (!r.ok()) {
        Finish(ToGrpcStatus(r.status()));
        return;
      }
      state_ = *std::move(r);
      chunks_.emplace(&state_, chunk_bytes_);
      WriteNext();
    });
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
      return;
    }
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (!chunks_->Next(&chunk_)) {
      Finish(grpc::Status::OK);
      return;
    }
    StartWrite(&chunk_);
  }

  const int64_t chunk_bytes_;
  BlockStateArchive state_;
  std::optional<StateChunker> chunks_;
  v1::StateChunk chunk_;
};

// LoadState: the first chunk's header is checked by the core before anything
// is buffered; then chunks are collected up to the size it announced, and
// the core checks and loads them. One LoadState at a time (`slot`).
class LoadReactor : public grpc::ServerReadReactor<v1::StateChunk> {
 public:
  LoadReactor(WorkerCore* core, v1::LoadStateResponse* response,
              std::atomic<bool>* slot)
      : core_(core), response_(response), slot_(slot) {
    StartRead(&chunk_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      absl::StatusOr<BlockStateArchive> state = state_.Finish();
      if (!state.ok()) {
        End(state.status());
        return;
      }
      core_->LoadState(*std::move(state), [this](absl::StatusOr<int64_t> r) {
        if (r.ok()) response_->set_step(*r);
        End(r.status());
      });
      return;
    }
    if (!state_.started()) {
      state_.Start(chunk_);
      // Nothing is read on until the core has checked the header against
      // the configured block.
      core_->CheckLoadState(state_.header(), state_.total_bytes(),
                            [this](absl::Status s) {
                              if (s.ok()) s = state_.Reserve();
                              if (!s.ok()) {
                                End(s);
                                return;
                              }
                              Append();
                            });
      return;
    }
    Append();
  }
  void OnDone() override { delete this; }

 private:
  // Takes the current chunk's data and reads the next chunk.
  void Append() {
    if (absl::Status s = state_.Append(chunk_); !s.ok()) {
      End(s);
      return;
    }
    chunk_.Clear();
    StartRead(&chunk_);
  }
  // Frees what was buffered and the one-at-a-time slot, then finishes:
  // the next LoadState is admitted as soon as this caller has its status.
  void End(const absl::Status& s) {
    state_.Release();
    chunk_.Clear();
    slot_->store(false);
    Finish(ToGrpcStatus(s));
  }

  WorkerCore* core_;
  v1::LoadStateResponse* response_;
  std::atomic<bool>* slot_;
  v1::StateChunk chunk_;
  StateAssembler state_{"load_state"};
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
  return new SaveReactor(core_, *request);
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
  return new LoadReactor(core_, response, &loading_);
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
