#include "coordinator/run_clock.h"

#include <algorithm>
#include <limits>

#include "plan/status_macros.h"
#include "services/models.h"
#include "services/trainer.h"
#include "services/wire_codec.h"

namespace interlock {

using interlock::v1::TrainingSpec;

absl::Status RunClock::Start(const interlock::v1::RunConfig& config,
                             const DataShape& shape, const WireCodec& codec,
                             int blocks, int window, int64_t rows,
                             int64_t input_bytes, int64_t target_bytes) {
  const auto& t = config.training();
  PipelineShape sh;
  sh.blocks = blocks;
  sh.microbatches = t.microbatches();
  sh.window = window;
  sh.e2e = t.mode() == TrainingSpec::E2E;
  sh.n = t.n();
  sh.sum_rule = t.rule() == TrainingSpec::SUM;
  sh.compute_unused = t.compute_unused_gradients();
  sh.link = link_;
  sh.input_bytes = input_bytes + target_bytes;
  sh.replicas = replicas_;
  sh.ring_reduction = t.reduction() == TrainingSpec::RING;
  sh.first_step = base_;
  ASSIGN_OR_RETURN(ModelProbe probe,
                   ProbeModel(config.model(), shape, /*with_heads=*/!sh.e2e));
  sh.parameters = probe.trained_parameters;
  for (int k = 0; k + 1 < blocks; ++k) {
    int64_t elements = rows;
    for (int64_t d : probe.output_shapes[k]) elements *= d;
    sh.down_bytes.push_back(
        codec.activations().MaxEncodedBytes(torch::kFloat32, elements) +
        target_bytes);
    sh.up_bytes.push_back(sh.Down(k) * codec.gradients().MaxEncodedBytes(
                                           torch::kFloat32, elements));
  }
  sim_ = std::make_unique<PipelineSim>(std::move(sh), kTimelineSteps);
  return absl::OkStatus();
}

void RunClock::Submitted(int64_t step, int mb, int m) {
  const int64_t count = (step - base_) * m + mb + 1;
  if (count > submitted_) {
    sim_->SetSubmitted(count);
    submitted_ = count;
  }
}

int64_t RunClock::StepsBegun() const {
  const int m = sim_->shape().microbatches;
  return (submitted_ + m - 1) / m;
}

void RunClock::SetRoutes(int64_t step, std::vector<int32_t> routes) {
  // A step submitted before (resubmitted after a recovery) keeps the routes
  // it was first run with: they index its members.
  if (sim_ && step - base_ >= StepsBegun()) {
    sim_->SetRoutes(step - base_, std::move(routes));
  }
}

void RunClock::SetTopology(int64_t step, const Topology& workers) {
  if (!sim_ || static_cast<int>(workers.size()) != sim_->shape().blocks) {
    return;
  }
  const int blocks = sim_->shape().blocks;
  slots_.resize(blocks);
  const int64_t from = std::max(step - base_, StepsBegun());
  std::vector<std::vector<int>> members(blocks);
  bool changed = false;
  for (int k = 0; k < blocks; ++k) {
    for (const auto& address : workers[k]) {
      const int next = static_cast<int>(slots_[k].size());
      members[k].push_back(slots_[k].emplace(address, next).first->second);
    }
    changed |= members[k] != sim_->Members(from, k);
  }
  // The first call names the replicas the clock was started with: no
  // change unless it was started with other counts.
  if (changed) sim_->SetMembers(from, std::move(members));
}

std::vector<std::vector<double>> RunClock::ReplicaRates(
    int64_t min_microbatches) const {
  if (!sim_) return {};
  const PipelineShape& shape = sim_->shape();
  std::vector<std::vector<double>> rates(shape.blocks);
  for (int k = 0; k < shape.blocks; ++k) {
    const std::vector<int>& members = sim_->Members(StepsBegun(), k);
    if (members.size() < 2) continue;  // nothing to weigh
    for (int r : members) {
      const int64_t n = sim_->ReplicaMicrobatches(k, r);
      const double seconds = sim_->ReplicaMicrobatchSeconds(k, r);
      if (n < min_microbatches || !(seconds > 0)) return {};
      rates[k].push_back(static_cast<double>(n) / seconds);
    }
  }
  return rates;
}

void RunClock::OnMicrobatch(int64_t step, int mb,
                            const std::vector<OpTiming>& timings) {
  if (!fed_.insert({step, mb}).second) return;
  const int k = sim_->shape().blocks;
  std::vector<MbDurations> d(k);
  for (const auto& t : timings) {
    if (t.block < 0 || t.block >= k) continue;
    if (t.phase == Phase::kForward) d[t.block].forward += t.seconds;
    if (t.phase == Phase::kHead) d[t.block].head += t.seconds;
    if (t.phase == Phase::kBackward) d[t.block].backward += t.seconds;
    if (t.phase == Phase::kInputGrad) d[t.block].input_grad += t.seconds;
    if (t.phase == Phase::kParamPass || t.phase == Phase::kSharedPass ||
        t.phase == Phase::kInputPass) {
      passes_.resize(k);
      Passes& p = passes_[t.block];
      (t.phase == Phase::kParamPass    ? p.param
       : t.phase == Phase::kSharedPass ? p.shared
                                       : p.input)
          .push_back(t.seconds);
    }
  }
  sim_->SetMicrobatch(step - base_, mb, std::move(d));
}

namespace {

// The median of num[i] / den[i] - offset over the pairs with den[i] > 0; -1
// with none.
double MedianRatio(const std::vector<double>& num,
                   const std::vector<double>& den, double offset) {
  std::vector<double> r;
  for (size_t i = 0; i < std::min(num.size(), den.size()); ++i) {
    if (den[i] > 0) r.push_back(std::max(0.0, num[i] / den[i] - offset));
  }
  if (r.empty()) return -1.0;
  std::sort(r.begin(), r.end());
  const size_t h = r.size() / 2;
  return r.size() % 2 ? r[h] : (r[h - 1] + r[h]) / 2;
}

}  // namespace

std::vector<double> RunClock::SharedExtra() const {
  std::vector<double> out;
  for (const Passes& p : passes_) {
    out.push_back(MedianRatio(p.shared, p.param, 1.0));
  }
  return out;
}

std::vector<double> RunClock::InputShare() const {
  std::vector<double> out;
  for (const Passes& p : passes_) {
    out.push_back(MedianRatio(p.input, p.param, 0.0));
  }
  return out;
}

void RunClock::OnOptimizer(int64_t step, int block, double seconds) {
  if (fed_.insert({step, -1 - block}).second) {
    sim_->SetOptimizer(step - base_, block, seconds);
  }
}

void RunClock::Finish() {
  if (sim_) sim_->Finish();
}

void RunClock::Advance() {
  if (sim_) sim_->Advance();
}

void RunClock::Checkpointed(int64_t steps) {
  fed_.erase(fed_.begin(),
             fed_.lower_bound({steps, std::numeric_limits<int>::min()}));
}

double RunClock::End(int64_t s) const {
  if (!sim_ || s < base_) return offset_;
  const int64_t i = s - base_;
  if (i >= sim_->steps_finished()) return offset_ + sim_->Now();
  return offset_ + sim_->StepEnd(i);
}

int64_t RunClock::Finished() const {
  return sim_ ? base_ + sim_->steps_finished() : base_;
}

bool RunClock::WouldExceed(int64_t s, double budget) {
  if (!sim_) return false;
  sim_->Advance();
  const int64_t f = sim_->steps_finished();
  if (f == 0) return offset_ + sim_->Now() >= budget;
  const double last = sim_->StepEnd(f - 1);
  const double projected = offset_ + last + (s - base_ + 1 - f) * (last / f);
  return projected > budget;
}

std::vector<double> RunClock::BusyNow() const {
  const PipelineShape& sh = sim_->shape();
  std::vector<double> busy(sh.blocks);
  for (int b = 0; b < sh.blocks; ++b) {
    busy[b] =
        sim_->Now() > 0 ? sim_->Busy(b) / (sh.Replicas(b) * sim_->Now()) : 0.0;
  }
  return busy;
}

ClockSummary RunClock::Summary(int64_t steps) const {
  ClockSummary r;
  r.virtual_seconds = offset_;
  if (!sim_ || steps <= base_) return r;
  // Means and busy ratios are of the part this process replayed.
  const int64_t n = steps - base_;
  const PipelineShape& sh = sim_->shape();
  const double end = sim_->StepEnd(n - 1);
  r.virtual_seconds = offset_ + end;
  r.mean_step_virtual = n > 1 ? (end - sim_->StepEnd(0)) / (n - 1) : end;
  auto ratio = [end](double busy, int tracks) {
    return end > 0 ? busy / (tracks * end) : 0.0;
  };
  double busy = 0;
  for (int b = 0; b < sh.blocks; ++b) {
    busy += sim_->Busy(b);
    r.busy_ratio.push_back(ratio(sim_->Busy(b), sh.Replicas(b)));
    auto& replicas = r.replica_busy_ratio.emplace_back();
    for (int i = 0; i < sh.Replicas(b); ++i) {
      replicas.push_back(ratio(sim_->ReplicaBusy(b, i), 1));
    }
  }
  r.utilisation = ratio(busy, sh.Tracks());
  return r;
}

}  // namespace interlock
