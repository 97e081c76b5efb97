#include "services/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "services/calibration.h"
#include "services/codec_kernels.h"
#include "services/device.h"
#include "services/replication.h"
#include "services/torch_guard.h"
#include "services/wire_codec.h"

namespace interlock {
namespace {

using Clock = std::chrono::steady_clock;

// The seconds an operation on `device` took since `t0`: waits for the
// device first, so an asynchronous device's time is execution, not launch.
double SecondsSince(const c10::Device& device, Clock::time_point t0) {
  Synchronize(device);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int64_t Hits(const torch::Tensor& logits, const torch::Tensor& target) {
  if (target.scalar_type() != torch::kInt64 ||
      logits.dim() != target.dim() + 1) {
    return 0;
  }
  return logits.argmax(-1).eq(target).sum().item<int64_t>();
}

std::vector<torch::Tensor> ParamsOf(const torch::nn::Sequential& m) {
  std::vector<torch::Tensor> out;
  if (m) {
    for (auto& p : m->parameters()) out.push_back(p);
  }
  return out;
}

// Re-lays a 4-D parameter or buffer out channels-last in place (the module
// keeps the same tensor object); other tensors are left as they are.
void ToChannelsLast(torch::Tensor& t) {
  if (t.defined() && t.dim() == 4) {
    t.set_data(t.contiguous(at::MemoryFormat::ChannelsLast));
  }
}

}  // namespace

const char* PhaseName(Phase p) {
  switch (p) {
    case Phase::kForward:
      return "forward";
    case Phase::kHead:
      return "head";
    case Phase::kBackward:
      return "backward";
    case Phase::kOptimizer:
      return "optimizer";
    case Phase::kInputGrad:
      return "input_grad";
    case Phase::kParamPass:
      return "param_pass";
    case Phase::kSharedPass:
      return "shared_pass";
    case Phase::kInputPass:
      return "input_pass";
  }
  return "unknown";
}

torch::Tensor CrossEntropy(const torch::Tensor& logits,
                           const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
}

TrainerOptions TrainerOptionsFromConfig(const interlock::v1::RunConfig& config,
                                        int block, int num_blocks) {
  TrainerOptions o;
  o.block = block;
  o.num_blocks = num_blocks;
  const auto& t = config.training();
  o.e2e = t.mode() == interlock::v1::TrainingSpec::E2E;
  o.n = t.n() > 0 ? t.n() : 1;
  o.sum_rule = t.rule() == interlock::v1::TrainingSpec::SUM;
  o.microbatches = t.microbatches() > 0 ? t.microbatches() : 1;
  o.test_loss_scale = FinalLossOf(config.model()).test_loss_scale;
  o.skip_nonfinite =
      t.nonfinite_policy() == interlock::v1::TrainingSpec::SKIP_STEP;
  o.compute_unused = t.compute_unused_gradients();
  o.output_range = WireRange(config.wire().activations());
  o.upstream_range = WireRange(config.wire().gradients());
  o.channels_last = ChannelsLast(config.model());
  return o;
}

BlockTrainer::BlockTrainer(TrainerOptions options, BlockModules modules,
                           interlock::v1::OptimizerSpec optimizer)
    : options_(options),
      modules_(std::move(modules)),
      optimizer_spec_(std::move(optimizer)) {
  block_params_ = ParamsOf(modules_.block);
}

BlockTrainer::~BlockTrainer() = default;

void BlockTrainer::SetReplicas(std::shared_ptr<Collective> group,
                               interlock::v1::TrainingSpec::Reduction mode) {
  if (!group || group->size() <= 1) {
    replication_.reset();
    return;
  }
  replication_ = std::make_unique<Replication>(
      std::move(group), mode, options_.block, options_.microbatches,
      TrainedParams(), modules_.block, modules_.head);
}

std::vector<torch::Tensor> BlockTrainer::TrainedParams() const {
  std::vector<torch::Tensor> params = block_params_;
  for (auto& p : ParamsOf(modules_.head)) params.push_back(p);
  return params;
}

absl::StatusOr<std::unique_ptr<BlockTrainer>> BlockTrainer::Create(
    const interlock::v1::RunConfig& config, const DataShape& shape, int block,
    c10::Device device) {
  ASSIGN_OR_RETURN(int k_blocks, NumBlocks(config.model()));
  if (block < 0 || block >= k_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("block index ", block, " outside [0, ", k_blocks, ")"));
  }
  TrainerOptions options = TrainerOptionsFromConfig(config, block, k_blocks);
  options.device = device;
  ASSIGN_OR_RETURN(auto all, BuildModel(config.model(), shape, !options.e2e,
                                        config.training().seed(), block));
  return FromModules(options, std::move(all[block]), config.optimizer());
}

absl::StatusOr<std::unique_ptr<BlockTrainer>> BlockTrainer::FromModules(
    const TrainerOptions& options, BlockModules modules,
    const interlock::v1::OptimizerSpec& optimizer) {
  if (!options.e2e && options.block + 1 < options.num_blocks && !modules.head) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", options.block, " needs an auxiliary head"));
  }
  // Built on the CPU from the run's seed, so every device starts from the
  // same values; moved before the optimizer takes the parameters.
  if (!options.device.is_cpu()) {
    RETURN_IF_ERROR(TorchGuard("move to device", [&]() -> absl::Status {
      PrepareDevice(options.device);
      modules.block->to(options.device);
      if (modules.head) modules.head->to(options.device);
      return absl::OkStatus();
    }));
  }
  if (options.channels_last) {
    // Values are unchanged; only the strides. Before the optimizer is
    // built, so its state follows the parameters' layout.
    RETURN_IF_ERROR(TorchGuard("channels-last", [&]() -> absl::Status {
      torch::NoGradGuard no_grad;
      for (const auto& m : {modules.block, modules.head}) {
        if (!m) continue;
        for (auto& t : m->parameters()) ToChannelsLast(t);
        for (auto& t : m->buffers()) ToChannelsLast(t);
      }
      return absl::OkStatus();
    }));
  }
  std::unique_ptr<BlockTrainer> t(
      new BlockTrainer(options, std::move(modules), optimizer));
  ASSIGN_OR_RETURN(t->optimizer_,
                   Optimizer::Create(optimizer, t->TrainedParams()));
  t->modules_.block->train();
  if (t->modules_.head) t->modules_.head->train();
  return t;
}

