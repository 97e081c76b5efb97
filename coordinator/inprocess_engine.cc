#include "coordinator/inprocess_engine.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/event_queue.h"
#include "plan/status_macros.h"
#include "services/block_host.h"
#include "services/runtime.h"
#include "services/wire_codec.h"

namespace interlock {
namespace {

// A chain of block hosts joined in memory. Every message crossing a block
// boundary goes through the run's wire codec (Transfer), as it would
// between workers.
class InProcessEngine : public Engine {
 public:
  InProcessEngine(Schedule schedule, int threads, WireCodec codec)
      : schedule_(schedule), threads_(threads), codec_(std::move(codec)) {}
  ~InProcessEngine() override { Shutdown(); }

  absl::Status Init(const interlock::v1::RunConfig& config,
                    const DataShape& shape,
                    const std::vector<c10::Device>& devices) {
    const int k_blocks = static_cast<int>(devices.size());
    // One build for all blocks: the same values BlockTrainer::Create gives
    // each worker, without building the whole model K times.
    const TrainerOptions first = TrainerOptionsFromConfig(config, 0, k_blocks);
    ASSIGN_OR_RETURN(auto modules, BuildModel(config.model(), shape, !first.e2e,
                                              config.training().seed()));
    BlockHost::Options options;
    options.threads = threads_;
    if (schedule_ == Schedule::kSequential) options.shared = &queue_;
    options.on_error = [this](absl::Status s) {
      // Sequential: nothing queued runs after an error.
      if (schedule_ == Schedule::kSequential) queue_.Clear();
      events_.Fail(std::move(s));
    };
    for (int k = 0; k < k_blocks; ++k) {
      TrainerOptions trainer_options =
          TrainerOptionsFromConfig(config, k, k_blocks);
      trainer_options.device = devices[k];
      ASSIGN_OR_RETURN(auto trainer, BlockTrainer::FromModules(
                                         trainer_options, std::move(modules[k]),
                                         config.optimizer()));
      BlockDriver::Callbacks cb;
      cb.send_down = [this, k](ForwardMsg m) {
        hosts_[k + 1]->Forward(codec_.Transfer(std::move(m)));
      };
      cb.send_up = [this, k](UpwardMsg m) {
        if (k == 0) {
          events_.Push(codec_.Transfer(std::move(m)));
        } else {
          hosts_[k - 1]->Upward(codec_.Transfer(std::move(m)));
        }
      };
      cb.step_done = [this](StepDone d) { events_.Push(d); };
      hosts_.push_back(std::make_unique<BlockHost>(
          options, std::make_unique<BlockDriver>(std::move(trainer), cb)));
    }
    return absl::OkStatus();
  }

  int num_blocks() const override { return static_cast<int>(hosts_.size()); }

  absl::Status Submit(ForwardMsg msg) override {
    {
      auto l = events_.Lock();
      if (!events_.ErrorLocked().ok()) return events_.ErrorLocked();
    }
    hosts_[0]->Forward(codec_.Transfer(std::move(msg)));
    if (schedule_ == Schedule::kSequential) queue_.RunPending();
    auto l = events_.Lock();
    return events_.ErrorLocked();
  }

  absl::StatusOr<EngineEvent> Next() override {
    // Sequential: every event of the work submitted is queued already.
    return events_.Next(schedule_ == Schedule::kThreaded
                            ? absl::InfiniteDuration()
                            : absl::ZeroDuration(),
                        absl::FailedPreconditionError(
                            "in-process engine: waiting for an event with no "
                            "work in flight"));
  }

  bool Ready() override { return events_.Ready(); }

  absl::StatusOr<std::vector<HeadEval>> Evaluate(
      const torch::Tensor& input, const torch::Tensor& target) override {
    std::vector<HeadEval> out;
    // Block 0's input crosses the coordinator's link, as on a cluster.
    EvalMsg msg{0, codec_.TransferActivation(input), target, false};
    for (auto& host : hosts_) {
      const int k = host->driver()->trainer().options().block;
      absl::StatusOr<EvalResult> r;
      host->Call(
          [&] { r = host->Evaluate(msg, absl::StrCat("block ", k, " eval")); });
      if (!r.ok()) return r.status();
      for (size_t i = 0; i < r->loss.size(); ++i) {
        out.push_back({k, r->loss[i], r->correct[i], r->count});
      }
      msg.input = codec_.TransferActivation(std::move(r->output));
      msg.nonfinite = r->output_nonfinite;
    }
    return out;
  }

  absl::StatusOr<std::vector<BlockState>> FetchState() override {
    std::vector<BlockState> out;
    for (auto& host : hosts_) {
      BlockState s;
      for (auto& [name, t] : host->driver()->trainer().NamedState()) {
        // On the CPU, as the cluster's GetState delivers them.
        if (absl::StartsWith(name, "head.")) {
          s.head.emplace_back(name, t.cpu());
        } else {
          s.block.emplace_back(name, t.cpu());
        }
      }
      out.push_back(std::move(s));
    }
    return out;
  }

  absl::StatusOr<std::vector<std::string>> SaveState() override {
    std::vector<std::string> out(hosts_.size());
    for (size_t k = 0; k < hosts_.size(); ++k) {
      absl::StatusOr<std::string> r;
      hosts_[k]->Call([&] { r = hosts_[k]->driver()->SaveState(); });
      if (!r.ok()) return r.status();
      out[k] = *std::move(r);
    }
    return out;
  }

  absl::Status LoadState(int64_t step,
                         const std::vector<std::string>& states) override {
    if (states.size() != hosts_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("load state: ", states.size(), " archives for ",
                       hosts_.size(), " blocks"));
    }
    for (size_t k = 0; k < hosts_.size(); ++k) {
      absl::Status s;
      hosts_[k]->Call(
          [&] { s = hosts_[k]->driver()->LoadState(states[k], step); });
      RETURN_IF_ERROR(s);
    }
    return absl::OkStatus();
  }

  absl::Status Recover(absl::Duration) override {
    return absl::UnimplementedError(
        "the in-process engine has no workers to recover");
  }

  // Each block finishes the messages it was sent before the stop.
  void Shutdown() override {
    for (auto& host : hosts_) host->Stop(BlockHost::StopMode::kDrain);
  }

 private:
  const Schedule schedule_;
  const int threads_;
  const WireCodec codec_;
  BlockHost::SharedQueue queue_;  // sequential schedule
  std::vector<std::unique_ptr<BlockHost>> hosts_;
  EventQueue events_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> MakeInProcessEngine(
    const ResolvedRun& run, const DataShape& shape, Schedule schedule) {
  const int threads = std::max(1, run.config.training().threads_per_block());
  ConfigureThreads(threads);
  // E2E with one micro-batch per step keeps one block busy at a time: the
  // only overlap a thread per block could win, a block's optimizer step
  // beside the backward pass of the block below, is worth less than the
  // hand-offs between threads cost (2-13 % of the step,
  // docs/notebook/BENCHMARKS-lab.md), so the blocks run one after another
  // on the caller's thread. Where micro-batches or n-way blocks overlap,
  // they get their threads.
  const auto& t = run.config.training();
  if (schedule == Schedule::kThreaded &&
      t.mode() == interlock::v1::TrainingSpec::E2E && t.microbatches() <= 1) {
    schedule = Schedule::kSequential;
  }
  auto engine = std::make_unique<InProcessEngine>(schedule, threads, run.codec);
  RETURN_IF_ERROR(engine->Init(run.config, shape, run.devices));
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace interlock
