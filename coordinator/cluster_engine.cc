#include "coordinator/cluster_engine.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "collective/gloo_collective.h"
#include "plan/replica_routes.h"
#include "plan/status_macros.h"
#include "proto/worker.grpc.pb.h"
#include "rpc/status.h"
#include "rpc/worker_client.h"
#include "services/failure.h"
#include "services/models.h"
#include "services/scripted.h"
#include "services/sha256.h"
#include "services/wire.h"
#include "services/wire_codec.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

// Largest block state accepted from a worker.
constexpr int64_t kMaxStateBytes = int64_t{16} << 30;

std::string NewRunId() {
  std::random_device rd;
  return absl::StrFormat("%08x%08x", rd(), rd());
}

class ClusterEngine : public Engine {
 public:
  ClusterEngine(const v1::RunConfig& config, const DataShape& shape,
                const ClusterOptions& options, WireCodec codec)
      : config_(config),
        shape_(shape),
        options_(options),
        codec_(std::move(codec)) {}

  ~ClusterEngine() override { Shutdown(); }

  absl::Status Init() {
    ASSIGN_OR_RETURN(const int k_blocks, NumBlocks(config_.model()));
    if (static_cast<int>(options_.workers.size()) != k_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--workers: ", options_.workers.size(),
          " blocks of addresses for a model of ", k_blocks, " blocks"));
    }
    RETURN_IF_ERROR(CheckReplicas(ReplicaCounts(options_.workers), k_blocks,
                                  config_.training().microbatches(),
                                  "--workers"));
    ASSIGN_OR_RETURN(max_bytes_, codec_.MaxMessageBytes(config_, shape_));
    // A scripted model's files travel with Configure, each block's to its
    // workers, so the run's messages must hold the largest set.
    model_files_.clear();
    for (int k = 0; k < k_blocks; ++k) {
      ASSIGN_OR_RETURN(auto files, ScriptedFilesOfBlock(config_.model(), k));
      int64_t bytes = 0;
      for (const auto& f : files) bytes += f.bytes.size() + 256;
      max_bytes_ = std::max(max_bytes_, bytes + (int64_t{1} << 20));
      model_files_.push_back(std::move(files));
    }
    run_id_ = NewRunId();
    SetTopology(options_.workers);
    steps_done_.assign(k_blocks, 0);
    elastic_ = options_.membership != nullptr || Replicated(replicas_);
    if (elastic_) {
      // The rendezvous of every block's reduction group; the groups
      // themselves connect worker to worker.
      RETURN_IF_ERROR(StartStore());
    }
    RETURN_IF_ERROR(Connect(options_.connect_timeout, /*parallel=*/false));
    if (options_.membership) {
      options_.membership->SetTopology(run_id_, workers_, generation_);
    }
    return absl::OkStatus();
  }

  // The topology in force: its clients, one per worker.
  void SetTopology(const Topology& t) {
    workers_ = t;
    replicas_ = ReplicaCounts(t);
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

  int num_workers() const {
    int n = 0;
    for (int r : replicas_) n += r;
    return n;
  }

  // Waits for every worker, configures the chain under the current
  // generation and opens the stream into block 0. `parallel`: configure
  // every worker at once (after a failure, a survivor blocked in its
  // group's reduction is freed only when its peers leave that group).
  // `restore`: workers that continue from their own snapshot at the
  // boundary before `restore_step` (ConfigureRequest.restore_step).
  absl::Status Connect(absl::Duration timeout, bool parallel,
                       const std::set<std::string>& restore = {},
                       int64_t restore_step = 0) {
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
    std::vector<absl::Status> results(order.size());
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
      req.set_snapshots(elastic_);
      EncodeShape(shape_, req.mutable_shape());
      req.set_max_message_bytes(max_bytes_);
      req.set_window(options_.window);
      if (restore.count(workers_[k][r])) req.set_restore_step(restore_step);
      for (const auto& f : model_files_[k]) {
        v1::ModelFile* m = req.add_model_files();
        m->set_name(f.name);
        m->set_sha256(f.sha256);
        m->set_data(f.bytes);
      }
      // At the start, wait for a worker still coming up; in a recovery a
      // worker that is gone again fails the attempt at once (it is
      // retried).
      results[i] = peers_[k][r]
                       ->Configure(req, absl::Now() + options_.rpc_deadline,
                                   /*wait_for_ready=*/generation_ == 1)
                       .status();
    };
    if (parallel) {
      std::vector<std::thread> threads;
      for (size_t i = 0; i < order.size(); ++i)
        threads.emplace_back(configure, i);
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
      std::lock_guard<std::mutex> l(mu_);
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
  absl::Status OpenControls(int64_t epoch, absl::Time deadline) {
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
    std::unique_lock<std::mutex> l(mu_);
    const int workers = num_workers();
    cv_.wait_until(l, absl::ToChronoTime(deadline),
                   [&] { return opened_ == workers || !error_.ok(); });
    if (!error_.ok()) return error_;
    if (opened_ < workers) {
      return absl::UnavailableError(
          absl::StrCat("only ", opened_, " of ", workers,
                       " workers opened their control stream in time"));
    }
    return absl::OkStatus();
  }

  absl::Status Recover(absl::Duration timeout) override {
    CloseStream(/*drain=*/false);
    {
      std::lock_guard<std::mutex> l(mu_);
      error_ = absl::OkStatus();
      events_.clear();
      evals_.clear();
    }
    if (options_.revive) options_.revive();
    // A new generation: whatever of the failed attempt is still in flight
    // anywhere is refused as stale, and every block starts afresh.
    ++generation_;
    RETURN_IF_ERROR(Connect(timeout, /*parallel=*/generation_ > 1));
    std::lock_guard<std::mutex> l(mu_);
    steps_done_.assign(num_blocks(), 0);
    dead_.clear();
    return absl::OkStatus();
  }

  bool MembershipPending() override {
    return options_.membership != nullptr && options_.membership->Pending();
  }

  absl::Status ApplyMembership(int64_t step) override {
    if (!options_.membership) return absl::OkStatus();
    std::vector<MemberChange> changes = options_.membership->TakePending();
    if (changes.empty()) return absl::OkStatus();
    Topology next = workers_;
    std::vector<MemberChange> applied;
    for (const auto& c : changes) {
      auto& block = next[c.block];
      if (c.kind == MemberChangeKind::kJoin) {
        // A joiner that went away meanwhile is dropped, not waited for. A
        // health call, not the channel's state: a refused connection fails
        // it at once, where waiting to connect takes the whole deadline.
        WorkerClient probe("joining worker", c.address, max_bytes_,
                           options_.security);
        const absl::Status alive = probe.Ping(absl::Now() + absl::Seconds(2));
        if (!alive.ok()) {
          options_.membership->Refused("gone");
          if (options_.on_join_dropped) options_.on_join_dropped(c, alive);
          continue;
        }
        block.push_back(c.address);
      } else {
        auto it = std::find(block.begin(), block.end(), c.address);
        if (it == block.end() || block.size() == 1) continue;
        block.erase(it);
      }
      applied.push_back(c);
    }
    if (applied.empty()) {
      options_.membership->SetTopology(run_id_, workers_, generation_);
      return absl::OkStatus();
    }
    // The chain is idle at the boundary and every replica holds the same
    // state: the other replicas keep theirs (their own snapshot), and
    // replica 0 of a block that gains one hands it to the joiner.
    const absl::Time t0 = absl::Now();
    std::vector<std::string> states(num_blocks());
    for (const auto& c : applied) {
      if (c.kind != MemberChangeKind::kJoin || !states[c.block].empty()) {
        continue;
      }
      ASSIGN_OR_RETURN(states[c.block], SaveBlockState(c.block));
    }
    return Reconfigure(next, step, states, std::move(applied),
                       absl::Now() - t0);
  }

  absl::StatusOr<int64_t> RecoverFromReplicas(int64_t accounted) override {
    if (!elastic_) return absl::UnimplementedError("no replicas");
    CloseStream(/*drain=*/false);
    std::set<std::string> dead;
    int64_t from = 0;
    {
      std::lock_guard<std::mutex> l(mu_);
      dead = dead_;
      error_ = absl::OkStatus();
      events_.clear();
      evals_.clear();
      step_reports_.clear();
      from = std::min(
          accounted, *std::min_element(steps_done_.begin(), steps_done_.end()));
    }
    // A worker that does not answer a health check within a second is gone
    // too. A call, not the channel's state: a peer killed a moment ago (its
    // replica's reduction broke first) can still look connected.
    for (const auto& block : peers_) {
      for (const auto& peer : block) {
        if (!dead.count(peer->address()) &&
            !peer->Ping(absl::Now() + absl::Seconds(1)).ok()) {
          dead.insert(peer->address());
        }
      }
    }
    if (dead.empty()) {
      return absl::FailedPreconditionError("no worker is gone");
    }
    // A new rendezvous store: closing the old one ends every member's
    // connection to it, so a survivor held in a group's rendezvous for a
    // peer that died (the first reduction after a topology change) fails
    // now instead of after Gloo's timeout, and can be reconfigured.
    if (store_) RETURN_IF_ERROR(StartStore());
    Topology next(num_blocks());
    std::vector<MemberChange> changes;
    for (int k = 0; k < num_blocks(); ++k) {
      for (int r = 0; r < replicas_[k]; ++r) {
        const std::string& a = workers_[k][r];
        if (dead.count(a)) {
          changes.push_back({MemberChangeKind::kFailure, k, a});
        } else {
          next[k].push_back(a);
        }
      }
      if (next[k].empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("block ", k, " has no replica to fail over to"));
      }
    }
    // Every survivor continues from its own snapshot at the boundary every
    // block passed; one that has none fails the reconfiguration, and the
    // run falls back to its checkpoint.
    RETURN_IF_ERROR(Reconfigure(next, from, std::vector<std::string>(),
                                std::move(changes)));
    return from;
  }

  // Starts the rendezvous store, closing the one running first.
  absl::Status StartStore() {
    store_.reset();
    ASSIGN_OR_RETURN(store_, StoreServer::Start(options_.collective_host,
                                                options_.collective_port));
    collective_address_ =
        absl::StrCat(options_.collective_host, ":", store_->port());
    return absl::OkStatus();
  }

  Topology Workers() const override { return workers_; }

  std::vector<TopologyEvent> TopologyHistory() const override {
    return history_;
  }

  absl::StatusOr<std::vector<std::string>> SaveState() override {
    std::vector<std::string> out;
    for (int k = 0; k < num_blocks(); ++k) {
      ASSIGN_OR_RETURN(std::string state, SaveBlockState(k));
      out.push_back(std::move(state));
    }
    return out;
  }

  // Block k's state, from replica 0: replicas hold the same state at a
  // step boundary.
  absl::StatusOr<std::string> SaveBlockState(int k) {
    v1::SaveStateRequest req;
    req.set_run_id(run_id_);
    req.set_generation(generation_);
    ASSIGN_OR_RETURN(
        BlockStateArchive state,
        peers_[k][0]->SaveState(req, k, absl::Now() + options_.rpc_deadline,
                                kMaxStateBytes));
    return std::move(state.bytes);
  }

  absl::Status LoadState(int64_t step,
                         const std::vector<std::string>& states) override {
    if (static_cast<int>(states.size()) != num_blocks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("load state: ", states.size(), " archives for ",
                       num_blocks(), " blocks"));
    }
    for (int k = 0; k < num_blocks(); ++k) {
      for (auto& peer : peers_[k]) {
        RETURN_IF_ERROR(LoadStateInto(*peer, k, step, states[k]));
      }
    }
    return absl::OkStatus();
  }

  absl::Status LoadStateInto(WorkerClient& peer, int k, int64_t step,
                             const std::string& state) {
    BlockStateArchive header;
    header.run_id = run_id_;
    header.generation = generation_;
    header.block = k;
    header.step = step;
    header.sha256 = Sha256Hex(state.data(), state.size());
    return peer.LoadState(header, state, absl::Now() + options_.rpc_deadline);
  }

  int num_blocks() const override { return static_cast<int>(peers_.size()); }

  absl::Status Submit(ForwardMsg msg) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!error_.ok()) return error_;
    }
    int replica = 0;
    if (Replicated(replicas_)) {
      if (routes_step_ != msg.step) {
        // The runner's (measured throughput) if they fit this topology,
        // else equal shares.
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

  absl::StatusOr<EngineEvent> Next() override {
    std::unique_lock<std::mutex> l(mu_);
    if (!cv_.wait_for(l, absl::ToChronoSeconds(options_.stall_timeout),
                      [&] { return !events_.empty() || !error_.ok(); })) {
      return absl::DeadlineExceededError(
          absl::StrCat("no progress from the workers for ",
                       absl::FormatDuration(options_.stall_timeout)));
    }
    if (!error_.ok()) return error_;
    EngineEvent e = std::move(events_.front());
    events_.pop_front();
    return e;
  }

  bool Ready() override {
    std::lock_guard<std::mutex> l(mu_);
    return !events_.empty() || !error_.ok();
  }

  absl::StatusOr<std::vector<HeadEval>> Evaluate(
      const torch::Tensor& input, const torch::Tensor& target) override {
    const int64_t id = next_eval_++;
    DownFrame down;
    SetHeader(&down.proto);
    codec_.EncodeEval({id, input, target, false}, &down);
    // Replicas hold the same parameters between steps: the first of each
    // block evaluates.
    streams_[0]->Send(down);
    std::unique_lock<std::mutex> l(mu_);
    const size_t k = peers_.size();
    if (!cv_.wait_for(l, absl::ToChronoSeconds(options_.stall_timeout),
                      [&] { return !error_.ok() || evals_[id].size() == k; })) {
      return absl::DeadlineExceededError("evaluation: no answer from workers");
    }
    if (!error_.ok()) return error_;
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

  absl::StatusOr<std::vector<BlockState>> FetchState() override {
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
          ASSIGN_OR_RETURN(torch::Tensor t,
                           DecodeTensor(nt.tensor(), nt.name()));
          (part == &resp.block() ? st.block : st.head)
              .emplace_back(nt.name(), std::move(t));
        }
      }
      out.push_back(std::move(st));
    }
    return out;
  }

  void Shutdown() override {
    CloseStream();
    if (options_.membership) options_.membership->Close();
  }

 private:
  // A new generation with topology `next` at the boundary before `step`:
  // the replicas `next` keeps from the current topology continue from
  // their own snapshots at that boundary, a joiner of block k loads
  // `states[k]` (a live replica's state there).
  // `saved`: the time it took to take `states`.
  absl::Status Reconfigure(const Topology& next, int64_t step,
                           const std::vector<std::string>& states,
                           std::vector<MemberChange> changes,
                           absl::Duration saved = absl::ZeroDuration()) {
    CloseStream();
    std::set<std::string> kept;
    std::vector<std::pair<int, int>> joiners;
    for (int k = 0; k < static_cast<int>(next.size()); ++k) {
      for (int r = 0; r < static_cast<int>(next[k].size()); ++r) {
        const auto& now = workers_[k];
        if (std::find(now.begin(), now.end(), next[k][r]) != now.end()) {
          kept.insert(next[k][r]);
        } else {
          joiners.emplace_back(k, r);
        }
      }
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      error_ = absl::OkStatus();
      events_.clear();
      evals_.clear();
      step_reports_.clear();
      dead_.clear();
    }
    RETURN_IF_ERROR(CheckReplicas(ReplicaCounts(next), num_blocks(),
                                  config_.training().microbatches(),
                                  "topology"));
    SetTopology(next);
    routes_step_ = -1;
    ++generation_;
    const absl::Time t0 = absl::Now();
    RETURN_IF_ERROR(
        Connect(options_.connect_timeout, /*parallel=*/true, kept, step));
    const absl::Time t1 = absl::Now();
    int64_t state_bytes = 0;
    for (const auto& [k, r] : joiners) {
      if (k >= static_cast<int>(states.size()) || states[k].empty()) {
        return absl::InternalError(
            absl::StrCat(peers_[k][r]->label(), " joins with no state"));
      }
      RETURN_IF_ERROR(LoadStateInto(*peers_[k][r], k, step, states[k]));
      state_bytes += static_cast<int64_t>(states[k].size());
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      steps_done_.assign(num_blocks(), step);
    }
    history_.push_back({step, generation_, std::move(changes), replicas_,
                        state_bytes, absl::ToDoubleSeconds(saved),
                        absl::ToDoubleSeconds(t1 - t0),
                        absl::ToDoubleSeconds(absl::Now() - t1)});
    if (options_.membership) {
      options_.membership->SetTopology(run_id_, workers_, generation_);
    }
    if (options_.on_topology) options_.on_topology(history_.back());
    return absl::OkStatus();
  }

  static absl::Status SameState(const v1::GetStateResponse& a,
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

  // Ends the data stream (half-close, cancelled if it does not end) and the
  // control streams, and waits until gRPC is done with them: their
  // handlers point at this engine. After a failure (`drain` false) the
  // data stream is cancelled at once: every block goes back to a state it
  // kept, so nothing in flight is wanted, and a replica of block 0 that
  // hangs (stopped, not dead) would hold the half-close for the whole grace
  // period.
  void CloseStream(bool drain = true) {
    {
      std::lock_guard<std::mutex> l(mu_);
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
    std::unique_lock<std::mutex> l(mu_);
    auto done = [&] {
      return (streams_.empty() || streams_live_ == 0) && controls_live_ == 0;
    };
    if (!cv_.wait_for(l, std::chrono::seconds(5), done)) {
      for (auto& s : streams_) s->Cancel();
      cv_.wait_for(l, std::chrono::seconds(60), done);
    }
    l.unlock();
    streams_.clear();
    controls_.clear();
  }

  void WorkerState(int block, bool up) {
    if (options_.on_worker_state) options_.on_worker_state(block, up);
  }

  void SetHeader(v1::DownMessage* m, int replica = 0) {
    m->mutable_header()->set_run_id(run_id_);
    m->mutable_header()->set_generation(generation_);
    m->mutable_header()->mutable_route()->set_block(0);
    m->mutable_header()->mutable_route()->set_replica(replica);
  }

  void Fail(absl::Status s) {
    std::lock_guard<std::mutex> l(mu_);
    if (error_.ok()) error_ = std::move(s);
    cv_.notify_all();
  }

  void OnUp(const UpFrame& m) {
    if (m.proto.kind_case() != v1::UpMessage::kUpward) {
      Fail(absl::InternalError("worker 0: empty upward message"));
      return;
    }
    auto up = codec_.DecodeUpward(m);
    if (!up.ok()) {
      Fail(up.status());
      return;
    }
    Push(std::move(*up));
  }

  // A replica's step report. The block's step is done when every replica
  // has taken it; they reduced together, so they applied the same.
  void OnStepDone(int k, const StepDone& d) {
    std::lock_guard<std::mutex> l(mu_);
    if (replicas_[k] == 1) {
      steps_done_[k] = std::max(steps_done_[k], d.step + 1);
      events_.push_back(d);
      cv_.notify_all();
      return;
    }
    auto& reports = step_reports_[{k, d.step}];
    reports.push_back(d);
    if (static_cast<int>(reports.size()) < replicas_[k]) return;
    StepDone out = reports[0];
    for (const auto& o : reports) {
      if (o.skipped != out.skipped || o.microbatches != out.microbatches) {
        if (error_.ok()) {
          error_ = absl::InternalError(
              absl::StrCat("block ", k, " step ", d.step,
                           ": its replicas applied different updates"));
        }
      }
      out.timing.seconds = std::max(out.timing.seconds, o.timing.seconds);
    }
    step_reports_.erase({k, d.step});
    steps_done_[k] = std::max(steps_done_[k], d.step + 1);
    events_.push_back(out);
    cv_.notify_all();
  }

  void OnControl(int k, int r, v1::ControlEvent e) {
    // What a worker reports is of its own block.
    int block = k;
    switch (e.kind_case()) {
      case v1::ControlEvent::kOpened: {
        std::lock_guard<std::mutex> l(mu_);
        ++opened_;
        cv_.notify_all();
        return;
      }
      case v1::ControlEvent::kStepDone:
        block = e.step_done().block();
        if (block == k) OnStepDone(k, codec_.DecodeStepDone(e.step_done()));
        break;
      case v1::ControlEvent::kDuplicate: {
        const auto& d = e.duplicate();
        block = d.block();
        if (block == k) Push(DuplicateAck{d.block(), d.step(), d.microbatch()});
        break;
      }
      case v1::ControlEvent::kEval: {
        block = e.eval().block();
        if (block != k) break;
        std::lock_guard<std::mutex> l(mu_);
        evals_[e.eval().batch()].push_back(codec_.DecodeEvalResult(e.eval()));
        cv_.notify_all();
        return;
      }
      case v1::ControlEvent::kFailure: {
        std::lock_guard<std::mutex> l(mu_);
        FailLocked(e.failure());
        return;
      }
      default:
        break;
    }
    if (block != k) {
      Fail(absl::InternalError(
          absl::StrCat(peers_[k][r]->label(), ": reported for block ", block)));
    }
  }

  // A failure a worker reported: names the culprit it saw.
  void FailLocked(const v1::Failure& f) {
    if (!error_.ok()) return;
    if (f.block() >= 0 && f.block() < num_blocks())
      WorkerState(f.block(), false);
    const std::string where =
        f.address().empty() ? "" : absl::StrCat(" (", f.address(), ")");
    error_ = absl::Status(
        static_cast<absl::StatusCode>(f.code()),
        absl::StrCat("worker ", f.block(), where, " failed: ", f.message()));
    if (error_.ok()) error_ = absl::UnknownError(f.message());
    cv_.notify_all();
  }

  void Push(EngineEvent e) {
    std::lock_guard<std::mutex> l(mu_);
    events_.push_back(std::move(e));
    cv_.notify_all();
  }

  void OnStreamDone(int64_t epoch, int r, const grpc::Status& s) {
    // Everything under the lock, notify included: the engine may be
    // destroyed as soon as a waiter sees streams_live_ reach 0.
    std::lock_guard<std::mutex> l(mu_);
    if (epoch != stream_epoch_) return;
    --streams_live_;
    // Not a sign the worker died: it ends this stream itself when its
    // block fails (a peer replica gone); its control stream tells.
    // A block that stopped the chain says who failed on the status.
    if (auto f = ReportedFailure(FromGrpcStatus(s))) {
      FailLocked(*f);
    } else if ((!closing_ || !s.ok()) && error_.ok()) {
      if (!closing_) WorkerState(0, false);
      error_ = absl::UnavailableError(absl::StrCat(
          peers_[0][r]->label(), ": stream ended: ",
          s.ok() ? std::string("closed by the worker") : s.error_message()));
    }
    cv_.notify_all();
  }

  void OnControlDone(int64_t epoch, int k, int r, const grpc::Status& s) {
    // Under the lock, notify included, as OnStreamDone.
    std::lock_guard<std::mutex> l(mu_);
    if (epoch != stream_epoch_) return;
    --controls_live_;
    // First-hand: the worker itself went away (or refused the stream).
    if (!closing_) dead_.insert(workers_[k][r]);
    if (!closing_ && error_.ok()) {
      // The worker itself went away (or refused the stream): first-hand.
      WorkerState(k, false);
      error_ = absl::UnavailableError(absl::StrCat(
          peers_[k][r]->label(), ": control stream ended: ",
          s.ok() ? std::string("closed by the worker") : s.error_message()));
    }
    cv_.notify_all();
  }

  const v1::RunConfig config_;
  const DataShape shape_;
  const ClusterOptions options_;
  const WireCodec codec_;
  std::string run_id_;
  int64_t generation_ = 1;
  std::atomic<int64_t> stream_epoch_{0};
  int64_t max_bytes_ = 0;
  // Per block: the scripted model's files its workers are sent.
  std::vector<std::vector<ScriptedFile>> model_files_;
  // The topology in force and its replica counts, by block, then replica.
  Topology workers_;
  std::vector<int> replicas_;
  // Snapshots on every worker, so that replicas can fail over.
  bool elastic_ = false;
  std::vector<TopologyEvent> history_;
  std::vector<std::vector<std::unique_ptr<WorkerClient>>> peers_;
  // The rendezvous store of the reduction groups (with replicas only).
  std::unique_ptr<StoreServer> store_;
  std::string collective_address_;
  // The routes of the step last submitted.
  int64_t routes_step_ = -1;
  std::vector<int32_t> routes_;
  // Into each replica of block 0.
  std::vector<std::shared_ptr<StreamClient>> streams_;
  std::vector<std::shared_ptr<ControlClient>> controls_;
  int64_t next_eval_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<EngineEvent> events_;
  std::map<int64_t, std::vector<EvalReport>> evals_;
  absl::Status error_;
  bool closing_ = false;
  int streams_live_ = 0;  // streams into block 0 not done yet
  // Step reports of replicated blocks, until every replica's is in.
  std::map<std::pair<int, int64_t>, std::vector<StepDone>> step_reports_;
  // Steps each block has applied (every replica of it); guarded by mu_.
  std::vector<int64_t> steps_done_;
  // Workers whose streams ended under them this attempt; guarded by mu_.
  std::set<std::string> dead_;
  int opened_ = 0;         // control streams the workers took
  int controls_live_ = 0;  // control streams not done yet
};

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> MakeClusterEngine(
    const v1::RunConfig& config, const DataShape& shape,
    const ClusterOptions& options) {
  ASSIGN_OR_RETURN(WireCodec codec, WireCodec::ForRun(config));
  auto engine =
      std::make_unique<ClusterEngine>(config, shape, options, std::move(codec));
  RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace interlock
