// A worker's control stream, read on a thread of its own, for tests that
// drive a worker by hand: step reports, duplicate acknowledgements,
// evaluation results and failures arrive here, not on the Stream.
#ifndef INTERLOCK_TESTS_CONTROL_WATCHER_H_
#define INTERLOCK_TESTS_CONTROL_WATCHER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "proto/worker.grpc.pb.h"

namespace interlock::testing {

class ControlWatcher {
 public:
  // Opens the control stream of run `run_id`; `opened()` says whether the
  // worker took it.
  ControlWatcher(interlock::v1::Worker::Stub* stub, const std::string& run_id,
                 int64_t generation = 1) {
    interlock::v1::ControlRequest req;
    req.set_run_id(run_id);
    req.set_generation(generation);
    reader_ = stub->Control(&ctx_, req);
    thread_ = std::thread([this] {
      interlock::v1::ControlEvent e;
      while (reader_->Read(&e)) {
        std::lock_guard<std::mutex> l(mu_);
        events_.push_back(e);
        cv_.notify_all();
      }
      grpc::Status s = reader_->Finish();
      std::lock_guard<std::mutex> l(mu_);
      status_ = s;
      cv_.notify_all();
    });
    opened_ = Await([](const auto& e) { return e.has_opened(); }).has_value();
  }
  ~ControlWatcher() {
    ctx_.TryCancel();
    thread_.join();
  }

  bool opened() const { return opened_; }

  // The first event `match` accepts, taken off the stream's events; nothing
  // if none came within `timeout`.
  std::optional<interlock::v1::ControlEvent> Await(
      std::function<bool(const interlock::v1::ControlEvent&)> match,
      std::chrono::seconds timeout = std::chrono::seconds(30)) {
    std::unique_lock<std::mutex> l(mu_);
    std::optional<interlock::v1::ControlEvent> found;
    cv_.wait_for(l, timeout, [&] {
      for (auto it = events_.begin(); it != events_.end(); ++it) {
        if (match(*it)) {
          found = *it;
          events_.erase(it);
          return true;
        }
      }
      return status_.has_value();
    });
    return found;
  }

  // How the stream ended, once it has.
  std::optional<grpc::Status> status() {
    std::lock_guard<std::mutex> l(mu_);
    return status_;
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<interlock::v1::ControlEvent>> reader_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<interlock::v1::ControlEvent> events_;
  std::optional<grpc::Status> status_;
  bool opened_ = false;
};

}  // namespace interlock::testing

#endif  // INTERLOCK_TESTS_CONTROL_WATCHER_H_
