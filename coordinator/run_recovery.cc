#include "coordinator/run_recovery.h"

#include <chrono>
#include <filesystem>
#include <optional>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "rpc/status.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

// Longest single attempt of a recovery (waiting for workers, configuring,
// restoring); attempts repeat until --recover-timeout.
constexpr absl::Duration kRecoverAttempt = absl::Seconds(5);
// Recoveries in a row without a completed step before the run gives up.
constexpr int kMaxWithoutProgress = 10;

}  // namespace

absl::Status RunRecovery::Open(const std::string& dir) {
  ASSIGN_OR_RETURN(checkpoints_, RunCheckpoints::Open(dir, o_.keep, seal_key_));
  return absl::OkStatus();
}

absl::StatusOr<ResumePoint> RunRecovery::Resume() {
  ASSIGN_OR_RETURN(ResumePoint point, OpenAndResume());
  if (!adopted_) return point;
  // The engine adopted the live workers: they hold the blocks' states at
  // the journal's step; the coordinator's part comes from the journal.
  point = ResumeFrom(adopted_->manifest());
  ++state_.ledger.accounting().adoptions;
  LOG(INFO) << "continuing run " << adopted_->run_id() << " from step "
            << point.step << " of " << state_.plan.steps()
            << " on its live workers (journal " << journal_->path() << ")";
  return point;
}

absl::StatusOr<ResumePoint> RunRecovery::OpenAndResume() {
  ResumePoint point;
  std::string dir = o_.dir;
  if (dir.empty() && !out_dir_.empty()) dir = out_dir_ + "/checkpoints";
  if (dir.empty() && !o_.resume.empty()) {
    // The folder the resumed checkpoint lives in.
    std::error_code ec;
    const auto r = std::filesystem::weakly_canonical(o_.resume, ec);
    dir = std::filesystem::exists(r / "manifest.pbtxt", ec)
              ? r.parent_path().string()
              : r.string();
  }
  if (dir.empty()) {
    if (o_.every > 0 || !o_.resume.empty()) {
      return absl::InvalidArgumentError(
          "--checkpoint-every needs --out or --checkpoint-dir");
    }
    return point;
  }
  dir_ = dir;
  std::error_code ec;
  if (o_.every == 0 && o_.resume.empty() && !std::filesystem::exists(dir, ec)) {
    return point;  // opened if a stop request needs it
  }
  RETURN_IF_ERROR(Open(dir));
  if (adopted_) return point;  // continued below, from the journal
  ASSIGN_OR_RETURN(std::optional<Checkpoint> c,
                   checkpoints_->FindResume(o_.resume));
  if (!c) return point;
  const auto& mf = c->manifest;
  RETURN_IF_ERROR(CheckSameRun(mf, c_, c->dir));
  const RunPlan& plan = state_.plan;
  if (mf.num_blocks() != plan.blocks() || mf.total_steps() != plan.steps()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", c->dir, " is of a run of ", mf.num_blocks(),
                     " blocks and ", mf.total_steps(), " steps; this run has ",
                     plan.blocks(), " and ", plan.steps()));
  }
  const int m = plan.microbatches();
  if (mf.microbatches_applied() != mf.step() * m) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", c->dir, ": ", mf.microbatches_applied(),
                     " micro-batches applied in ", mf.step(), " steps of ", m));
  }
  RETURN_IF_ERROR(Restore(engine_, *c));
  LOG(INFO) << "resuming from " << c->dir << " (step " << mf.step() << " of "
            << plan.steps() << ")";
  return ResumeFrom(mf);
}

ResumePoint RunRecovery::ResumeFrom(const v1::CheckpointManifest& mf) {
  ResumePoint point;
  point.step = mf.step();
  point.wall_seconds = mf.wall_seconds();
  point.pending_records.assign(mf.pending_metrics().begin(),
                               mf.pending_metrics().end());
  state_.clock.Resume(point.step, mf.virtual_seconds());
  state_.ledger.Restored(point.step);
  state_.ledger.accounting().recoveries = mf.recoveries();
  state_.ledger.accounting().adoptions = mf.adoptions();
  state_.ledger.accounting().failovers = mf.failovers();
  auto& evals = state_.evals;
  evals.clear();
  for (const auto& e : mf.evals()) {
    if (evals.empty() || evals.back().step != e.step()) {
      evals.push_back(
          EvalPoint{e.step(), e.wall_seconds(), e.virtual_seconds(), {}});
    }
    HeadResult h;
    h.block = e.block();
    h.final = e.final();
    h.loss = e.loss();
    h.accuracy = e.accuracy();
    h.perplexity = e.perplexity();
    evals.back().heads.push_back(h);
  }
  return point;
}

absl::StatusOr<bool> RunRecovery::CanStop() {
  if (!checkpoints_ && !dir_.empty()) RETURN_IF_ERROR(Open(dir_));
  return checkpoints_ != nullptr;
}

