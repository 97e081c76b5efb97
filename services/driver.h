// The per-block schedule around a BlockTrainer: orders micro-batches, defers
// the next step's forwards until this block's optimizer step, merges the loss
// reports coming up from below, and decides when to step (ARCHITECTURE:
// layers). Both the in-process runner and the worker service feed it; it is not
// thread-safe and must be driven from one thread (its BlockHost's executor).
#ifndef INTERLOCK_SERVICES_DRIVER_H_
#define INTERLOCK_SERVICES_DRIVER_H_

#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "services/messages.h"
#include "services/trainer.h"

namespace interlock {

class BlockDriver {
 public:
  struct Callbacks {
    std::function<void(ForwardMsg)> send_down;  // never called for the last
    std::function<void(UpwardMsg)> send_up;     // block 0: a completion
    std::function<void(StepDone)> step_done;
  };
  // `first_step` is the step the block expects next (non-zero on resume).
  // `replica`: which replica of its block this is (ARCHITECTURE: replicas); it
  // runs the micro-batches each step's routes give it (all of them when a
  // message has no routes).
  BlockDriver(std::unique_ptr<BlockTrainer> trainer, Callbacks callbacks,
              int64_t first_step = 0, int replica = 0);

  // Both return an error for a message that cannot belong to this run's
  // schedule (stale step, repeated micro-batch, wrong gradient count); the
  // driver's state is unchanged then.
  absl::Status OnForward(ForwardMsg msg);
  absl::Status OnUpward(UpwardMsg msg);

  // Whether a forward of (step, mb) was already received (run or queued):
  // a repeat must be acknowledged, not applied again.
  bool Seen(int64_t step, int mb) const;
  // No micro-batch in flight or queued: a step boundary.
  bool Idle() const;

  // The block's training state at the current step boundary (a LibTorch
  // archive), and its restoration; both need Idle().
  absl::StatusOr<std::string> SaveState() const;
  // The state copied into `into` (BlockTrainer::CopyState), a snapshot kept
  // in memory. Without the idle check, for step_done: the block has just
  // stepped and runs nothing of the next step before step_done returns, so
  // forwards queued for it do not change the state.
  absl::Status CopyStateAtBoundary(BlockStateRecord* into) const {
    return trainer_->CopyState(step_, into);
  }
  // The block continues from the archive's step (which must be `step`
  // unless that is -1).
  absl::Status LoadState(const std::string& archive, int64_t step = -1);
  // The same from a record (a snapshot CopyStateAtBoundary took).
  absl::Status LoadRecord(const BlockStateRecord& record, int64_t step = -1);

  BlockTrainer& trainer() { return *trainer_; }
  int64_t current_step() const { return step_; }
  // Forwards received ahead of their turn, waiting to run.
  size_t queued() const { return forward_queue_.size(); }
  // Whether a forward of (step, mb) with these routes would run at once
  // rather than wait.
  bool RunsNext(int64_t step, int mb,
                const std::vector<int32_t>& routes = {}) const;
  // The micro-batches of a step that `routes` give this replica, in order
  // (0..M-1 when `routes` is empty).
  std::vector<int> OwnMicrobatches(const std::vector<int32_t>& routes) const;

 private:
  absl::Status CheckIdleForLoad() const;
  struct MbState {
    bool backward_done = false;
    bool below_seen = false;          // the final upward message from block k+1
    std::vector<torch::Tensor> down;  // the downstream list, as it arrives
    std::vector<bool> down_nonfinite;  // its entries' non-finite marks
    int down_count = 0;
    std::vector<LossReport> reports;
    std::vector<OpTiming> timings;
  };

  absl::Status Drain();
  // Learns this step's own micro-batches from a queued forward of it;
  // false while none has come.
  bool KnowOwn();
  // Position of `mb` among this step's own micro-batches (-1: not ours).
  int OwnIndex(int mb) const;
  absl::Status RunForward(ForwardMsg msg);
  absl::Status RunBackward(int mb);
  // Runs the input-gradient pass of early upstream entry i and sends it.
  absl::Status SendEntry(int64_t step, int mb, int i, MbState& st,
                         const torch::Tensor& entry,
                         bool entry_nonfinite = false);
  void SendGradient(int64_t step, int mb, int i, torch::Tensor grad,
                    bool nonfinite);
  void MaybeSendUp(int mb, int64_t step);

  std::unique_ptr<BlockTrainer> trainer_;
  Callbacks cb_;
  const int m_;
  int64_t step_;
  double lr_ = 0.0;
  // This step's micro-batches on this replica, and its routes.
  bool own_known_ = false;
  std::vector<int> own_;
  std::vector<int32_t> routes_;
  const int replica_;
  int forwarded_ = 0;   // own micro-batches of step_ forwarded
  int backwarded_ = 0;  // own micro-batches of step_ backwarded
  std::map<std::pair<int64_t, int>, ForwardMsg> forward_queue_;
  std::map<std::pair<int64_t, int>, MbState> states_;
};

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_DRIVER_H_
