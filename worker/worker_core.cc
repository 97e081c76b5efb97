#include "worker/worker_core.h"

#include <chrono>
#include <cmath>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "services/config.h"
#include "services/digest.h"
#include "services/models.h"
#include "services/runtime.h"
#include "services/status_macros.h"

namespace interlock {

using Clock = std::chrono::steady_clock;

struct WorkerCore::Run {
  std::string run_id;
  int64_t generation = 0;
  int block = 0;
  int num_blocks = 1;
  int microbatches = 1;
  int64_t eval_batch = 1;
  int64_t classes = 0;
  std::string next_address;
  int64_t max_message_bytes = 0;
  std::vector<int64_t> sample_shape;  // block input, no batch dimension
  std::vector<int64_t> output_shape;  // block output, no batch dimension
  std::vector<int64_t> target_shape;  // no batch dimension
  int64_t mb_size = 1;
  // Micro-batches the coordinator keeps in flight, and what follows from
  // it: how many steps ahead of the block a forward can be, how many
  // forwards can wait in the driver's queue.
  int window = 0;
  int64_t max_steps_ahead = 0;
  int64_t max_queued = 0;
  // The largest archive this block's SaveState can produce, with margin.
  int64_t max_state_bytes = 0;
  torch::ScalarType input_dtype = torch::kFloat32;
  std::unique_ptr<BlockDriver> driver;
  std::unique_ptr<DownstreamLink> link;
  uint64_t link_id = 0;
  bool failed = false;
  BlockMetrics* metrics = nullptr;
  int64_t nonfinite_seen = 0;  // the trainer's count already exported
  v1::ConfigureResponse response;

  // Refuses a non-finite received tensor, counting it.
  absl::Status CheckFinite(const torch::Tensor& t, const std::string& what) {
    absl::Status s = ExpectFinite(t, what);
    if (!s.ok()) metrics->nonfinite->Increment();
    return s;
  }
  // Exports the non-finite losses and gradients the trainer met.
  void SyncNonFinite() {
    if (!driver) return;
    const int64_t n = driver->trainer().nonfinite_count();
    if (n > nonfinite_seen) {
      metrics->nonfinite->Increment(static_cast<double>(n - nonfinite_seen));
      nonfinite_seen = n;
    }
  }
};

namespace {

std::vector<int64_t> WithBatch(int64_t b, const std::vector<int64_t>& s) {
  std::vector<int64_t> out{b};
  out.insert(out.end(), s.begin(), s.end());
  return out;
}

// A caller's string in an error message: escaped and cut short (it may be
// as long as a whole message).
std::string Quoted(const std::string& s) {
  constexpr size_t kMax = 64;
  return absl::StrCat("'", absl::CHexEscape(s.substr(0, kMax)), "'",
                      s.size() > kMax ? "..." : "");
}

// Far beyond any useful pipeline; keeps the bounds below from overflowing.
constexpr int kMaxWindow = 1 << 20;

}  // namespace

WorkerCore::WorkerCore(WorkerOptions options, WorkerMetrics* metrics,
                       LinkFactory link_factory)
    : options_(options),
      metrics_(metrics),
      link_factory_(std::move(link_factory)) {
  thread_ = std::thread([this] { Loop(); });
}

WorkerCore::~WorkerCore() { Shutdown(); }

void WorkerCore::Shutdown() {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stopping_) {
      if (!thread_.joinable()) return;
    }
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (run_ && run_->link) run_->link->Close();
  run_.reset();
}

void WorkerCore::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (stopping_) return;
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

bool WorkerCore::WaitingForGradients() const {
  return run_ && run_->driver && run_->driver->trainer().NeedsDownstream() &&
         run_->driver->trainer().pending() > 0;
}

void WorkerCore::Loop() {
  for (;;) {
    std::function<void()> task;
    const bool idle = WaitingForGradients();
    const auto idle_start = Clock::now();
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stopping_ || !tasks_.empty(); });
      if (stopping_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    if (idle && run_ && run_->metrics) {
      run_->metrics->idle_seconds->Increment(
          std::chrono::duration<double>(Clock::now() - idle_start).count());
    }
    task();
  }
}

