#include "worker/state_reactors.h"

#include <optional>

#include "rpc/state_chunks.h"
#include "rpc/status.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

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

grpc::ServerWriteReactor<v1::StateChunk>* NewSaveReactor(
    WorkerCore* core, const v1::SaveStateRequest& request) {
  return new SaveReactor(core, request);
}

grpc::ServerReadReactor<v1::StateChunk>* NewLoadReactor(
    WorkerCore* core, v1::LoadStateResponse* response,
    std::atomic<bool>* slot) {
  return new LoadReactor(core, response, slot);
}

}  // namespace interlock
