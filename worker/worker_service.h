// The thin gRPC adapter over WorkerCore (callback API), and the link factory
// that opens streams to the next block.
#ifndef INTERLOCK_WORKER_WORKER_SERVICE_H_
#define INTERLOCK_WORKER_WORKER_SERVICE_H_

#include <atomic>
#include <string>

#include "proto/worker.grpc.pb.h"
#include "rpc/security.h"
#include "worker/worker_core.h"

namespace interlock {

struct WorkerServiceOptions {
  // Every call must carry this bearer token (empty: no token).
  std::string token;
  // Stream and Control calls open at once; one more is refused with
  // RESOURCE_EXHAUSTED.
  int max_concurrent_streams = 8;
  // Counts calls refused for a missing or wrong token (may be null).
  prometheus::Counter* unauthenticated = nullptr;
};

// The callback service with Stream taking raw byte buffers: its messages
// are frames (rpc/frames.h), parsed without copying tensor values.
using WorkerServiceBase = interlock::v1::Worker::WithCallbackMethod_Configure<
    interlock::v1::Worker::WithRawCallbackMethod_Stream<
        interlock::v1::Worker::WithCallbackMethod_GetState<
            interlock::v1::Worker::WithCallbackMethod_SaveState<
                interlock::v1::Worker::WithCallbackMethod_LoadState<
                    interlock::v1::Worker::WithCallbackMethod_Control<
                        interlock::v1::Worker::WithCallbackMethod_Identify<
                            interlock::v1::Worker::
                                WithCallbackMethod_PutModelFile<
                                    interlock::v1::Worker::
                                        WithCallbackMethod_Release<
                                            interlock::v1::Worker::
                                                Service>>>>>>>>>;

// Every method checks the token first: a call without the right one ends
// with UNAUTHENTICATED and never reaches the core.
class WorkerService final : public WorkerServiceBase {
 public:
  WorkerService(WorkerCore* core, WorkerServiceOptions options)
      : core_(core), options_(std::move(options)) {}

  grpc::ServerUnaryReactor* Configure(
      grpc::CallbackServerContext* ctx,
      const interlock::v1::ConfigureRequest* request,
      interlock::v1::ConfigureResponse* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* GetState(
      grpc::CallbackServerContext* ctx,
      const interlock::v1::GetStateRequest* request,
      interlock::v1::GetStateResponse* response) override;
  grpc::ServerWriteReactor<interlock::v1::StateChunk>* SaveState(
      grpc::CallbackServerContext* ctx,
      const interlock::v1::SaveStateRequest* request) override;
  grpc::ServerReadReactor<interlock::v1::StateChunk>* LoadState(
      grpc::CallbackServerContext* ctx,
      interlock::v1::LoadStateResponse* response) override;
  grpc::ServerReadReactor<interlock::v1::ModelFileChunk>* PutModelFile(
      grpc::CallbackServerContext* ctx,
      interlock::v1::PutModelFileResponse* response) override;
  grpc::ServerWriteReactor<interlock::v1::ControlEvent>* Control(
      grpc::CallbackServerContext* ctx,
      const interlock::v1::ControlRequest* request) override;
  grpc::ServerUnaryReactor* Release(
      grpc::CallbackServerContext* ctx,
      const interlock::v1::ReleaseRequest* request,
      interlock::v1::ReleaseResponse* response) override;
  grpc::ServerUnaryReactor* Identify(
      grpc::CallbackServerContext* ctx,
      const interlock::v1::IdentifyRequest* request,
      interlock::v1::IdentifyResponse* response) override;

 private:
  absl::Status Authenticate(grpc::CallbackServerContext* ctx);
  // Authenticates a Stream or Control call and takes one of the
  // --max_concurrent_streams slots (the reactor gives it back).
  absl::Status AdmitStream(grpc::CallbackServerContext* ctx);

  WorkerCore* core_;
  const WorkerServiceOptions options_;
  std::atomic<int> open_streams_{0};
  std::atomic<bool> loading_{false};  // a LoadState call is open
  std::atomic<bool> putting_{false};  // a PutModelFile call is open
};

// Opens gRPC streams to the next block for WorkerCore, with this worker's
// certificates and token.
WorkerCore::LinkFactory GrpcLinkFactory(const TransportSecurity& security);

}  // namespace interlock

#endif  // INTERLOCK_WORKER_WORKER_SERVICE_H_
