#include "services/replication.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "services/norm_kernels.h"
#include "services/torch_guard.h"

namespace interlock {

// A BatchNorm layer's running statistics: the module's own members, which
// its forward reads and writes (the registered buffers are the same tensors
// except while a StatsCapture has swapped the members).
struct Replication::Norm {
  std::shared_ptr<torch::nn::Module> module;
  std::string name;
  torch::Tensor* mean = nullptr;
  torch::Tensor* var = nullptr;
  torch::Tensor* count = nullptr;  // num_batches_tracked
  torch::nn::BatchNormOptions* options = nullptr;
  int64_t channels = 0;
  int64_t offset = 0;  // of [calls, mean[C], var[C]] within a row
};

namespace {

template <typename Impl, typename Norm>
bool AddNorm(const std::string& name,
             const std::shared_ptr<torch::nn::Module>& m,
             std::vector<Norm>& out, std::string& unsupported) {
  auto bn = std::dynamic_pointer_cast<Impl>(m);
  if (!bn) return false;
  if (!bn->running_mean.defined()) return true;  // no running statistics
  if (bn->running_mean.scalar_type() != torch::kFloat32 ||
      bn->running_var.scalar_type() != torch::kFloat32) {
    unsupported = absl::StrCat(name, " keeps ",
                               c10::toString(bn->running_mean.scalar_type()),
                               " statistics (replicas replay float32 only)");
    return true;
  }
  if (!bn->num_batches_tracked.defined()) {
    // The counter tells a capture which layers ran (the block and its head
    // are captured apart); LibTorch always keeps one with running stats.
    unsupported = absl::StrCat(name, " keeps no num_batches_tracked");
    return true;
  }
  Norm n;
  n.module = bn;
  n.name = name;
  n.mean = &bn->running_mean;
  n.var = &bn->running_var;
  n.count = &bn->num_batches_tracked;
  n.options = &bn->options;
  n.channels = bn->running_mean.numel();
  out.push_back(std::move(n));
  return true;
}

}  // namespace

Replication::Replication(std::shared_ptr<Collective> group,
                         interlock::v1::TrainingSpec::Reduction mode,
                         int block_index, int microbatches,
                         std::vector<torch::Tensor> params,
                         const torch::nn::Sequential& block,
                         const torch::nn::Sequential& head)
    : group_(std::move(group)),
      ordered_(mode != interlock::v1::TrainingSpec::RING),
      block_(block_index),
      m_(microbatches),
      params_(std::move(params)),
      forwarded_(microbatches, false) {
  for (const auto& p : params_) {
    offsets_.push_back(numel_);
    numel_ += p.numel();
  }
  const int64_t f = static_cast<int64_t>(params_.size());
  stats_offset_ = ordered_ ? f : 0;
  int64_t width = stats_offset_;
  for (const auto& [prefix, part] :
       {std::make_pair("block.", block), std::make_pair("head.", head)}) {
    if (!part) continue;
    for (const auto& kv : part->named_modules("", /*include_self=*/false)) {
      const std::string name = prefix + kv.key();
      const auto& m = kv.value();
      if (AddNorm<torch::nn::BatchNorm1dImpl>(name, m, norms_, unsupported_) ||
          AddNorm<torch::nn::BatchNorm2dImpl>(name, m, norms_, unsupported_) ||
          AddNorm<torch::nn::BatchNorm3dImpl>(name, m, norms_, unsupported_)) {
        continue;
      }
      // Any other state would drift apart between the replicas.
      for (const auto& b : m->named_buffers(/*recurse=*/false)) {
        unsupported_ =
            absl::StrCat(name, ".", b.key(), " is not a BatchNorm statistic");
      }
    }
  }
  for (auto& n : norms_) {
    n.offset = width;
    width += 1 + 2 * n.channels;
  }
  row_width_ = width;
  tail_ = m_ * row_width_;
  meta_ = torch::zeros({tail_ + (ordered_ ? 0 : f) + 2}, torch::kInt32);
  if (ordered_) grads_ = torch::zeros({m_, numel_}, torch::kFloat32);
}

Replication::~Replication() = default;

absl::Status Replication::CheckForward(int mb) const {
  if (!unsupported_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", block_, ": replicas cannot keep it equal: ", unsupported_));
  }
  if (mb < 0 || mb >= m_) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", block_, ": micro-batch index ", mb,
                     " outside [0, ", m_, ") of a replica"));
  }
  if (forwarded_[mb]) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", block_, ": micro-batch ", mb,
                     " was already forwarded in this step"));
  }
  return absl::OkStatus();
}

