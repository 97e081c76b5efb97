#include "coordinator/cluster_engine.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "coordinator/chain_links.h"
#include "coordinator/chain_membership.h"
#include "coordinator/event_queue.h"
#include "plan/status_macros.h"
#include "services/logging.h"
#include "services/wire_codec.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

// Drives the chain: its links carry one generation, its membership decides
// the next; the run's events come through one queue.
class ClusterEngine : public ElasticEngine {
 public:
  ClusterEngine(const v1::RunConfig& config, const DataShape& shape,
                const ClusterOptions& options, WireCodec codec)
      : config_(config),
        shape_(shape),
        options_(options),
        codec_(std::move(codec)),
        links_(config_, shape_, options_, codec_, &events_),
        membership_(&links_, options_) {}

  ~ClusterEngine() override { Shutdown(); }

  absl::Status Init() {
    if (options_.adopt) {
      const LiveRun& live = *options_.adopt;
      absl::Status s = Adopt(live);
      if (s.ok()) {
        adopted_ = live.step;
        LOG(INFO) << "adopted the live workers of run " << live.run_id
                  << " at step " << live.step << " (generation "
                  << links_.generation()
                  << "; every block from its own snapshot, no checkpoint read)";
        return absl::OkStatus();
      }
      LOG(WARNING) << "could not adopt the live workers of run " << live.run_id
                   << " (" << s.message()
                   << "); starting them afresh (the run resumes from its "
                      "checkpoint, if any)";
      links_.Close(/*drain=*/false);
      links_.ResetAttempt();
    }
    RETURN_IF_ERROR(links_.Init(options_.workers));
    // A journal of another run names nothing this one can adopt.
    if (options_.on_generation) {
      options_.on_generation(links_.run_id(), links_.generation());
    }
    RETURN_IF_ERROR(membership_.Start());
    RETURN_IF_ERROR(
        links_.Connect(options_.connect_timeout, /*parallel=*/false));
    membership_.Publish();
    return absl::OkStatus();
  }

  // Configures the workers of `live` under its run and generation, each
  // continuing from its own snapshot at `live.step`; fails (nothing
  // adopted) when one is gone or has no such snapshot.
  absl::Status Adopt(const LiveRun& live) {
    RETURN_IF_ERROR(links_.Init(live.workers));
    links_.Continue(live.run_id, live.generation);
    RETURN_IF_ERROR(membership_.Start());
    std::set<std::string> all;
    for (const auto& block : live.workers)
      all.insert(block.begin(), block.end());
    // Every worker at once: one waiting for a peer (a replica's reduction)
    // is freed when that peer is reconfigured. Live workers answer at once;
    // one that does not is gone, and the run falls back to its checkpoint
    // rather than wait the whole connect timeout.
    RETURN_IF_ERROR(
        links_.Connect(std::min(options_.connect_timeout, absl::Seconds(5)),
                       /*parallel=*/true, all, live.step));
    links_.ResetProgress(live.step);
    membership_.Publish();
    return absl::OkStatus();
  }

  int num_blocks() const override { return links_.num_blocks(); }

  absl::Status Submit(ForwardMsg msg) override {
    return links_.Submit(std::move(msg));
  }

  absl::StatusOr<EngineEvent> Next() override {
    return events_.Next(options_.stall_timeout,
                        absl::DeadlineExceededError(absl::StrCat(
                            "no progress from the workers for ",
                            absl::FormatDuration(options_.stall_timeout))));
  }

  bool Ready() override { return events_.Ready(); }

  absl::StatusOr<std::vector<HeadEval>> Evaluate(
      const torch::Tensor& input, const torch::Tensor& target) override {
    return links_.Evaluate(input, target);
  }

  absl::StatusOr<std::vector<BlockState>> FetchState() override {
    return links_.FetchState();
  }

  absl::StatusOr<std::vector<std::string>> SaveState() override {
    std::vector<std::string> out;
    for (int k = 0; k < num_blocks(); ++k) {
      ASSIGN_OR_RETURN(std::string state, links_.SaveBlockState(k));
      out.push_back(std::move(state));
    }
    return out;
  }

  absl::Status LoadState(int64_t step,
                         const std::vector<std::string>& states) override {
    if (static_cast<int>(states.size()) != num_blocks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("load state: ", states.size(), " archives for ",
                       num_blocks(), " blocks"));
    }
    for (int k = 0; k < num_blocks(); ++k) {
      for (int r = 0; r < links_.replicas()[k]; ++r) {
        RETURN_IF_ERROR(links_.LoadStateInto(k, r, step, states[k]));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Recover(absl::Duration timeout) override {
    links_.Close(/*drain=*/false);
    links_.ResetAttempt();
    if (options_.revive) options_.revive();
    // Every block starts afresh under a new generation.
    links_.NextGeneration();
    RETURN_IF_ERROR(
        links_.Connect(timeout, /*parallel=*/links_.generation() > 1));
    links_.ResetProgress(0);
    return absl::OkStatus();
  }

  bool MembershipPending() override { return membership_.Pending(); }
  absl::Status ApplyMembership(int64_t step) override {
    return membership_.Apply(step);
  }
  absl::StatusOr<int64_t> RecoverFromReplicas(int64_t accounted) override {
    return membership_.FailOver(accounted);
  }
  std::vector<TopologyEvent> TopologyHistory() const override {
    return membership_.history();
  }
  Topology Workers() const override { return links_.workers(); }
  LiveRun Live() const override {
    return LiveRun{links_.run_id(), links_.generation(), links_.workers(),
                   links_.generation_step()};
  }
  std::optional<int64_t> Adopted() const override { return adopted_; }

  void Shutdown() override {
    links_.Close(/*drain=*/true);
    membership_.Close();
  }

 private:
  const v1::RunConfig config_;
  const DataShape shape_;
  const ClusterOptions options_;
  const WireCodec codec_;
  // Before the links: their stream handlers push into it until they close.
  EventQueue events_;
  ChainLinks links_;
  ChainMembership membership_;
  std::optional<int64_t> adopted_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> MakeClusterEngine(
    const ResolvedRun& run, const DataShape& shape,
    const ClusterOptions& options) {
  auto engine =
      std::make_unique<ClusterEngine>(run.config, shape, options, run.codec);
  RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace interlock