bool AllFinite(const torch::Tensor& t) {
  return AllWithin(t, std::numeric_limits<float>::infinity());
}

bool AllWithin(const torch::Tensor& t, float range) {
  if (!t.defined() || !t.is_floating_point() || t.numel() == 0) return true;
  // Dense fp32 on the CPU (row-major or channels-last: the order does not
  // matter): one vectorised pass, where LibTorch's expressions below make
  // two or three and allocate a tensor for each.
  if (t.scalar_type() == torch::kFloat && t.device().is_cpu() &&
      t.is_non_overlapping_and_dense() && range > 0) {
    return AllBelowFloats(t.data_ptr<float>(), t.numel(), range);
  }
  if (std::isinf(range)) return torch::isfinite(t).all().item<bool>();
  // NaN compares false, so it is caught too.
  return (t.abs() < range).all().item<bool>();
}

namespace {

// What a value failing AllWithin(t, range) is, for the policy's error.
std::string NotCarried(float range, const char* field) {
  if (std::isinf(range)) return "is not finite";
  return absl::StrCat("is not finite or reaches ", range,
                      " in magnitude, beyond the range of ", field);
}

}  // namespace

absl::Status BlockTrainer::OnNonFinite(const std::string& what) {
  ++nonfinite_count_;
  if (!options_.skip_nonfinite) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", options_.block, ": ", what,
                     " (training.nonfinite_policy is STOP)"));
  }
  skip_step_ = true;
  return absl::OkStatus();
}

absl::StatusOr<bool> BlockTrainer::CheckUpstream(int mb, int i, bool marked,
                                                 torch::Tensor& grad) {
  if (!marked && AllWithin(grad, options_.upstream_range)) return false;
  if (!marked) {
    RETURN_IF_ERROR(OnNonFinite(
        absl::StrCat("micro-batch ", mb, ": upstream gradient ", i, " ",
                     NotCarried(options_.upstream_range, "wire.gradients"))));
  }
  grad = torch::zeros_like(grad);
  return true;
}

