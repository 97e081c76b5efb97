#include "rpc/worker_client.h"

#include "absl/strings/str_cat.h"
#include "rpc/channel.h"
#include "rpc/state_chunks.h"
#include "rpc/status.h"
#include "services/sha256.h"

namespace interlock {

WorkerClient::WorkerClient(const std::string& name, std::string address,
                           int64_t max_message_bytes,
                           const TransportSecurity& security)
    : address_(std::move(address)),
      label_(absl::StrCat(name, " (", address_, ")")),
      max_message_bytes_(max_message_bytes),
      security_(security),
      channel_(MakeChannel(address_, max_message_bytes, security)),
      stub_(v1::Worker::NewStub(channel_)),
      generic_stub_(std::make_shared<grpc::GenericStub>(channel_)) {}

bool WorkerClient::WaitForConnected(absl::Time deadline) {
  return channel_->WaitForConnected(absl::ToChronoTime(deadline));
}

absl::Status WorkerClient::Ping(absl::Time deadline) {
  absl::StatusOr<int> code = CheckHealth(channel_, kLivenessService, deadline);
  if (!code.ok()) {
    return absl::Status(code.status().code(),
                        absl::StrCat(label_, ": health check failed: ",
                                     code.status().message()));
  }
  if (*code != 1) {
    return absl::UnavailableError(
        absl::StrCat(label_, ": not serving (health status ", *code, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ConfigureResponse> WorkerClient::Configure(
    const v1::ConfigureRequest& request, absl::Time deadline,
    bool wait_for_ready) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  ctx.set_wait_for_ready(wait_for_ready);
  v1::ConfigureResponse response;
  grpc::Status s = stub_->Configure(&ctx, request, &response);
  if (!s.ok()) return CallFailed(label_, "configure", s);
  return response;
}

absl::StatusOr<std::string> WorkerClient::Identify(absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::IdentifyResponse response;
  grpc::Status s = stub_->Identify(&ctx, v1::IdentifyRequest(), &response);
  if (!s.ok()) return CallFailed(label_, "identify", s);
  return response.instance_id();
}

absl::StatusOr<v1::GetStateResponse> WorkerClient::GetState(
    const v1::GetStateRequest& request, absl::Time deadline,
    int64_t max_bytes) {
  std::shared_ptr<v1::Worker::Stub> stub = stub_;
  if (max_bytes > max_message_bytes_) {
    std::lock_guard<std::mutex> l(large_mu_);
    if (!large_channel_ || large_bytes_ != max_bytes) {
      large_channel_ = MakeChannel(address_, max_bytes, security_);
      large_bytes_ = max_bytes;
    }
    stub = v1::Worker::NewStub(large_channel_);
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::GetStateResponse response;
  grpc::Status s = stub->GetState(&ctx, request, &response);
  if (!s.ok()) return CallFailed(label_, "get_state", s);
  return response;
}

absl::StatusOr<BlockStateArchive> WorkerClient::SaveState(
    const v1::SaveStateRequest& request, int block, absl::Time deadline,
    int64_t max_bytes) {
  const std::string what = absl::StrCat(label_, ": save_state");
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  auto reader = stub_->SaveState(&ctx, request);
  StateAssembler state(what);
  absl::Status local;
  v1::StateChunk chunk;
  while (local.ok() && reader->Read(&chunk)) {
    if (!state.started()) {
      state.Start(chunk);
      if (state.total_bytes() < 0 || state.total_bytes() > max_bytes) {
        local = absl::DataLossError(
            absl::StrCat(what, ": the worker announced ", state.total_bytes(),
                         " bytes; at most ", max_bytes, " are accepted"));
      } else {
        local = state.Reserve();
      }
    }
    if (local.ok()) local = state.Append(chunk);
    // Stop the worker sending more once the state is refused.
    if (!local.ok()) ctx.TryCancel();
  }
  grpc::Status s = reader->Finish();
  if (!local.ok()) return local;
  if (!s.ok()) return CallFailed(label_, "save_state", s);
  absl::StatusOr<BlockStateArchive> archive = state.Finish();
  if (!archive.ok()) return archive.status();
  const std::string sha =
      Sha256Hex(archive->bytes.data(), archive->bytes.size());
  if (archive->block != block || sha != archive->sha256) {
    return absl::DataLossError(
        absl::StrCat(what, ": the state received (block ", archive->block, ", ",
                     archive->bytes.size(), " bytes, SHA-256 ", sha,
                     ") does not match what was asked or announced (block ",
                     block, ", SHA-256 ", archive->sha256, ")"));
  }
  return archive;
}

absl::Status WorkerClient::LoadState(const BlockStateArchive& header,
                                     const std::string& bytes,
                                     absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::LoadStateResponse response;
  auto writer = stub_->LoadState(&ctx, &response);
  StateChunker chunks(&header, &bytes, kDefaultStateChunkBytes);
  v1::StateChunk chunk;
  // A refused write means the call ended; Finish says why.
  while (chunks.Next(&chunk) && writer->Write(chunk)) {
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  return CallFailed(label_, "load_state", s);
}

absl::Status WorkerClient::PutModelFile(const std::string& name,
                                        const std::string& sha256,
                                        const std::string& bytes,
                                        absl::Time deadline,
                                        bool wait_for_ready) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  ctx.set_wait_for_ready(wait_for_ready);
  v1::PutModelFileResponse response;
  auto writer = stub_->PutModelFile(&ctx, &response);
  // The header alone first: a worker that holds the file ends the call
  // before the bytes are sent.
  v1::ModelFileChunk chunk;
  chunk.set_name(name);
  chunk.set_sha256(sha256);
  chunk.set_total_bytes(static_cast<int64_t>(bytes.size()));
  bool open = writer->Write(chunk);
  for (size_t offset = 0; open && offset < bytes.size();
       offset += kDefaultStateChunkBytes) {
    chunk.Clear();
    chunk.set_data(bytes.substr(offset, kDefaultStateChunkBytes));
    open = writer->Write(chunk);  // false: the call ended; Finish says why
  }
  writer->WritesDone();
  return CallFailed(label_, "put_model_file", writer->Finish());
}

absl::Status WorkerClient::Release(const v1::ReleaseRequest& request,
                                   absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::ReleaseResponse response;
  return CallFailed(label_, "release",
                    stub_->Release(&ctx, request, &response));
}

std::function<void(const grpc::Status&)> WorkerClient::Holding(
    std::function<void(const grpc::Status&)> on_done) const {
  return [channel = channel_, stub = stub_, generic_stub = generic_stub_,
          on_done = std::move(on_done)](const grpc::Status& s) {
    if (on_done) on_done(s);
  };
}

std::shared_ptr<StreamClient> WorkerClient::OpenStream(
    StreamClient::Handlers handlers) {
  handlers.on_done = Holding(std::move(handlers.on_done));
  return StreamClient::Open(generic_stub_.get(), std::move(handlers));
}

std::shared_ptr<ControlClient> WorkerClient::OpenControl(
    const v1::ControlRequest& request, ControlClient::Handlers handlers) {
  handlers.on_done = Holding(std::move(handlers.on_done));
  return ControlClient::Open(stub_.get(), request, std::move(handlers));
}

}  // namespace interlock
