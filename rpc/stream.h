// Client sides of a worker's streams: the Stream link (coordinator -> block
// 0, block k -> block k+1), a callback-API reactor with a write queue, so
// callers never block and only one write is in flight at a time, that
// sends and reads frames (rpc/frames.h: tensor values are not copied); and
// the Control stream (worker -> coordinator).
#ifndef INTERLOCK_RPC_STREAM_H_
#define INTERLOCK_RPC_STREAM_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <deque>
#include <functional>
#include <memory>
#include <mutex>

#include "proto/worker.grpc.pb.h"
#include "services/wire_frame.h"

namespace interlock {

class StreamClient
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  struct Handlers {
    // Called on a gRPC thread for every message read; must not block.
    std::function<void(UpFrame)> on_message;
    // Called once when the stream has ended (after CloseWrites, an error,
    // the peer going away, or a message read that is not an UpMessage:
    // then with INVALID_ARGUMENT saying why).
    std::function<void(const grpc::Status&)> on_done;
  };

  // Opens the stream (Worker.Stream on `stub`'s channel). The returned
  // object stays alive until on_done ran and the caller dropped its
  // reference.
  static std::shared_ptr<StreamClient> Open(grpc::GenericStub* stub,
                                            Handlers handlers);

  void Send(const DownFrame& msg);
  // Half-closes: the peer sees the end of its reads and finishes.
  void CloseWrites();
  void Cancel() { ctx_.TryCancel(); }

  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& s) override;

 private:
  explicit StreamClient(Handlers h) : handlers_(std::move(h)) {}
  // Start the next write or the half-close. Both return true when the hold
  // is to be removed (by the caller, once mu_ is released).
  bool MaybeWriteLocked();
  bool ReleaseHoldLocked();

  Handlers handlers_;
  grpc::ClientContext ctx_;
  grpc::ByteBuffer incoming_;
  std::mutex mu_;
  std::deque<grpc::ByteBuffer> queue_;
  grpc::Status refused_;  // a message read did not parse; guarded by mu_
  bool writing_ = false;
  bool close_requested_ = false;
  bool holding_ = true;                 // writes may still start (see Open)
  std::shared_ptr<StreamClient> self_;  // keeps the reactor alive until OnDone
};

// Client side of a worker's Control stream (the coordinator): reads events
// until the stream ends or Cancel.
class ControlClient
    : public grpc::ClientReadReactor<interlock::v1::ControlEvent> {
 public:
  struct Handlers {
    // Called on a gRPC thread for every event read; must not block.
    std::function<void(interlock::v1::ControlEvent)> on_event;
    // Called once when the stream has ended.
    std::function<void(const grpc::Status&)> on_done;
  };

  // Opens the stream. The returned object stays alive until on_done ran and
  // the caller dropped its reference.
  static std::shared_ptr<ControlClient> Open(
      interlock::v1::Worker::Stub* stub,
      const interlock::v1::ControlRequest& request, Handlers handlers);

  void Cancel() { ctx_.TryCancel(); }

  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& s) override;

 private:
  explicit ControlClient(Handlers h) : handlers_(std::move(h)) {}

  Handlers handlers_;
  grpc::ClientContext ctx_;
  interlock::v1::ControlRequest request_;
  interlock::v1::ControlEvent incoming_;
  std::mutex mu_;
  std::shared_ptr<ControlClient> self_;  // keeps the reactor alive until OnDone
};

}  // namespace interlock

#endif  // INTERLOCK_RPC_STREAM_H_
