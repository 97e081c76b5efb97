#include "coordinator/run_plan.h"

#include "absl/strings/str_cat.h"
#include "services/data.h"
#include "services/optim.h"

namespace interlock {

absl::StatusOr<RunPlan> RunPlan::Make(const interlock::v1::RunConfig& config,
                                      int64_t train_size, int blocks,
                                      int window) {
  RunPlan p(config, train_size, blocks);
  const auto& t = config.training();
  p.per_epoch_ = train_size / p.batch_;
  if (p.per_epoch_ == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "training.batch_size: ", p.batch_, " is larger than the training set (",
        train_size, " samples)"));
  }
  p.steps_ = t.steps() > 0 ? t.steps() : t.epochs() * p.per_epoch_;
  p.window_ = window > 0 ? window : 2 * blocks * p.m_;
  return p;
}

double RunPlan::LearningRate(int64_t step) const {
  return LearningRateAt(schedule_, step, steps_);
}

std::vector<int64_t> RunPlan::Samples(int64_t step, int mb) {
  if (EpochOf(step) != epoch_) {
    epoch_ = EpochOf(step);
    perm_ = EpochPermutation(train_size_, seed_, epoch_);
  }
  const int64_t base = OffsetOf(step);
  const int64_t per_mb = batch_ / m_;
  return std::vector<int64_t>(perm_.begin() + base + mb * per_mb,
                              perm_.begin() + base + (mb + 1) * per_mb);
}

}  // namespace interlock
