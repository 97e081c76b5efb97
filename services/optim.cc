#include "services/optim.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace interlock {

using interlock::v1::OptimizerSpec;
using interlock::v1::ScheduleSpec;

absl::StatusOr<std::unique_ptr<Optimizer>> Optimizer::Create(
    const OptimizerSpec& spec, std::vector<torch::Tensor> params) {
  const double beta1 = spec.beta1() > 0 ? spec.beta1() : 0.9;
  const double beta2 = spec.beta2() > 0 ? spec.beta2() : 0.999;
  const double eps = spec.eps() > 0 ? spec.eps() : 1e-8;
  // The rate set here is replaced before every step.
  switch (spec.kind()) {
    case OptimizerSpec::KIND_UNSPECIFIED:
    case OptimizerSpec::SGD: {
      if (spec.nesterov() && spec.momentum() <= 0) {
        return absl::InvalidArgumentError(
            "optimizer.nesterov: needs optimizer.momentum > 0");
      }
      auto opts = torch::optim::SGDOptions(0.1)
                      .momentum(spec.momentum())
                      .nesterov(spec.nesterov())
                      .weight_decay(spec.weight_decay());
      return std::unique_ptr<Optimizer>(new Optimizer(
          std::make_unique<torch::optim::SGD>(std::move(params), opts),
          OptimizerSpec::SGD));
    }
    case OptimizerSpec::ADAM: {
      auto opts = torch::optim::AdamOptions(1e-3)
                      .betas({beta1, beta2})
                      .eps(eps)
                      .weight_decay(spec.weight_decay());
      return std::unique_ptr<Optimizer>(new Optimizer(
          std::make_unique<torch::optim::Adam>(std::move(params), opts),
          OptimizerSpec::ADAM));
    }
    case OptimizerSpec::ADAMW: {
      auto opts = torch::optim::AdamWOptions(1e-3)
                      .betas({beta1, beta2})
                      .eps(eps)
                      .weight_decay(spec.weight_decay());
      return std::unique_ptr<Optimizer>(new Optimizer(
          std::make_unique<torch::optim::AdamW>(std::move(params), opts),
          OptimizerSpec::ADAMW));
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer.kind: unknown value ", spec.kind()));
  }
}

void Optimizer::Step(double lr) {
  for (auto& group : impl_->param_groups()) {
    switch (kind_) {
      case OptimizerSpec::ADAM:
        static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
        break;
      case OptimizerSpec::ADAMW:
        static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
        break;
      default:
        static_cast<torch::optim::SGDOptions&>(group.options()).lr(lr);
    }
  }
  impl_->step();
}

void Optimizer::ZeroGrad() {
  // Drop the gradient tensors (set_to_none) so the next accumulation starts
  // from exactly the first micro-batch's gradient.
  for (auto& group : impl_->param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) p.mutable_grad().reset();
    }
  }
}

double LearningRateAt(const ScheduleSpec& s, int64_t step,
                      int64_t total_steps) {
  const double base = s.lr() > 0 ? s.lr() : 0.1;
  switch (s.kind()) {
    case ScheduleSpec::MULTISTEP: {
      const double gamma = s.gamma() > 0 ? s.gamma() : 0.1;
      double lr = base;
      for (int64_t m : s.milestones()) {
        if (step >= m) lr *= gamma;
      }
      return lr;
    }
    case ScheduleSpec::COSINE: {
      if (step < s.warmup_steps()) {
        return base * static_cast<double>(step + 1) /
               static_cast<double>(s.warmup_steps());
      }
      const int64_t span = std::max<int64_t>(1, total_steps - s.warmup_steps());
      const double t =
          std::min(1.0, static_cast<double>(step - s.warmup_steps()) / span);
      return s.min_lr() +
             (base - s.min_lr()) * 0.5 * (1.0 + std::cos(M_PI * t));
    }
    default:
      return base;
  }
}

}  // namespace interlock
