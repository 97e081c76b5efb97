#include "coordinator/chain_links.h"

#include <openssl/rand.h>

#include <algorithm>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "plan/replica_routes.h"
#include "plan/status_macros.h"
#include "rpc/status.h"
#include "services/failure.h"
#include "services/logging.h"
#include "services/models.h"
#include "services/sha256.h"
#include "services/wire.h"

namespace interlock {

namespace {

// Largest block state accepted from a worker.
constexpr int64_t kMaxStateBytes = int64_t{16} << 30;

std::string NewRunId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x", rd(), rd());
}

}  // namespace

ChainLinks::ChainLinks(const v1::RunConfig& config, const DataShape& shape,
                       const ClusterOptions& options, const WireCodec& codec,
                       EventQueue* events)
    : config_(config),
      shape_(shape),
      options_(options),
      codec_(codec),
      events_(events) {}

absl::Status ChainLinks::Init(const Topology& workers) {
  const int k_blocks = static_cast<int>(workers.size());
  ASSIGN_OR_RETURN(max_bytes_, codec_.MaxMessageBytes(config_, shape_));
  // A scripted model's files, each block's sent to its workers before
  // Configure (PutModelFile, in chunks: no message holds a whole file).
  model_files_.clear();
  for (int k = 0; k < k_blocks; ++k) {
    ASSIGN_OR_RETURN(auto files, ScriptedFilesOfBlock(config_.model(), k));
    model_files_.push_back(std::move(files));
  }
  run_id_ = NewRunId();
  generation_ = 1;
  generation_step_ = 0;
  SetTopology(workers);
  steps_done_.assign(k_blocks, 0);
  return absl::OkStatus();
}

std::shared_ptr<WorkerClient> ChainLinks::NewClient(
    const std::string& label, const std::string& address) const {
  return std::make_shared<WorkerClient>(label, address, max_bytes_,
                                        options_.security);
}

void ChainLinks::SetTopology(const Topology& t) {
  workers_ = t;
  replicas_ = ReplicaCounts(t);
  routes_step_ = -1;
  peers_.clear();
  for (int k = 0; k < static_cast<int>(t.size()); ++k) {
    peers_.emplace_back();
    for (int r = 0; r < replicas_[k]; ++r) {
      peers_[k].push_back(std::make_unique<WorkerClient>(
          replicas_[k] > 1 ? absl::StrCat("worker ", k, ".", r)
                           : absl::StrCat("worker ", k),
          t[k][r], max_bytes_, options_.security));
    }
  }
}

int ChainLinks::num_workers() const {
  int n = 0;
  for (int r : replicas_) n += r;
  return n;
}

