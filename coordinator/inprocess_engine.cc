#include "coordinator/inprocess_engine.h"

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/runtime.h"
#include "services/status_macros.h"

namespace interlock {
namespace {

struct StopMsg {};
// Work that must run on a block's own thread (state save and load).
using BlockTask = std::function<void(BlockDriver&)>;
using Inbound = std::variant<ForwardMsg, UpwardMsg, StopMsg, BlockTask>;

class InProcessEngine : public Engine {
 public:
  InProcessEngine(Schedule schedule, int threads)
      : schedule_(schedule), threads_(threads) {}
  ~InProcessEngine() override { Shutdown(); }

  absl::Status Init(const interlock::v1::RunConfig& config,
                    const DataShape& shape) {
    ASSIGN_OR_RETURN(int k_blocks, NumBlocks(config.model()));
    // One build for all blocks: the same values BlockTrainer::Create gives
    // each worker, without building the whole model K times.
    const TrainerOptions first = TrainerOptionsFromConfig(config, 0, k_blocks);
    ASSIGN_OR_RETURN(auto modules, BuildModel(config.model(), shape, !first.e2e,
                                              config.training().seed()));
    for (int k = 0; k < k_blocks; ++k) {
      ASSIGN_OR_RETURN(auto trainer,
                       BlockTrainer::FromModules(
                           TrainerOptionsFromConfig(config, k, k_blocks),
                           std::move(modules[k]), config.optimizer()));
      BlockDriver::Callbacks cb;
      cb.send_down = [this, k](ForwardMsg m) { Deliver(k + 1, std::move(m)); };
      cb.send_up = [this, k](UpwardMsg m) {
        if (k == 0) {
          Emit(std::move(m));
        } else {
          Deliver(k - 1, std::move(m));
        }
      };
      cb.step_done = [this](StepDone d) { Emit(d); };
      auto b = std::make_unique<Block>();
      b->driver = std::make_unique<BlockDriver>(std::move(trainer), cb);
      blocks_.push_back(std::move(b));
    }
    if (schedule_ == Schedule::kThreaded) {
      for (int k = 0; k < k_blocks; ++k) {
        blocks_[k]->thread = std::thread([this, k] { Loop(k); });
      }
    }
    return absl::OkStatus();
  }

  int num_blocks() const override { return static_cast<int>(blocks_.size()); }

