// The block host: one executor (a thread and a FIFO of tasks) that owns a
// block's BlockDriver. Every touch of the block happens on the executor, in
// the order posted; with one intra-op thread that keeps the block
// deterministic (ARCHITECTURE: layers). The worker (worker/worker_core.h) and
// the in-process engine (coordinator/inprocess_engine.cc) both host their
// blocks here and add only their wiring: network links, or in-memory delivery
// to the neighbouring host.
#ifndef INTERLOCK_SERVICES_BLOCK_HOST_H_
#define INTERLOCK_SERVICES_BLOCK_HOST_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/driver.h"
#include "services/messages.h"

namespace interlock {

class BlockHost {
 public:
  // Hosts sharing one queue have no thread: their tasks run on the thread
  // that calls RunPending, in the order posted across all of them (the
  // in-process engine's sequential schedule). Not thread-safe.
  class SharedQueue {
   public:
    void Push(std::function<void()> task) { tasks_.push_back(std::move(task)); }
    // Runs tasks, including those they post, until none is left.
    void RunPending();
    void Clear() { tasks_.clear(); }

   private:
    std::deque<std::function<void()>> tasks_;
  };

  struct Options {
    // Intra-op threads of the executor thread (0: left as they are).
    int threads = 0;
    // Null: the host runs a thread of its own.
    SharedQueue* shared = nullptr;
    // An error of a message posted with Forward or Upward (on the executor).
    std::function<void(absl::Status)> on_error;
    // The seconds the executor waited for work while its block waited for
    // gradients from below (on the executor, own thread only).
    std::function<void(double)> on_idle;
  };

  explicit BlockHost(Options options,
                     std::unique_ptr<BlockDriver> driver = nullptr);
  ~BlockHost();
  BlockHost(const BlockHost&) = delete;
  BlockHost& operator=(const BlockHost&) = delete;

  // Runs `task` on the executor after everything posted before it. Returns
  // false (and drops it) once the host is stopped.
  bool Post(std::function<void()> task);
  // Runs `task` on the executor and waits for it; never from the executor.
  // On a shared queue, or once stopped, it runs here at once.
  void Call(const std::function<void()>& task);
  // Messages for the driver, handled in the order posted.
  void Forward(ForwardMsg msg);
  void Upward(UpwardMsg msg);

  enum class StopMode {
    kAbandon,  // tasks not yet started are dropped
    kDrain,    // tasks posted before the stop still run
  };
  // Ends the executor and joins it; later posts are dropped. The driver
  // stays (training is over; its state may still be read).
  void Stop(StopMode mode);

  // The hosted block: on the executor only (or after Stop).
  BlockDriver* driver() const { return driver_.get(); }
  void set_driver(std::unique_ptr<BlockDriver> driver) {
    driver_ = std::move(driver);
  }
  // Forward-only pass of one batch through this block (and its head), for
  // a block with no training micro-batch in flight. `where` names the
  // batch in errors.
  absl::StatusOr<EvalResult> Evaluate(const EvalMsg& msg,
                                      const std::string& where) const;

 private:
  void Loop();
  // The block has forwarded micro-batches whose gradients have not come.
  bool WaitingForGradients() const;
  void Report(const absl::Status& s) {
    if (!s.ok() && options_.on_error) options_.on_error(s);
  }

  const Options options_;
  std::unique_ptr<BlockDriver> driver_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  bool drain_ = false;  // on stop, run what was posted first
  std::thread thread_;
};

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_BLOCK_HOST_H_
