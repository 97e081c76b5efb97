#include "coordinator/train.h"

#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "coordinator/engine_factory.h"
#include "coordinator/evaluation.h"
#include "coordinator/partition.h"
#include "coordinator/progress.h"
#include "coordinator/run_journal.h"
#include "coordinator/run_recovery.h"
#include "coordinator/run_report.h"
#include "coordinator/run_state.h"
#include "plan/replica_routes.h"
#include "plan/status_macros.h"
#include "plan/topology.h"
#include "rpc/security.h"
#include "services/calibration.h"
#include "services/config.h"
#include "services/logging.h"
#include "services/op_profile.h"
#include "services/wire_codec.h"

namespace interlock {
namespace {

using interlock::v1::RunConfig;

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// --profile-ops: how many steps are profiled (fewer if the run ends, or an
// evaluation, checkpoint or membership change comes, first).
constexpr int64_t kProfiledSteps = 10;

// Whether two folder names are the same folder (so it is locked once).
bool SameFolder(const std::string& a, const std::string& b) {
  std::error_code ec1, ec2;
  const auto ca = std::filesystem::weakly_canonical(a, ec1);
  const auto cb = std::filesystem::weakly_canonical(b, ec2);
  return !ec1 && !ec2 && ca == cb;
}

// Submits the plan's micro-batches to the engine within the window, drains
// what comes back into the run's parts, and stops, evaluates, checkpoints
// and recovers at step boundaries.
class Runner {
 public:
  Runner(const ResolvedRun& run, const TrainOptions& options, Engine& engine,
         const DataSplits& data, RunState& state, RunRecovery& recovery,
         CoordinatorMetrics* metrics)
      : c_(run.config),
        replicas_(run.replicas),
        o_(options),
        engine_(engine),
        data_(data),
        s_(state),
        recovery_(recovery),
        metrics_(metrics),
        codec_(run.codec),
        k_(run.blocks) {}

  absl::StatusOr<TrainResult> Run() {
    const RunPlan& plan = s_.plan;
    total_ = plan.steps();
    if (!o_.output.out_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(o_.output.out_dir, ec);
      if (ec) {
        return absl::PermissionDeniedError(absl::StrCat(
            "--out: cannot create ", o_.output.out_dir, ": ", ec.message()));
      }
    }
    ASSIGN_OR_RETURN(const ResumePoint resume, recovery_.Resume());
    if (!o_.output.profile_ops.empty()) {
      // A file that cannot be written fails now, not after the run.
      std::ofstream f(o_.output.profile_ops, std::ios::trunc);
      if (!f) {
        return absl::PermissionDeniedError(absl::StrCat(
            "--profile-ops: cannot write ", o_.output.profile_ops));
      }
      // Start once the micro-batches the blocks calibrate are through the
      // window: their extra backward passes are not a step's work. A run
      // too short for that skips only its first step (caches, allocator),
      // and the report says calibration is in.
      const int64_t m = s_.plan.microbatches();
      const int64_t settle =
          (kCalibrateAfter + kCalibrations + s_.plan.window() + m - 1) / m;
      const int64_t left = total_ - resume.step;
      profile_calibrating_ = left <= settle;
      if (!profile_calibrating_) {
        profile_from_ = resume.step + settle;
      } else {
        profile_from_ = resume.step + (left > 1 ? 1 : 0);
      }
    }
    ASSIGN_OR_RETURN(const int64_t dropped,
                     s_.records.Open(o_.output.out_dir, resume.step,
                                     resume.pending_records));
    s_.ledger.accounting().microbatches_replayed +=
        dropped * plan.microbatches();
    Progress progress(
        o_.output.console, o_.output.progress_bar, o_.output.quiet,
        plan.steps(),
        absl::StrCat(
            o_.output.progress_label.empty() ? ""
                                             : o_.output.progress_label + " ",
            c_.name(), " ", ModeName(c_),
            c_.has_wire() ? absl::StrCat(" wire ", WireName(c_.wire())) : ""),
        absl::ToDoubleSeconds(o_.budget.wall));
    s_.records.SetProgress(&progress);
    s_.timer.Start(resume.wall_seconds);
    if (metrics_) {
      const std::vector<int> replicas = replicas_;
      for (int b = 0; b < k_; ++b) {
        metrics_->OnSkippedSteps(b, 0);
        metrics_->SetReplicas(b, replicas[b]);
      }
    }
    s_.records.StartAt(resume.step, resume.wall_seconds);
    ResetTo(resume.step);
    TrainResult result;
    // A worker failing anywhere, the final evaluation included, is
    // recovered from: restore, replay, and finish again.
    for (int64_t from = resume.step;;) {
      absl::Status st = TrainSteps(from);
      if (st.ok()) st = Finish(result);
      if (st.ok()) break;
      ASSIGN_OR_RETURN(from, recovery_.Recover(st));
      ResetTo(from);
    }
    recovery_.CloseJournal();
    progress.Finish();
    s_.records.SetProgress(nullptr);
    RETURN_IF_ERROR(s_.records.Close());
    RETURN_IF_ERROR(s_.ledger.Close(total_));
    result.accounting = s_.ledger.accounting();
    if (!o_.output.out_dir.empty()) {
      RETURN_IF_ERROR(WriteRunFiles(c_, result, s_.clock, o_.output.out_dir));
    }
    return result;
  }