v1::CheckpointManifest RunRecovery::Manifest(int64_t steps) {
  const RunPlan& plan = state_.plan;
  v1::CheckpointManifest mf;
  mf.set_format(1);
  mf.set_num_blocks(plan.blocks());
  *mf.mutable_config() = c_;
  mf.set_step(steps);
  mf.set_total_steps(plan.steps());
  mf.mutable_cursor()->set_seed(c_.training().seed());
  mf.mutable_cursor()->set_epoch(plan.EpochOf(steps));
  mf.mutable_cursor()->set_offset(plan.OffsetOf(steps));
  mf.set_wall_seconds(state_.timer.Training());
  RunClock& clock = state_.clock;
  mf.set_virtual_seconds(steps > 0 ? clock.End(steps - 1) : 0.0);
  mf.set_microbatches_applied(steps * plan.microbatches());
  mf.set_recoveries(state_.ledger.accounting().recoveries);
  mf.set_adoptions(state_.ledger.accounting().adoptions);
  mf.set_failovers(state_.ledger.accounting().failovers);
  for (auto& e : state_.evals) {
    if (e.step > steps) continue;
    if (e.virtual_seconds == 0.0 && e.step > 0) {
      e.virtual_seconds = clock.End(e.step - 1);
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
  return mf;
}

void RunRecovery::Journal() {
  ElasticEngine* elastic = engine_.elastic();
  if (!journal_ || !elastic) return;
  const int64_t steps =
      std::min(state_.records.recorded(), state_.ledger.MinStepsDone());
  // Called after every event: nothing is copied until the boundary moved
  // (a new generation is written at its own boundary, JournalBoundary, or
  // with the next step).
  if (steps == journaled_step_) return;
  const LiveRun live = elastic->Live();
  // The workers of this generation hold snapshots from its first step on;
  // an earlier boundary is not theirs to continue from.
  if (steps < live.step) return;
  journaled_step_ = steps;
  journal_->Write(live, Manifest(steps));
}

void RunRecovery::JournalBoundary(int64_t step) {
  ElasticEngine* elastic = engine_.elastic();
  if (!journal_ || !elastic) return;
  state_.clock.Advance();
  v1::CheckpointManifest mf = Manifest(step);
  for (auto& line : state_.records.Pending(step)) {
    mf.add_pending_metrics(std::move(line));
  }
  const LiveRun live = elastic->Live();
  journaled_step_ = step;
  journal_->Write(live, std::move(mf));
}

absl::StatusOr<std::string> RunRecovery::Take(int64_t steps) {
  const auto t0 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(state_.ledger.CheckThrough(steps));
  RunClock& clock = state_.clock;
  clock.Advance();
  v1::CheckpointManifest mf = Manifest(steps);
  // Steps done but not yet placed on the virtual clock (it runs up to two
  // steps behind) are kept as records without a virtual time, so that a
  // resumed run's metrics.jsonl has every step.
  for (auto& line : state_.records.Pending(steps)) {
    mf.add_pending_metrics(std::move(line));
  }
  ASSIGN_OR_RETURN(std::string dir, checkpoints_->Take(engine_, mf));
  ++state_.ledger.accounting().checkpoints;
  if (metrics_) {
    metrics_->OnCheckpoint(steps, std::chrono::duration<double>(
                                      std::chrono::steady_clock::now() - t0)
                                      .count());
  }
  // Replays never go back before this checkpoint.
  clock.Checkpointed(steps);
  return dir;
}

absl::StatusOr<int64_t> RunRecovery::Recover(const absl::Status& failure) {
  if (!IsTransient(failure) || o_.recover_timeout <= absl::ZeroDuration() ||
      (o_.stop_requested != nullptr && o_.stop_requested->load())) {
    return failure;
  }
  if (++recoveries_without_progress_ > kMaxWithoutProgress) {
    return absl::Status(
        failure.code(),
        absl::StrCat(failure.message(), " (", kMaxWithoutProgress,
                     " recoveries in a row made no progress)"));
  }
  // Replicas died but every block kept one: the survivors carry on from
  // their snapshots, without a checkpoint.
  absl::StatusOr<int64_t> failover =
      absl::UnimplementedError("no replicas to fail over to");
  if (ElasticEngine* elastic = engine_.elastic()) {
    failover = elastic->RecoverFromReplicas(
        std::min(state_.ledger.MinStepsDone(), state_.records.completed()));
  }
  if (failover.ok()) {
    ++state_.ledger.accounting().failovers;
    JournalBoundary(*failover);
    LOG(INFO) << failure.message()
              << "; the surviving replicas continue from step " << *failover
              << " (no checkpoint restore)";
    return *failover;
  }
  if (!absl::IsUnimplemented(failover.status())) {
    LOG(WARNING) << "no fail-over to replicas (" << failover.status().message()
                 << ")";
  }
  LOG(WARNING) << failure.message() << "; recovering (waiting up to "
               << absl::FormatDuration(o_.recover_timeout)
               << " for every worker)";
  const absl::Time deadline = absl::Now() + o_.recover_timeout;
  int64_t from = 0;
  for (;;) {
    // Attempts are bounded so that a worker dying again, or a call stuck on
    // a dead one, is retried (the dead restarted) within the deadline.
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
    if (!IsTransient(s) || absl::Now() >= deadline) {
      return absl::Status(
          s.code(),
          absl::StrCat("recovery failed within ",
                       absl::FormatDuration(o_.recover_timeout), ": ",
                       s.message(), " (after: ", failure.message(), ")"));
    }
    LOG(WARNING) << "recovery interrupted (" << s.message()
                 << "); trying again";
  }
  ++state_.ledger.accounting().recoveries;
  if (metrics_) metrics_->OnRecovery();
  LOG(INFO) << "recovered; replaying from step " << from;
  return from;
}

}  // namespace interlock
