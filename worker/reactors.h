// Building blocks of the worker's callback reactors (worker_service.cc,
// state_reactors.cc): a refusal before the core, a write queue with one
// write in flight, and the handle the core holds, which outlives a reactor.
#ifndef INTERLOCK_WORKER_REACTORS_H_
#define INTERLOCK_WORKER_REACTORS_H_

#include <grpcpp/grpcpp.h>

#include <deque>
#include <mutex>

#include "absl/status/status.h"
#include "rpc/status.h"

namespace interlock {

// A call refused before it reaches the core.
template <typename Reactor>
class Refused : public Reactor {
 public:
  explicit Refused(const absl::Status& s) { this->Finish(ToGrpcStatus(s)); }
  void OnDone() override { delete this; }
};

// Writes `Out` messages in order, one in flight at a time, and finishes once
// what was queued before the end is written (or a write failed).
template <typename Reactor, typename Out>
class QueuedWrites : public Reactor {
 public:
  void Enqueue(Out msg) {
    std::lock_guard<std::mutex> l(mu_);
    if (finishing_) return;
    queue_.push_back(std::move(msg));
    if (!writing_) {
      writing_ = true;
      this->StartWrite(&queue_.front());
    }
  }

  void FinishOnce(const absl::Status& s) {
    std::lock_guard<std::mutex> l(mu_);
    FinishLocked(s);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> l(mu_);
    queue_.pop_front();
    if (ok && !queue_.empty()) {
      this->StartWrite(&queue_.front());
      return;
    }
    writing_ = false;
    if (!ok) {
      queue_.clear();
      if (!finishing_) {
        finishing_ = true;
        final_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed");
      }
    }
    if (finishing_) this->Finish(final_);
  }

 protected:
  void FinishLocked(const absl::Status& s) {
    if (finishing_) return;
    finishing_ = true;
    final_ = ToGrpcStatus(s);
    if (!writing_) this->Finish(final_);
  }

  std::mutex mu_;
  bool finishing_ = false;  // guarded by mu_

 private:
  std::deque<Out> queue_;
  bool writing_ = false;
  grpc::Status final_;
};

// What the core holds of a reactor: calls reach it until OnDone orphans
// the handle, and are dropped after.
template <typename R>
class ReactorHandle {
 public:
  explicit ReactorHandle(R* r) : reactor_(r) {}
  template <typename F>
  void With(F f) {
    std::lock_guard<std::mutex> l(mu_);
    if (reactor_) f(reactor_);
  }
  void Orphan() {
    std::lock_guard<std::mutex> l(mu_);
    reactor_ = nullptr;
  }

 private:
  std::mutex mu_;
  R* reactor_;
};

}  // namespace interlock

#endif  // INTERLOCK_WORKER_REACTORS_H_