Replication::StatsCapture::StatsCapture(Replication& r, int mb)
    : r_(r), mb_(mb) {
  torch::NoGradGuard no_grad;
  for (auto& n : r_.norms_) {
    Saved s{*n.mean, *n.var, *n.count, n.options->momentum()};
    *n.mean = torch::zeros_like(s.mean);
    *n.var = torch::zeros_like(s.var);
    *n.count = torch::zeros_like(s.count);
    // ATen's CPU update is float(m * x + (1 - m) * r) with m = float(1):
    // exactly x, whatever was there.
    n.options->momentum(1.0);
    saved_.push_back(std::move(s));
  }
}

Replication::StatsCapture::~StatsCapture() {
  for (size_t i = 0; i < saved_.size(); ++i) {
    Norm& n = r_.norms_[i];
    *n.mean = std::move(saved_[i].mean);
    *n.var = std::move(saved_[i].var);
    *n.count = std::move(saved_[i].count);
    n.options->momentum(saved_[i].momentum);
  }
}

absl::Status Replication::StatsCapture::Keep() {
  int32_t* row = r_.Row(mb_);
  for (size_t i = 0; i < saved_.size(); ++i) {
    const Norm& n = r_.norms_[i];
    const int32_t calls = static_cast<int32_t>(n.count->item<int64_t>());
    if (calls > 1 || (calls == 1 && row[n.offset] != 0)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", r_.block_, ": ", n.name,
          " ran more than once in one forward: replicas cannot replay its "
          "statistics"));
    }
    // The block and its head are captured apart (BlockTrainer::ForwardBlock
    // and ForwardHead): each capture keeps only the layers that ran in it.
    if (calls == 0) continue;
    row[n.offset] = calls;
    auto stats =
        torch::from_blob(row + n.offset + 1, {2, n.channels}, torch::kFloat32);
    stats[0].copy_(*n.mean);
    stats[1].copy_(*n.var);
  }
  r_.forwarded_[mb_] = true;
  return absl::OkStatus();
}

void Replication::TakeGradients(int mb) {
  if (!ordered_) return;
  int32_t* flags = Row(mb);
  torch::Tensor row = grads_[mb];
  for (size_t j = 0; j < params_.size(); ++j) {
    torch::Tensor& g = params_[j].mutable_grad();
    if (!g.defined()) continue;
    torch::Tensor dst = row.narrow(0, offsets_[j], params_[j].numel());
    const torch::Tensor src = g.reshape({-1});
    // A second contribution of the same micro-batch (a parameter shared by
    // head and block, which our models never do) is added in place.
    if (flags[j]) {
      dst.add_(src.to(torch::kCPU));
    } else {
      dst.copy_(src);
    }
    flags[j] = 1;
    g.reset();
  }
}

absl::StatusOr<Replication::Totals> Replication::Reduce(bool skip,
                                                        int accumulated) {
  auto totals = TorchGuard("replica reduction",
                           [&] { return ReduceImpl(skip, accumulated); });
  Reset();
  if (!totals.ok()) {
    return absl::Status(totals.status().code(),
                        absl::StrCat("block ", block_, ": replica reduction: ",
                                     totals.status().message()));
  }
  return totals;
}

