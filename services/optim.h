// Optimisers and learning-rate schedules. The coordinator computes the rate
// of each step; the optimizer only applies it.
#ifndef INTERLOCK_SERVICES_OPTIM_H_
#define INTERLOCK_SERVICES_OPTIM_H_

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/config.pb.h"

namespace interlock {

// A thin wrapper over torch::optim that can set the rate of every step.
class Optimizer {
 public:
  static absl::StatusOr<std::unique_ptr<Optimizer>> Create(
      const interlock::v1::OptimizerSpec& spec,
      std::vector<torch::Tensor> params);
  void Step(double lr);
  void ZeroGrad();
  torch::optim::Optimizer& impl() { return *impl_; }

 private:
  explicit Optimizer(std::unique_ptr<torch::optim::Optimizer> impl,
                     interlock::v1::OptimizerSpec::Kind kind)
      : impl_(std::move(impl)), kind_(kind) {}
  std::unique_ptr<torch::optim::Optimizer> impl_;
  interlock::v1::OptimizerSpec::Kind kind_;
};

// Learning rate of step `step` (0-based) of a run of `total_steps` steps.
double LearningRateAt(const interlock::v1::ScheduleSpec& schedule, int64_t step,
                      int64_t total_steps);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_OPTIM_H_
