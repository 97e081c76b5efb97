#include "coordinator/event_queue.h"

namespace interlock {

absl::StatusOr<EngineEvent> EventQueue::Next(absl::Duration wait,
                                             absl::Status if_none) {
  std::unique_lock<std::mutex> l(mu_);
  auto ready = [&] { return !events_.empty() || !error_.ok(); };
  if (wait == absl::InfiniteDuration()) {
    cv_.wait(l, ready);
  } else if (wait > absl::ZeroDuration()) {
    cv_.wait_for(l, absl::ToChronoSeconds(wait), ready);
  }
  if (!error_.ok()) return error_;
  if (events_.empty()) return if_none;
  EngineEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

}  // namespace interlock
