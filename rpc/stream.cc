#include "rpc/stream.h"

#include <iterator>

#include "rpc/frames.h"
#include "rpc/status.h"

namespace interlock {

std::shared_ptr<StreamClient> StreamClient::Open(grpc::GenericStub* stub,
                                                 Handlers handlers) {
  std::shared_ptr<StreamClient> s(new StreamClient(std::move(handlers)));
  s->self_ = s;
  stub->PrepareBidiStreamingCall(&s->ctx_, kStreamMethod, grpc::StubOptions(),
                                 s.get());
  // Writes start from outside the reactions (Send, CloseWrites). Without a
  // hold the call may complete, and gRPC destroy its half of the stream,
  // between a failed read and OnDone; a write started then calls into the
  // destroyed stream ("pure virtual method called"). The hold is dropped
  // once no write can start any more (ReleaseHoldLocked).
  s->AddHold();
  s->StartRead(&s->incoming_);
  s->StartCall();
  return s;
}

void StreamClient::Send(const DownFrame& msg) {
  grpc::ByteBuffer buffer = ToByteBuffer(msg);
  bool release = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (close_requested_ || !holding_) return;
    queue_.push_back(std::move(buffer));
    release = MaybeWriteLocked();
  }
  if (release) RemoveHold();
}

void StreamClient::CloseWrites() {
  bool release = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (close_requested_) return;
    close_requested_ = true;
    release = MaybeWriteLocked();
  }
  if (release) RemoveHold();
}

bool StreamClient::MaybeWriteLocked() {
  if (writing_ || !holding_) return false;
  if (!queue_.empty()) {
    writing_ = true;
    StartWrite(&queue_.front());
    return false;
  }
  if (close_requested_) {
    StartWritesDone();
    return ReleaseHoldLocked();
  }
  return false;
}

bool StreamClient::ReleaseHoldLocked() {
  if (!holding_) return false;
  holding_ = false;
  // What was not written is dropped; a message being written stays until
  // its OnWriteDone (gRPC may still read it).
  queue_.erase(writing_ ? std::next(queue_.begin()) : queue_.begin(),
               queue_.end());
  return true;
}

void StreamClient::OnWriteDone(bool ok) {
  bool release = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    writing_ = false;
    if (!queue_.empty()) queue_.pop_front();
    // A failed write: the stream is broken and OnDone says why.
    release = ok ? MaybeWriteLocked() : ReleaseHoldLocked();
  }
  if (release) RemoveHold();
}

void StreamClient::OnReadDone(bool ok) {
  if (!ok) {
    // The peer ended the stream (or it broke): nothing more is written.
    bool release = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      release = ReleaseHoldLocked();
    }
    if (release) RemoveHold();
    return;
  }
  absl::StatusOr<UpFrame> frame = UpFrameOf(incoming_);
  incoming_.Clear();
  if (!frame.ok()) {
    // As a message gRPC could not parse: the call ends, with the reason,
    // and nothing more is written.
    bool release = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      refused_ = ToGrpcStatus(frame.status());
      release = ReleaseHoldLocked();
    }
    ctx_.TryCancel();
    if (release) RemoveHold();
    return;
  }
  if (handlers_.on_message) handlers_.on_message(*std::move(frame));
  StartRead(&incoming_);
}

void StreamClient::OnDone(const grpc::Status& s) {
  std::shared_ptr<StreamClient> keep;
  grpc::Status status = s;
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.clear();
    keep = std::move(self_);
    if (!refused_.ok()) status = refused_;
  }
  if (handlers_.on_done) handlers_.on_done(status);
}

std::shared_ptr<ControlClient> ControlClient::Open(
    interlock::v1::Worker::Stub* stub,
    const interlock::v1::ControlRequest& request, Handlers handlers) {
  std::shared_ptr<ControlClient> c(new ControlClient(std::move(handlers)));
  c->self_ = c;
  c->request_ = request;  // read by gRPC until the call starts
  stub->async()->Control(&c->ctx_, &c->request_, c.get());
  c->StartRead(&c->incoming_);
  c->StartCall();
  return c;
}

void ControlClient::OnReadDone(bool ok) {
  if (!ok) return;  // end of stream; OnDone follows
  if (handlers_.on_event) handlers_.on_event(std::move(incoming_));
  incoming_.Clear();
  StartRead(&incoming_);
}

void ControlClient::OnDone(const grpc::Status& s) {
  std::shared_ptr<ControlClient> keep;
  {
    std::lock_guard<std::mutex> l(mu_);
    keep = std::move(self_);
  }
  if (handlers_.on_done) handlers_.on_done(s);
}

}  // namespace interlock
