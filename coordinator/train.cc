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
#include "services/config.h"
#include "services/data.h"
#include "services/digest.h"
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
};

class Runner {
 public:
  Runner(const RunConfig& config, const TrainOptions& options, Engine& engine,
         const Dataset& train, const Dataset& test, bool text,
         CoordinatorMetrics* metrics)
      : metrics_out_(metrics),
        c_(config),
        o_(options),
        engine_(engine),
        train_(train),
        test_(test),
        text_(text),
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
    const int64_t total = t.steps() > 0 ? t.steps() : t.epochs() * per_epoch;
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
    Progress progress(o_.log, o_.progress_bar, o_.quiet, total,
                      absl::StrCat(c_.name(), " ", ModeName(c_)));
    progress_ = &progress;
    start_ = Clock::now();
    steps_done_.assign(k_, 0);
    const int window = 2 * m;
    int64_t epoch = -1;
    std::vector<int64_t> perm;
    for (int64_t s = 0; s < total; ++s) {
      if (s / per_epoch != epoch) {
        epoch = s / per_epoch;
        perm = EpochPermutation(train_.size(), t.seed(), epoch);
      }
      const double lr = LearningRateAt(c_.schedule(), s, total);
      lrs_[s] = lr;
      const int64_t base = (s % per_epoch) * batch;
      const int64_t per_mb = batch / m;
      for (int mb = 0; mb < m; ++mb) {
        while (in_flight_ >= window) RETURN_IF_ERROR(HandleNext());
        std::vector<int64_t> idx(perm.begin() + base + mb * per_mb,
                                 perm.begin() + base + (mb + 1) * per_mb);
        auto [x, y] = train_.Gather(idx);
        ForwardMsg msg;
        msg.step = s;
        msg.mb = mb;
        msg.lr = lr;
        msg.input = std::move(x);
        msg.target = std::move(y);
        RETURN_IF_ERROR(engine_.Submit(std::move(msg)));
        ++in_flight_;
        // Record finished steps as soon as they finish, so wall times and
        // throughput are not a step late.
        while (engine_.Ready()) RETURN_IF_ERROR(HandleNext());
      }
      const int64_t every = t.eval_every_steps();
      if (every > 0 && (s + 1) % every == 0 && s + 1 < total) {
        // Evaluation needs an idle chain: finish step s everywhere first.
        while (next_emit_ <= s || MinStepsDone() <= s) {
          RETURN_IF_ERROR(HandleNext());
        }
        ASSIGN_OR_RETURN(auto evals, Evaluate());
        eval_log_.emplace_back(s + 1, std::move(evals));
      }
    }
    while (next_emit_ < total || MinStepsDone() < total) {
      RETURN_IF_ERROR(HandleNext());
    }
    TrainResult result;
    result.steps = total;
    result.wall_seconds = Elapsed();
    result.final_losses = last_losses_;
    progress.Finish();
    ASSIGN_OR_RETURN(result.eval, Evaluate());
    eval_log_.emplace_back(total, result.eval);
    RETURN_IF_ERROR(Digests(result));
    if (!o_.out_dir.empty()) RETURN_IF_ERROR(WriteFiles(result));
    return result;
  }

 private:
  double Elapsed() const {
    return std::chrono::duration<double>(Clock::now() - start_).count();
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
    // Steps are recorded in order even if completions interleave.
    const int m = c_.training().microbatches();
    for (auto it = steps_.find(next_emit_);
         it != steps_.end() && it->second.done == m;
         it = steps_.find(next_emit_)) {
      EmitStep(next_emit_, it->second);
      steps_.erase(it);
      ++next_emit_;
    }
    return absl::OkStatus();
  }

  void EmitStep(int64_t s, const StepAgg& agg) {
    std::vector<double> losses(k_, kNaN);
    for (int k = 0; k < k_; ++k) {
      if (agg.loss_n[k] > 0) losses[k] = agg.loss_sum[k] / agg.loss_n[k];
    }
    last_losses_ = losses;
    const double wall = Elapsed();
    const double samples =
        static_cast<double>(c_.training().batch_size()) * (s + 1);
    const double sps = wall > 0 ? samples / wall : 0.0;
    if (metrics_.is_open()) {
      std::vector<std::string> ls;
      for (double l : losses) ls.push_back(JsonNumber(l));
      metrics_ << "{\"step\":" << s << ",\"wall_seconds\":" << JsonNumber(wall)
               << ",\"lr\":" << JsonNumber(lrs_[s]) << ",\"loss\":["
               << absl::StrJoin(ls, ",")
               << "],\"samples_per_second\":" << JsonNumber(sps) << "}\n";
      metrics_.flush();
    }
    lrs_.erase(s);
    if (metrics_out_) {
      metrics_out_->OnStep(s, losses, sps, c_.training().microbatches());
    }
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
    for (const auto& [step, heads] : eval_log_) {
      for (const auto& h : heads) {
        ev << "{\"step\":" << step << ",\"block\":" << h.block
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
       << ",\n  \"wall_seconds\": " << JsonNumber(r.wall_seconds)
       << ",\n  \"eval\": [";
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
    return absl::OkStatus();
  }

  CoordinatorMetrics* metrics_out_;
  const RunConfig& c_;
  const TrainOptions& o_;
  Engine& engine_;
  const Dataset& train_;
  const Dataset& test_;
  const bool text_;
  const int k_;
  Progress* progress_ = nullptr;
  Clock::time_point start_;
  std::ofstream metrics_;
  int in_flight_ = 0;
  int64_t next_emit_ = 0;
  std::map<int64_t, StepAgg> steps_;
  std::map<int64_t, double> lrs_;
  std::vector<int64_t> steps_done_;
  std::vector<double> last_losses_;
  std::vector<std::pair<int64_t, std::vector<HeadResult>>> eval_log_;
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
    if (co.workers.empty()) {
      ASSIGN_OR_RETURN(const int k, NumBlocks(config.model()));
      ASSIGN_OR_RETURN(local,
                       LocalCluster::Launch(k, options.worker_binary.empty()
                                                   ? DefaultWorkerBinary()
                                                   : options.worker_binary));
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
  Runner runner(config, options, *engine, *data.train, *data.test,
                data.shape.is_text, metrics.get());
  auto result = runner.Run();
  engine->Shutdown();
  if (local) {
    if (options.on_cluster) options.on_cluster(nullptr);
    local->Stop();
  }
  return result;
}

}  // namespace interlock
