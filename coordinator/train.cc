#include "coordinator/train.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "analysis/checked_write.h"
#include "analysis/run_files.h"
#include "analysis/timeline.h"
#include "coordinator/checkpoint.h"
#include "coordinator/cluster_engine.h"
#include "coordinator/inprocess_engine.h"
#include "coordinator/local_cluster.h"
#include "coordinator/metrics.h"
#include "coordinator/progress.h"
#include "coordinator/run_checkpoints.h"
#include "coordinator/run_report.h"
#include "services/config.h"
#include "services/data.h"
#include "services/digest.h"
#include "services/models.h"
#include "services/optim.h"
#include "services/status_macros.h"

namespace interlock {
namespace {

using Clock = std::chrono::steady_clock;
using interlock::v1::RunConfig;
using interlock::v1::TrainingSpec;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// Longest single attempt of a recovery (waiting for workers, configuring,
// restoring); attempts repeat until --recover-timeout.
constexpr absl::Duration kRecoverAttempt = absl::Seconds(5);

std::string ModeName(const RunConfig& c) {
  const auto& t = c.training();
  if (t.mode() == TrainingSpec::E2E) return "e2e";
  return absl::StrCat(t.n(), "-way ",
                      t.rule() == TrainingSpec::SUM ? "sum" : "furthest");
}

// Sums the loss reports of one step's micro-batches per block.
struct StepAgg {
  int done = 0;
  std::vector<double> loss_sum;
  std::vector<int> loss_n;
  double wall = 0.0;  // training time when the last micro-batch completed
};

// Steps of the run kept in the timeline (timeline.json, timeline.png).
constexpr int64_t kTimelineSteps = 64;

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// Whether two folder names are the same folder (so it is locked once).
bool SameFolder(const std::string& a, const std::string& b) {
  std::error_code ec1, ec2;
  const auto ca = std::filesystem::weakly_canonical(a, ec1);
  const auto cb = std::filesystem::weakly_canonical(b, ec2);
  return !ec1 && !ec2 && ca == cb;
}

class Runner {
 public:
  Runner(const RunConfig& config, const TrainOptions& options, Engine& engine,
         const Dataset& train, const Dataset& test, const DataShape& shape,
         CoordinatorMetrics* metrics, std::string seal_key)
      : seal_key_(std::move(seal_key)),
        metrics_out_(metrics),
        c_(config),
        o_(options),
        engine_(engine),
        train_(train),
        test_(test),
        shape_(shape),
        text_(shape.is_text),
        k_(engine.num_blocks()) {}

  absl::StatusOr<TrainResult> Run() {
    const auto& t = c_.training();
    const int64_t batch = t.batch_size();
    per_epoch_ = train_.size() / batch;
    if (per_epoch_ == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "training.batch_size: ", batch, " is larger than the training set (",
          train_.size(), " samples)"));
    }
    asked_ = t.steps() > 0 ? t.steps() : t.epochs() * per_epoch_;
    total_ = asked_;
    completions_.assign(asked_, 0);
    block_steps_.assign(asked_, 0);
    block_grads_.assign(asked_, 0);
    if (!o_.out_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(o_.out_dir, ec);
      if (ec) {
        return absl::PermissionDeniedError(absl::StrCat(
            "--out: cannot create ", o_.out_dir, ": ", ec.message()));
      }
    }
    RETURN_IF_ERROR(SetUpCheckpoints());
    if (!o_.out_dir.empty()) {
      const std::string path = o_.out_dir + "/metrics.jsonl";
      if (start_step_ > 0) {
        // Continue the file: the steps after the checkpoint run again and
        // are recorded again.
        int64_t dropped = 0;
        int64_t last_kept = -1;
        RETURN_IF_ERROR(CutMetricsLines(path, [&](int64_t step) {
          if (step < start_step_) {
            last_kept = std::max(last_kept, step);
            return true;
          }
          ++dropped;
          return false;
        }));
        acc_.microbatches_replayed += dropped * t.microbatches();
        RETURN_IF_ERROR(metrics_.Open(path, /*append=*/true));
        for (const auto& line : pending_metrics_) {
          auto parsed = ParseMetricsLine(line);
          if (!parsed.ok()) continue;
          const auto step = static_cast<int64_t>(parsed->step());
          if (step > last_kept && step < start_step_) {
            RETURN_IF_ERROR(metrics_.Append(line));
          }
        }
      } else {
        RETURN_IF_ERROR(metrics_.Open(path, /*append=*/false));
      }
    }
    Progress progress(
        o_.log, o_.progress_bar, o_.quiet, asked_,
        absl::StrCat(o_.progress_label.empty() ? "" : o_.progress_label + " ",
                     c_.name(), " ", ModeName(c_)));
    progress_ = &progress;
    start_ = Clock::now();
    if (metrics_out_) {
      for (int b = 0; b < k_; ++b) metrics_out_->OnSkippedSteps(b, 0);
    }
    ResetTo(start_step_);
    next_emit_ = start_step_;
    clock_base_ = start_step_;
    TrainResult result;
    // A worker failing anywhere, the final evaluation included, is
    // recovered from: restore, replay, and finish again.
    for (int64_t from = start_step_;;) {
      absl::Status s = TrainSteps(from);
      if (s.ok()) {
        result = TrainResult();
        result.steps = total_;
        result.wall_seconds = TrainElapsed();
        result.final_losses = last_losses_;
        result.skipped_steps.assign(k_, 0);
        for (const auto& [step, block] : skipped_)
          ++result.skipped_steps[block];
        s = Finish(result);
      }
      if (s.ok()) break;
      ASSIGN_OR_RETURN(from, Recover(s));
    }
    progress.Finish();
    RETURN_IF_ERROR(metrics_.Close());
    RETURN_IF_ERROR(CheckAccounting());
    result.accounting = acc_;
    if (!o_.out_dir.empty()) RETURN_IF_ERROR(WriteFiles(result));
    return result;
  }