torch::Tensor BlockTrainer::OnDevice(torch::Tensor t) const {
  if (!t.defined()) return t;
  t = t.to(options_.device);
  // Whatever layout a tensor arrived in (the wire carries NCHW, the
  // in-process engine hands over what the block above produced), the block
  // computes on one: the same bits in process and on a cluster. A no-op for
  // tensors already in that layout.
  if (options_.channels_last && t.dim() == 4) {
    t = t.contiguous(at::MemoryFormat::ChannelsLast);
  } else {
    t = t.contiguous();
  }
  return t;
}

GradientLists BlockTrainer::lists() const {
  return GradientLists{options_.num_blocks, options_.e2e, options_.n,
                       options_.sum_rule, options_.compute_unused};
}

int BlockTrainer::DownstreamListSize() const {
  return lists().Down(options_.block);
}

bool BlockTrainer::NeedsDownstream() const { return DownstreamListSize() > 0; }

int BlockTrainer::UpstreamListSize() const {
  return lists().Up(options_.block);
}

int BlockTrainer::SharedEntry() const { return lists().Shared(options_.block); }

absl::StatusOr<EntryResult> BlockTrainer::Entry(int mb, int i,
                                                const torch::Tensor& entry,
                                                bool entry_nonfinite) {
  auto it = pending_.find(mb);
  if (it == pending_.end() || !it->second.head_done) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", options_.block, ": micro-batch ", mb,
        it == pending_.end() ? " was not forwarded" : " has not run its head"));
  }
  if (!IsEarlyEntry(i)) {
    return absl::InternalError(absl::StrCat(
        "block ", options_.block, ": upstream entry ", i, " is not early"));
  }
  const Pending& p = it->second;
  const bool own = i == 0 && p.own_grad.defined();
  const torch::Tensor& g = own ? p.own_grad : entry;
  const bool marked =
      p.input_nonfinite || (own ? p.own_nonfinite : entry_nonfinite);
  if (!g.defined() || g.sizes() != p.output.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", options_.block, ": gradient shape ",
        g.defined() ? c10::str(g.sizes()) : "undefined",
        " does not match output shape ", c10::str(p.output.sizes())));
  }
  return TorchGuard("input gradient", [&]() -> absl::StatusOr<EntryResult> {
    const torch::Tensor grad = OnDevice(g);
    auto t0 = Clock::now();
    EntryResult r;
    r.grad = torch::autograd::grad({p.output}, {p.input}, {grad},
                                   /*retain_graph=*/true)[0];
    ASSIGN_OR_RETURN(r.nonfinite, CheckUpstream(mb, i, marked, r.grad));
    r.timing = {options_.block, Phase::kInputGrad, SecondsSince(device(), t0)};
    return r;
  });
}

void BlockTrainer::Calibrate(const Pending& p, const torch::Tensor& theta_grad,
                             std::vector<OpTiming>& timings) {
  std::vector<torch::Tensor> both = block_params_;
  both.push_back(p.input);
  const std::pair<Phase, std::vector<torch::Tensor>> passes[] = {
      {Phase::kParamPass, block_params_},
      {Phase::kSharedPass, both},
      {Phase::kInputPass, {p.input}}};
  for (const auto& [phase, inputs] : passes) {
    auto t0 = Clock::now();
    // torch::autograd::grad returns the gradients instead of accumulating
    // them, so training sees none of this.
    torch::autograd::grad({p.output}, inputs, {theta_grad},
                          /*retain_graph=*/true, /*create_graph=*/false,
                          /*allow_unused=*/true);
    timings.push_back({options_.block, phase, SecondsSince(device(), t0)});
  }
}

