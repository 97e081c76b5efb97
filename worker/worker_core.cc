#include "worker/worker_core.h"

#include <openssl/rand.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "services/collective.h"
#include "services/digest.h"
#include "services/logging.h"
#include "services/runtime.h"
#include "services/scripted.h"
#include "services/wire_codec.h"
#include "worker/block_run_spec.h"
#include "worker/replica_group.h"
#include "worker/worker_run.h"

namespace interlock {

bool SameKey(const std::string& given, const std::string& expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    diff |= static_cast<unsigned char>(expected[i]) ^
            static_cast<unsigned char>(i < given.size() ? given[i] : 0);
  }
  return diff == 0;
}

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
               const std::string& stream_key, v1::DownMessage* m) {
  m->mutable_header()->set_stream_key(stream_key);
  m->mutable_header()->set_run_id(run_id);
  m->mutable_header()->set_generation(generation);
  m->mutable_header()->mutable_route()->set_block(block);
}

namespace {

std::string NewInstanceId() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
    // Never expected; an id from the clock and the process still tells
    // processes apart.
    return absl::StrCat("t", absl::ToUnixNanos(absl::Now()), "p", getpid());
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

}  // namespace

WorkerCore::WorkerCore(WorkerOptions options, WorkerMetrics* metrics,
                       LinkFactory link_factory)
    : options_(options),
      instance_id_(NewInstanceId()),
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
      // A refused configuration is logged where it was refused. Not the
      // run's id: a caller who does not know the run may have sent it.
      LOG(WARNING) << "configure of block " << request.block() << " replica "
                   << request.replica() << " generation "
                   << request.generation() << " refused: " << response.status();
    } else {
      VLOG(1) << "configured block " << request.block() << " replica "
              << request.replica() << " of run " << request.run_id()
              << " generation " << request.generation();
    }
    done(std::move(response));
  });
}

namespace {

// Whether a Release names this run and a newer generation and carries the
// stream key of the generation held (compared in constant time).
bool ProvesRelease(const v1::ReleaseRequest& request, const std::string& run_id,
                   int64_t generation, const std::string& key) {
  return request.run_id() == run_id && request.generation() > generation &&
         SameKey(request.stream_key(), key);
}

}  // namespace

void WorkerCore::Release(const v1::ReleaseRequest& request,
                         std::function<void(absl::Status)> done) {
  {
    // A replica woken inside a reduction its group gave up on would wait
    // there until Gloo's timeout: let it go first (as Configure does).
    std::lock_guard<std::mutex> l(group_mu_);
    if (live_group_.group &&
        ProvesRelease(request, live_group_.run_id, live_group_.generation,
                      live_group_.stream_key)) {
      live_group_.group->Abandon();
    }
  }
  host_.Post([this, request, done = std::move(done)] {
    if (!run_ || !ProvesRelease(request, run_->run_id, run_->generation,
                                run_->stream_key)) {
      // Tells nothing of the configured run.
      done(absl::FailedPreconditionError(
          "release: not the run and generation this worker holds"));
      return;
    }
    LOG(WARNING) << "dropped from run " << request.run_id() << ": block "
                 << run_->block << " replica " << run_->replica
                 << " was left out of generation " << request.generation();
    EndRun(absl::AbortedError(absl::StrCat("dropped from run ",
                                           request.run_id(), " (generation ",
                                           request.generation(), ")")));
    if (on_configured_) on_configured_(false);
    if (on_released_) on_released_(request.run_id(), request.generation());
    done(absl::OkStatus());
  });
}

bool WorkerCore::HoldsModelFile(const std::string& sha256) const {
  return HoldsScriptedFile(sha256);
}

absl::Status WorkerCore::StageModelFile(ScriptedFile file) {
  const std::string name = file.name;
  absl::Status s = StageScriptedFile(std::move(file), options_.max_model_bytes);
  if (!s.ok()) LOG(WARNING) << "refused put_model_file " << name << ": " << s;
  return s;
}