absl::Status ChainLinks::Connect(absl::Duration timeout, bool parallel,
                                 const std::set<std::string>& restore,
                                 int64_t restore_step) {
  const absl::Time deadline = absl::Now() + timeout;
  const int k_blocks = num_blocks();
  for (int k = 0; k < k_blocks; ++k) {
    for (auto& peer : peers_[k]) {
      if (!peer->WaitForConnected(deadline)) {
        return absl::UnavailableError(
            absl::StrCat(peer->label(), ": not reachable within ",
                         absl::FormatDuration(timeout)));
      }
    }
    WorkerState(k, true);
  }
  // Last block first, so each worker's downstream is ready when it opens
  // its link.
  std::vector<std::pair<int, int>> order;
  for (int k = k_blocks - 1; k >= 0; --k) {
    for (int r = 0; r < replicas_[k]; ++r) order.emplace_back(k, r);
  }
  // Fresh keys: a stream of an earlier generation, or of anyone who learnt
  // the run's id, cannot take over a link of this one.
  stream_keys_.assign(k_blocks, std::string(16, '\0'));
  for (auto& key : stream_keys_) {
    if (RAND_bytes(reinterpret_cast<unsigned char*>(key.data()),
                   static_cast<int>(key.size())) != 1) {
      return absl::InternalError("no random bytes for the stream keys");
    }
  }
  std::vector<absl::Status> results(order.size());
  instances_.assign(k_blocks, {});
  for (int k = 0; k < k_blocks; ++k) instances_[k].assign(replicas_[k], "");
  auto configure = [&](size_t i) {
    const auto [k, r] = order[i];
    v1::ConfigureRequest req;
    req.set_run_id(run_id_);
    req.set_generation(generation_);
    *req.mutable_config() = config_;
    req.set_block(k);
    req.set_num_blocks(k_blocks);
    if (k + 1 < k_blocks) {
      req.set_next_address(workers_[k + 1][0]);
      for (const auto& a : workers_[k + 1]) req.add_next_addresses(a);
    }
    req.set_replica(r);
    req.set_replicas(replicas_[k]);
    req.set_collective_address(collective_address_);
    req.set_snapshots(snapshots_);
    req.set_stream_key(stream_keys_[k]);
    if (k + 1 < k_blocks) req.set_next_stream_key(stream_keys_[k + 1]);
    EncodeShape(shape_, req.mutable_shape());
    req.set_max_message_bytes(max_bytes_);
    req.set_window(options_.window);
    if (restore.count(workers_[k][r])) req.set_restore_step(restore_step);
    // At the start, wait for a worker still coming up; in a recovery a
    // worker that is gone again fails the attempt at once (it is retried).
    // A scripted model's files go first, in chunks; Configure names them.
    for (const auto& f : model_files_[k]) {
      results[i] = peers_[k][r]->PutModelFile(
          f.name, f.sha256, f.bytes,
          absl::Now() + options_.rpc_deadline +
              absl::Seconds(static_cast<int64_t>(f.bytes.size() >> 20)),
          /*wait_for_ready=*/generation_ == 1);
      if (!results[i].ok()) return;
      v1::ModelFile* m = req.add_model_files();
      m->set_name(f.name);
      m->set_sha256(f.sha256);
    }
    auto configured =
        peers_[k][r]->Configure(req, absl::Now() + options_.rpc_deadline,
                                /*wait_for_ready=*/generation_ == 1);
    results[i] = configured.status();
    if (configured.ok()) instances_[k][r] = configured->instance_id();
    VLOG(1) << peers_[k][r]->label()
            << (results[i].ok() ? " configured" : " refused configure")
            << " for generation " << generation_
            << (req.has_restore_step() ? " from its own snapshot" : "")
            << (results[i].ok() ? "" : ": ") << results[i].message();
  };
  if (parallel) {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < order.size(); ++i) {
      threads.emplace_back(configure, i);
    }
    for (auto& t : threads) t.join();
  } else {
    for (size_t i = 0; i < order.size(); ++i) {
      configure(i);
      if (!results[i].ok()) break;
    }
  }
  for (const auto& st : results) RETURN_IF_ERROR(st);
  // Messages and the end of streams of an earlier attempt (before a
  // Recover) are ignored: only the current streams count.
  const int64_t epoch = ++stream_epoch_;
  {
    auto l = events_->Lock();
    streams_live_ = replicas_[0];
    closing_ = false;
    opened_ = 0;
    controls_live_ = num_workers();
    step_reports_.clear();
  }
  // A fresh deadline: configuring may have waited that long already (a
  // survivor held in its group's reduction until Gloo's timeout).
  RETURN_IF_ERROR(OpenControls(epoch, absl::Now() + timeout));
  streams_.clear();
  for (int r = 0; r < replicas_[0]; ++r) {
    StreamClient::Handlers h;
    h.on_message = [this, epoch](UpFrame m) {
      if (epoch == stream_epoch_) OnUp(std::move(m));
    };
    h.on_done = [this, epoch, r](const grpc::Status& s) {
      OnStreamDone(epoch, r, s);
    };
    streams_.push_back(peers_[0][r]->OpenStream(std::move(h)));
  }
  return absl::OkStatus();
}

// One control stream per worker; returns once every worker has taken its
// own, so that nothing it reports is lost.
absl::Status ChainLinks::OpenControls(int64_t epoch, absl::Time deadline) {
  v1::ControlRequest req;
  req.set_run_id(run_id_);
  req.set_generation(generation_);
  controls_.clear();
  for (int k = 0; k < num_blocks(); ++k) {
    for (int r = 0; r < replicas_[k]; ++r) {
      ControlClient::Handlers h;
      h.on_event = [this, epoch, k, r](v1::ControlEvent e) {
        if (epoch == stream_epoch_) OnControl(k, r, std::move(e));
      };
      h.on_done = [this, epoch, k, r](const grpc::Status& s) {
        OnControlDone(epoch, k, r, s);
      };
      controls_.push_back(peers_[k][r]->OpenControl(req, std::move(h)));
    }
  }
  auto l = events_->Lock();
  const int workers = num_workers();
  events_->WaitUntil(l, deadline, [&] {
    return opened_ == workers || !events_->ErrorLocked().ok();
  });
  if (!events_->ErrorLocked().ok()) return events_->ErrorLocked();
  if (opened_ < workers) {
    return absl::UnavailableError(
        absl::StrCat("only ", opened_, " of ", workers,
                     " workers opened their control stream in time"));
  }
  return absl::OkStatus();
}