absl::Status BlockTrainer::RunBlock(int mb, const torch::Tensor& input,
                                    const torch::Tensor& target,
                                    bool input_nonfinite, Pending& p,
                                    ForwardResult& r) {
  const torch::Tensor x = OnDevice(input);
  p.target = OnDevice(target);
  auto t0 = Clock::now();
  // Calibrate a few micro-batches after the first ones (allocations and
  // cold caches) of every block whose input gradient some mode needs.
  p.calibrate = options_.block > 0 && forwards_ >= kCalibrateAfter &&
                forwards_ < kCalibrateAfter + kCalibrations;
  ++forwards_;
  p.input = UpstreamListSize() > 0 || p.calibrate
                ? x.detach().requires_grad_(true)
                : x;
  p.output = modules_.block->forward(p.input);
  r.timings.push_back(
      {options_.block, Phase::kForward, SecondsSince(device(), t0)});
  p.input_nonfinite = input_nonfinite;
  if (input_nonfinite) skip_step_ = true;
  p.output_nonfinite = input_nonfinite;
  if (!input_nonfinite && !AllWithin(p.output, SentRange())) {
    RETURN_IF_ERROR(
        OnNonFinite(absl::StrCat("micro-batch ", mb, ": output ",
                                 NotCarried(SentRange(), "wire.activations"))));
    p.output_nonfinite = true;
  }
  r.output_nonfinite = p.output_nonfinite;
  if (!is_last()) {
    r.output =
        p.output_nonfinite ? torch::zeros_like(p.output) : p.output.detach();
  }
  return absl::OkStatus();
}

absl::Status BlockTrainer::RunHead(int mb, Pending& p, ForwardResult& r) {
  p.head_done = true;
  // The head (or the model's loss) sees the output detached: its update
  // never reaches the block directly, only through the gradient list.
  if (options_.e2e && !is_last()) return absl::OkStatus();
  auto t0 = Clock::now();
  auto detached = p.output.detach().requires_grad_(true);
  torch::Tensor logits =
      is_last() ? detached : modules_.head->forward(detached);
  torch::Tensor raw;
  if (is_last() && options_.test_loss_scale != 0.0f) {
    raw = (logits * options_.test_loss_scale).sum();
  } else {
    raw = CrossEntropy(logits, p.target);
  }
  (raw / options_.microbatches).backward();
  p.own_grad = detached.grad().detach();
  LossReport rep;
  rep.block = options_.block;
  rep.loss = raw.item<double>();
  if (p.output_nonfinite) {
    // Computed from values standing for NaN or infinities: no loss.
    rep.loss = std::numeric_limits<double>::quiet_NaN();
    p.own_grad = torch::zeros_like(p.own_grad);
    p.own_nonfinite = true;
  } else if (!std::isfinite(rep.loss) || !AllFinite(p.own_grad)) {
    RETURN_IF_ERROR(
        OnNonFinite(absl::StrCat("micro-batch ", mb, ": loss is ", rep.loss)));
    // The head's gradients are dropped with the skipped step; the block
    // and the blocks above get zeros marked non-finite.
    p.own_grad = torch::zeros_like(p.own_grad);
    p.own_nonfinite = true;
  }
  rep.correct = Hits(logits.detach(), p.target);
  rep.count = p.target.numel();
  r.reports.push_back(rep);
  r.timings.push_back(
      {options_.block, Phase::kHead, SecondsSince(device(), t0)});
  return absl::OkStatus();
}

absl::StatusOr<ForwardResult> BlockTrainer::Forward(int mb,
                                                    const torch::Tensor& input,
                                                    const torch::Tensor& target,
                                                    bool input_nonfinite) {
  ASSIGN_OR_RETURN(ForwardResult r,
                   ForwardBlock(mb, input, target, input_nonfinite));
  ASSIGN_OR_RETURN(ForwardResult head, ForwardHead(mb));
  for (auto& rep : head.reports) r.reports.push_back(rep);
  for (auto& t : head.timings) r.timings.push_back(t);
  return r;
}

absl::StatusOr<ForwardResult> BlockTrainer::ForwardBlock(
    int mb, const torch::Tensor& input, const torch::Tensor& target,
    bool input_nonfinite) {
  if (pending_.count(mb)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", options_.block, ": micro-batch ", mb, " already forwarded"));
  }
  if (replication_) RETURN_IF_ERROR(replication_->CheckForward(mb));
  return TorchGuard("forward", [&]() -> absl::StatusOr<ForwardResult> {
    ForwardResult r;
    Pending p;
    // Replicas: this micro-batch's BatchNorm statistics are kept apart.
    std::optional<Replication::StatsCapture> capture;
    if (replication_) capture.emplace(*replication_, mb);
    RETURN_IF_ERROR(RunBlock(mb, input, target, input_nonfinite, p, r));
    if (capture) RETURN_IF_ERROR(capture->Keep());
    pending_.emplace(mb, std::move(p));
    return r;
  });
}