 private:
  // Whether step s should not start: a time budget would be exceeded.
  bool BudgetReached(int64_t s) {
    const BudgetOptions& b = o_.budget;
    if (b.wall > absl::ZeroDuration() &&
        s_.timer.Training() >= Seconds(b.wall)) {
      return true;
    }
    return b.virtual_time > absl::ZeroDuration() &&
           s_.clock.WouldExceed(s, Seconds(b.virtual_time));
  }

  absl::Status EvaluateAt(int64_t step) {
    const double t0 = s_.timer.Elapsed();
    const double wall = s_.timer.Training();
    ASSIGN_OR_RETURN(auto heads, EvaluateHeads(engine_, *data_.test,
                                               c_.training().eval_batch_size(),
                                               data_.shape.is_text, metrics_));
    s_.timer.AddEvaluation(s_.timer.Elapsed() - t0);
    s_.evals.push_back(EvalPoint{step, wall, 0.0, std::move(heads)});
    return absl::OkStatus();
  }

  // Submits steps [from, total), with evaluations and checkpoints at their
  // step boundaries, and waits until every block has stepped all of them.
  absl::Status TrainSteps(int64_t from) {
    RunPlan& plan = s_.plan;
    const int m = plan.microbatches();
    for (int64_t s = from; s < total_; ++s) {
      if (o_.checkpoints.stop_requested != nullptr &&
          o_.checkpoints.stop_requested->load()) {
        return Stop(s);
      }
      if (BudgetReached(s)) {
        total_ = s;
        break;
      }
      RETURN_IF_ERROR(ProfileOps(s));
      const double lr = plan.LearningRate(s);
      s_.records.SetLearningRate(s, lr);
      std::vector<int32_t> routes;
      for (int mb = 0; mb < m; ++mb) {
        while (in_flight_ >= plan.window()) RETURN_IF_ERROR(HandleNext());
        auto [x, y] = data_.train->Gather(plan.Samples(s, mb));
        if (!s_.clock.started()) {
          RETURN_IF_ERROR(s_.clock.Start(
              c_, data_.shape, codec_, k_, plan.window(), x.size(0),
              codec_.activations().MaxEncodedBytes(x.scalar_type(), x.numel()),
              static_cast<int64_t>(y.nbytes())));
        }
        if (mb == 0) {
          // The clock follows joins, leaves and fail-overs from the step
          // they take effect at (an unchanged topology changes nothing).
          const Topology workers =
              engine_.elastic() ? engine_.elastic()->Workers() : Topology();
          s_.clock.SetTopology(s, workers);
          routes = MeasuredRoutes(s, workers);
          if (!routes.empty()) s_.clock.SetRoutes(s, routes);
        }
        ForwardMsg msg;
        msg.step = s;
        msg.mb = mb;
        msg.routes = routes;
        msg.lr = lr;
        msg.input = std::move(x);
        msg.target = std::move(y);
        RETURN_IF_ERROR(engine_.Submit(std::move(msg)));
        s_.clock.Submitted(s, mb, m);
        ++in_flight_;
        // Record finished steps as soon as they finish, so wall times and
        // throughput are not a step late.
        while (engine_.Ready()) RETURN_IF_ERROR(HandleNext());
      }
      const int64_t every = c_.training().eval_every_steps();
      const bool eval_due = every > 0 && (s + 1) % every == 0 &&
                            s + 1 < plan.steps() &&
                            (s_.evals.empty() || s_.evals.back().step <= s);
      const bool checkpoint_due = recovery_.Due(s + 1, plan.steps());
      // Both need an idle chain: finish step s everywhere first.
      if (eval_due || checkpoint_due) {
        RETURN_IF_ERROR(DrainThrough(s));
        RETURN_IF_ERROR(EndOpProfile(s + 1));
      }
      if (eval_due) RETURN_IF_ERROR(EvaluateAt(s + 1));
      if (checkpoint_due) RETURN_IF_ERROR(recovery_.Take(s + 1).status());
      // Joins and leaves (ARCHITECTURE: replicas) take effect at a step
      // boundary, with the chain idle.
      ElasticEngine* elastic = engine_.elastic();
      if (s + 1 < total_ && elastic && elastic->MembershipPending()) {
        const auto t0 = absl::Now();
        RETURN_IF_ERROR(DrainThrough(s));
        RETURN_IF_ERROR(EndOpProfile(s + 1));
        const auto drained = absl::Now();
        const size_t changes = elastic->TopologyHistory().size();
        RETURN_IF_ERROR(elastic->ApplyMembership(s + 1));
        const auto history = elastic->TopologyHistory();
        const bool changed = history.size() > changes;
        if (changed) recovery_.JournalBoundary(s + 1);
        std::string detail;
        if (changed) {
          // Where a change's time goes: state from live replicas for the
          // joiners, configuring every worker, loading the joiners.
          const TopologyEvent& e = history.back();
          detail = absl::StrCat(
              ": state ", absl::FormatDuration(absl::Seconds(e.save_seconds)),
              ", configure ",
              absl::FormatDuration(absl::Seconds(e.configure_seconds)),
              ", load ", absl::FormatDuration(absl::Seconds(e.load_seconds)),
              ", ", e.state_bytes, " bytes sent");
        }
        LOG(INFO) << (changed ? "topology changed"
                              : "no membership change applied")
                  << " before step " << s + 1 << " (drain "
                  << absl::FormatDuration(drained - t0) << ", change "
                  << absl::FormatDuration(absl::Now() - drained) << detail
                  << ")";
      }
    }
    // No more submissions: the replay may now run past the last step.
    s_.clock.Finish();
    RETURN_IF_ERROR(DrainThrough(total_ - 1));
    RETURN_IF_ERROR(EndOpProfile(total_));
    s_.clock.Advance();
    RETURN_IF_ERROR(s_.records.EmitReady());
    if (s_.records.recorded() < total_) {
      return absl::InternalError(absl::StrCat("virtual clock: step ",
                                              s_.records.recorded(),
                                              " did not finish in the replay"));
    }
    return absl::OkStatus();
  }