void WorkerCore::Configure(
    const v1::ConfigureRequest& request,
    std::function<void(absl::StatusOr<v1::ConfigureResponse>)> done) {
  Post([this, request, done = std::move(done)] { done(DoConfigure(request)); });
}

absl::StatusOr<v1::ConfigureResponse> WorkerCore::DoConfigure(
    const v1::ConfigureRequest& req) {
  if (run_ && run_->run_id == req.run_id() &&
      run_->generation == req.generation() && run_->block == req.block()) {
    return run_->response;  // a retried Configure of the same run
  }
  if (req.run_id().empty()) {
    return absl::InvalidArgumentError("configure: run_id is empty");
  }
  v1::RunConfig config = req.config();
  ApplyDefaults(config);
  RETURN_IF_ERROR(ValidateRunConfig(config));
  ASSIGN_OR_RETURN(int k_blocks, NumBlocks(config.model()));
  if (req.num_blocks() != k_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("configure: num_blocks ", req.num_blocks(),
                     " but the model has ", k_blocks, " blocks"));
  }
  if (req.block() < 0 || req.block() >= k_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "configure: block ", req.block(), " outside [0, ", k_blocks, ")"));
  }
  if (req.block() + 1 < k_blocks && req.next_address().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("configure: block ", req.block(), " needs next_address"));
  }
  if (req.window() < 0 || req.window() > kMaxWindow) {
    return absl::InvalidArgumentError(absl::StrCat(
        "configure: window ", req.window(), " outside [0, ", kMaxWindow, "]"));
  }
  if (req.max_message_bytes() > options_.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "configure: the run needs messages of ", req.max_message_bytes(),
        " bytes but this worker accepts at most ", options_.max_message_bytes,
        " (raise --max_message_bytes)"));
  }
  const DataShape shape = DecodeShape(req.shape());
  ASSIGN_OR_RETURN(auto outputs, BlockOutputShapes(config.model(), shape));

  // A new run replaces the old one: its streams end.
  if (run_) {
    if (run_->link) run_->link->Close();
    std::shared_ptr<UpstreamSink> old;
    {
      std::lock_guard<std::mutex> l(mu_);
      old = sink_;
    }
    if (old) {
      old->Finish(absl::AbortedError(absl::StrCat(
          "block ", run_->block, " reconfigured for run ", req.run_id())));
    }
    run_.reset();
  }

  ConfigureThreads(config.training().threads_per_block());
  ASSIGN_OR_RETURN(auto trainer,
                   BlockTrainer::Create(config, shape, req.block()));
  auto run = std::make_unique<Run>();
  run->run_id = req.run_id();
  run->generation = req.generation();
  run->block = req.block();
  run->num_blocks = k_blocks;
  run->microbatches = config.training().microbatches();
  run->mb_size = config.training().batch_size() / run->microbatches;
  run->window =
      req.window() > 0 ? req.window() : 2 * k_blocks * run->microbatches;
  // With W micro-batches in flight, a forward for step s reaches this block
  // only while some micro-batch of its current step c is unfinished, and
  // every micro-batch of steps c+1..s-1 is unfinished too (the block runs
  // none of them before stepping c): (s-c-1)*M + 2 <= W. Two steps more
  // of margin. Forwards waiting in the queue are all in flight: fewer
  // than W, M more of margin. Each has the exact input and target shape,
  // so this also bounds their bytes.
  run->max_steps_ahead =
      (run->window + run->microbatches - 1) / run->microbatches + 2;
  run->max_queued = int64_t{run->window} + run->microbatches;
  run->eval_batch = std::max<int64_t>(config.training().eval_batch_size(),
                                      config.training().batch_size());
  run->classes = shape.classes;
  run->next_address = req.next_address();
  run->max_message_bytes = req.max_message_bytes();
  run->sample_shape =
      req.block() == 0 ? SampleShape(shape) : outputs[req.block() - 1];
  run->output_shape = outputs[req.block()];
  run->target_shape = TargetShape(shape);
  run->input_dtype =
      req.block() == 0 && shape.is_text ? torch::kInt64 : torch::kFloat32;
  run->metrics = &metrics_->ForBlock(req.block());
  int64_t params = 0;
  int64_t tensor_bytes = 0;
  int64_t entries = 0;
  for (const auto& [name, t] : trainer->NamedState()) {
    params += t.numel();
    tensor_bytes += t.numel() * static_cast<int64_t>(t.element_size());
    ++entries;
  }
  run->response.set_parameters(params);
  // SaveState's archive holds every parameter and buffer and, per tensor,
  // at most three optimizer tensors of its size (Adam's exp_avg,
  // exp_avg_sq, max_exp_avg_sq) and a step scalar, each entry with its
  // name and zip and pickle records (4 KiB each is generous). Twice that
  // plus 1 MiB bounds what LoadState can legitimately receive.
  run->max_state_bytes = std::min(
      options_.max_state_bytes,
      2 * (4 * tensor_bytes + 5 * entries * 4096) + (int64_t{1} << 20));
  for (int64_t d : WithBatch(run->mb_size, run->sample_shape)) {
    run->response.add_input_shape(d);
  }
  for (int64_t d : WithBatch(run->mb_size, run->output_shape)) {
    run->response.add_output_shape(d);
  }

  Run* r = run.get();
  BlockDriver::Callbacks cb;
  cb.send_down = [this, r](ForwardMsg m) {
    v1::DownMessage msg;
    msg.mutable_header()->set_run_id(r->run_id);
    msg.mutable_header()->set_generation(r->generation);
    msg.mutable_header()->mutable_route()->set_block(r->block + 1);
    auto* f = msg.mutable_forward();
    f->set_step(m.step);
    f->set_microbatch(m.mb);
    f->set_microbatches(r->microbatches);
    f->set_learning_rate(m.lr);
    f->set_nonfinite(m.nonfinite);
    EncodeTensor(m.input, f->mutable_input());
    EncodeTensor(m.target, f->mutable_target());
    SendDown(std::move(msg));
  };
  cb.send_up = [this, r](UpwardMsg m) {
    if (m.final) r->metrics->microbatches->Increment();
    for (const auto& t : m.timings) {
      if (t.block != r->block) continue;
      switch (t.phase) {
        case Phase::kForward:
          r->metrics->forward_seconds->Observe(t.seconds);
          break;
        case Phase::kHead:
          r->metrics->head_seconds->Observe(t.seconds);
          break;
        case Phase::kBackward:
          r->metrics->backward_seconds->Observe(t.seconds);
          break;
        case Phase::kOptimizer:
          r->metrics->optimizer_seconds->Observe(t.seconds);
          break;
        case Phase::kInputGrad:
          r->metrics->input_grad_seconds->Observe(t.seconds);
          break;
      }
    }
    for (const auto& rep : m.reports) {
      if (rep.block == r->block) r->metrics->head_loss->Set(rep.loss);
    }
    v1::UpMessage msg;
    EncodeUpward(m, msg.mutable_upward());
    SendUp(std::move(msg));
  };
  cb.step_done = [this, r](StepDone d) {
    r->metrics->step->Set(static_cast<double>(d.step + 1));
    r->metrics->optimizer_seconds->Observe(d.timing.seconds);
    v1::UpMessage msg;
    msg.mutable_step_done()->set_block(d.block);
    msg.mutable_step_done()->set_step(d.step);
    msg.mutable_step_done()->set_optimizer_seconds(d.timing.seconds);
    msg.mutable_step_done()->set_skipped(d.skipped);
    msg.mutable_step_done()->set_microbatches(d.microbatches);
    SendUp(std::move(msg));
  };
  run->driver = std::make_unique<BlockDriver>(std::move(trainer), cb);
  run->metrics->configured->Set(1);
  run->metrics->step->Set(0);
  run_ = std::move(run);
  if (on_configured_) on_configured_(true);
  return run_->response;
}