// After a failure (`drain` false) the data stream is cancelled at once:
// every block goes back to a state it kept, so nothing in flight is wanted,
// and a replica of block 0 that hangs (stopped, not dead) would hold the
// half-close for the whole grace period.
void ChainLinks::Close(bool drain) {
  {
    auto l = events_->Lock();
    closing_ = true;
  }
  for (auto& s : streams_) {
    if (drain) {
      s->CloseWrites();
    } else {
      s->Cancel();
    }
  }
  for (auto& c : controls_) c->Cancel();
  auto l = events_->Lock();
  // The handlers point at these links: wait until gRPC is done with them.
  auto done = [&] {
    return (streams_.empty() || streams_live_ == 0) && controls_live_ == 0;
  };
  if (!events_->WaitUntil(l, absl::Now() + absl::Seconds(5), done)) {
    for (auto& s : streams_) s->Cancel();
    events_->WaitUntil(l, absl::Now() + absl::Seconds(60), done);
  }
  l.unlock();
  streams_.clear();
  controls_.clear();
}

void ChainLinks::ResetAttempt() {
  events_->Reset();
  auto l = events_->Lock();
  evals_.clear();
  step_reports_.clear();
  dead_.clear();
}

void ChainLinks::ResetProgress(int64_t step) {
  generation_step_ = step;
  auto l = events_->Lock();
  steps_done_.assign(num_blocks(), step);
}

void ChainLinks::NextGeneration() {
  ++generation_;
  if (options_.on_generation) options_.on_generation(run_id_, generation_);
}

void ChainLinks::Continue(const std::string& run_id, int64_t generation) {
  run_id_ = run_id;
  generation_ = generation;
  if (options_.on_generation) options_.on_generation(run_id_, generation_);
}

std::set<std::string> ChainLinks::Dead() {
  auto l = events_->Lock();
  return dead_;
}

int64_t ChainLinks::MinStepDone() {
  auto l = events_->Lock();
  return *std::min_element(steps_done_.begin(), steps_done_.end());
}

