#include "coordinator/step_records.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "analysis/run_files.h"
#include "plan/status_macros.h"
#include "services/trainer.h"

namespace interlock {
namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
}  // namespace

absl::StatusOr<int64_t> StepRecords::Open(
    const std::string& out_dir, int64_t start,
    const std::vector<std::string>& pending) {
  if (out_dir.empty()) return 0;
  const std::string path = out_dir + "/metrics.jsonl";
  if (start == 0) {
    RETURN_IF_ERROR(file_.Open(path, /*append=*/false));
    return 0;
  }
  // Continue the file: the steps after the checkpoint run again and are
  // recorded again.
  int64_t dropped = 0;
  int64_t last_kept = -1;
  RETURN_IF_ERROR(CutMetricsLines(path, [&](int64_t step) {
    if (step < start) {
      last_kept = std::max(last_kept, step);
      return true;
    }
    ++dropped;
    return false;
  }));
  RETURN_IF_ERROR(file_.Open(path, /*append=*/true));
  for (const auto& line : pending) {
    auto parsed = ParseMetricsLine(line);
    if (!parsed.ok()) continue;
    const auto step = static_cast<int64_t>(parsed->step());
    if (step > last_kept && step < start) RETURN_IF_ERROR(file_.Append(line));
  }
  return dropped;
}

void StepRecords::StartAt(int64_t step, double wall_offset) {
  next_emit_ = step;
  wall_offset_ = wall_offset;
  ResetFrom(step);
}

bool StepRecords::OnCompletion(int64_t step,
                               const std::vector<LossReport>& reports,
                               double wall) {
  const int k = plan_.blocks();
  StepAgg& agg = steps_[step];
  if (agg.loss_sum.empty()) {
    agg.loss_sum.assign(k, 0.0);
    agg.loss_n.assign(k, 0);
  }
  ++agg.done;
  for (const auto& r : reports) {
    if (r.block < 0 || r.block >= k) continue;
    agg.loss_sum[r.block] += r.loss;
    ++agg.loss_n[r.block];
  }
  // Steps are recorded in order even if completions interleave.
  bool progressed = false;
  for (auto it = steps_.find(completed_);
       it != steps_.end() && it->second.done == plan_.microbatches();
       it = steps_.find(completed_)) {
    if (completed_ < next_emit_) {
      // Replayed after a recovery: recorded already.
      steps_.erase(it);
      lrs_.erase(completed_);
    } else {
      it->second.wall = wall;
      if (completed_ == clock_.base()) first_wall_ = wall;
      last_wall_ = wall;
      progressed = true;
    }
    ++completed_;
  }
  return progressed;
}

absl::Status StepRecords::EmitReady() {
  while (next_emit_ < completed_ && next_emit_ < clock_.Finished()) {
    auto it = steps_.find(next_emit_);
    RETURN_IF_ERROR(Emit(next_emit_, it->second));
    steps_.erase(it);
    ++next_emit_;
  }
  return absl::OkStatus();
}

void StepRecords::ResetFrom(int64_t from) {
  steps_.erase(steps_.lower_bound(from), steps_.end());
  completed_ = from;
}

std::vector<std::string> StepRecords::Pending(int64_t steps) const {
  std::vector<std::string> out;
  for (int64_t s = next_emit_; s < steps; ++s) {
    auto it = steps_.find(s);
    if (it != steps_.end()) out.push_back(Line(s, it->second, kNaN));
  }
  return out;
}

double StepRecords::MeanStepWall(int64_t steps) const {
  const int64_t trained = steps - clock_.base();
  return trained > 1 ? (last_wall_ - first_wall_) / (trained - 1)
                     : last_wall_ - wall_offset_;
}

std::vector<double> StepRecords::MeanLosses(const StepAgg& agg) const {
  std::vector<double> losses(plan_.blocks(), kNaN);
  for (int k = 0; k < plan_.blocks(); ++k) {
    if (agg.loss_n[k] > 0) losses[k] = agg.loss_sum[k] / agg.loss_n[k];
  }
  return losses;
}

std::string StepRecords::Line(int64_t s, const StepAgg& agg,
                              double virt) const {
  const double samples = static_cast<double>(plan_.batch_size()) * (s + 1);
  const auto lr = lrs_.find(s);
  v1::MetricsLine line;
  line.set_step(static_cast<double>(s));
  line.set_wall_seconds(agg.wall);
  line.set_virtual_seconds(virt);
  line.set_lr(lr == lrs_.end() ? 0.0 : lr->second);
  for (double l : MeanLosses(agg)) line.add_loss(l);
  line.set_samples_per_second(agg.wall > 0 ? samples / agg.wall : 0.0);
  return JsonLine(line);
}

absl::Status StepRecords::Emit(int64_t s, const StepAgg& agg) {
  last_losses_ = MeanLosses(agg);
  const double wall = agg.wall;
  const double virt = clock_.End(s);
  const double prev_virt =
      s > clock_.base() ? clock_.End(s - 1) : clock_.offset();
  const double samples = static_cast<double>(plan_.batch_size()) * (s + 1);
  const double sps = wall > 0 ? samples / wall : 0.0;
  if (file_.is_open()) RETURN_IF_ERROR(file_.Append(Line(s, agg, virt)));
  lrs_.erase(s);
  if (metrics_) {
    metrics_->OnStep(s, last_losses_, sps, plan_.microbatches());
    metrics_->OnStepTimes(
        wall - (s > clock_.base() ? prev_wall_ : wall_offset_), virt,
        virt - prev_virt, clock_.BusyNow());
  }
  prev_wall_ = wall;
  if (progress_) progress_->Update(s + 1, last_losses_, sps, wall);
  return absl::OkStatus();
}

}  // namespace interlock