absl::StatusOr<ForwardResult> BlockTrainer::ForwardHead(int mb) {
  auto it = pending_.find(mb);
  if (it == pending_.end() || it->second.head_done) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", options_.block, ": micro-batch ", mb,
        it == pending_.end() ? " was not forwarded" : " already ran its head"));
  }
  return TorchGuard("head", [&]() -> absl::StatusOr<ForwardResult> {
    ForwardResult r;
    std::optional<Replication::StatsCapture> capture;
    if (replication_) capture.emplace(*replication_, mb);
    RETURN_IF_ERROR(RunHead(mb, it->second, r));
    if (capture) {
      RETURN_IF_ERROR(capture->Keep());
      replication_->TakeGradients(mb);  // the head's
    }
    return r;
  });
}

absl::StatusOr<BackwardResult> BlockTrainer::Backward(
    int mb, std::vector<torch::Tensor> downstream,
    const std::vector<bool>& downstream_nonfinite) {
  auto it = pending_.find(mb);
  if (it == pending_.end() || !it->second.head_done) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", options_.block, ": micro-batch ", mb,
        it == pending_.end() ? " was not forwarded" : " has not run its head"));
  }
  if (static_cast<int>(downstream.size()) != DownstreamListSize()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", options_.block, ": expected ", DownstreamListSize(),
        " downstream gradients, got ", downstream.size()));
  }
  if (!downstream_nonfinite.empty() &&
      downstream_nonfinite.size() != downstream.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", options_.block, ": ", downstream_nonfinite.size(),
        " non-finite marks for ", downstream.size(), " gradients"));
  }
  const int unused = UnusedDownstream();
  for (int i = 0; i < unused; ++i) {
    if (downstream[i].defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", options_.block, ": downstream gradient ", i,
                       " trains no block and must not be sent"));
    }
  }
  Pending p = std::move(it->second);
  pending_.erase(it);
  for (size_t i = unused; i < downstream.size(); ++i) {
    const torch::Tensor& g = downstream[i];
    if (!g.defined() || g.sizes() != p.output.sizes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", options_.block, ": gradient shape ",
          g.defined() ? c10::str(g.sizes()) : "undefined",
          " does not match output shape ", c10::str(p.output.sizes())));
    }
  }
  return TorchGuard("backward", [&]() -> absl::StatusOr<BackwardResult> {
    BackwardResult r;
    for (auto& g : downstream) g = OnDevice(std::move(g));
    auto t0 = Clock::now();
    // The list of gradients w.r.t. this block's output, nearest loss first.
    std::vector<torch::Tensor> list;
    std::vector<bool> bad;  // entries standing for non-finite values
    if (p.own_grad.defined()) {
      list.push_back(p.own_grad);
      bad.push_back(p.own_nonfinite);
    }
    for (size_t i = 0; i < downstream.size(); ++i) {
      list.push_back(std::move(downstream[i]));
      bad.push_back(!downstream_nonfinite.empty() && downstream_nonfinite[i]);
    }
    if (p.input_nonfinite) bad.assign(bad.size(), true);

    const int last = static_cast<int>(list.size()) - 1;
    // FURTHEST trains theta with the last entry, SUM with all of them.
    for (int i = options_.sum_rule ? 0 : last; i <= last; ++i) {
      if (bad[i]) skip_step_ = true;
    }
    torch::Tensor theta_grad = list[last];
    if (options_.sum_rule) {
      for (int i = last - 1; i >= 0; --i) theta_grad = theta_grad + list[i];
    }
    if (p.calibrate && !block_params_.empty() && !skip_step_) {
      Calibrate(p, theta_grad, r.timings);
      t0 = Clock::now();
    }
    // Entries that only feed upstream had their input-gradient-only passes
    // (Entry()); the one the parameter pass yields comes out here.
    std::vector<torch::Tensor> inputs = block_params_;
    const bool with_input = SharedEntry() >= 0;
    if (with_input) inputs.push_back(p.input);
    if (!inputs.empty()) {
      torch::autograd::backward({p.output}, {theta_grad},
                                /*retain_graph=*/false,
                                /*create_graph=*/false, inputs);
    }
    if (replication_) replication_->TakeGradients(mb);
    if (with_input) {
      r.shared = p.input.grad().detach();
      ASSIGN_OR_RETURN(
          r.shared_nonfinite,
          CheckUpstream(mb, SharedEntry(), bad[SharedEntry()], r.shared));
    }
    r.timings.push_back(
        {options_.block, Phase::kBackward, SecondsSince(device(), t0)});
    ++accumulated_;
    return r;
  });
}