void WorkerCore::GetState(
    const v1::GetStateRequest& request,
    std::function<void(absl::StatusOr<v1::GetStateResponse>)> done) {
  Post([this, request, done = std::move(done)] {
    if (!run_) {
      done(absl::FailedPreconditionError("get_state: no block configured"));
      return;
    }
    if (!request.run_id().empty() && request.run_id() != run_->run_id) {
      done(absl::FailedPreconditionError(
          absl::StrCat("get_state: run ", Quoted(request.run_id()),
                       " is not the run this worker is configured for")));
      return;
    }
    v1::GetStateResponse resp;
    resp.set_step(run_->driver->current_step());
    for (const auto& [name, t] : run_->driver->trainer().NamedState()) {
      auto* nt =
          name.rfind("head.", 0) == 0 ? resp.add_head() : resp.add_block();
      nt->set_name(name);
      EncodeTensor(t, nt->mutable_tensor());
    }
    done(std::move(resp));
  });
}

absl::Status WorkerCore::CheckRun(const std::string& what,
                                  const std::string& run_id,
                                  int64_t generation) const {
  if (!run_) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": no block configured"));
  }
  // The refusal names only what the caller sent: a caller who does not
  // know the run must not learn its id or generation from it.
  if (run_id != run_->run_id || generation != run_->generation) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": run ", Quoted(run_id), " generation ", generation,
                     " is not the run this worker is configured for"));
  }
  return absl::OkStatus();
}

