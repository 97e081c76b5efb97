#include "worker/worker_core.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "services/collective.h"
#include "services/config.h"
#include "services/digest.h"
#include "services/models.h"
#include "services/runtime.h"
#include "services/scripted.h"
#include "services/wire_codec.h"
#include "worker/replica_group.h"
#include "worker/worker_run.h"

namespace interlock {

std::vector<int64_t> WithBatch(int64_t b, const std::vector<int64_t>& s) {
  std::vector<int64_t> out{b};
  out.insert(out.end(), s.begin(), s.end());
  return out;
}

std::string Quoted(const std::string& s) {
  constexpr size_t kMax = 64;
  return absl::StrCat("'", absl::CHexEscape(s.substr(0, kMax)), "'",
                      s.size() > kMax ? "..." : "");
}

void SetHeader(const std::string& run_id, int64_t generation, int block,
               v1::DownMessage* m) {
  m->mutable_header()->set_run_id(run_id);
  m->mutable_header()->set_generation(generation);
  m->mutable_header()->mutable_route()->set_block(block);
}

namespace {

// Far beyond any useful pipeline; keeps the bounds below from overflowing.
constexpr int kMaxWindow = 1 << 20;

}  // namespace

WorkerCore::WorkerCore(WorkerOptions options, WorkerMetrics* metrics,
                       LinkFactory link_factory)
    : options_(options),
      metrics_(metrics),
      link_factory_(std::move(link_factory)),
      host_([this] {
        BlockHost::Options o;
        o.on_idle = [this](double seconds) {
          if (run_ && run_->metrics) {
            run_->metrics->idle_seconds->Increment(seconds);
          }
        };
        return o;
      }()) {}

WorkerCore::~WorkerCore() { Shutdown(); }

void WorkerCore::Shutdown() {
  {
    std::lock_guard<std::mutex> l(group_mu_);
    if (live_group_.group) live_group_.group->Abandon();
  }
  host_.Stop(BlockHost::StopMode::kAbandon);
  if (run_) run_->CloseLinks();
  run_.reset();
  host_.set_driver(nullptr);
}

void WorkerCore::Configure(
    const v1::ConfigureRequest& request,
    std::function<void(absl::StatusOr<v1::ConfigureResponse>)> done) {
  {
    // Only the run's own coordinator knows its id (refusals never tell it).
    std::lock_guard<std::mutex> l(group_mu_);
    if (live_group_.group && request.run_id() == live_group_.run_id &&
        request.generation() > live_group_.generation) {
      live_group_.group->Abandon();
    }
  }
  host_.Post([this, request, done = std::move(done)] {
    auto response = DoConfigure(request);
    if (!response.ok()) {
      // A refused configuration is logged where it was refused.
      std::cerr << "interlock-worker: configure of block " << request.block()
                << " replica " << request.replica() << " refused: "
                << response.status() << std::endl;
    }
    done(std::move(response));
  });
}

absl::StatusOr<v1::ConfigureResponse> WorkerCore::DoConfigure(
    const v1::ConfigureRequest& req) {
  if (run_ && run_->run_id == req.run_id() &&
      run_->generation == req.generation() && run_->block == req.block() &&
      run_->replica == req.replica()) {
    return run_->response;  // a retried Configure of the same run
  }
  if (req.run_id().empty()) {
    return absl::InvalidArgumentError("configure: run_id is empty");
  }
  v1::RunConfig config = req.config();
  // A worker builds a scripted model from the files Configure carries
  // only, never from a path of the coordinator's machine.
  if (config.model().has_scripted()) {
    config.mutable_model()->mutable_scripted()->clear_path();
  }
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
  const int replicas = req.replicas() > 0 ? req.replicas() : 1;
  if (req.replica() < 0 || req.replica() >= replicas) {
    return absl::InvalidArgumentError(absl::StrCat(
        "configure: replica ", req.replica(), " outside [0, ", replicas, ")"));
  }
  // Every replica runs at least one micro-batch of each step: it must
  // reach the step's reduction, or its peers would wait for it.
  const int microbatches = config.training().microbatches();
  if (replicas > microbatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("configure: block ", req.block(), " has ", replicas,
                     " replicas but a step has only ", microbatches,
                     " micro-batches: at most one replica per micro-batch"));
  }
  if (replicas > 1 && req.collective_address().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "configure: ", replicas, " replicas need collective_address"));
  }
  std::vector<std::string> next(req.next_addresses().begin(),
                                req.next_addresses().end());
  if (next.empty() && !req.next_address().empty()) {
    next.push_back(req.next_address());
  }
  if (!req.next_address().empty() && req.next_address() != next[0]) {
    return absl::InvalidArgumentError(
        "configure: next_address is not the first of next_addresses");
  }
  if (req.block() + 1 < k_blocks && next.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("configure: block ", req.block(), " needs next_address"));
  }
  if (static_cast<int>(next.size()) > microbatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "configure: ", next.size(), " replicas of block ", req.block() + 1,
        " but a step has only ", microbatches, " micro-batches"));
  }
  for (const auto& a : next) {
    if (a.empty()) {
      return absl::InvalidArgumentError(
          "configure: an empty address in next_addresses");
    }
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
  // A membership change or fail-over: the block continues from its own
  // snapshot instead of being sent state it already has. Copied, not
  // taken: this Configure may still fail below.
  BlockStateRecord restored;
  if (req.has_restore_step()) {
    const Snapshots& s = snapshots_;
    if (s.run_id != req.run_id() || s.block != req.block() ||
        s.generation >= req.generation()) {
      // Not naming what it does keep: the caller may not know that run.
      return absl::FailedPreconditionError(
          absl::StrCat("configure: restore_step ", req.restore_step(),
                       ", but this worker keeps no snapshots of block ",
                       req.block(), " of run ", Quoted(req.run_id()),
                       " before generation ", req.generation()));
    }
    auto it = s.by_step.find(req.restore_step());
    if (it == s.by_step.end()) {
      return absl::NotFoundError(absl::StrCat(
          "configure: block ", req.block(), " keeps no snapshot at step ",
          req.restore_step(),
          s.by_step.empty()
              ? std::string(" (it keeps none)")
              : absl::StrCat(" (it keeps steps ", s.by_step.begin()->first,
                             " to ", s.by_step.rbegin()->first, ")")));
    }
    restored = it->second;
  }

  // A new run replaces the old one: its streams end.
  if (run_) {
    run_->CloseLinks();
    std::map<int, std::shared_ptr<UpstreamSink>> old;
    std::shared_ptr<ControlSink> old_control;
    {
      std::lock_guard<std::mutex> l(sink_mu_);
      old = sinks_;
      old_control = std::move(control_);
    }
    const absl::Status ended = absl::AbortedError(absl::StrCat(
        "block ", run_->block, " reconfigured for run ", req.run_id()));
    for (auto& [from, sink] : old) sink->Finish(ended);
    if (old_control) old_control->Finish(ended);
    run_.reset();
    host_.set_driver(nullptr);
  }
  {
    std::lock_guard<std::mutex> l(group_mu_);
    live_group_ = LiveGroup();
  }

  ConfigureThreads(config.training().threads_per_block());
  // A scripted model's units come with the request, never from a path.
  std::vector<ScriptedFile> files;
  for (const auto& f : req.model_files()) {
    files.push_back({f.name(), f.sha256(), f.data()});
  }
  RETURN_IF_ERROR(
      HoldScriptedFiles(std::move(files), options_.max_message_bytes));
  ASSIGN_OR_RETURN(
      auto trainer,
      BlockTrainer::Create(config, shape, req.block(), options_.device));
  ASSIGN_OR_RETURN(WireCodec codec, WireCodec::ForRun(config));
  auto run = std::make_unique<Run>(std::move(codec));
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
  run->replica = req.replica();
  run->replicas = replicas;
  run->next_addresses = std::move(next);
  run->snapshots = req.snapshots();
  run->max_message_bytes = req.max_message_bytes();
  run->sample_shape =
      req.block() == 0 ? SampleShape(shape) : outputs[req.block() - 1];
  run->output_shape = outputs[req.block()];
  run->target_shape = TargetShape(shape);
  run->input_dtype =
      req.block() == 0 && shape.is_text ? torch::kInt64 : torch::kFloat32;
  run->metrics = &metrics_->ForBlock(
      req.block(), req.replica(), std::string(run->codec.activations().name()),
      std::string(run->codec.gradients().name()));
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
    const int to =
        m.routes.empty() ? 0 : m.routes[m.mb * r->num_blocks + r->block + 1];
    DownFrame msg;
    SetHeader(r->run_id, r->generation, r->block + 1, &msg.proto);
    msg.proto.mutable_header()->mutable_route()->set_replica(to);
    msg.proto.mutable_header()->set_from_replica(r->replica);
    r->codec.EncodeForward(m, r->microbatches, &msg);
    SendDown(to, std::move(msg));
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
        case Phase::kParamPass:  // calibration, not training work
        case Phase::kSharedPass:
        case Phase::kInputPass:
          break;
      }
    }
    for (const auto& rep : m.reports) {
      if (rep.block == r->block) r->metrics->head_loss->Set(rep.loss);
    }
    UpFrame msg;
    r->codec.EncodeUpward(m, &msg);
    SendUp(m.step, m.mb, m.final, std::move(msg));
  };
  cb.step_done = [this, r](StepDone d) {
    if (r->snapshots) TakeSnapshot(d.step + 1);
    r->metrics->step->Set(static_cast<double>(d.step + 1));
    r->metrics->optimizer_seconds->Observe(d.timing.seconds);
    if (r->replicas > 1) {
      r->metrics->reduction_seconds->Observe(
          r->driver->trainer().last_reduction_seconds());
      r->metrics->reduction_wait_seconds->Observe(
          r->driver->trainer().last_reduction_wait_seconds());
    }
    v1::ControlEvent msg;
    r->codec.EncodeStepDone(d, msg.mutable_step_done());
    SendControl(std::move(msg));
  };
  if (replicas > 1) {
    // One group per run, generation and block.
    ASSIGN_OR_RETURN(
        auto group,
        ReplicaGroup(
            req.collective_address(),
            absl::StrCat(req.run_id(), "/", req.generation(), "/", req.block()),
            req.replica(), replicas, options_.collective_host));
    {
      std::lock_guard<std::mutex> l(group_mu_);
      live_group_ = LiveGroup{req.run_id(), req.generation(), group};
    }
    trainer->SetReplicas(std::move(group), config.training().reduction());
  }
  host_.set_driver(std::make_unique<BlockDriver>(std::move(trainer), cb,
                                                 /*first_step=*/0,
                                                 req.replica()));
  run->driver = host_.driver();
  int64_t step = 0;
  if (req.has_restore_step()) {
    RETURN_IF_ERROR(run->driver->LoadRecord(restored, req.restore_step()));
    step = run->driver->current_step();
  }
  run->metrics->configured->Set(1);
  run->metrics->step->Set(static_cast<double>(step));
  snapshots_ = Snapshots();
  snapshots_.run_id = run->run_id;
  snapshots_.generation = run->generation;
  snapshots_.block = run->block;
  // Blocks are at most max_steps_ahead apart (see above), so the last
  // boundary every block passed is never older than that.
  snapshots_.keep = run->max_steps_ahead + 1;
  run_ = std::move(run);
  if (run_->snapshots) {
    if (req.has_restore_step()) {
      // The snapshot just loaded is the state at this boundary already.
      snapshots_.by_step[step] = std::move(restored);
    } else {
      TakeSnapshot(step);
    }
  }
  if (on_configured_) on_configured_(true);
  return run_->response;
}

