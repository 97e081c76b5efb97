// Optimisers and learning-rate schedules. The coordinator computes the rate
// of each step; the optimizer only applies it.
#ifndef INTERLOCK_SERVICES_OPTIM_H_
#define INTERLOCK_SERVICES_OPTIM_H_

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
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

  // The per-parameter state as named tensors (on the parameters' device;
  // "step" on the CPU), for checkpoints: for
  // parameter i (in the order given to Create) that has state,
  // "<i>.momentum_buffer" (SGD) or "<i>.step" (an int64 scalar),
  // "<i>.exp_avg", "<i>.exp_avg_sq" and "<i>.max_exp_avg_sq" (Adam, AdamW;
  // the last only when defined).
  std::map<std::string, torch::Tensor> StateTensors() const;
  // Replaces the state with what StateTensors() gave (on any device: the
  // state is copied to its parameter's). Every name, dtype and shape is
  // checked first (`what` names the source in errors); on error nothing
  // changes.
  absl::Status LoadStateTensors(const std::map<std::string, torch::Tensor>& in,
                                const std::string& what);

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