void WorkerCore::SaveState(
    const v1::SaveStateRequest& request,
    std::function<void(absl::StatusOr<BlockStateArchive>)> done) {
  Post([this, request, done = std::move(done)] {
    done([&]() -> absl::StatusOr<BlockStateArchive> {
      RETURN_IF_ERROR(
          CheckRun("save_state", request.run_id(), request.generation()));
      BlockStateArchive a;
      a.run_id = run_->run_id;
      a.generation = run_->generation;
      a.block = run_->block;
      a.step = run_->driver->current_step();
      ASSIGN_OR_RETURN(a.bytes, run_->driver->SaveState());
      a.sha256 = Sha256Hex(a.bytes.data(), a.bytes.size());
      return a;
    }());
  });
}

void WorkerCore::CheckLoadState(const BlockStateArchive& header,
                                int64_t total_bytes,
                                std::function<void(absl::Status)> done) {
  Post([this, run_id = header.run_id, generation = header.generation,
        block = header.block, total_bytes, done = std::move(done)] {
    done([&]() -> absl::Status {
      RETURN_IF_ERROR(CheckRun("load_state", run_id, generation));
      const std::string what =
          absl::StrCat("load_state of block ", run_->block);
      if (block != run_->block) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": the state is of block ", block));
      }
      if (total_bytes < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": negative size ", total_bytes, " announced"));
      }
      if (total_bytes > run_->max_state_bytes) {
        return absl::ResourceExhaustedError(
            absl::StrCat(what, ": ", total_bytes,
                         " bytes announced, but this block's state is at most ",
                         run_->max_state_bytes, " bytes"));
      }
      return absl::OkStatus();
    }());
  });
}

void WorkerCore::LoadState(BlockStateArchive state,
                           std::function<void(absl::StatusOr<int64_t>)> done) {
  Post([this, state = std::move(state), done = std::move(done)]() mutable {
    absl::StatusOr<int64_t> result = [&]() -> absl::StatusOr<int64_t> {
      RETURN_IF_ERROR(CheckRun("load_state", state.run_id, state.generation));
      const std::string what =
          absl::StrCat("load_state of block ", run_->block);
      if (state.block != run_->block) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": the state is of block ", state.block));
      }
      if (static_cast<int64_t>(state.bytes.size()) > run_->max_state_bytes) {
        return absl::ResourceExhaustedError(
            absl::StrCat(what, ": ", state.bytes.size(),
                         " bytes, but this block's state is at most ",
                         run_->max_state_bytes, " bytes"));
      }
      const std::string sha = Sha256Hex(state.bytes.data(), state.bytes.size());
      if (sha != state.sha256) {
        return absl::DataLossError(
            absl::StrCat(what, ": SHA-256 of the ", state.bytes.size(),
                         " bytes received is ", sha, ", the sender said ",
                         state.sha256.empty() ? "nothing" : state.sha256));
      }
      if (state.step < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": negative step ", state.step));
      }
      RETURN_IF_ERROR(run_->driver->LoadState(state.bytes, state.step));
      const int64_t step = run_->driver->current_step();
      run_->metrics->step->Set(static_cast<double>(step));
      return step;
    }();
    // The archive is freed before the caller hears back: the service
    // admits the next LoadState then.
    std::string().swap(state.bytes);
    done(std::move(result));
  });
}

void WorkerCore::Attach(std::shared_ptr<UpstreamSink> sink) {
  std::shared_ptr<UpstreamSink> old;
  {
    std::lock_guard<std::mutex> l(mu_);
    old = std::move(sink_);
    sink_ = std::move(sink);
  }
  if (old) old->Finish(absl::AbortedError("replaced by a newer stream"));
}