 private:
  double Elapsed() const {
    return wall_offset_ +
           std::chrono::duration<double>(Clock::now() - start_).count();
  }
  // Training time: evaluation stops the clock.
  double TrainElapsed() const { return Elapsed() - eval_seconds_; }

  // The replay needs the bytes every link carries per micro-batch: the input
  // batch, each block's activation (with the targets), and the gradient list.
  absl::Status StartClock(const torch::Tensor& x, const torch::Tensor& y,
                          int window) {
    const auto& t = c_.training();
    PipelineShape sh;
    sh.blocks = k_;
    sh.microbatches = t.microbatches();
    sh.window = window;
    sh.e2e = t.mode() == TrainingSpec::E2E;
    sh.n = t.n();
    sh.sum_rule = t.rule() == TrainingSpec::SUM;
    sh.compute_unused = t.compute_unused_gradients();
    sh.link = o_.link;
    sh.input_bytes = static_cast<int64_t>(x.nbytes() + y.nbytes());
    ASSIGN_OR_RETURN(auto outs, BlockOutputShapes(c_.model(), shape_));
    for (int k = 0; k + 1 < k_; ++k) {
      int64_t act = x.size(0) * static_cast<int64_t>(sizeof(float));
      for (int64_t d : outs[k]) act *= d;
      sh.down_bytes.push_back(act + static_cast<int64_t>(y.nbytes()));
      sh.up_bytes.push_back(sh.Down(k) * act);
    }
    clock_ = std::make_unique<PipelineSim>(std::move(sh), kTimelineSteps);
    return absl::OkStatus();
  }

  // Whether step s should not start: a time budget would be exceeded. On
  // the virtual clock the end of step s is projected from the replayed steps'
  // mean (the replay runs up to two steps behind the real run).
  bool BudgetReached(int64_t s) {
    if (o_.budget_wall > absl::ZeroDuration() &&
        TrainElapsed() >= Seconds(o_.budget_wall)) {
      return true;
    }
    if (o_.budget_virtual > absl::ZeroDuration() && clock_) {
      clock_->Advance();
      const int64_t f = clock_->steps_finished();
      if (f == 0) {
        return virtual_offset_ + clock_->Now() >= Seconds(o_.budget_virtual);
      }
      const double last = clock_->StepEnd(f - 1);
      const double projected =
          virtual_offset_ + last + (s - clock_base_ + 1 - f) * (last / f);
      return projected > Seconds(o_.budget_virtual);
    }
    return false;
  }

  absl::Status EvaluateAt(int64_t step) {
    const double t0 = Elapsed();
    const double wall = TrainElapsed();
    ASSIGN_OR_RETURN(auto heads, Evaluate());
    eval_seconds_ += Elapsed() - t0;
    evals_.push_back(EvalPoint{step, wall, 0.0, std::move(heads)});
    return absl::OkStatus();
  }

  // Virtual times of the evaluation points and the run's clock summary.
  void FillClock(TrainResult& r) {
    const int64_t trained = r.steps - clock_base_;
    r.mean_step_wall = trained > 1 ? (last_wall_ - first_wall_) / (trained - 1)
                                   : last_wall_ - wall_offset_;
    r.virtual_seconds = virtual_offset_;
    if (clock_ && r.steps > clock_base_) {
      // Means and busy ratios are of the part this process replayed.
      const int64_t n = r.steps - clock_base_;
      const double end = clock_->StepEnd(n - 1);
      r.virtual_seconds = virtual_offset_ + end;
      r.mean_step_virtual = n > 1 ? (end - clock_->StepEnd(0)) / (n - 1) : end;
      double busy = 0;
      for (int k = 0; k < k_; ++k) {
        busy += clock_->Busy(k);
        r.busy_ratio.push_back(end > 0 ? clock_->Busy(k) / end : 0.0);
      }
      r.utilisation = end > 0 ? busy / (k_ * end) : 0.0;
    }
    for (auto& e : evals_) {
      if (e.step > clock_base_ && e.step <= ClockFinished()) {
        e.virtual_seconds = VirtualEnd(e.step - 1);
      }
    }
    r.evals = evals_;
  }