  // The final evaluation, the virtual clock's summary and the digests.
  absl::Status Finish(TrainResult& result) {
    result = TrainResult();
    result.steps = total_;
    result.wall_seconds = s_.timer.Training();
    result.final_losses = s_.records.last_losses();
    result.skipped_steps = s_.ledger.SkippedPerBlock();
    result.replicas = replicas_;
    if (engine_.elastic())
      result.topology = engine_.elastic()->TopologyHistory();
    if (!result.topology.empty())
      result.replicas = result.topology.back().replicas;
    result.insecure = o_.engine.insecure;
    auto& evals = s_.evals;
    if (evals.empty() || evals.back().step != total_) {
      RETURN_IF_ERROR(EvaluateAt(total_));
    }
    result.eval = evals.back().heads;
    result.mean_step_wall = s_.records.MeanStepWall(total_);
    const ClockSummary clock = s_.clock.Summary(total_);
    result.virtual_seconds = clock.virtual_seconds;
    result.mean_step_virtual = clock.mean_step_virtual;
    result.utilisation = clock.utilisation;
    result.busy_ratio = clock.busy_ratio;
    result.replica_busy_ratio = clock.replica_busy_ratio;
    for (auto& e : evals) {
      if (e.step > s_.clock.base() && e.step <= s_.clock.Finished()) {
        e.virtual_seconds = s_.clock.End(e.step - 1);
      }
    }
    result.evals = evals;
    return DigestState(engine_, o_.output.dump_params, result);
  }

  // Starts the operation profile before step profile_from_ and ends it
  // kProfiledSteps steps later.
  absl::Status ProfileOps(int64_t s) {
    if (profile_from_ < 0) return absl::OkStatus();
    if (op_profile_) {
      return s >= profile_from_ + kProfiledSteps ? EndOpProfile(s)
                                                 : absl::OkStatus();
    }
    if (s == profile_from_) {
      ASSIGN_OR_RETURN(op_profile_, OpProfile::Start());
    }
    return absl::OkStatus();
  }