void WorkerCore::Detach(const UpstreamSink* sink) {
  std::lock_guard<std::mutex> l(mu_);
  if (sink_.get() == sink) sink_.reset();
}

void WorkerCore::OnFirstDown(std::shared_ptr<UpstreamSink> from,
                             v1::DownMessage msg,
                             std::function<void()> accepted) {
  Post([this, from = std::move(from), msg = std::move(msg),
        accepted = std::move(accepted)]() mutable {
    if (!run_) {
      from->Finish(absl::FailedPreconditionError(
          "stream: no block configured on this worker"));
      return;
    }
    const auto& h = msg.header();
    if (h.run_id() != run_->run_id || h.generation() != run_->generation) {
      run_->metrics->rejected->Increment();
      from->Finish(absl::FailedPreconditionError(
          absl::StrCat("stream: the first message names run ",
                       Quoted(h.run_id()), " generation ", h.generation(),
                       ", not the run this worker is configured for")));
      return;
    }
    // The same run and generation: a reconnect (the coordinator after a
    // broken stream, block k-1 re-opening its link) takes over.
    Attach(from);
    accepted();
    ProcessDown(from, std::move(msg));
  });
}

void WorkerCore::OnDown(std::shared_ptr<UpstreamSink> from,
                        v1::DownMessage msg) {
  // Messages are processed even if their stream was replaced meanwhile: they
  // were delivered, and the driver's checks refuse anything stale.
  Post([this, from = std::move(from), msg = std::move(msg)]() mutable {
    ProcessDown(from, std::move(msg));
  });
}

void WorkerCore::OnDownClosed(std::shared_ptr<UpstreamSink> from) {
  Post([from = std::move(from)] { from->Finish(absl::OkStatus()); });
}

void WorkerCore::ProcessDown(const std::shared_ptr<UpstreamSink>& from,
                             v1::DownMessage msg) {
  if (run_) run_->metrics->received_down_bytes->Increment(msg.ByteSizeLong());
  Run* before = run_.get();
  const int64_t seen = before ? before->nonfinite_seen : 0;
  absl::Status s = HandleDown(std::move(msg));
  if (!s.ok()) {
    // A stop by this block's non-finite policy is not a refused message.
    const bool own =
        run_ && run_.get() == before && run_->nonfinite_seen > seen;
    if (run_ && !own) run_->metrics->rejected->Increment();
    from->Finish(s);
  }
}

absl::Status WorkerCore::HandleDown(v1::DownMessage msg) {
  if (!run_) {
    return absl::FailedPreconditionError("worker: no block configured");
  }
  const auto& h = msg.header();
  if (h.run_id() != run_->run_id || h.generation() != run_->generation) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", run_->block, ": message for run ",
                     Quoted(h.run_id()), " generation ", h.generation(),
                     ", not the run this worker is configured for"));
  }
  if (h.route().block() != run_->block || h.route().replica() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", run_->block, ": message routed to block ",
                     h.route().block(), " replica ", h.route().replica()));
  }
  if (run_->failed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", run_->block, ": the run failed; reconfigure to continue"));
  }
  switch (msg.kind_case()) {
    case v1::DownMessage::kForward:
      return HandleForward(msg.forward());
    case v1::DownMessage::kEval:
      return HandleEval(msg.eval());
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("block ", run_->block, ": empty down message"));
  }
}

