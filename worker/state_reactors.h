// The reactors of the chunked calls: SaveState and LoadState (a block's
// state, rpc/state_chunks) and PutModelFile (a scripted model's file),
// checked and applied by the core.
#ifndef INTERLOCK_WORKER_STATE_REACTORS_H_
#define INTERLOCK_WORKER_STATE_REACTORS_H_

#include <grpcpp/grpcpp.h>

#include <atomic>

#include "proto/worker.grpc.pb.h"
#include "worker/worker_core.h"

namespace interlock {

grpc::ServerWriteReactor<interlock::v1::StateChunk>* NewSaveReactor(
    WorkerCore* core, const interlock::v1::SaveStateRequest& request);
// `slot` is set while a LoadState is open (one at a time); the reactor
// clears it as soon as its caller has a status.
grpc::ServerReadReactor<interlock::v1::StateChunk>* NewLoadReactor(
    WorkerCore* core, interlock::v1::LoadStateResponse* response,
    std::atomic<bool>* slot);

// `slot` as NewLoadReactor's, for PutModelFile.
grpc::ServerReadReactor<interlock::v1::ModelFileChunk>* NewPutModelFileReactor(
    WorkerCore* core, interlock::v1::PutModelFileResponse* response,
    std::atomic<bool>* slot);

}  // namespace interlock

#endif  // INTERLOCK_WORKER_STATE_REACTORS_H_