  // Ends the operation profile, if one runs, after the steps before `end`
  // were submitted, and writes it.
  absl::Status EndOpProfile(int64_t end) {
    if (!op_profile_) return absl::OkStatus();
    ASSIGN_OR_RETURN(const OpProfileResult r, op_profile_->Stop());
    op_profile_.reset();
    const int64_t from = profile_from_;
    profile_from_ = -1;  // once per run
    const std::string title = absl::StrCat(
        "Operations of ", c_.name(), " ", ModeName(c_), ", steps ", from + 1,
        "-", end, " (in process, sequential schedule, ",
        std::max(1, c_.training().threads_per_block()), " intra-op thread(s))");
    std::ofstream f(o_.output.profile_ops, std::ios::trunc);
    f << FormatOpProfile(r, title, end - from);
    if (profile_calibrating_) {
      f << "\nThe run is too short to leave out the steps in which blocks "
           "calibrate their backward passes (three extra passes each): "
           "these steps include them.\n";
    }
    f.close();
    if (!f) {
      return absl::DataLossError(
          absl::StrCat("--profile-ops: writing ", o_.output.profile_ops));
    }
    return absl::OkStatus();
  }

  // Waits until step s completed and every block has stepped it.
  absl::Status DrainThrough(int64_t s) {
    while (s_.records.completed() <= s || s_.ledger.MinStepsDone() <= s) {
      RETURN_IF_ERROR(HandleNext());
    }
    return absl::OkStatus();
  }

  // A stop request: checkpoint at this step boundary and end the run.
  absl::Status Stop(int64_t s) {
    ASSIGN_OR_RETURN(const bool can, recovery_.CanStop());
    if (!can) {
      return absl::CancelledError(
          absl::StrCat("stopped at step ", s, " (no checkpoint folder)"));
    }
    RETURN_IF_ERROR(DrainThrough(s - 1));
    // Nothing more is submitted: the clock can place every step, and all of
    // them are recorded before the checkpoint.
    if (s_.clock.started()) {
      s_.clock.Finish();
      s_.clock.Advance();
      RETURN_IF_ERROR(s_.records.EmitReady());
    }
    ASSIGN_OR_RETURN(const std::string dir, recovery_.Take(s));
    // Stopped on purpose: the run continues from this checkpoint, not from
    // the workers' snapshots.
    recovery_.CloseJournal();
    return absl::CancelledError(
        absl::StrCat("stopped at step ", s, "; checkpoint ", dir,
                     " (run again with the same --out to resume)"));
  }

  // The chain restarts at step `from`: forget everything in flight and the
  // accounting of the steps that run again. Steps already recorded in
  // metrics.jsonl stay recorded; the replay computes the same values.
  void ResetTo(int64_t from) {
    s_.ledger.ResetFrom(from);
    s_.records.ResetFrom(from);
    in_flight_ = 0;
  }

  absl::Status HandleNext() {
    // Used in place: moving the variant out of the StatusOr makes GCC 12 at
    // -O3 warn (falsely) that its vectors may be used uninitialised.
    absl::StatusOr<EngineEvent> next = engine_.Next();
    if (!next.ok()) return next.status();
    EngineEvent& e = *next;
    const int64_t base = s_.clock.base();
    const int64_t steps = s_.plan.steps();
    if (auto* d = std::get_if<StepDone>(&e)) {
      if (d->block < 0 || d->block >= k_ || d->step < base ||
          d->step >= steps) {
        return absl::InternalError(absl::StrCat("step report of step ", d->step,
                                                " from block ", d->block));
      }
      if (s_.ledger.OnBlockStep(d->block, d->step, d->microbatches,
                                d->skipped) &&
          metrics_) {
        metrics_->OnSkippedSteps(d->block, 1);
      }
      s_.clock.OnOptimizer(d->step, d->block, d->timing.seconds);
      s_.clock.Advance();
      RETURN_IF_ERROR(s_.records.EmitReady());
      recovery_.Journal();
      return absl::OkStatus();
    }
    if (std::get_if<DuplicateAck>(&e)) {
      s_.ledger.OnDuplicate();
      return absl::OkStatus();
    }
    auto& up = std::get<UpwardMsg>(e);
    if (up.step < base || up.step >= steps) {
      return absl::InternalError(absl::StrCat("completion of step ", up.step));
    }
    s_.ledger.OnCompletion(up.step);
    --in_flight_;
    s_.clock.OnMicrobatch(up.step, up.mb, up.timings);
    if (s_.records.OnCompletion(up.step, up.reports, s_.timer.Training())) {
      recovery_.Progressed();
    }
    s_.clock.Advance();
    RETURN_IF_ERROR(s_.records.EmitReady());
    recovery_.Journal();
    return absl::OkStatus();
  }

