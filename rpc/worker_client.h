// The one client of a worker, used by the coordinator and by a worker's
// link to the next block: channel and stub, the Stream, and the state calls
// with their chunking. Errors keep the code the call ended with and name
// the worker and the call.
#ifndef INTERLOCK_RPC_WORKER_CLIENT_H_
#define INTERLOCK_RPC_WORKER_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/worker.grpc.pb.h"
#include "rpc/security.h"
#include "rpc/stream.h"
#include "services/block_archive.h"

namespace interlock {

class WorkerClient {
 public:
  // `name` prefixes every error, e.g. "worker 2"; the address is added.
  WorkerClient(const std::string& name, std::string address,
               int64_t max_message_bytes, const TransportSecurity& security);

  const std::string& address() const { return address_; }
  // "worker 2 (10.0.0.7:5002)"
  const std::string& label() const { return label_; }

  bool WaitForConnected(absl::Time deadline);
  // OK while the worker answers its liveness health check by the deadline
  // (configured or not). Unlike WaitForConnected, this notices a worker
  // that died while its channel still looks connected.
  absl::Status Ping(absl::Time deadline);

  // `wait_for_ready`: wait for a worker still coming up instead of failing
  // at once while it is unreachable.
  absl::StatusOr<interlock::v1::ConfigureResponse> Configure(
      const interlock::v1::ConfigureRequest& request, absl::Time deadline,
      bool wait_for_ready);
  // Sends one of a scripted model's files ahead of Configure, in chunks;
  // a worker that holds it already reads no further (no error).
  absl::Status PutModelFile(const std::string& name, const std::string& sha256,
                            const std::string& bytes, absl::Time deadline,
                            bool wait_for_ready);
  // Tells a worker the run left it out of `request.generation()`
  // (WorkerCore::Release).
  absl::Status Release(const interlock::v1::ReleaseRequest& request,
                       absl::Time deadline);
  // The worker process's instance id (Identify).
  absl::StatusOr<std::string> Identify(absl::Time deadline);
  // A response of up to `max_bytes` is accepted (0: the largest message
  // of the run, as on every other call). A block's parameters can be
  // larger than any message its run sends; such a call goes over a
  // channel of its own.
  absl::StatusOr<interlock::v1::GetStateResponse> GetState(
      const interlock::v1::GetStateRequest& request, absl::Time deadline,
      int64_t max_bytes = 0);
  // The state of `block`, whole and checked against its header (size,
  // SHA-256); at most `max_bytes` are accepted.
  absl::StatusOr<BlockStateArchive> SaveState(
      const interlock::v1::SaveStateRequest& request, int block,
      absl::Time deadline, int64_t max_bytes);
  absl::Status LoadState(const BlockStateArchive& state, absl::Time deadline) {
    return LoadState(state, state.bytes, deadline);
  }
  // The same with the archive's bytes kept apart (`header.bytes` unused).
  absl::Status LoadState(const BlockStateArchive& header,
                         const std::string& bytes, absl::Time deadline);

  // Opens the worker's Stream. The stream keeps the channel and stub alive
  // until `on_done` ran, however long this client lives.
  std::shared_ptr<StreamClient> OpenStream(StreamClient::Handlers handlers);
  // Opens the worker's Control stream, kept alive the same way.
  std::shared_ptr<ControlClient> OpenControl(
      const interlock::v1::ControlRequest& request,
      ControlClient::Handlers handlers);

 private:
  // `on_done` holding the channel and stub until the call ended.
  std::function<void(const grpc::Status&)> Holding(
      std::function<void(const grpc::Status&)> on_done) const;

  const std::string address_;
  const std::string label_;
  const int64_t max_message_bytes_;
  const TransportSecurity security_;
  std::shared_ptr<grpc::Channel> channel_;
  // GetState's channel for responses above max_message_bytes_, made on
  // first use, and the limit it was made with.
  std::mutex large_mu_;
  std::shared_ptr<grpc::Channel> large_channel_;  // guarded by large_mu_
  int64_t large_bytes_ = 0;                       // guarded by large_mu_
  std::shared_ptr<interlock::v1::Worker::Stub> stub_;
  // The Stream method sends and reads frames as raw byte buffers.
  std::shared_ptr<grpc::GenericStub> generic_stub_;
};

}  // namespace interlock

#endif  // INTERLOCK_RPC_WORKER_CLIENT_H_
