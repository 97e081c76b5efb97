#include "worker/state_reactors.h"

#include <new>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
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

// PutModelFile: the first chunk names the file; one the core holds already
// ends the call at once (already_held), anything else is collected up to
// the announced size, within --max_model_bytes, and handed to the core,
// which checks its SHA-256. One call at a time (`slot`).
class PutModelFileReactor : public grpc::ServerReadReactor<v1::ModelFileChunk> {
 public:
  PutModelFileReactor(WorkerCore* core, v1::PutModelFileResponse* response,
                      std::atomic<bool>* slot)
      : core_(core), response_(response), slot_(slot) {
    StartRead(&chunk_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      if (!started_) {
        End(absl::InvalidArgumentError("put_model_file: no chunk"));
      } else if (static_cast<int64_t>(file_.bytes.size()) != total_) {
        End(absl::InvalidArgumentError(absl::StrCat(
            "put_model_file ", file_.name, ": ", file_.bytes.size(),
            " bytes came, ", total_, " were announced")));
      } else {
        End(core_->StageModelFile(std::move(file_)));
      }
      return;
    }
    if (!started_) {
      started_ = true;
      if (absl::Status s = Start(); !s.ok() || response_->already_held()) {
        End(s);
        return;
      }
    } else if (!chunk_.name().empty() || !chunk_.sha256().empty() ||
               chunk_.total_bytes() != 0) {
      End(absl::InvalidArgumentError(
          absl::StrCat("put_model_file ", file_.name,
                       ": a chunk after the first carries header fields")));
      return;
    }
    if (static_cast<int64_t>(file_.bytes.size() + chunk_.data().size()) >
        total_) {
      End(absl::InvalidArgumentError(absl::StrCat("put_model_file ", file_.name,
                                                  ": more than the ", total_,
                                                  " bytes announced")));
      return;
    }
    file_.bytes.append(chunk_.data());
    chunk_.Clear();
    StartRead(&chunk_);
  }
  void OnDone() override { delete this; }

 private:
  // Checks the first chunk's header and reserves the announced size.
  absl::Status Start() {
    file_.name = chunk_.name();
    file_.sha256 = chunk_.sha256();
    total_ = chunk_.total_bytes();
    const bool plain = !file_.name.empty() && file_.name.size() <= 255 &&
                       file_.name.find_first_of("/\\") == std::string::npos &&
                       file_.name != "." && file_.name != "..";
    if (!plain) {
      return absl::InvalidArgumentError(
          "put_model_file: the file name must be a plain name (no folders, "
          "at most 255 bytes)");
    }
    if (file_.sha256.size() != 64 ||
        file_.sha256.find_first_not_of("0123456789abcdef") !=
            std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("put_model_file ", file_.name,
                       ": sha256 must be 64 lower-case hex digits"));
    }
    if (core_->HoldsModelFile(file_.sha256)) {
      response_->set_already_held(true);
      return absl::OkStatus();
    }
    const int64_t limit = core_->options().max_model_bytes;
    if (total_ < 0 || total_ > limit) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "put_model_file ", file_.name, ": ", total_, " bytes, more than the ",
          limit, " this worker accepts (--max_model_bytes)"));
    }
    try {
      file_.bytes.reserve(static_cast<size_t>(total_));
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "put_model_file ", file_.name, ": cannot hold ", total_, " bytes"));
    }
    return absl::OkStatus();
  }
  // Frees what was buffered and the slot, then finishes.
  void End(const absl::Status& s) {
    file_ = ScriptedFile();
    chunk_.Clear();
    slot_->store(false);
    Finish(ToGrpcStatus(s));
  }

  WorkerCore* core_;
  v1::PutModelFileResponse* response_;
  std::atomic<bool>* slot_;
  v1::ModelFileChunk chunk_;
  ScriptedFile file_;
  int64_t total_ = 0;
  bool started_ = false;
};

}  // namespace

grpc::ServerReadReactor<v1::ModelFileChunk>* NewPutModelFileReactor(
    WorkerCore* core, v1::PutModelFileResponse* response,
    std::atomic<bool>* slot) {
  return new PutModelFileReactor(core, response, slot);
}

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
