// The thin gRPC adapter over WorkerCore (callback API), and the link factory
// that opens streams to the next block.
#ifndef INTERLOCK_WORKER_WORKER_SERVICE_H_
#define INTERLOCK_WORKER_WORKER_SERVICE_H_

#include "proto/worker.grpc.pb.h"
#include "worker/worker_core.h"

namespace interlock {

class WorkerService final : public interlock::v1::Worker::CallbackService {
 public:
  explicit WorkerService(WorkerCore* core) : core_(core) {}

  grpc::ServerUnaryReactor* Configure(
      grpc::CallbackServerContext* ctx,
      const interlock::v1::ConfigureRequest* request,
      interlock::v1::ConfigureResponse* response) override;
  grpc::ServerBidiReactor<interlock::v1::DownMessage, interlock::v1::UpMessage>*
  Stream(grpc::CallbackServerContext* ctx) override;
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

 private:
  WorkerCore* core_;
};

// Opens gRPC streams to the next block for WorkerCore.
WorkerCore::LinkFactory GrpcLinkFactory();

}  // namespace interlock

#endif  // INTERLOCK_WORKER_WORKER_SERVICE_H_