  // Step records wait for the replay to place the step on the virtual clock.
  absl::Status EmitReady() {
    while (next_emit_ < completed_ && next_emit_ < ClockFinished()) {
      auto it = steps_.find(next_emit_);
      RETURN_IF_ERROR(EmitStep(next_emit_, it->second));
      steps_.erase(it);
      ++next_emit_;
    }
    return absl::OkStatus();
  }
  // Submits steps [from, total), with evaluations and checkpoints at their
  // step boundaries, and waits until every block has stepped all of them.
  absl::Status TrainSteps(int64_t from) {
    const auto& t = c_.training();
    const int64_t batch = t.batch_size();
    const int m = t.microbatches();
    // Micro-batches in flight. A completion comes back only after the
    // micro-batch went down the whole chain and its reports came up again,
    // so keeping K blocks busy in 1-way and n-way needs about 2K of them;
    // E2E limits itself (block 0 waits for its gradient).
    const int window = o_.window > 0 ? o_.window : 2 * k_ * m;
    int64_t epoch = -1;
    std::vector<int64_t> perm;
    for (int64_t s = from; s < total_; ++s) {
      if (o_.stop_requested != nullptr && o_.stop_requested->load()) {
        return Stop(s);
      }
      if (BudgetReached(s)) {
        total_ = s;
        break;
      }
      if (s / per_epoch_ != epoch) {
        epoch = s / per_epoch_;
        perm = EpochPermutation(train_.size(), t.seed(), epoch);
      }
      const double lr = LearningRateAt(c_.schedule(), s, asked_);
      lrs_[s] = lr;
      const int64_t base = (s % per_epoch_) * batch;
      const int64_t per_mb = batch / m;
      for (int mb = 0; mb < m; ++mb) {
        while (in_flight_ >= window) RETURN_IF_ERROR(HandleNext());
        std::vector<int64_t> idx(perm.begin() + base + mb * per_mb,
                                 perm.begin() + base + (mb + 1) * per_mb);
        auto [x, y] = train_.Gather(idx);
        if (!clock_) RETURN_IF_ERROR(StartClock(x, y, window));
        ForwardMsg msg;
        msg.step = s;
        msg.mb = mb;
        msg.lr = lr;
        msg.input = std::move(x);
        msg.target = std::move(y);
        RETURN_IF_ERROR(engine_.Submit(std::move(msg)));
        // A replay after a recovery submits again what the clock knows.
        const int64_t count = (s - clock_base_) * m + mb + 1;
        if (count > clock_submitted_) {
          clock_->SetSubmitted(count);
          clock_submitted_ = count;
        }
        ++in_flight_;
        // Record finished steps as soon as they finish, so wall times and
        // throughput are not a step late.
        while (engine_.Ready()) RETURN_IF_ERROR(HandleNext());
      }
      const int64_t every = t.eval_every_steps();
      const bool eval_due = every > 0 && (s + 1) % every == 0 &&
                            s + 1 < asked_ &&
                            (evals_.empty() || evals_.back().step <= s);
      const bool checkpoint_due = checkpoints_ && o_.checkpoint_every > 0 &&
                                  (s + 1) % o_.checkpoint_every == 0;
      // Both need an idle chain: finish step s everywhere first.
      if (eval_due || checkpoint_due) RETURN_IF_ERROR(DrainThrough(s));
      if (eval_due) RETURN_IF_ERROR(EvaluateAt(s + 1));
      if (checkpoint_due) RETURN_IF_ERROR(TakeCheckpoint(s + 1).status());
    }
    // No more submissions: the replay may now run past the last step.
    if (clock_) clock_->Finish();
    RETURN_IF_ERROR(DrainThrough(total_ - 1));
    if (clock_) clock_->Advance();
    RETURN_IF_ERROR(EmitReady());
    if (next_emit_ < total_) {
      return absl::InternalError(absl::StrCat(
          "virtual clock: step ", next_emit_, " did not finish in the replay"));
    }
    return absl::OkStatus();
  }

  // The final evaluation, the virtual clock's summary and the digests.
  absl::Status Finish(TrainResult& result) {
    if (evals_.empty() || evals_.back().step != total_) {
      RETURN_IF_ERROR(EvaluateAt(total_));
    }
    result.eval = evals_.back().heads;
    FillClock(result);
    return Digests(result);
  }

  // Waits until step s completed and every block has stepped it.
  absl::Status DrainThrough(int64_t s) {
    while (completed_ <= s || MinStepsDone() <= s) {
      RETURN_IF_ERROR(HandleNext());
    }
    return absl::OkStatus();
  }

  // A stop request: checkpoint at this step boundary and end the run.
  absl::Status Stop(int64_t s) {
    if (!checkpoints_ && !checkpoint_dir_.empty()) {
      ASSIGN_OR_RETURN(checkpoints_, RunCheckpoints::Open(checkpoint_dir_,
                                                          o_.keep_checkpoints,
                                                          o_.log, seal_key_));
    }
    if (!checkpoints_) {
      return absl::CancelledError(
          absl::StrCat("stopped at step ", s, " (no checkpoint folder)"));
    }
    RETURN_IF_ERROR(DrainThrough(s - 1));
    // Nothing more is submitted: the clock can place every step, and all of
    // them are recorded before the checkpoint.
    if (clock_) {
      clock_->Finish();
      clock_->Advance();
      RETURN_IF_ERROR(EmitReady());
    }
    ASSIGN_OR_RETURN(const std::string dir, TakeCheckpoint(s));
    return absl::CancelledError(
        absl::StrCat("stopped at step ", s, "; checkpoint ", dir,
                     " (run again with the same --out to resume)"));
  }