absl::Status WorkerCore::HandleForward(const v1::ForwardData& f) {
  Run& r = *run_;
  const std::string where = absl::StrCat("block ", r.block, " step ", f.step(),
                                         " micro-batch ", f.microbatch());
  if (f.microbatches() != r.microbatches) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": microbatches ", f.microbatches(),
                     ", the run uses ", r.microbatches));
  }
  if (f.microbatch() < 0 || f.microbatch() >= r.microbatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": micro-batch index outside [0, ", r.microbatches, ")"));
  }
  if (f.step() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": negative step"));
  }
  // Before anything changes: a rate LibTorch cannot apply would otherwise
  // fail the block's optimizer step, and every step after it.
  RETURN_IF_ERROR(CheckLearningRate(f.learning_rate(), where));
  if (r.driver->Seen(f.step(), f.microbatch())) {
    // A repeat (a coordinator resending after a broken stream): applying
    // it again would count its gradient twice. Acknowledge it instead.
    v1::UpMessage ack;
    ack.mutable_duplicate()->set_block(r.block);
    ack.mutable_duplicate()->set_step(f.step());
    ack.mutable_duplicate()->set_microbatch(f.microbatch());
    SendUp(std::move(ack));
    return absl::OkStatus();
  }
  // What the run's window allows to be queued (see DoConfigure); more is
  // a client growing the worker's memory.
  const int64_t current = r.driver->current_step();
  if (f.step() > current + r.max_steps_ahead) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": more than ", r.max_steps_ahead,
                     " steps ahead of the block (at step ", current, ", with ",
                     r.window, " micro-batches in flight)"));
  }
  // The forward the block runs next is always taken: it drains the queue.
  if (!r.driver->RunsNext(f.step(), f.microbatch()) &&
      static_cast<int64_t>(r.driver->queued()) >= r.max_queued) {
    return absl::ResourceExhaustedError(absl::StrCat(
        where, ": ", r.driver->queued(),
        " forwards already wait for their turn, the most a window of ",
        r.window, " micro-batches allows"));
  }
  ASSIGN_OR_RETURN(torch::Tensor input,
                   DecodeTensor(f.input(), where + " input", options_.limits));
  RETURN_IF_ERROR(ExpectTensor(input, r.input_dtype,
                               WithBatch(r.mb_size, r.sample_shape),
                               where + " input"));
  RETURN_IF_ERROR(r.CheckFinite(input, where + " input"));
  ASSIGN_OR_RETURN(
      torch::Tensor target,
      DecodeTensor(f.target(), where + " target", options_.limits));
  RETURN_IF_ERROR(ExpectTensor(target, torch::kInt64,
                               WithBatch(r.mb_size, r.target_shape),
                               where + " target"));
  if (target.numel() > 0 && (target.min().item<int64_t>() < 0 ||
                             target.max().item<int64_t>() >= r.classes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": target values outside [0, ", r.classes, ")"));
  }
  ForwardMsg m;
  m.step = f.step();
  m.mb = f.microbatch();
  m.lr = f.learning_rate();
  m.input = std::move(input);
  m.target = std::move(target);
  m.nonfinite = f.nonfinite();
  absl::Status s = r.driver->OnForward(std::move(m));
  r.SyncNonFinite();
  return s;
}

absl::Status WorkerCore::HandleEval(const v1::EvalData& e) {
  Run& r = *run_;
  const std::string where =
      absl::StrCat("block ", r.block, " eval batch ", e.batch());
  if (r.driver->trainer().pending() > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, ": training micro-batches still in flight"));
  }
  ASSIGN_OR_RETURN(torch::Tensor input,
                   DecodeTensor(e.input(), where + " input", options_.limits));
  const int64_t b = input.dim() > 0 ? input.size(0) : 0;
  if (b < 1 || b > r.eval_batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": batch of ", b, " samples, expected 1..", r.eval_batch));
  }
  RETURN_IF_ERROR(ExpectTensor(input, r.input_dtype,
                               WithBatch(b, r.sample_shape), where + " input"));
  RETURN_IF_ERROR(r.CheckFinite(input, where + " input"));
  ASSIGN_OR_RETURN(
      torch::Tensor target,
      DecodeTensor(e.target(), where + " target", options_.limits));
  RETURN_IF_ERROR(ExpectTensor(
      target, torch::kInt64, WithBatch(b, r.target_shape), where + " target"));
  ASSIGN_OR_RETURN(EvalResult res,
                   r.driver->trainer().Evaluate(input, target, e.nonfinite()));
  v1::UpMessage up;
  auto* er = up.mutable_eval();
  er->set_batch(e.batch());
  er->set_block(r.block);
  er->set_has_head(!res.loss.empty());
  if (!res.loss.empty()) {
    er->set_loss_sum(res.loss[0]);
    er->set_correct(res.correct[0]);
  }
  er->set_count(res.count);
  SendUp(std::move(up));
  if (r.block + 1 < r.num_blocks) {
    v1::DownMessage down;
    down.mutable_header()->set_run_id(r.run_id);
    down.mutable_header()->set_generation(r.generation);
    down.mutable_header()->mutable_route()->set_block(r.block + 1);
    down.mutable_eval()->set_batch(e.batch());
    down.mutable_eval()->set_nonfinite(res.output_nonfinite);
    EncodeTensor(res.output, down.mutable_eval()->mutable_input());
    *down.mutable_eval()->mutable_target() = e.target();
    SendDown(std::move(down));
  }
  return absl::OkStatus();
}