absl::StatusOr<v1::ConfigureResponse> WorkerCore::DoConfigure(
    const v1::ConfigureRequest& req) {
  // A retried Configure of the same run: the same generation and stream
  // key (drawn afresh for every configuration, so a coordinator started
  // again that reuses a generation is not taken for a retry).
  if (run_ && run_->run_id == req.run_id() &&
      run_->generation == req.generation() && run_->block == req.block() &&
      run_->replica == req.replica() && run_->stream_key == req.stream_key()) {
    return run_->response;
  }
  // Everything that can refuse the request is decided before the run this
  // worker has is let go.
  ASSIGN_OR_RETURN(BlockRunSpec spec,
                   ResolveBlockRun(req, options_.max_message_bytes));
  BlockStateRecord restored;
  if (spec.restore_step) {
    ASSIGN_OR_RETURN(restored, snapshots_.Find(spec.run_id, spec.generation,
                                               spec.block, *spec.restore_step));
  }
  EndRun(
      absl::AbortedError(absl::StrCat("block ", run_ ? run_->block : spec.block,
                                      " reconfigured for run ", spec.run_id)));

  ConfigureThreads(spec.config.training().threads_per_block());
  RETURN_IF_ERROR(HoldScriptedFiles(std::exchange(spec.model_files, {}),
                                    options_.max_model_bytes));
  ASSIGN_OR_RETURN(auto trainer,
                   BlockTrainer::Create(spec.config, spec.shape, spec.block,
                                        options_.device));
  ASSIGN_OR_RETURN(WireCodec codec, WireCodec::ForRun(spec.config));
  auto run = std::make_unique<Run>(std::move(spec), std::move(codec));
  run->metrics = &metrics_->ForBlock(
      run->block, run->replica, std::string(run->codec.activations().name()),
      std::string(run->codec.gradients().name()));
  Describe(*trainer, run.get());
  if (run->replicas > 1) {
    // One group per run, generation and block.
    ASSIGN_OR_RETURN(
        auto group,
        ReplicaGroup(
            run->collective_address, options_.store_client,
            absl::StrCat(run->run_id, "/", run->generation, "/", run->block),
            run->replica, run->replicas, options_.collective_host));
    {
      std::lock_guard<std::mutex> l(group_mu_);
      live_group_ =
          LiveGroup{run->run_id, run->generation, run->stream_key, group};
    }
    trainer->SetReplicas(std::move(group), run->config.training().reduction());
  }
  host_.set_driver(std::make_unique<BlockDriver>(
      std::move(trainer), DriverCallbacks(run.get()), /*first_step=*/0,
      run->replica));
  run->driver = host_.driver();
  if (run->restore_step) {
    RETURN_IF_ERROR(run->driver->LoadRecord(restored, *run->restore_step));
  }
  const int64_t step = run->driver->current_step();
  run->metrics->configured->Set(1);
  run->metrics->step->Set(static_cast<double>(step));
  // Blocks are at most max_steps_ahead apart (block_run_spec.cc), so the
  // last boundary every block passed is never older than that; the
  // coordinator's journal names one up to two steps older still (its
  // virtual clock places steps up to two behind).
  snapshots_.Reset(run->run_id, run->generation, run->block,
                   run->max_steps_ahead + 3);
  run_ = std::move(run);
  if (run_->snapshots) {
    if (run_->restore_step) {
      // The snapshot just loaded is the state at this boundary already.
      snapshots_.Put(step, std::move(restored));
    } else {
      snapshots_.Take(*run_->driver, step);
    }
  }
  if (on_configured_) on_configured_(true);
  return run_->response;
}

void WorkerCore::EndRun(const absl::Status& ended) {
  {
    std::lock_guard<std::mutex> l(group_mu_);
    live_group_ = LiveGroup();
  }
  if (!run_) return;
  if (run_->metrics) run_->metrics->configured->Set(0);
  run_->CloseLinks();
  std::map<int, std::shared_ptr<UpstreamSink>> old;
  std::shared_ptr<ControlSink> old_control;
  {
    std::lock_guard<std::mutex> l(sink_mu_);
    old = sinks_;
    old_control = std::move(control_);
  }
  for (auto& [from, sink] : old) sink->Finish(ended);
  if (old_control) old_control->Finish(ended);
  run_.reset();
  host_.set_driver(nullptr);
}

void WorkerCore::Describe(BlockTrainer& trainer, Run* run) {
  int64_t params = 0;
  int64_t tensor_bytes = 0;
  int64_t entries = 0;
  for (const auto& [name, t] : trainer.NamedState()) {
    params += t.numel();
    tensor_bytes += t.numel() * static_cast<int64_t>(t.element_size());
    ++entries;
  }
  run->max_state_bytes =
      MaxStateBytes(tensor_bytes, entries, options_.max_state_bytes);
  run->response.set_parameters(params);
  run->response.set_instance_id(instance_id_);
  for (int64_t d : WithBatch(run->mb_size, run->sample_shape)) {
    run->response.add_input_shape(d);
  }
  for (int64_t d : WithBatch(run->mb_size, run->output_shape)) {
    run->response.add_output_shape(d);
  }
}

BlockDriver::Callbacks WorkerCore::DriverCallbacks(Run* r) {
  BlockDriver::Callbacks cb;
  cb.send_down = [this, r](ForwardMsg m) {
    const int to =
        m.routes.empty() ? 0 : m.routes[m.mb * r->num_blocks + r->block + 1];
    DownFrame msg;
    SetHeader(r->run_id, r->generation, r->block + 1, r->next_stream_key,
              &msg.proto);
    msg.proto.mutable_header()->mutable_route()->set_replica(to);
    msg.proto.mutable_header()->set_from_replica(r->replica);
    r->codec.EncodeForward(m, r->microbatches, &msg);
    SendDown(to, std::move(msg));
  };
  cb.send_up = [this, r](UpwardMsg m) {
    ObserveUpward(m, r->block, r->metrics);
    UpFrame msg;
    r->codec.EncodeUpward(m, &msg);
    SendUp(m.step, m.mb, m.final, std::move(msg));
  };
  cb.step_done = [this, r](StepDone d) {
    if (r->snapshots) snapshots_.Take(*r->driver, d.step + 1);
    const bool replicated = r->replicas > 1;
    const BlockTrainer& t = r->driver->trainer();
    ObserveStepDone(d, replicated ? t.last_reduction_seconds() : -1,
                    replicated ? t.last_reduction_wait_seconds() : -1,
                    r->metrics);
    v1::ControlEvent msg;
    r->codec.EncodeStepDone(d, msg.mutable_step_done());
    SendControl(std::move(msg));
  };
  return cb;
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
        snapshots_.Clear();
        snapshots_.Take(*run_->driver, step);
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