  absl::Status SetUpCheckpoints() {
    std::string dir = o_.checkpoint_dir;
    if (dir.empty() && !o_.out_dir.empty()) dir = o_.out_dir + "/checkpoints";
    if (dir.empty() && !o_.resume.empty()) {
      // The folder the resumed checkpoint lives in.
      std::error_code ec;
      const auto r = std::filesystem::weakly_canonical(o_.resume, ec);
      dir = std::filesystem::exists(r / "manifest.pbtxt", ec)
                ? r.parent_path().string()
                : r.string();
    }
    if (dir.empty()) {
      if (o_.checkpoint_every > 0 || !o_.resume.empty()) {
        return absl::InvalidArgumentError(
            "--checkpoint-every needs --out or --checkpoint-dir");
      }
      return absl::OkStatus();
    }
    checkpoint_dir_ = dir;
    std::error_code ec;
    if (o_.checkpoint_every == 0 && o_.resume.empty() &&
        !std::filesystem::exists(dir, ec)) {
      return absl::OkStatus();  // opened if a stop request needs it
    }
    ASSIGN_OR_RETURN(
        checkpoints_,
        RunCheckpoints::Open(dir, o_.keep_checkpoints, o_.log, seal_key_));
    ASSIGN_OR_RETURN(std::optional<Checkpoint> c,
                     checkpoints_->FindResume(o_.resume));
    if (!c) return absl::OkStatus();
    const auto& mf = c->manifest;
    RETURN_IF_ERROR(CheckSameRun(mf, c_, c->dir));
    if (mf.num_blocks() != k_ || mf.total_steps() != asked_) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint ", c->dir, " is of a run of ",
                       mf.num_blocks(), " blocks and ", mf.total_steps(),
                       " steps; this run has ", k_, " and ", asked_));
    }
    const int m = c_.training().microbatches();
    if (mf.microbatches_applied() != mf.step() * m) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint ", c->dir, ": ", mf.microbatches_applied(),
          " micro-batches applied in ", mf.step(), " steps of ", m));
    }
    RETURN_IF_ERROR(Restore(engine_, *c));
    start_step_ = mf.step();
    pending_metrics_.assign(mf.pending_metrics().begin(),
                            mf.pending_metrics().end());
    wall_offset_ = mf.wall_seconds();
    virtual_offset_ = mf.virtual_seconds();
    acc_.resumed_from_step = start_step_;
    acc_.recoveries = mf.recoveries();
    for (int64_t s = 0; s < start_step_; ++s) {
      completions_[s] = m;
      block_steps_[s] = k_;
      block_grads_[s] = int64_t{k_} * m;
    }
    evals_.clear();
    for (const auto& e : mf.evals()) {
      if (evals_.empty() || evals_.back().step != e.step()) {
        evals_.push_back(
            EvalPoint{e.step(), e.wall_seconds(), e.virtual_seconds(), {}});
      }
      HeadResult h;
      h.block = e.block();
      h.final = e.final();
      h.loss = e.loss();
      h.accuracy = e.accuracy();
      h.perplexity = e.perplexity();
      evals_.back().heads.push_back(h);
    }
    *o_.log << "interlock: resuming from " << c->dir << " (step " << start_step_
            << " of " << asked_ << ")\n";
    return absl::OkStatus();
  }

  // Checkpoint of `steps` completed steps (the chain is idle).
  absl::StatusOr<std::string> TakeCheckpoint(int64_t steps) {
    const auto t0 = Clock::now();
    const auto& t = c_.training();
    for (int64_t s = 0; s < steps; ++s) {
      if (!AppliedOnce(s)) {
        return absl::InternalError(
            absl::StrCat("checkpoint at step ", steps, ": step ", s,
                         " was not applied exactly once"));
      }
    }
    interlock::v1::CheckpointManifest mf;
    *mf.mutable_config() = c_;
    mf.set_step(steps);
    mf.set_total_steps(asked_);
    mf.mutable_cursor()->set_seed(t.seed());
    mf.mutable_cursor()->set_epoch(steps / per_epoch_);
    mf.mutable_cursor()->set_offset((steps % per_epoch_) * t.batch_size());
    mf.set_wall_seconds(TrainElapsed());
    if (clock_) clock_->Advance();
    mf.set_virtual_seconds(steps > 0 ? VirtualEnd(steps - 1) : 0.0);
    mf.set_microbatches_applied(steps * t.microbatches());
    mf.set_recoveries(acc_.recoveries);
    for (auto& e : evals_) {
      if (e.step > steps) continue;
      if (e.virtual_seconds == 0.0 && e.step > 0) {
        e.virtual_seconds = VirtualEnd(e.step - 1);
      }
      for (const auto& h : e.heads) {
        auto* r = mf.add_evals();
        r->set_step(e.step);
        r->set_block(h.block);
        r->set_final(h.final);
        r->set_loss(h.loss);
        r->set_accuracy(h.accuracy);
        r->set_perplexity(h.perplexity);
        r->set_wall_seconds(e.wall_seconds);
        r->set_virtual_seconds(e.virtual_seconds);
      }
    }
    // Steps done but not yet placed on the virtual clock (it runs up to two
    // steps behind) are kept as records without a virtual time, so that a
    // resumed run's metrics.jsonl has every step.
    for (int64_t s = next_emit_; s < steps; ++s) {
      auto it = steps_.find(s);
      if (it == steps_.end()) continue;
      mf.add_pending_metrics(MetricsLine(s, it->second, kNaN));
    }
    ASSIGN_OR_RETURN(std::string dir, checkpoints_->Take(engine_, mf));
    ++acc_.checkpoints;
    if (metrics_out_) {
      metrics_out_->OnCheckpoint(
          steps, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    // Replays never go back before this checkpoint.
    fed_.erase(fed_.begin(),
               fed_.lower_bound({steps, std::numeric_limits<int>::min()}));
    return dir;
  }

  static bool Transient(const absl::Status& s) {
    const auto code = s.code();
    return code == absl::StatusCode::kUnavailable ||
           code == absl::StatusCode::kAborted ||
           code == absl::StatusCode::kDeadlineExceeded ||
           code == absl::StatusCode::kCancelled ||
           code == absl::StatusCode::kUnknown;
  }

  // After a failure: wait for the workers, restore the newest checkpoint
  // (or the initial state) and return the step to continue from. A worker
  // failing again meanwhile restarts the attempt, within the same deadline.
  absl::StatusOr<int64_t> Recover(const absl::Status& failure) {
    if (!Transient(failure) || o_.recover_timeout <= absl::ZeroDuration() ||
        (o_.stop_requested != nullptr && o_.stop_requested->load())) {
      return failure;
    }
    constexpr int kMaxWithoutProgress = 10;
    if (++recoveries_without_progress_ > kMaxWithoutProgress) {
      return absl::Status(
          failure.code(),
          absl::StrCat(failure.message(), " (", kMaxWithoutProgress,
                       " recoveries in a row made no progress)"));
    }
    *o_.log << "\ninterlock: " << failure.message()
            << "; recovering (waiting up to "
            << absl::FormatDuration(o_.recover_timeout)
            << " for every worker)\n";
    const absl::Time deadline = absl::Now() + o_.recover_timeout;
    int64_t from = 0;
    for (;;) {
      // Attempts are bounded so that a worker dying again, or a call stuck
      // on a dead one, is retried (the dead restarted) within the deadline.
      absl::Status s =
          engine_.Recover(std::min(deadline - absl::Now(), kRecoverAttempt));
      if (s.code() == absl::StatusCode::kUnimplemented) return failure;
      from = 0;
      if (s.ok() && checkpoints_) {
        auto c = checkpoints_->FindResume("");
        if (!c.ok()) return c.status();
        if (*c) {
          s = CheckSameRun((*c)->manifest, c_, (*c)->dir);
          if (s.ok()) s = Restore(engine_, **c);
          from = (*c)->manifest.step();
        }
      }
      if (s.ok()) break;
      if (!Transient(s) || absl::Now() >= deadline) {
        return absl::Status(
            s.code(),
            absl::StrCat("recovery failed within ",
                         absl::FormatDuration(o_.recover_timeout), ": ",
                         s.message(), " (after: ", failure.message(), ")"));
      }
      *o_.log << "interlock: recovery interrupted (" << s.message()
              << "); trying again\n";
    }
    ++acc_.recoveries;
    if (metrics_out_) metrics_out_->OnRecovery();
    *o_.log << "interlock: recovered; replaying from step " << from << "\n";
    ResetTo(from);
    return from;
  }

  // The chain restarts at step `from`: forget everything in flight and the
  // accounting of the steps that run again. Steps already recorded in
  // metrics.jsonl stay recorded (next_emit_ is kept); the replay computes
  // the same values.
  void ResetTo(int64_t from) {
    for (int64_t s = from; s < asked_; ++s) {
      acc_.microbatches_replayed += completions_[s];
      completions_[s] = 0;
      block_steps_[s] = 0;
      block_grads_[s] = 0;
    }
    in_flight_ = 0;
    // Records of steps before `from` that wait for the virtual clock stay.
    steps_.erase(steps_.lower_bound(from), steps_.end());
    completed_ = from;
    steps_done_.assign(k_, from);
  }

  bool AppliedOnce(int64_t s) const {
    const int m = c_.training().microbatches();
    return completions_[s] == m && block_steps_[s] == k_ &&
           block_grads_[s] == int64_t{k_} * m;
  }

  absl::Status CheckAccounting() {
    const int m = c_.training().microbatches();
    acc_.microbatches_per_step = m;
    acc_.microbatches_applied = 0;
    acc_.block_steps = 0;
    acc_.steps_not_exactly_once.clear();
    for (int64_t s = 0; s < total_; ++s) {
      acc_.microbatches_applied += completions_[s];
      acc_.block_steps += block_steps_[s];
      if (!AppliedOnce(s)) acc_.steps_not_exactly_once.push_back(s);
    }
    if (!acc_.steps_not_exactly_once.empty()) {
      return absl::InternalError(
          absl::StrCat(acc_.steps_not_exactly_once.size(),
                       " steps were not applied exactly once, the first ",
                       acc_.steps_not_exactly_once.front()));
    }
    return absl::OkStatus();
  }

  // The virtual clock replays the part of the run this process trained
  // (from clock_base_ on); a resumed run continues the checkpoint's time.
  // A step the replay has not placed yet reads as the replay's time so far
  // (a lower bound).
  double VirtualEnd(int64_t s) const {
    if (!clock_ || s < clock_base_) return virtual_offset_;
    const int64_t i = s - clock_base_;
    if (i >= clock_->steps_finished()) return virtual_offset_ + clock_->Now();
    return virtual_offset_ + clock_->StepEnd(i);
  }
  int64_t ClockFinished() const {
    return clock_ ? clock_base_ + clock_->steps_finished() : clock_base_;
  }

  int64_t MinStepsDone() const {
    int64_t m = std::numeric_limits<int64_t>::max();
    for (int64_t v : steps_done_) m = std::min(m, v);
    return m;
  }

  absl::Status HandleNext() {
    // Used in place: moving the variant out of the StatusOr makes GCC 12 at
    // -O3 warn (falsely) that its vectors may be used uninitialised.
    absl::StatusOr<EngineEvent> next = engine_.Next();
    if (!next.ok()) return next.status();
    EngineEvent& e = *next;
    if (auto* d = std::get_if<StepDone>(&e)) {
      if (d->block < 0 || d->block >= k_ || d->step < clock_base_ ||
          d->step >= asked_) {
        return absl::InternalError(absl::StrCat("step report of step ", d->step,
                                                " from block ", d->block));
      }
      ++steps_done_[d->block];
      ++block_steps_[d->step];
      block_grads_[d->step] += d->microbatches;
      // A replay after a recovery skips the same steps again (it is
      // deterministic): count each once.
      if (d->skipped && skipped_.insert({d->step, d->block}).second &&
          metrics_out_) {
        metrics_out_->OnSkippedSteps(d->block, 1);
      }
      // A replayed step's durations are on the clock already.
      if (fed_.insert({d->step, -1 - d->block}).second) {
        clock_->SetOptimizer(d->step - clock_base_, d->block,
                             d->timing.seconds);
      }
      clock_->Advance();
      return EmitReady();
    }
    if (std::get_if<DuplicateAck>(&e)) {
      ++acc_.duplicates_acknowledged;
      return absl::OkStatus();
    }
    auto& up = std::get<UpwardMsg>(e);
    if (up.step < clock_base_ || up.step >= asked_) {
      return absl::InternalError(absl::StrCat("completion of step ", up.step));
    }
    ++completions_[up.step];
    --in_flight_;
    StepAgg& agg = steps_[up.step];
    if (agg.loss_sum.empty()) {
      agg.loss_sum.assign(k_, 0.0);
      agg.loss_n.assign(k_, 0);
    }
    ++agg.done;
    for (const auto& r : up.reports) {
      if (r.block < 0 || r.block >= k_) continue;
      agg.loss_sum[r.block] += r.loss;
      ++agg.loss_n[r.block];
    }
    std::vector<MbDurations> d(k_);
    for (const auto& t : up.timings) {
      if (t.block < 0 || t.block >= k_) continue;
      if (t.phase == Phase::kForward) d[t.block].forward += t.seconds;
      if (t.phase == Phase::kHead) d[t.block].head += t.seconds;
      if (t.phase == Phase::kBackward) d[t.block].backward += t.seconds;
      if (t.phase == Phase::kInputGrad) d[t.block].input_grad += t.seconds;
    }
    if (fed_.insert({up.step, up.mb}).second) {
      clock_->SetMicrobatch(up.step - clock_base_, up.mb, std::move(d));
    }
    // Steps are recorded in order even if completions interleave.
    const int m = c_.training().microbatches();
    for (auto it = steps_.find(completed_);
         it != steps_.end() && it->second.done == m;
         it = steps_.find(completed_)) {
      if (completed_ < next_emit_) {
        // Replayed after a recovery: recorded already.
        steps_.erase(it);
        lrs_.erase(completed_);
      } else {
        it->second.wall = TrainElapsed();
        if (completed_ == clock_base_) first_wall_ = it->second.wall;
        last_wall_ = it->second.wall;
        recoveries_without_progress_ = 0;
      }
      ++completed_;
    }
    clock_->Advance();
    return EmitReady();
  }

  std::vector<double> MeanLosses(const StepAgg& agg) const {
    std::vector<double> losses(k_, kNaN);
    for (int k = 0; k < k_; ++k) {
      if (agg.loss_n[k] > 0) losses[k] = agg.loss_sum[k] / agg.loss_n[k];
    }
    return losses;
  }

  // One line of metrics.jsonl (no newline).
  std::string MetricsLine(int64_t s, const StepAgg& agg, double virt) {
    const double samples =
        static_cast<double>(c_.training().batch_size()) * (s + 1);
    v1::MetricsLine line;
    line.set_step(static_cast<double>(s));
    line.set_wall_seconds(agg.wall);
    line.set_virtual_seconds(virt);
    line.set_lr(lrs_[s]);
    for (double l : MeanLosses(agg)) line.add_loss(l);
    line.set_samples_per_second(agg.wall > 0 ? samples / agg.wall : 0.0);
    return JsonLine(line);
  }

  absl::Status EmitStep(int64_t s, const StepAgg& agg) {
    const std::vector<double> losses = MeanLosses(agg);
    last_losses_ = losses;
    const double wall = agg.wall;
    const double virt = VirtualEnd(s);
    const double prev_virt =
        s > clock_base_ ? VirtualEnd(s - 1) : virtual_offset_;
    const double samples =
        static_cast<double>(c_.training().batch_size()) * (s + 1);
    const double sps = wall > 0 ? samples / wall : 0.0;
    if (metrics_.is_open()) {
      RETURN_IF_ERROR(metrics_.Append(MetricsLine(s, agg, virt)));
    }
    lrs_.erase(s);
    if (metrics_out_) {
      metrics_out_->OnStep(s, losses, sps, c_.training().microbatches());
      std::vector<double> busy(k_);
      for (int k = 0; k < k_; ++k) {
        busy[k] = clock_->Now() > 0 ? clock_->Busy(k) / clock_->Now() : 0.0;
      }
      metrics_out_->OnStepTimes(
          wall - (s > clock_base_ ? prev_wall_ : wall_offset_), virt,
          virt - prev_virt, busy);
    }
    prev_wall_ = wall;
    progress_->Update(s + 1, losses, sps, wall);
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<HeadResult>> Evaluate() {
    const int64_t eb = std::max(1, c_.training().eval_batch_size());
    std::map<int, HeadEval> sums;
    for (int64_t i = 0; i < test_.size(); i += eb) {
      std::vector<int64_t> idx;
      for (int64_t j = i; j < std::min(test_.size(), i + eb); ++j) {
        idx.push_back(j);
      }
      auto [x, y] = test_.Gather(idx);
      ASSIGN_OR_RETURN(auto heads, engine_.Evaluate(x, y));
      for (const auto& h : heads) {
        HeadEval& s = sums[h.block];
        s.block = h.block;
        s.loss_sum += h.loss_sum;
        s.correct += h.correct;
        s.count += h.count;
      }
    }
    std::vector<HeadResult> out;
    for (const auto& [block, s] : sums) {
      HeadResult r;
      r.block = block;
      r.final = block == k_ - 1;
      r.loss = s.count ? s.loss_sum / s.count : kNaN;
      r.accuracy = s.count ? static_cast<double>(s.correct) / s.count : kNaN;
      r.perplexity = text_ ? std::exp(r.loss) : kNaN;
      if (metrics_out_) metrics_out_->OnEval(block, r.accuracy, r.loss);
      out.push_back(r);
    }
    return out;
  }

  absl::Status Digests(TrainResult& result) {
    ASSIGN_OR_RETURN(auto states, engine_.FetchState());
    std::vector<std::string> all;
    for (size_t k = 0; k < states.size(); ++k) {
      result.block_digests.push_back(DigestTensors(states[k].block));
      result.head_digests.push_back(
          states[k].head.empty() ? "" : DigestTensors(states[k].head));
      all.push_back(result.block_digests.back());
      all.push_back(result.head_digests.back());
      if (o_.dump_params) {
        for (const auto* part : {&states[k].block, &states[k].head}) {
          for (const auto& [name, t] : *part) {
            AppendParamDump(absl::StrCat("block", k, ".", name), t,
                            &result.params_json);
          }
        }
      }
    }
    const std::string joined = absl::StrJoin(all, "/");
    result.digest = Sha256Hex(joined.data(), joined.size());
    return absl::OkStatus();
  }

  // Every file is built in memory and written with every write and the
  // close checked: a full disk fails the run, naming the file.
  absl::Status WriteFiles(const TrainResult& r) {
    RETURN_IF_ERROR(
        WriteEval(o_.out_dir + "/eval.jsonl", EvalLinesOf(r.evals)));
    RETURN_IF_ERROR(WriteSummary(o_.out_dir + "/summary.json",
                                 SummaryOf(c_, ModeName(c_), k_, r)));
    const auto& t = c_.training();
    if (!clock_ || r.steps <= clock_base_) return absl::OkStatus();
    RunInfo info;
    info.name = c_.name();
    info.mode = ModeName(c_);
    info.e2e = t.mode() == TrainingSpec::E2E;
    info.n = t.n();
    info.sum_rule = t.rule() == TrainingSpec::SUM;
    info.batch_size = t.batch_size();
    info.steps = r.steps - clock_base_;
    info.mean_step_wall = r.mean_step_wall;
    info.mean_step_virtual = r.mean_step_virtual;
    RETURN_IF_ERROR(WriteProfile(*clock_, info, o_.out_dir + "/profile.json"));
    return WriteTimeline(*clock_, info, o_.out_dir);
  }

  // The run's token: checkpoints are signed with it and must carry its
  // signature to be loaded (empty: checksums only).
  const std::string seal_key_;
  CoordinatorMetrics* metrics_out_;
  const RunConfig& c_;
  const TrainOptions& o_;
  Engine& engine_;
  const Dataset& train_;
  const Dataset& test_;
  const DataShape shape_;
  const bool text_;
  const int k_;
  Progress* progress_ = nullptr;
  Clock::time_point start_;
  AppendFile metrics_;
  int64_t per_epoch_ = 0;
  int64_t asked_ = 0;  // steps the config asks for
  int64_t total_ = 0;  // steps run (fewer when a budget stops the run)
  int in_flight_ = 0;
  int64_t completed_ = 0;  // steps whose micro-batches all completed
  int64_t next_emit_ = 0;  // steps recorded (placed on the virtual clock)
  std::unique_ptr<PipelineSim> clock_;
  // The clock replays steps from clock_base_ (the step resumed from) on,
  // numbered from 0, after virtual_offset_ seconds of the earlier run.
  int64_t clock_base_ = 0;
  double virtual_offset_ = 0.0;
  int64_t clock_submitted_ = 0;
  // (step, micro-batch) and (step, -1 - block) whose durations the clock
  // has: a replay after a recovery does not give them twice.
  std::set<std::pair<int64_t, int>> fed_;
  // Checkpoints (null without a checkpoint folder), where the run started
  // and the training time before it.
  std::unique_ptr<RunCheckpoints> checkpoints_;
  std::string checkpoint_dir_;
  int64_t start_step_ = 0;
  std::vector<std::string> pending_metrics_;  // from the checkpoint
  double wall_offset_ = 0.0;
  int recoveries_without_progress_ = 0;
  // Exactly-once accounting, per step of the surviving history:
  // completions, block optimizer steps and block gradients applied.
  std::vector<int> completions_;
  std::vector<int> block_steps_;
  std::vector<int64_t> block_grads_;
  Accounting acc_;
  double eval_seconds_ = 0.0;
  double first_wall_ = 0.0, last_wall_ = 0.0, prev_wall_ = 0.0;
  std::vector<EvalPoint> evals_;
  std::map<int64_t, StepAgg> steps_;
  std::map<int64_t, double> lrs_;
  std::vector<int64_t> steps_done_;
  // (step, block) whose update the block skipped (nonfinite_policy); steps
  // before a resumed checkpoint are not included.
  std::set<std::pair<int64_t, int>> skipped_;
  std::vector<double> last_losses_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<FolderLock>> FolderLock::Acquire(
    const std::string& dir, const std::string& flag) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat(flag, ": cannot create ", dir, ": ", ec.message()));
  }
  const std::string path = dir + "/.interlock.lock";
  // Close-on-exec: a worker started by a local cluster must not inherit
  // (and so keep) the lock.
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    return absl::PermissionDeniedError(absl::StrCat(
        flag, ": cannot open the lock file ", path, ": ", std::strerror(err)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    close(fd);
    if (err == EWOULDBLOCK) {
      int64_t pid = 0;
      const bool known =
          n > 0 && absl::SimpleAtoi(absl::StripAsciiWhitespace(buf), &pid);
      return absl::FailedPreconditionError(absl::StrCat(
          flag, ": ", dir, " is in use by another run",
          known ? absl::StrCat(" (pid ", pid, ")") : "", "; wait for it to ",
          "finish or choose another ", flag, " (lock: ", path, ")"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": cannot lock ", path, ": ", std::strerror(err)));
  }
  // The holder, for the message above. Only informative: a full disk must
  // not stop the run here (its own writes will say so).
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) == 0) {
    if (pwrite(fd, pid.data(), pid.size(), 0) < 0) {
      // Ignored, see above.
    }
  }
  return std::unique_ptr<FolderLock>(new FolderLock(fd));
}

