#include "coordinator/train.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "coordinator/cluster_engine.h"
#include "coordinator/inprocess_engine.h"
#include "coordinator/json.h"
#include "coordinator/local_cluster.h"
#include "coordinator/metrics.h"
#include "coordinator/progress.h"
#include "coordinator/timeline.h"
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

class Runner {
 public:
  Runner(const RunConfig& config, const TrainOptions& options, Engine& engine,
         const Dataset& train, const Dataset& test, const DataShape& shape,
         CoordinatorMetrics* metrics)
      : metrics_out_(metrics),
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
    const int m = t.microbatches();
    const int64_t per_epoch = train_.size() / batch;
    if (per_epoch == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "training.batch_size: ", batch, " is larger than the training set (",
          train_.size(), " samples)"));
    }
    const int64_t asked = t.steps() > 0 ? t.steps() : t.epochs() * per_epoch;
    int64_t total = asked;
    if (!o_.out_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(o_.out_dir, ec);
      if (ec) {
        return absl::PermissionDeniedError(absl::StrCat(
            "--out: cannot create ", o_.out_dir, ": ", ec.message()));
      }
      metrics_.open(o_.out_dir + "/metrics.jsonl", std::ios::trunc);
      if (!metrics_) {
        return absl::PermissionDeniedError(
            absl::StrCat("--out: cannot write ", o_.out_dir, "/metrics.jsonl"));
      }
    }
    Progress progress(
        o_.log, o_.progress_bar, o_.quiet, asked,
        absl::StrCat(o_.progress_label.empty() ? "" : o_.progress_label + " ",
                     c_.name(), " ", ModeName(c_)));
    progress_ = &progress;
    start_ = Clock::now();
    steps_done_.assign(k_, 0);
    skipped_.assign(k_, 0);
    // Micro-batches in flight. A completion comes back only after the
    // micro-batch went down the whole chain and its reports came up again,
    // so keeping K blocks busy in 1-way and n-way needs about 2K of them;
    // E2E limits itself (block 0 waits for its gradient).
    const int window = o_.window > 0 ? o_.window : 2 * k_ * m;
    int64_t epoch = -1;
    std::vector<int64_t> perm;
    for (int64_t s = 0; s < asked; ++s) {
      if (BudgetReached(s)) {
        total = s;
        break;
      }
      if (s / per_epoch != epoch) {
        epoch = s / per_epoch;
        perm = EpochPermutation(train_.size(), t.seed(), epoch);
      }
      const double lr = LearningRateAt(c_.schedule(), s, asked);
      lrs_[s] = lr;
      const int64_t base = (s % per_epoch) * batch;
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
        clock_->SetSubmitted(s * m + mb + 1);
        ++in_flight_;
        // Record finished steps as soon as they finish, so wall times and
        // throughput are not a step late.
        while (engine_.Ready()) RETURN_IF_ERROR(HandleNext());
      }
      const int64_t every = t.eval_every_steps();
      if (every > 0 && (s + 1) % every == 0 && s + 1 < asked) {
        // Evaluation needs an idle chain: finish step s everywhere first.
        while (completed_ <= s || MinStepsDone() <= s) {
          RETURN_IF_ERROR(HandleNext());
        }
        RETURN_IF_ERROR(EvaluateAt(s + 1));
      }
    }
    // No more submissions: the replay may now run past the last step.
    if (clock_) clock_->Finish();
    while (completed_ < total || MinStepsDone() < total) {
      RETURN_IF_ERROR(HandleNext());
    }
    if (clock_) clock_->Advance();
    EmitReady();
    if (next_emit_ < total) {
      return absl::InternalError(absl::StrCat(
          "virtual clock: step ", next_emit_, " did not finish in the replay"));
    }
    TrainResult result;
    result.steps = total;
    result.wall_seconds = TrainElapsed();
    result.final_losses = last_losses_;
    result.skipped_steps = skipped_;
    progress.Finish();
    RETURN_IF_ERROR(EvaluateAt(total));
    result.eval = evals_.back().heads;
    FillClock(result);
    RETURN_IF_ERROR(Digests(result));
    if (!o_.out_dir.empty()) RETURN_IF_ERROR(WriteFiles(result));
    return result;
  }

 private:
  double Elapsed() const {
    return std::chrono::duration<double>(Clock::now() - start_).count();
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
      if (f == 0) return clock_->Now() >= Seconds(o_.budget_virtual);
      const double last = clock_->StepEnd(f - 1);
      const double projected = last + (s + 1 - f) * (last / f);
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
    r.mean_step_wall =
        r.steps > 1 ? (last_wall_ - first_wall_) / (r.steps - 1) : first_wall_;
    if (clock_ && r.steps > 0) {
      const double end = clock_->StepEnd(r.steps - 1);
      r.virtual_seconds = end;
      r.mean_step_virtual =
          r.steps > 1 ? (end - clock_->StepEnd(0)) / (r.steps - 1) : end;
      double busy = 0;
      for (int k = 0; k < k_; ++k) {
        busy += clock_->Busy(k);
        r.busy_ratio.push_back(end > 0 ? clock_->Busy(k) / end : 0.0);
      }
      r.utilisation = end > 0 ? busy / (k_ * end) : 0.0;
    }
    for (auto& e : evals_) {
      if (clock_ && e.step > 0 && e.step <= clock_->steps_finished()) {
        e.virtual_seconds = clock_->StepEnd(e.step - 1);
      }
    }
    r.evals = evals_;
  }

  // Step records wait for the replay to place the step on the virtual clock.
  void EmitReady() {
    while (next_emit_ < completed_ && clock_ &&
           next_emit_ < clock_->steps_finished()) {
      auto it = steps_.find(next_emit_);
      EmitStep(next_emit_, it->second);
      steps_.erase(it);
      ++next_emit_;
    }
  }
  int64_t MinStepsDone() const {
    int64_t m = std::numeric_limits<int64_t>::max();
    for (int64_t v : steps_done_) m = std::min(m, v);
    return m;
  }

  absl::Status HandleNext() {
    ASSIGN_OR_RETURN(EngineEvent e, engine_.Next());
    if (auto* d = std::get_if<StepDone>(&e)) {
      if (d->block < 0 || d->block >= k_) {
        return absl::InternalError("step report from an unknown block");
      }
      ++steps_done_[d->block];
      if (d->skipped) {
        ++skipped_[d->block];
        if (metrics_out_) metrics_out_->OnSkippedStep(d->block);
      }
      clock_->SetOptimizer(d->step, d->block, d->timing.seconds);
      clock_->Advance();
      EmitReady();
      return absl::OkStatus();
    }
    auto& up = std::get<UpwardMsg>(e);
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
    clock_->SetMicrobatch(up.step, up.mb, std::move(d));
    // Steps are recorded in order even if completions interleave.
    const int m = c_.training().microbatches();
    for (auto it = steps_.find(completed_);
         it != steps_.end() && it->second.done == m;
         it = steps_.find(completed_)) {
      it->second.wall = TrainElapsed();
      if (completed_ == 0) first_wall_ = it->second.wall;
      last_wall_ = it->second.wall;
      ++completed_;
    }
    clock_->Advance();
    EmitReady();
    return absl::OkStatus();
  }

  void EmitStep(int64_t s, const StepAgg& agg) {
    std::vector<double> losses(k_, kNaN);
    for (int k = 0; k < k_; ++k) {
      if (agg.loss_n[k] > 0) losses[k] = agg.loss_sum[k] / agg.loss_n[k];
    }
    last_losses_ = losses;
    const double wall = agg.wall;
    const double virt = clock_->StepEnd(s);
    const double prev_virt = s > 0 ? clock_->StepEnd(s - 1) : 0.0;
    const double samples =
        static_cast<double>(c_.training().batch_size()) * (s + 1);
    const double sps = wall > 0 ? samples / wall : 0.0;
    if (metrics_.is_open()) {
      std::vector<std::string> ls;
      for (double l : losses) ls.push_back(JsonNumber(l));
      metrics_ << "{\"step\":" << s << ",\"wall_seconds\":" << JsonNumber(wall)
               << ",\"virtual_seconds\":" << JsonNumber(virt)
               << ",\"lr\":" << JsonNumber(lrs_[s]) << ",\"loss\":["
               << absl::StrJoin(ls, ",")
               << "],\"samples_per_second\":" << JsonNumber(sps) << "}\n";
      metrics_.flush();
    }
    lrs_.erase(s);
    if (metrics_out_) {
      metrics_out_->OnStep(s, losses, sps, c_.training().microbatches());
      std::vector<double> busy(k_);
      for (int k = 0; k < k_; ++k) {
        busy[k] = clock_->Now() > 0 ? clock_->Busy(k) / clock_->Now() : 0.0;
      }
      metrics_out_->OnStepTimes(wall - prev_wall_, virt, virt - prev_virt,
                                busy);
    }
    prev_wall_ = wall;
    progress_->Update(s + 1, losses, sps, wall);
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
            auto flat = t.detach().to(torch::kFloat64).contiguous().view({-1});
            std::vector<std::string> vals;
            for (int64_t i = 0; i < flat.numel(); ++i) {
              vals.push_back(JsonNumber(flat[i].item<double>()));
            }
            std::vector<std::string> dims;
            for (int64_t d : t.sizes()) dims.push_back(absl::StrCat(d));
            absl::StrAppend(&result.params_json, "{\"name\":",
                            JsonString(absl::StrCat("block", k, ".", name)),
                            ",\"shape\":[", absl::StrJoin(dims, ","),
                            "],\"values\":[", absl::StrJoin(vals, ","), "]}\n");
          }
        }
      }
    }
    const std::string joined = absl::StrJoin(all, "/");
    result.digest = Sha256Hex(joined.data(), joined.size());
    return absl::OkStatus();
  }

  absl::Status WriteFiles(const TrainResult& r) {
    std::ofstream ev(o_.out_dir + "/eval.jsonl", std::ios::trunc);
    for (const auto& e : r.evals) {
      for (const auto& h : e.heads) {
        ev << "{\"step\":" << e.step
           << ",\"wall_seconds\":" << JsonNumber(e.wall_seconds)
           << ",\"virtual_seconds\":" << JsonNumber(e.virtual_seconds)
           << ",\"block\":" << h.block
           << ",\"head\":" << (h.final ? "\"final\"" : "\"aux\"")
           << ",\"loss\":" << JsonNumber(h.loss)
           << ",\"accuracy\":" << JsonNumber(h.accuracy)
           << ",\"perplexity\":" << JsonNumber(h.perplexity) << "}\n";
      }
    }
    std::ofstream sm(o_.out_dir + "/summary.json.tmp", std::ios::trunc);
    const auto& t = c_.training();
    sm << "{\n  \"name\": " << JsonString(c_.name())
       << ",\n  \"mode\": " << JsonString(ModeName(c_))
       << ",\n  \"blocks\": " << k_ << ",\n  \"n\": " << t.n()
       << ",\n  \"microbatches\": " << t.microbatches()
       << ",\n  \"batch_size\": " << t.batch_size()
       << ",\n  \"seed\": " << t.seed() << ",\n  \"steps\": " << r.steps
       << ",\n  \"skipped_steps\": [" << absl::StrJoin(r.skipped_steps, ", ")
       << "]"
       << ",\n  \"wall_seconds\": " << JsonNumber(r.wall_seconds)
       << ",\n  \"virtual_seconds\": " << JsonNumber(r.virtual_seconds)
       << ",\n  \"mean_step_seconds\": {\"wall\": "
       << JsonNumber(r.mean_step_wall)
       << ", \"virtual\": " << JsonNumber(r.mean_step_virtual) << "}"
       << ",\n  \"utilisation\": " << JsonNumber(r.utilisation)
       << ",\n  \"busy_ratio\": [";
    for (size_t k = 0; k < r.busy_ratio.size(); ++k) {
      sm << (k ? ", " : "") << JsonNumber(r.busy_ratio[k]);
    }
    sm << "],\n  \"eval\": [";
    for (size_t i = 0; i < r.eval.size(); ++i) {
      const auto& h = r.eval[i];
      sm << (i ? ", " : "") << "{\"block\": " << h.block
         << ", \"head\": " << (h.final ? "\"final\"" : "\"aux\"")
         << ", \"loss\": " << JsonNumber(h.loss)
         << ", \"accuracy\": " << JsonNumber(h.accuracy)
         << ", \"perplexity\": " << JsonNumber(h.perplexity) << "}";
    }
    sm << "],\n  \"digests\": [";
    for (size_t k = 0; k < r.block_digests.size(); ++k) {
      sm << (k ? ", " : "") << "{\"block\": " << k
         << ", \"params\": " << JsonString(r.block_digests[k])
         << ", \"head\": " << JsonString(r.head_digests[k]) << "}";
    }
    sm << "],\n  \"digest\": " << JsonString(r.digest) << "\n}\n";
    sm.close();
    if (!ev || !sm) {
      return absl::DataLossError(
          absl::StrCat("--out: writing results to ", o_.out_dir, " failed"));
    }
    std::error_code ec;
    std::filesystem::rename(o_.out_dir + "/summary.json.tmp",
                            o_.out_dir + "/summary.json", ec);
    if (ec) return absl::DataLossError(ec.message());
    if (!clock_ || r.steps == 0) return absl::OkStatus();
    RunInfo info;
    info.name = c_.name();
    info.mode = ModeName(c_);
    info.e2e = t.mode() == TrainingSpec::E2E;
    info.n = t.n();
    info.sum_rule = t.rule() == TrainingSpec::SUM;
    info.batch_size = t.batch_size();
    info.steps = r.steps;
    info.mean_step_wall = r.mean_step_wall;
    info.mean_step_virtual = r.mean_step_virtual;
    RETURN_IF_ERROR(WriteProfile(*clock_, info, o_.out_dir + "/profile.json"));
    return WriteTimeline(*clock_, info, o_.out_dir);
  }

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
  std::ofstream metrics_;
  int in_flight_ = 0;
  int64_t completed_ = 0;  // steps whose micro-batches all completed
  int64_t next_emit_ = 0;  // steps recorded (placed on the virtual clock)
  std::unique_ptr<PipelineSim> clock_;
  double eval_seconds_ = 0.0;
  double first_wall_ = 0.0, last_wall_ = 0.0, prev_wall_ = 0.0;
  std::vector<EvalPoint> evals_;
  std::map<int64_t, StepAgg> steps_;
  std::map<int64_t, double> lrs_;
  std::vector<int64_t> steps_done_;
  std::vector<int64_t> skipped_;
  std::vector<double> last_losses_;
};

}  // namespace

absl::StatusOr<TrainResult> Train(const RunConfig& config_in,
                                  const TrainOptions& options) {
  RunConfig config = config_in;
  ApplyDefaults(config);
  RETURN_IF_ERROR(ValidateRunConfig(config));
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
    ASSIGN_OR_RETURN(co.security, LoadTransportSecurity(options.security,
                                                        /*server=*/false));
    if (co.workers.empty()) {
      ASSIGN_OR_RETURN(const int k, NumBlocks(config.model()));
      ASSIGN_OR_RETURN(
          local, LocalCluster::Launch(
                     k,
                     options.worker_binary.empty() ? DefaultWorkerBinary()
                                                   : options.worker_binary,
                     absl::Seconds(30), SecurityFlags(options.security)));
      if (options.on_cluster) options.on_cluster(local.get());
      co.workers = local->addresses();
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
                metrics.get());
  auto result = runner.Run();
  engine->Shutdown();
  if (local) {
    if (options.on_cluster) options.on_cluster(nullptr);
    local->Stop();
  }
  return result;
}

}  // namespace interlock