absl::StatusOr<Replication::Totals> Replication::ReduceImpl(bool skip,
                                                            int accumulated) {
  int32_t* meta = meta_.data_ptr<int32_t>();
  const int64_t f = static_cast<int64_t>(params_.size());
  torch::Tensor flat;  // RING: this replica's accumulated gradients
  if (!ordered_) {
    flat = torch::zeros({numel_}, torch::kFloat32);
    for (int64_t j = 0; j < f; ++j) {
      const torch::Tensor& g = params_[j].grad();
      if (!g.defined()) continue;
      flat.narrow(0, offsets_[j], params_[j].numel()).copy_(g.reshape({-1}));
      meta[tail_ + j] = 1;
    }
  }
  int32_t* counters = meta + meta_.numel() - 2;
  counters[0] = skip ? 1 : 0;
  counters[1] = accumulated;
  const auto arrived = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(group_->AllReduceSum(meta_));
  const double wait_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - arrived)
          .count();
  if (ordered_) {
    // Float bits summed as integers: x + 0 + ... + 0 is x for every value,
    // -0.0 and NaN payloads included.
    torch::Tensor bits = grads_.view(torch::kInt32);
    RETURN_IF_ERROR(group_->AllReduceSum(bits));
  } else {
    RETURN_IF_ERROR(group_->AllReduceSum(flat));
  }

  torch::NoGradGuard no_grad;
  for (int64_t j = 0; j < f; ++j) {
    torch::Tensor& p = params_[j];
    const int64_t n = p.numel();
    torch::Tensor acc;
    if (ordered_) {
      // AccumulateGrad's order: the first contribution is taken as it is,
      // each later one added in place, in micro-batch order.
      for (int mb = 0; mb < m_; ++mb) {
        if (!Row(mb)[j]) continue;
        torch::Tensor src =
            grads_[mb].narrow(0, offsets_[j], n).view(p.sizes());
        if (!acc.defined()) {
          acc = src.clone();
        } else {
          acc.add_(src);
        }
      }
    } else if (meta[tail_ + j] > 0) {
      acc = flat.narrow(0, offsets_[j], n).view(p.sizes()).clone();
    }
    if (acc.defined()) {
      p.mutable_grad() = acc.to(p.device());
    } else {
      p.mutable_grad().reset();
    }
  }
  RETURN_IF_ERROR(ReplayStatistics());
  Totals t;
  t.skip = counters[0] > 0;
  t.accumulated = counters[1];
  t.wait_seconds = wait_seconds;
  return t;
}

absl::Status Replication::ReplayStatistics() {
  torch::NoGradGuard no_grad;
  for (Norm& n : norms_) {
    torch::Tensor mean = n.mean->to(torch::kCPU).contiguous().clone();
    torch::Tensor var = n.var->to(torch::kCPU).contiguous().clone();
    float* rm = mean.data_ptr<float>();
    float* rv = var.data_ptr<float>();
    int64_t count = n.count->item<int64_t>();
    for (int mb = 0; mb < m_; ++mb) {
      const int32_t* row = Row(mb) + n.offset;
      if (row[0] == 0) continue;  // not forwarded (or the layer not run)
      const float* x_mean = reinterpret_cast<const float*>(row + 1);
      const float* x_var = x_mean + n.channels;
      // BatchNormImplBase::forward's factor, then ATen 1.13's CPU update
      // (contiguous or channels-last input alike), which the fused
      // channels-last layers (services/resnet.cc) make too.
      ++count;
      const double factor =
          n.options->momentum().value_or(1.0 / static_cast<double>(count));
      BlendRunningStats(static_cast<float>(factor), x_mean, x_var, n.channels,
                        rm, rv);
    }
    n.mean->copy_(mean);
    n.var->copy_(var);
    n.count->fill_(count);
  }
  return absl::OkStatus();
}

void Replication::Reset() {
  meta_.zero_();
  if (grads_.defined()) grads_.zero_();
  forwarded_.assign(m_, false);
}

}  // namespace interlock
