#include "rpc/stream.h"

namespace interlock {

std::shared_ptr<StreamClient> StreamClient::Open(
    interlock::v1::Worker::Stub* stub, Handlers handlers) {
  std::shared_ptr<StreamClient> s(new StreamClient(std::move(handlers)));
  s->self_ = s;
  stub->async()->Stream(&s->ctx_, s.get());
  s->StartRead(&s->incoming_);
  s->StartCall();
  return s;
}

void StreamClient::Send(interlock::v1::DownMessage msg) {
  std::lock_guard<std::mutex> l(mu_);
  if (close_requested_ || done_) return;
  queue_.push_back(std::move(msg));
  MaybeWriteLocked();
}

void StreamClient::CloseWrites() {
  std::lock_guard<std::mutex> l(mu_);
  if (close_requested_) return;
  close_requested_ = true;
  MaybeWriteLocked();
}

void StreamClient::MaybeWriteLocked() {
  if (writing_ || done_) return;
  if (!queue_.empty()) {
    writing_ = true;
    StartWrite(&queue_.front());
  } else if (close_requested_ && !closed_) {
    closed_ = true;
    StartWritesDone();
  }
}

void StreamClient::OnWriteDone(bool ok) {
  std::lock_guard<std::mutex> l(mu_);
  writing_ = false;
  if (!queue_.empty()) queue_.pop_front();
  if (!ok) {
    // The stream is broken; OnDone reports why.
    queue_.clear();
    return;
  }
  MaybeWriteLocked();
}

void StreamClient::OnReadDone(bool ok) {
  if (!ok) return;  // end of stream; OnDone follows
  if (handlers_.on_message) handlers_.on_message(std::move(incoming_));
  incoming_.Clear();
  StartRead(&incoming_);
}

void StreamClient::OnDone(const grpc::Status& s) {
  std::shared_ptr<StreamClient> keep;
  {
    std::lock_guard<std::mutex> l(mu_);
    done_ = true;
    queue_.clear();
    keep = std::move(self_);
  }
  if (handlers_.on_done) handlers_.on_done(s);
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
