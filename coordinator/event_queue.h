// What a chain of blocks tells the run driver, in order: the one event queue
// both engines fill (the in-process engine from its block hosts, the
// cluster engine from its streams). The first failure wins and is what the
// driver sees next; Reset starts a new attempt.
#ifndef INTERLOCK_COORDINATOR_EVENT_QUEUE_H_
#define INTERLOCK_COORDINATOR_EVENT_QUEUE_H_

#include <condition_variable>
#include <deque>
#include <mutex>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coordinator/engine.h"

namespace interlock {

class EventQueue {
 public:
  void Push(EngineEvent e) {
    std::lock_guard<std::mutex> l(mu_);
    PushLocked(std::move(e));
  }
  void Fail(absl::Status s) {
    std::lock_guard<std::mutex> l(mu_);
    FailLocked(std::move(s));
  }
  // The next event, waiting up to `wait` for one (InfiniteDuration: until
  // one comes); `if_none` when none came. A failure comes before events.
  absl::StatusOr<EngineEvent> Next(absl::Duration wait, absl::Status if_none);
  // Whether Next would answer at once.
  bool Ready() {
    std::lock_guard<std::mutex> l(mu_);
    return !events_.empty() || !error_.ok();
  }
  // A new attempt: the failure and the events queued are dropped.
  void Reset() {
    std::lock_guard<std::mutex> l(mu_);
    error_ = absl::OkStatus();
    events_.clear();
  }

  // For state a producer keeps under the queue's lock, so that its own
  // waits also end when the chain fails (the cluster's links).
  std::unique_lock<std::mutex> Lock() {
    return std::unique_lock<std::mutex>(mu_);
  }
  void PushLocked(EngineEvent e) {
    events_.push_back(std::move(e));
    cv_.notify_all();
  }
  void FailLocked(absl::Status s) {
    if (error_.ok()) error_ = std::move(s);
    cv_.notify_all();
  }
  const absl::Status& ErrorLocked() const { return error_; }
  void NotifyLocked() { cv_.notify_all(); }
  // Waits with `l` (from Lock) until `done` holds or `deadline` passes;
  // whether `done` holds.
  template <typename Pred>
  bool WaitUntil(std::unique_lock<std::mutex>& l, absl::Time deadline,
                 Pred done) {
    return cv_.wait_until(l, absl::ToChronoTime(deadline), done);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<EngineEvent> events_;
  absl::Status error_;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_EVENT_QUEUE_H_
