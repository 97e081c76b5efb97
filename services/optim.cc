#include "services/optim.h"

#include <cmath>

#include "absl/strings/numbers.h"
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

namespace {

// The key torch::optim uses for a parameter's state.
std::string StateKey(const torch::Tensor& p) {
  return c10::guts::to_string(p.unsafeGetTensorImpl());
}

}  // namespace

std::map<std::string, torch::Tensor> Optimizer::StateTensors() const {
  std::map<std::string, torch::Tensor> out;
  const auto& params = impl_->param_groups().at(0).params();
  const auto& state = impl_->state();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = state.find(StateKey(params[i]));
    if (it == state.end()) continue;
    const std::string p = absl::StrCat(i, ".");
    auto put = [&](const char* name, const torch::Tensor& t) {
      if (t.defined()) out[p + name] = t.detach();
    };
    if (kind_ == OptimizerSpec::SGD) {
      put("momentum_buffer",
          static_cast<const torch::optim::SGDParamState&>(*it->second)
              .momentum_buffer());
      continue;
    }
    // AdamWParamState has the same fields as AdamParamState.
    auto adam = [&](const auto& st) {
      out[p + "step"] = torch::tensor(st.step(), torch::kInt64);
      put("exp_avg", st.exp_avg());
      put("exp_avg_sq", st.exp_avg_sq());
      put("max_exp_avg_sq", st.max_exp_avg_sq());
    };
    if (kind_ == OptimizerSpec::ADAM) {
      adam(static_cast<const torch::optim::AdamParamState&>(*it->second));
    } else {
      adam(static_cast<const torch::optim::AdamWParamState&>(*it->second));
    }
  }
  return out;
}

absl::Status Optimizer::LoadStateTensors(
    const std::map<std::string, torch::Tensor>& in, const std::string& what) {
  const auto& params = impl_->param_groups().at(0).params();
  // Per parameter: its entries by field name.
  std::vector<std::map<std::string, torch::Tensor>> per(params.size());
  for (const auto& [name, t] : in) {
    const size_t dot = name.find('.');
    size_t i = 0;
    if (dot == std::string::npos ||
        !absl::SimpleAtoi(name.substr(0, dot), &i) || i >= params.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": optimizer entry '", name,
                       "' names no parameter of the ", params.size()));
    }
    const std::string field = name.substr(dot + 1);
    const bool sgd = kind_ == OptimizerSpec::SGD;
    if (field == "step" && !sgd) {
      if (t.scalar_type() != torch::kInt64 || t.dim() != 0 ||
          t.item<int64_t>() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": optimizer entry '", name,
                         "' is not a non-negative int64 scalar"));
      }
    } else if ((sgd && field == "momentum_buffer") ||
               (!sgd && (field == "exp_avg" || field == "exp_avg_sq" ||
                         field == "max_exp_avg_sq"))) {
      const torch::Tensor& p = params[i];
      if (t.scalar_type() != p.scalar_type() || t.sizes() != p.sizes()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": optimizer entry '", name, "' is ",
                         c10::toString(t.scalar_type()), c10::str(t.sizes()),
                         ", its parameter ", c10::toString(p.scalar_type()),
                         c10::str(p.sizes())));
      }
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": optimizer entry '", name,
                       "' is not state of this optimizer"));
    }
    per[i][field] = t;
  }
  for (size_t i = 0; i < per.size(); ++i) {
    const auto& f = per[i];
    if (f.empty() || kind_ == OptimizerSpec::SGD) continue;
    if (!f.count("step") || !f.count("exp_avg") || !f.count("exp_avg_sq")) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": optimizer state of parameter ", i,
                       " lacks step, exp_avg or exp_avg_sq"));
    }
  }
  // Everything fits: replace the state (copies on the parameter's device,
  // so the archive's storage is not shared with the parameters' state).
  auto& state = impl_->state();
  state.clear();
  for (size_t i = 0; i < per.size(); ++i) {
    const auto& f = per[i];
    if (f.empty()) continue;
    const c10::Device device = params[i].device();
    auto get = [&](const char* field) {
      auto it = f.find(field);
      if (it == f.end()) return torch::Tensor();
      const torch::Tensor& t = it->second;
      return t.device() == device ? t.clone() : t.to(device);
    };
    auto adam = [&](auto st) {
      st->step(f.at("step").item<int64_t>());
      st->exp_avg(get("exp_avg"));
      st->exp_avg_sq(get("exp_avg_sq"));
      st->max_exp_avg_sq(get("max_exp_avg_sq"));
      state[StateKey(params[i])] = std::move(st);
    };
    if (kind_ == OptimizerSpec::SGD) {
      auto st = std::make_unique<torch::optim::SGDParamState>();
      st->momentum_buffer(get("momentum_buffer"));
      state[StateKey(params[i])] = std::move(st);
    } else if (kind_ == OptimizerSpec::ADAM) {
      adam(std::make_unique<torch::optim::AdamParamState>());
    } else {
      adam(std::make_unique<torch::optim::AdamWParamState>());
    }
  }
  return absl::OkStatus();
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