absl::Status ChainLinks::Submit(ForwardMsg msg) {
  {
    auto l = events_->Lock();
    if (!events_->ErrorLocked().ok()) return events_->ErrorLocked();
  }
  int replica = 0;
  if (Replicated(replicas_)) {
    if (routes_step_ != msg.step) {
      // The runner's (measured throughput) if they fit this topology, else
      // equal shares.
      routes_ = CheckRoutes(msg.routes, config_.training().microbatches(),
                            replicas_, "routes")
                        .ok()
                    ? msg.routes
                    : RouteStep(msg.step, config_.training().microbatches(),
                                replicas_);
      routes_step_ = msg.step;
    }
    msg.routes = routes_;
    replica = routes_[msg.mb * num_blocks()];
  }
  DownFrame down;
  SetHeader(&down.proto, replica);
  codec_.EncodeForward(msg, config_.training().microbatches(), &down);
  streams_[replica]->Send(down);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<HeadEval>> ChainLinks::Evaluate(
    const torch::Tensor& input, const torch::Tensor& target) {
  const int64_t id = next_eval_++;
  DownFrame down;
  SetHeader(&down.proto);
  codec_.EncodeEval({id, input, target, false}, &down);
  // Replicas hold the same parameters between steps: the first of each
  // block evaluates.
  streams_[0]->Send(down);
  auto l = events_->Lock();
  const size_t k = peers_.size();
  if (!events_->WaitUntil(l, absl::Now() + options_.stall_timeout, [&] {
        return !events_->ErrorLocked().ok() || evals_[id].size() == k;
      })) {
    return absl::DeadlineExceededError("evaluation: no answer from workers");
  }
  if (!events_->ErrorLocked().ok()) return events_->ErrorLocked();
  std::vector<HeadEval> out;
  std::vector<EvalReport> results = std::move(evals_[id]);
  evals_.erase(id);
  std::sort(results.begin(), results.end(),
            [](const auto& a, const auto& b) { return a.block < b.block; });
  for (const auto& r : results) {
    if (!r.has_head) continue;
    out.push_back({r.block, r.loss_sum, r.correct, r.count});
  }
  return out;
}

absl::StatusOr<std::vector<BlockState>> ChainLinks::FetchState() {
  std::vector<BlockState> out;
  for (size_t k = 0; k < peers_.size(); ++k) {
    v1::GetStateRequest req;
    req.set_run_id(run_id_);
    v1::GetStateResponse resp;
    // A block's parameters may exceed the largest message of its run.
    ASSIGN_OR_RETURN(
        resp, peers_[k][0]->GetState(req, absl::Now() + options_.rpc_deadline,
                                     kMaxStateBytes));
    // Replicas must end where the first does: anything else is a broken
    // reduction, and the run's result would depend on which one is read.
    for (size_t r = 1; r < peers_[k].size(); ++r) {
      ASSIGN_OR_RETURN(
          v1::GetStateResponse other,
          peers_[k][r]->GetState(req, absl::Now() + options_.rpc_deadline,
                                 kMaxStateBytes));
      RETURN_IF_ERROR(SameState(resp, other, *peers_[k][r]));
    }
    BlockState st;
    for (const auto* part : {&resp.block(), &resp.head()}) {
      for (const auto& nt : *part) {
        ASSIGN_OR_RETURN(torch::Tensor t, DecodeTensor(nt.tensor(), nt.name()));
        (part == &resp.block() ? st.block : st.head)
            .emplace_back(nt.name(), std::move(t));
      }
    }
    out.push_back(std::move(st));
  }
  return out;
}

absl::StatusOr<std::string> ChainLinks::SaveBlockState(int k) {
  v1::SaveStateRequest req;
  req.set_run_id(run_id_);
  req.set_generation(generation_);
  ASSIGN_OR_RETURN(
      BlockStateArchive state,
      peers_[k][0]->SaveState(req, k, absl::Now() + options_.rpc_deadline,
                              kMaxStateBytes));
  return std::move(state.bytes);
}

absl::Status ChainLinks::LoadStateInto(int k, int r, int64_t step,
                                       const std::string& state) {
  BlockStateArchive header;
  header.run_id = run_id_;
  header.generation = generation_;
  header.block = k;
  header.step = step;
  header.sha256 = Sha256Hex(state.data(), state.size());
  return peers_[k][r]->LoadState(header, state,
                                 absl::Now() + options_.rpc_deadline);
}

absl::Status ChainLinks::SameState(const v1::GetStateResponse& a,
                                   const v1::GetStateResponse& b,
                                   const WorkerClient& who) {
  auto differs = [&](const std::string& what) {
    return absl::InternalError(
        absl::StrCat(who.label(), ": ", what, " differs from replica 0's"));
  };
  if (a.step() != b.step()) return differs("the step");
  for (const auto& [pa, pb] : {std::make_pair(&a.block(), &b.block()),
                               std::make_pair(&a.head(), &b.head())}) {
    if (pa->size() != pb->size()) return differs("the tensor count");
    for (int i = 0; i < pa->size(); ++i) {
      const auto& x = (*pa)[i];
      const auto& y = (*pb)[i];
      if (x.name() != y.name() ||
          x.tensor().SerializeAsString() != y.tensor().SerializeAsString()) {
        return differs(x.name());
      }
    }
  }
  return absl::OkStatus();
}

void ChainLinks::WorkerState(int block, bool up) {
  if (options_.on_worker_state) options_.on_worker_state(block, up);
}

void ChainLinks::SetHeader(v1::DownMessage* m, int replica) {
  m->mutable_header()->set_stream_key(stream_keys_[0]);
  m->mutable_header()->set_run_id(run_id_);
  m->mutable_header()->set_generation(generation_);
  m->mutable_header()->mutable_route()->set_block(0);
  m->mutable_header()->mutable_route()->set_replica(replica);
}

void ChainLinks::OnUp(const UpFrame& m) {
  if (m.proto.kind_case() != v1::UpMessage::kUpward) {
    events_->Fail(absl::InternalError("worker 0: empty upward message"));
    return;
  }
  auto up = codec_.DecodeUpward(m);
  if (!up.ok()) {
    events_->Fail(up.status());
    return;
  }
  events_->Push(std::move(*up));
}

// A replica's step report. The block's step is done when every replica has
// taken it; they reduced together, so they applied the same.
void ChainLinks::OnStepDone(int k, const StepDone& d) {
  auto l = events_->Lock();
  if (replicas_[k] == 1) {
    steps_done_[k] = std::max(steps_done_[k], d.step + 1);
    events_->PushLocked(d);
    return;
  }
  auto& reports = step_reports_[{k, d.step}];
  reports.push_back(d);
  if (static_cast<int>(reports.size()) < replicas_[k]) return;
  StepDone out = reports[0];
  for (const auto& o : reports) {
    if (o.skipped != out.skipped || o.microbatches != out.microbatches) {
      events_->FailLocked(absl::InternalError(
          absl::StrCat("block ", k, " step ", d.step,
                       ": its replicas applied different updates")));
    }
    out.timing.seconds = std::max(out.timing.seconds, o.timing.seconds);
  }
  step_reports_.erase({k, d.step});
  steps_done_[k] = std::max(steps_done_[k], d.step + 1);
  events_->PushLocked(out);
}

void ChainLinks::OnControl(int k, int r, v1::ControlEvent e) {
  // What a worker reports is of its own block.
  int block = k;
  switch (e.kind_case()) {
    case v1::ControlEvent::kOpened: {
      auto l = events_->Lock();
      ++opened_;
      events_->NotifyLocked();
      return;
    }
    case v1::ControlEvent::kStepDone:
      block = e.step_done().block();
      if (block == k) OnStepDone(k, codec_.DecodeStepDone(e.step_done()));
      break;
    case v1::ControlEvent::kDuplicate: {
      const auto& d = e.duplicate();
      block = d.block();
      if (block == k) {
        events_->Push(DuplicateAck{d.block(), d.step(), d.microbatch()});
      }
      break;
    }
    case v1::ControlEvent::kEval: {
      block = e.eval().block();
      if (block != k) break;
      auto l = events_->Lock();
      evals_[e.eval().batch()].push_back(codec_.DecodeEvalResult(e.eval()));
      events_->NotifyLocked();
      return;
    }
    case v1::ControlEvent::kFailure: {
      auto l = events_->Lock();
      FailLocked(e.failure());
      return;
    }
    default:
      break;
  }
  if (block != k) {
    events_->Fail(absl::InternalError(
        absl::StrCat(peers_[k][r]->label(), ": reported for block ", block)));
  }
}

// A failure a worker reported: names the culprit it saw.
void ChainLinks::FailLocked(const v1::Failure& f) {
  if (!events_->ErrorLocked().ok()) return;
  if (f.block() >= 0 && f.block() < num_blocks()) WorkerState(f.block(), false);
  const std::string where =
      f.address().empty() ? "" : absl::StrCat(" (", f.address(), ")");
  absl::Status s(
      static_cast<absl::StatusCode>(f.code()),
      absl::StrCat("worker ", f.block(), where, " failed: ", f.message()));
  if (s.ok()) s = absl::UnknownError(f.message());
  events_->FailLocked(std::move(s));
}

void ChainLinks::OnStreamDone(int64_t epoch, int r, const grpc::Status& s) {
  // Everything under the lock, notify included: the links may be destroyed
  // as soon as a waiter sees streams_live_ reach 0.
  auto l = events_->Lock();
  if (epoch != stream_epoch_) return;
  --streams_live_;
  // Not a sign the worker died: it ends this stream itself when its block
  // fails (a peer replica gone); its control stream tells. A block that
  // stopped the chain says who failed on the status.
  if (auto f = ReportedFailure(FromGrpcStatus(s))) {
    FailLocked(*f);
  } else if ((!closing_ || !s.ok()) && events_->ErrorLocked().ok()) {
    if (!closing_) WorkerState(0, false);
    events_->FailLocked(absl::UnavailableError(absl::StrCat(
        peers_[0][r]->label(), ": stream ended: ",
        s.ok() ? std::string("closed by the worker") : s.error_message())));
  }
  events_->NotifyLocked();
}

void ChainLinks::OnControlDone(int64_t epoch, int k, int r,
                               const grpc::Status& s) {
  // Under the lock, notify included, as OnStreamDone.
  auto l = events_->Lock();
  if (epoch != stream_epoch_) return;
  --controls_live_;
  // First-hand: the worker itself went away (or refused the stream).
  if (!closing_) dead_.insert(workers_[k][r]);
  if (!closing_ && events_->ErrorLocked().ok()) {
    WorkerState(k, false);
    events_->FailLocked(absl::UnavailableError(absl::StrCat(
        peers_[k][r]->label(), ": control stream ended: ",
        s.ok() ? std::string("closed by the worker") : s.error_message())));
  }
  events_->NotifyLocked();
}

}  // namespace interlock