void WorkerCore::GetState(
    const v1::GetStateRequest& request,
    std::function<void(absl::StatusOr<v1::GetStateResponse>)> done) {
  host_.Post([this, request, done = std::move(done)] {
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

void WorkerCore::TakeSnapshot(int64_t step) {
  auto& kept = snapshots_.by_step;
  // The oldest snapshot's tensors take the new one when it is the one to
  // go: a snapshot per step then allocates nothing.
  BlockStateRecord record;
  if (!kept.empty() && static_cast<int64_t>(kept.size()) >= snapshots_.keep) {
    record = std::move(kept.begin()->second);
    kept.erase(kept.begin());
  }
  // A snapshot that cannot be taken is only missing: a recovery that needs
  // it falls back to the checkpoint.
  if (!run_->driver->CopyStateAtBoundary(&record).ok()) return;
  kept[step] = std::move(record);
  while (static_cast<int64_t>(kept.size()) > snapshots_.keep) {
    kept.erase(kept.begin());
  }
}

void WorkerCore::SaveState(
    const v1::SaveStateRequest& request,
    std::function<void(absl::StatusOr<BlockStateArchive>)> done) {
  host_.Post([this, request, done = std::move(done)] {
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
  host_.Post([this, run_id = header.run_id, generation = header.generation,
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
  host_.Post([this, state = std::move(state),
              done = std::move(done)]() mutable {
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
      if (run_->snapshots) {
        snapshots_.by_step.clear();
        TakeSnapshot(step);
      }
      run_->metrics->step->Set(static_cast<double>(step));
      return step;
    }();
    // The archive is freed before the caller hears back: the service
    // admits the next LoadState then.
    std::string().swap(state.bytes);
    done(std::move(result));
  });
}

}  // namespace interlock