FolderLock::~FolderLock() { close(fd_); }

absl::StatusOr<TrainResult> Train(const RunConfig& config_in,
                                  const TrainOptions& options) {
  RunConfig config = config_in;
  ApplyDefaults(config);
  RETURN_IF_ERROR(ValidateRunConfig(config));
  // Held until the run returns; a second run on the same folder is refused
  // here, before it loads data or starts workers.
  std::vector<std::unique_ptr<FolderLock>> locks;
  if (!options.out_dir.empty()) {
    ASSIGN_OR_RETURN(auto lock, FolderLock::Acquire(options.out_dir, "--out"));
    locks.push_back(std::move(lock));
  }
  if (!options.checkpoint_dir.empty() &&
      (options.out_dir.empty() ||
       !SameFolder(options.checkpoint_dir, options.out_dir))) {
    ASSIGN_OR_RETURN(auto lock, FolderLock::Acquire(options.checkpoint_dir,
                                                    "--checkpoint-dir"));
    locks.push_back(std::move(lock));
  }
  std::string seal_key;
  const int64_t context = config.model().has_transformer()
                              ? config.model().transformer().context()
                              : 1;
  ASSIGN_OR_RETURN(DataSplits data, LoadData(config.data(), context));
  std::unique_ptr<CoordinatorMetrics> metrics;
  if (options.metrics_port >= 0) {
    ASSIGN_OR_RETURN(metrics, CoordinatorMetrics::Serve(options.metrics_host,
                                                        options.metrics_port,
                                                        ModeName(config)));
  }
  std::unique_ptr<LocalCluster> local;
  std::unique_ptr<Engine> engine;
  if (options.engine == EngineKind::kCluster) {
    ClusterOptions co;
    co.workers = options.workers;
    co.connect_timeout = options.connect_timeout;
    co.window = options.window;
    ASSIGN_OR_RETURN(co.security, LoadTransportSecurity(options.security,
                                                        /*server=*/false));
    seal_key = co.security.token;
    if (metrics) {
      co.on_worker_state = [m = metrics.get()](int block, bool up) {
        m->SetWorkerUp(block, up);
      };
    }
    if (co.workers.empty()) {
      ASSIGN_OR_RETURN(const int k, NumBlocks(config.model()));
      ASSIGN_OR_RETURN(
          local, LocalCluster::Launch(
                     k,
                     options.worker_binary.empty() ? DefaultWorkerBinary()
                                                   : options.worker_binary,
                     absl::Seconds(120), SecurityFlags(options.security)));
      if (options.on_cluster) options.on_cluster(local.get());
      co.workers = local->addresses();
      // Like a restartPolicy: a dead worker is started again on its port.
      co.revive = [l = local.get(), log = options.log] {
        auto n = l->ReviveDead();
        if (!n.ok()) {
          *log << "interlock: restarting workers: " << n.status() << "\n";
        } else if (*n > 0) {
          *log << "interlock: restarted " << *n << " worker(s)\n";
        }
      };
    }
    auto made = MakeClusterEngine(config, data.shape, co);
    if (!made.ok()) {
      if (local && options.on_cluster) options.on_cluster(nullptr);
      return made.status();
    }
    engine = std::move(*made);
  } else {
    ASSIGN_OR_RETURN(engine,
                     MakeInProcessEngine(config, data.shape, options.schedule));
  }
  Runner runner(config, options, *engine, *data.train, *data.test, data.shape,
                metrics.get(), seal_key);
  auto result = runner.Run();
  engine->Shutdown();
  if (local) {
    if (options.on_cluster) options.on_cluster(nullptr);
    local->Stop();
  }
  return result;
}

}  // namespace interlock
