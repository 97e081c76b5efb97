#include "services/block_host.h"

#include <chrono>
#include <future>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/runtime.h"

namespace interlock {

void BlockHost::SharedQueue::RunPending() {
  while (!tasks_.empty()) {
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    task();
  }
}

BlockHost::BlockHost(Options options, std::unique_ptr<BlockDriver> driver)
    : options_(std::move(options)), driver_(std::move(driver)) {
  if (!options_.shared) thread_ = std::thread([this] { Loop(); });
}

BlockHost::~BlockHost() { Stop(StopMode::kAbandon); }

bool BlockHost::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stopping_) return false;
    if (options_.shared) {
      options_.shared->Push(std::move(task));
      return true;
    }
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

void BlockHost::Call(const std::function<void()>& task) {
  if (options_.shared) {
    task();
    return;
  }
  std::promise<void> done;
  if (!Post([&] {
        task();
        done.set_value();
      })) {
    task();  // stopped: nothing else touches the block any more
    return;
  }
  done.get_future().wait();
}

void BlockHost::Forward(ForwardMsg msg) {
  Post([this, msg = std::move(msg)]() mutable {
    Report(driver_->OnForward(std::move(msg)));
  });
}

void BlockHost::Upward(UpwardMsg msg) {
  Post([this, msg = std::move(msg)]() mutable {
    Report(driver_->OnUpward(std::move(msg)));
  });
}

void BlockHost::Stop(StopMode mode) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!stopping_) drain_ = mode == StopMode::kDrain;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
  }
}

absl::StatusOr<EvalResult> BlockHost::Evaluate(const EvalMsg& msg,
                                               const std::string& where) const {
  if (driver_->trainer().pending() > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": training micro-batches still in flight"));
  }
  return driver_->trainer().Evaluate(msg.input, msg.target, msg.nonfinite);
}

bool BlockHost::WaitingForGradients() const {
  return driver_ && driver_->trainer().NeedsDownstream() &&
         driver_->trainer().pending() > 0;
}

void BlockHost::Loop() {
  if (options_.threads > 0) ConfigureThreads(options_.threads);
  using Clock = std::chrono::steady_clock;
  for (;;) {
    std::function<void()> task;
    const bool idle = options_.on_idle && WaitingForGradients();
    const auto idle_start = Clock::now();
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stopping_ || !tasks_.empty(); });
      if (stopping_ && (!drain_ || tasks_.empty())) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    if (idle) {
      options_.on_idle(
          std::chrono::duration<double>(Clock::now() - idle_start).count());
    }
    task();
  }
}

}  // namespace interlock