  absl::Status Submit(ForwardMsg msg) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!error_.ok()) return error_;
    }
    Deliver(0, std::move(msg));
    if (schedule_ == Schedule::kSequential) RunSequential();
    std::lock_guard<std::mutex> l(mu_);
    return error_;
  }

  absl::StatusOr<EngineEvent> Next() override {
    std::unique_lock<std::mutex> l(mu_);
    if (schedule_ == Schedule::kThreaded) {
      cv_.wait(l, [&] { return !out_.empty() || !error_.ok(); });
    }
    if (!error_.ok()) return error_;
    if (out_.empty()) {
      return absl::FailedPreconditionError(
          "in-process engine: waiting for an event with no work in flight");
    }
    EngineEvent e = std::move(out_.front());
    out_.pop_front();
    return e;
  }

  bool Ready() override {
    std::lock_guard<std::mutex> l(mu_);
    return !out_.empty() || !error_.ok();
  }

  absl::StatusOr<std::vector<HeadEval>> Evaluate(
      const torch::Tensor& input, const torch::Tensor& target) override {
    std::vector<HeadEval> out;
    torch::Tensor x = input;
    bool nonfinite = false;
    for (auto& b : blocks_) {
      ASSIGN_OR_RETURN(EvalResult r,
                       b->driver->trainer().Evaluate(x, target, nonfinite));
      nonfinite = r.output_nonfinite;
      for (size_t i = 0; i < r.loss.size(); ++i) {
        out.push_back({b->driver->trainer().options().block, r.loss[i],
                       r.correct[i], r.count});
      }
      x = r.output;
    }
    return out;
  }

  absl::StatusOr<std::vector<BlockState>> FetchState() override {
    std::vector<BlockState> out;
    for (auto& b : blocks_) {
      BlockState s;
      for (auto& [name, t] : b->driver->trainer().NamedState()) {
        if (absl::StartsWith(name, "head.")) {
          s.head.emplace_back(name, t);
        } else {
          s.block.emplace_back(name, t);
        }
      }
      out.push_back(std::move(s));
    }
    return out;
  }

  absl::StatusOr<std::vector<std::string>> SaveState() override {
    std::vector<std::string> out(blocks_.size());
    for (size_t k = 0; k < blocks_.size(); ++k) {
      absl::StatusOr<std::string> r;
      RunOnBlock(static_cast<int>(k),
                 [&](BlockDriver& d) { r = d.SaveState(); });
      if (!r.ok()) return r.status();
      out[k] = *std::move(r);
    }
    return out;
  }

  absl::Status LoadState(int64_t step,
                         const std::vector<std::string>& states) override {
    if (states.size() != blocks_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("load state: ", states.size(), " archives for ",
                       blocks_.size(), " blocks"));
    }
    for (size_t k = 0; k < blocks_.size(); ++k) {
      absl::Status s;
      RunOnBlock(static_cast<int>(k),
                 [&](BlockDriver& d) { s = d.LoadState(states[k], step); });
      RETURN_IF_ERROR(s);
    }
    return absl::OkStatus();
  }

  absl::Status Recover(absl::Duration) override {
    return absl::UnimplementedError(
        "the in-process engine has no workers to recover");
  }

  void Shutdown() override {
    for (size_t k = 0; k < blocks_.size(); ++k) {
      if (blocks_[k]->thread.joinable()) {
        Deliver(static_cast<int>(k), StopMsg{});
        blocks_[k]->thread.join();
      }
    }
  }

 private:
  struct Block {
    std::unique_ptr<BlockDriver> driver;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Inbound> inbox;
    std::thread thread;
  };

  void Deliver(int k, Inbound msg) {
    if (schedule_ == Schedule::kSequential) {
      queue_.emplace_back(k, std::move(msg));
      return;
    }
    Block& b = *blocks_[k];
    {
      std::lock_guard<std::mutex> l(b.mu);
      b.inbox.push_back(std::move(msg));
    }
    b.cv.notify_one();
  }

  void Emit(EngineEvent e) {
    {
      std::lock_guard<std::mutex> l(mu_);
      out_.push_back(std::move(e));
    }
    cv_.notify_all();
  }

  void Fail(absl::Status s) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (error_.ok()) error_ = std::move(s);
    }
    cv_.notify_all();
  }

  // Runs `task` on block k's thread (threaded) or here (sequential) and
  // waits for it.
  void RunOnBlock(int k, const BlockTask& task) {
    if (schedule_ == Schedule::kSequential) {
      task(*blocks_[k]->driver);
      return;
    }
    std::promise<void> done;
    Deliver(k, BlockTask([&](BlockDriver& d) {
              task(d);
              done.set_value();
            }));
    done.get_future().wait();
  }

  absl::Status Handle(int k, Inbound msg) {
    BlockDriver& d = *blocks_[k]->driver;
    if (auto* t = std::get_if<BlockTask>(&msg)) {
      (*t)(d);
      return absl::OkStatus();
    }
    if (auto* f = std::get_if<ForwardMsg>(&msg))
      return d.OnForward(std::move(*f));
    if (auto* u = std::get_if<UpwardMsg>(&msg))
      return d.OnUpward(std::move(*u));
    return absl::OkStatus();
  }

  // All blocks on this thread: messages are handled in the order they were
  // sent, which is the reference implementation's simulated schedule.
  void RunSequential() {
    while (!queue_.empty()) {
      auto [k, msg] = std::move(queue_.front());
      queue_.pop_front();
      absl::Status s = Handle(k, std::move(msg));
      if (!s.ok()) {
        queue_.clear();
        Fail(s);
        return;
      }
    }
  }

  void Loop(int k) {
    ConfigureThreads(threads_);
    Block& b = *blocks_[k];
    for (;;) {
      Inbound msg;
      {
        std::unique_lock<std::mutex> l(b.mu);
        b.cv.wait(l, [&] { return !b.inbox.empty(); });
        msg = std::move(b.inbox.front());
        b.inbox.pop_front();
      }
      if (std::holds_alternative<StopMsg>(msg)) return;
      absl::Status s = Handle(k, std::move(msg));
      if (!s.ok()) Fail(s);
    }
  }

  const Schedule schedule_;
  const int threads_;
  std::vector<std::unique_ptr<Block>> blocks_;
  std::deque<std::pair<int, Inbound>> queue_;  // sequential schedule
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<EngineEvent> out_;
  absl::Status error_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> MakeInProcessEngine(
    const interlock::v1::RunConfig& config, const DataShape& shape,
    Schedule schedule) {
  const int threads = std::max(1, config.training().threads_per_block());
  ConfigureThreads(threads);
  auto engine = std::make_unique<InProcessEngine>(schedule, threads);
  RETURN_IF_ERROR(engine->Init(config, shape));
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace interlock