void WorkerCore::HandleUp(uint64_t link_id, v1::UpMessage msg) {
  if (!run_ || run_->link_id != link_id) return;  // an old run's link
  Run& r = *run_;
  r.metrics->received_up_bytes->Increment(msg.ByteSizeLong());
  if (msg.kind_case() != v1::UpMessage::kUpward) {
    SendUp(std::move(msg));  // step reports, eval results, failures
    return;
  }
  bool own_failure = false;
  absl::Status s = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(UpwardMsg up, DecodeUpward(msg.upward(), options_.limits));
    for (size_t i = 0; i < up.grads.size(); ++i) {
      const std::string what =
          absl::StrCat("block ", r.block, " step ", up.step, " micro-batch ",
                       up.mb, " gradient ", i, " from block ", r.block + 1);
      RETURN_IF_ERROR(ExpectTensor(up.grads[i], torch::kFloat32,
                                   WithBatch(r.mb_size, r.output_shape), what));
      RETURN_IF_ERROR(r.CheckFinite(up.grads[i], what));
    }
    const int64_t before = r.driver->trainer().nonfinite_count();
    absl::Status st = r.driver->OnUpward(std::move(up));
    r.SyncNonFinite();
    if (!st.ok() && r.driver->trainer().nonfinite_count() > before) {
      own_failure = true;  // this block's policy stopped the run
    }
    return st;
  }();
  if (!s.ok() && own_failure) {
    FailRun(r.block, "", s);
  } else if (!s.ok()) {
    r.metrics->rejected->Increment();
    FailRun(r.block + 1, r.next_address, s);
  }
}

void WorkerCore::HandleLinkDone(uint64_t link_id, absl::Status status) {
  if (!run_ || run_->link_id != link_id || run_->failed) return;
  if (status.ok()) {
    status = absl::UnavailableError("stream to the next block ended");
  }
  FailRun(run_->block + 1, run_->next_address, status);
}

void WorkerCore::FailRun(int block, const std::string& address,
                         const absl::Status& s) {
  if (run_) run_->failed = true;
  v1::UpMessage up;
  auto* f = up.mutable_failure();
  f->set_block(block);
  f->set_address(address);
  f->set_code(static_cast<int>(s.code()));
  f->set_message(std::string(s.message()));
  SendUp(std::move(up));
  std::shared_ptr<UpstreamSink> sink;
  {
    std::lock_guard<std::mutex> l(mu_);
    sink = sink_;
  }
  if (sink) {
    sink->Finish(absl::Status(
        s.code(), absl::StrCat("block ", block,
                               address.empty() ? "" : " (" + address + ")",
                               ": ", s.message())));
  }
}

void WorkerCore::SendUp(v1::UpMessage msg) {
  std::shared_ptr<UpstreamSink> sink;
  {
    std::lock_guard<std::mutex> l(mu_);
    sink = sink_;
  }
  if (!sink) return;  // nobody upstream: the coordinator will notice
  if (run_) run_->metrics->sent_up_bytes->Increment(msg.ByteSizeLong());
  sink->Send(std::move(msg));
}

void WorkerCore::SendDown(v1::DownMessage msg) {
  Run& r = *run_;
  if (!r.link) {
    const uint64_t id = next_link_id_++;
    r.link_id = id;
    r.link = link_factory_(
        r.next_address, r.max_message_bytes,
        [this, id](v1::UpMessage m) {
          Post([this, id, m = std::move(m)]() mutable {
            HandleUp(id, std::move(m));
          });
        },
        [this, id](absl::Status s) {
          Post([this, id, s] { HandleLinkDone(id, s); });
        });
  }
  r.metrics->sent_down_bytes->Increment(msg.ByteSizeLong());
  r.link->Send(std::move(msg));
}

}  // namespace interlock