  // The routes of step s in proportion to each replica's measured
  // throughput (ARCHITECTURE: replicas), the same for the engine and the clock;
  // empty (the engine splits equally) in process, where replicas are only
  // modelled, with RING, whose sums depend on which replica ran what, and
  // until every replica of the step's topology (a joiner too) has run a few
  // micro-batches. The clock was told `workers` for this step, so its rates
  // come in their order.
  std::vector<int32_t> MeasuredRoutes(int64_t s, const Topology& workers) {
    if (o_.engine.kind != EngineKind::kCluster ||
        c_.training().reduction() == interlock::v1::TrainingSpec::RING) {
      return {};
    }
    const std::vector<int> replicas =
        workers.empty() ? replicas_ : ReplicaCounts(workers);
    if (!Replicated(replicas)) return {};
    constexpr int64_t kMinMicrobatches = 4;
    const auto rates = s_.clock.ReplicaRates(kMinMicrobatches);
    if (rates.empty()) return {};
    return RouteStep(s, s_.plan.microbatches(), replicas, rates);
  }

  const RunConfig& c_;
  // Worker replicas per block at the start (ARCHITECTURE: replicas).
  const std::vector<int>& replicas_;
  const TrainOptions& o_;
  Engine& engine_;
  const DataSplits& data_;
  RunState& s_;
  RunRecovery& recovery_;
  CoordinatorMetrics* metrics_;
  // The run's wire codec: the virtual clock counts the bytes it sends.
  const WireCodec& codec_;
  const int k_;
  int64_t total_ = 0;  // steps run (fewer when a budget stops the run)
  int in_flight_ = 0;
  // --profile-ops: the first profiled step (-1: none, or done) and the
  // profile while it runs.
  int64_t profile_from_ = -1;
  bool profile_calibrating_ = false;
  std::unique_ptr<OpProfile> op_profile_;
};

}  // namespace

namespace {

// Locks the run's folders (`options.output.out_dir`, and a separate
// checkpoint folder) until the run returns: a second run on the same folder
// is refused before it loads data or starts workers.
absl::StatusOr<std::vector<std::unique_ptr<FolderLock>>> LockFolders(
    const TrainOptions& options) {
  const std::string& out = options.output.out_dir;
  std::string ckpt = options.checkpoints.dir;
  std::vector<std::unique_ptr<FolderLock>> locks;
  if (!out.empty()) {
    ASSIGN_OR_RETURN(auto lock, FolderLock::Acquire(out, "--out"));
    locks.push_back(std::move(lock));
    // OUT/checkpoints is a folder of its own: another run given it as its
    // --checkpoint-dir must find it taken.
    std::error_code ec;
    if (ckpt.empty() && (options.checkpoints.every > 0 ||
                         std::filesystem::exists(out + "/checkpoints", ec))) {
      ckpt = out + "/checkpoints";
    }
  }
  if (!ckpt.empty() && (out.empty() || !SameFolder(ckpt, out))) {
    ASSIGN_OR_RETURN(auto lock, FolderLock::Acquire(ckpt, "--checkpoint-dir"));
    locks.push_back(std::move(lock));
  }
  return locks;
}

// A finished run's files in --out are not written over unless the user
// says --replace: a run there resumes from a checkpoint, or refuses.
absl::Status CheckOutFree(const TrainOptions& options) {
  const std::string& out = options.output.out_dir;
  std::error_code ec;
  if (out.empty() || options.output.replace ||
      !std::filesystem::exists(out + "/summary.json", ec) ||
      !options.checkpoints.resume.empty()) {
    return absl::OkStatus();
  }
  const std::string ckpt = options.checkpoints.dir.empty()
                               ? out + "/checkpoints"
                               : options.checkpoints.dir;
  for (const auto& e : std::filesystem::directory_iterator(ckpt, ec)) {
    if (e.path().filename().string().rfind("step-", 0) == 0) {
      return absl::OkStatus();
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "--out: ", out,
      " holds a finished run (summary.json) and no checkpoint to resume "
      "from; give another --out, or --replace to write over it"));
}

// Trains a resolved run (folders locked).
absl::StatusOr<TrainResult> TrainResolved(const ResolvedRun& run,
                                          const TrainOptions& options) {
  const RunConfig& config = run.config;
  const std::string& out = options.output.out_dir;
  ASSIGN_OR_RETURN(DataSplits data,
                   LoadData(config.data(), TextContext(config.model())));
  std::unique_ptr<CoordinatorMetrics> metrics;
  if (options.output.metrics_port >= 0) {
    ASSIGN_OR_RETURN(metrics,
                     CoordinatorMetrics::Serve(options.output.metrics_host,
                                               options.output.metrics_port,
                                               ModeName(config)));
    // The port is news with --metrics-port 0 (any free port).
    LOG(INFO) << "coordinator metrics on " << options.output.metrics_host << ":"
              << metrics->port() << "/metrics";
  }
  ASSIGN_OR_RETURN(RunPlan plan, RunPlan::Make(config, data.train->size(),
                                               run.blocks, options.window));
  // Workers that live on their own outlive this process: its journal lets
  // a coordinator started again on this --out adopt them.
  EngineOptions engine_options = options.engine;
  std::unique_ptr<RunJournal> journal;
  std::optional<interlock::v1::RunJournal> adopt;
  if (engine_options.kind == EngineKind::kCluster &&
      !engine_options.workers.empty() && !out.empty()) {
    ASSIGN_OR_RETURN(
        const TransportSecurity security,
        LoadTransportSecurity(engine_options.security, /*server=*/false));
    journal = std::make_unique<RunJournal>(out, security.token);
    if (options.checkpoints.resume.empty()) {
      absl::StatusOr<std::optional<interlock::v1::RunJournal>> read =
          journal->Read(config);
      if (!read.ok()) {
        LOG(WARNING) << "not adopting the workers: " << read.status().message();
      } else if (*read) {
        adopt = std::move(**read);
        engine_options.adopt = RunJournal::Adoptable(*adopt);
        journal->Hold(*adopt);
      }
    }
    engine_options.keep_snapshots = true;
    engine_options.on_generation =
        [j = journal.get()](const std::string& run_id, int64_t generation) {
          j->Raise(run_id, generation);
        };
  }
  ASSIGN_OR_RETURN(std::unique_ptr<RunEngine> engine,
                   MakeEngine(run, data.shape, engine_options, options.window,
                              metrics.get()));
  const bool adopted = engine->engine().elastic() &&
                       engine->engine().elastic()->Adopted().has_value();
  // The replicas the virtual clock replays: the cluster's, or in process
  // (which runs the single chain, bitwise what ORDERED replicas compute)
  // the ones --replicas asks the clock to model.
  RunState state(std::move(plan), options.link, run.replicas, metrics.get());
  RunRecovery recovery(config, options.checkpoints, out, engine->seal_key(),
                       engine->engine(), state, metrics.get());
  recovery.SetJournal(journal.get(), adopted ? &*adopt : nullptr);
  Runner runner(run, options, engine->engine(), data, state, recovery,
                metrics.get());
  return runner.Run();
}

}  // namespace

absl::StatusOr<TrainResult> Train(const RunConfig& config,
                                  const TrainOptions& options) {
  ASSIGN_OR_RETURN(auto locks, LockFolders(options));
  RETURN_IF_ERROR(CheckOutFree(options));
  // A balanced cut is measured inside the run's folder (OUT/units), which
  // is locked by now.
  const std::string& out = options.output.out_dir;
  ASSIGN_OR_RETURN(
      ResolvedRun run,
      ResolveRun(config, options.engine, out.empty() ? "" : out + "/units",
                 UnitsByTraining()));
  return TrainResolved(run, options);
}

UnitMeasurer UnitsByTraining() {
  return [](const RunConfig& profiling,
            const std::string& dir) -> absl::StatusOr<Profile> {
    TrainOptions o;
    o.output.out_dir = dir;
    o.output.quiet = true;
    ASSIGN_OR_RETURN(auto locks, LockFolders(o));
    // One unit per block is the cut itself: nothing to measure for it.
    ASSIGN_OR_RETURN(ResolvedRun run,
                     ResolveRun(profiling, o.engine, "", /*measure=*/nullptr));
    RETURN_IF_ERROR(TrainResolved(run, o).status());
    return LoadProfile(dir);
  };
}

}  // namespace interlock
