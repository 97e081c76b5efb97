// The run's plan, fixed by its configuration: how many steps, which training
// samples each micro-batch of each step takes, the learning rate of each
// step, and how many micro-batches may be in flight. A replay after a
// recovery asks again and gets the same answers.
#ifndef INTERLOCK_COORDINATOR_RUN_PLAN_H_
#define INTERLOCK_COORDINATOR_RUN_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/config.pb.h"

namespace interlock {

class RunPlan {
 public:
  // `config` has its defaults applied; `train_size` samples are available;
  // the chain has `blocks` blocks; `window` is the option (0: default).
  static absl::StatusOr<RunPlan> Make(const interlock::v1::RunConfig& config,
                                      int64_t train_size, int blocks,
                                      int window);

  // Steps the configuration asks for (a budget may stop the run earlier).
  int64_t steps() const { return steps_; }
  int64_t steps_per_epoch() const { return per_epoch_; }
  int microbatches() const { return m_; }
  int blocks() const { return k_; }
  int64_t batch_size() const { return batch_; }
  // Micro-batches in flight. A completion comes back only after the
  // micro-batch went down the whole chain and its reports came up again, so
  // keeping K blocks busy in 1-way and n-way needs about 2K of them (E2E
  // limits itself: block 0 waits for its gradient). Default 2KM.
  int window() const { return window_; }

  double LearningRate(int64_t step) const;
  // Indices of the training samples of micro-batch `mb` of `step`: the
  // epoch's permutation of the training set, cut into batches and those
  // into micro-batches.
  std::vector<int64_t> Samples(int64_t step, int mb);
  // Where the data order stands before `step` (checkpoint cursor).
  int64_t EpochOf(int64_t step) const { return step / per_epoch_; }
  int64_t OffsetOf(int64_t step) const { return (step % per_epoch_) * batch_; }

 private:
  RunPlan(const interlock::v1::RunConfig& config, int64_t train_size,
          int blocks)
      : schedule_(config.schedule()),
        seed_(config.training().seed()),
        train_size_(train_size),
        batch_(config.training().batch_size()),
        m_(config.training().microbatches()),
        k_(blocks) {}

  interlock::v1::ScheduleSpec schedule_;
  uint64_t seed_;
  int64_t train_size_;
  int64_t batch_;
  int m_;
  int k_;
  int64_t per_epoch_ = 0;
  int64_t steps_ = 0;
  int window_ = 0;
  // The permutation of the epoch last asked for.
  int64_t epoch_ = -1;
  std::vector<int64_t> perm_;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RUN_PLAN_H_