absl::StatusOr<OpTiming> BlockTrainer::Step(double lr) {
  if (!pending_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", options_.block, ": optimizer step with ",
                     pending_.size(), " micro-batches still in flight"));
  }
  return TorchGuard("optimizer", [&]() -> absl::StatusOr<OpTiming> {
    auto t0 = Clock::now();
    if (replication_) {
      auto totals = replication_->Reduce(skip_step_, accumulated_);
      if (!totals.ok()) {
        optimizer_->ZeroGrad();
        skip_step_ = false;
        accumulated_ = 0;
        return totals.status();
      }
      skip_step_ = totals->skip;
      accumulated_ = totals->accumulated;
      last_reduction_seconds_ = SecondsSince(device(), t0);
      last_reduction_wait_seconds_ = totals->wait_seconds;
    }
    if (!skip_step_) {
      // Finite losses can still overflow in a backward pass.
      for (const auto* part : {&modules_.block, &modules_.head}) {
        if (!*part) continue;
        for (const auto& kv : (*part)->named_parameters()) {
          if (AllFinite(kv.value().grad())) continue;
          RETURN_IF_ERROR(OnNonFinite(absl::StrCat(
              "gradient of ", part == &modules_.block ? "block." : "head.",
              kv.key(), " is not finite")));
          break;
        }
        if (skip_step_) break;
      }
    }
    last_step_skipped_ = skip_step_;
    skip_step_ = false;
    if (!last_step_skipped_) optimizer_->Step(lr);
    optimizer_->ZeroGrad();
    last_applied_ = accumulated_;
    accumulated_ = 0;
    return OpTiming{options_.block, Phase::kOptimizer,
                    SecondsSince(device(), t0)};
  });
}

absl::StatusOr<EvalResult> BlockTrainer::Evaluate(
    const torch::Tensor& input, const torch::Tensor& target_in,
    bool input_nonfinite) {
  return TorchGuard("evaluate", [&]() -> absl::StatusOr<EvalResult> {
    torch::NoGradGuard no_grad;
    modules_.block->eval();
    if (modules_.head) modules_.head->eval();
    EvalResult r;
    const torch::Tensor target = OnDevice(target_in);
    r.output = modules_.block->forward(OnDevice(input));
    torch::Tensor logits;
    if (is_last()) {
      logits = r.output;
    } else if (modules_.head) {
      logits = modules_.head->forward(r.output);
    }
    if (logits.defined()) {
      double loss;
      if (is_last() && options_.test_loss_scale != 0.0f) {
        loss = (logits * options_.test_loss_scale).sum().item<double>();
      } else {
        loss = torch::nn::functional::cross_entropy(
                   logits.reshape({-1, logits.size(-1)}), target.reshape({-1}),
                   torch::nn::functional::CrossEntropyFuncOptions().reduction(
                       torch::kSum))
                   .item<double>();
      }
      if (input_nonfinite) loss = std::numeric_limits<double>::quiet_NaN();
      r.loss.push_back(loss);
      r.correct.push_back(input_nonfinite ? 0 : Hits(logits, target));
    }
    r.count = target.numel();
    r.output_nonfinite = input_nonfinite || !AllWithin(r.output, SentRange());
    if (r.output_nonfinite) r.output = torch::zeros_like(r.output);
    modules_.block->train();
    if (modules_.head) modules_.head->train();
    return r;
  });
}

}  // namespace interlock
