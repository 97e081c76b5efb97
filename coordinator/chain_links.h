// The cluster engine's links to one chain of workers: a client per worker,
// the data streams into block 0's replicas, a control stream per worker,
// and what comes back over them (completions, step reports merged across a
// block's replicas, evaluations, failures) turned into the run's events.
// One generation at a time: Connect configures every worker for the current
// one, NextGeneration moves on. Membership (chain_membership.h) decides what
// the topology is; the links carry it out.
#ifndef INTERLOCK_COORDINATOR_CHAIN_LINKS_H_
#define INTERLOCK_COORDINATOR_CHAIN_LINKS_H_

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/cluster_engine.h"
#include "coordinator/event_queue.h"
#include "plan/topology.h"
#include "proto/worker.pb.h"
#include "rpc/worker_client.h"
#include "services/scripted.h"
#include "services/wire_codec.h"

namespace interlock {

class ChainLinks {
 public:
  // `events`: where the chain's events go (outlives the links).
  ChainLinks(const interlock::v1::RunConfig& config, const DataShape& shape,
             const ClusterOptions& options, const WireCodec& codec,
             EventQueue* events);
  ~ChainLinks() { Close(/*drain=*/true); }

  // Sizes the run's messages (a scripted model's files travel with
  // Configure) for `workers`, the resolved run's topology. Before anything
  // else.
  absl::Status Init(const Topology& workers);

  const std::string& run_id() const { return run_id_; }
  int64_t generation() const { return generation_; }
  // A new generation: whatever of the last one is still in flight anywhere
  // is refused as stale by the workers. ClusterOptions::on_generation hears
  // of it first.
  void NextGeneration();
  // Continues run `run_id` under `generation` (a coordinator started again
  // adopting its workers), after Init.
  void Continue(const std::string& run_id, int64_t generation);
  // The step every block continued from when this generation started.
  int64_t generation_step() const { return generation_step_; }
  int num_blocks() const { return static_cast<int>(workers_.size()); }
  int microbatches() const { return config_.training().microbatches(); }
  const Topology& workers() const { return workers_; }
  const std::vector<int>& replicas() const { return replicas_; }
  // Each worker's process identity, as its last Configure answered it.
  const Topology& instances() const { return instances_; }
  // The topology in force: a client for each of its workers.
  void SetTopology(const Topology& t);
  WorkerClient& peer(int block, int replica) { return *peers_[block][replica]; }
  // A client of its own for `address`, usable after the topology changed.
  std::shared_ptr<WorkerClient> NewClient(const std::string& label,
                                          const std::string& address) const;
  // Block k's stream key of the generation in force.
  const std::string& stream_key(int block) const { return stream_keys_[block]; }
  const std::vector<std::vector<std::unique_ptr<WorkerClient>>>& peers() const {
    return peers_;
  }

  // What Configure tells every worker: the reduction groups' rendezvous
  // and whether to keep step-boundary snapshots.
  void set_collective_address(std::string a) { collective_address_ = a; }
  void set_snapshots(bool on) { snapshots_ = on; }

  // Waits for every worker, configures the chain under the current
  // generation and opens the streams. `parallel`: configure every worker at
  // once (after a failure, a survivor blocked in its group's reduction is
  // freed only when its peers leave that group). `restore`: workers that
  // continue from their own snapshot at the boundary before `restore_step`.
  absl::Status Connect(absl::Duration timeout, bool parallel,
                       const std::set<std::string>& restore = {},
                       int64_t restore_step = 0);
  // Ends the data streams (half-close, or cancelled when `drain` is false:
  // nothing in flight is wanted) and the control streams, and waits until
  // gRPC is done with them.
  void Close(bool drain);
  // A new attempt: queued events, the failure, evaluations, partial step
  // reports and the workers seen dying are dropped.
  void ResetAttempt();
  // Every block continues from `step`.
  void ResetProgress(int64_t step);
  // Workers whose streams ended under them this attempt, and the last step
  // boundary every block passed.
  std::set<std::string> Dead();
  int64_t MinStepDone();

  // Into block 0, along the routes of the message's step.
  absl::Status Submit(ForwardMsg msg);
  absl::StatusOr<std::vector<HeadEval>> Evaluate(const torch::Tensor& input,
                                                 const torch::Tensor& target);
  absl::StatusOr<std::vector<BlockState>> FetchState();
  // Block k's state, from replica 0 (replicas hold the same state at a step
  // boundary); loads one into replica r of block k.
  absl::StatusOr<std::string> SaveBlockState(int k);
  absl::Status LoadStateInto(int k, int r, int64_t step,
                             const std::string& state);

 private:
  int num_workers() const;
  absl::Status OpenControls(int64_t epoch, absl::Time deadline);
  void WorkerState(int block, bool up);
  void SetHeader(interlock::v1::DownMessage* m, int replica = 0);
  void OnUp(const UpFrame& m);
  void OnStepDone(int k, const StepDone& d);
  void OnControl(int k, int r, interlock::v1::ControlEvent e);
  void FailLocked(const interlock::v1::Failure& f);
  void OnStreamDone(int64_t epoch, int r, const grpc::Status& s);
  void OnControlDone(int64_t epoch, int k, int r, const grpc::Status& s);
  static absl::Status SameState(const interlock::v1::GetStateResponse& a,
                                const interlock::v1::GetStateResponse& b,
                                const WorkerClient& who);

  const interlock::v1::RunConfig& config_;
  const DataShape& shape_;
  const ClusterOptions& options_;
  const WireCodec& codec_;
  EventQueue* const events_;
  std::string run_id_;
  int64_t generation_ = 1;
  int64_t generation_step_ = 0;
  std::atomic<int64_t> stream_epoch_{0};
  int64_t max_bytes_ = 0;
  // Per block: the scripted model's files its workers are sent.
  std::vector<std::vector<ScriptedFile>> model_files_;
  std::string collective_address_;
  bool snapshots_ = false;
  // This generation's stream key of each block (ConfigureRequest.stream_key),
  // new with every Connect.
  std::vector<std::string> stream_keys_;
  // The topology in force and its replica counts, by block, then replica.
  Topology workers_;
  std::vector<int> replicas_;
  Topology instances_;
  std::vector<std::vector<std::unique_ptr<WorkerClient>>> peers_;
  // The routes of the step last submitted.
  int64_t routes_step_ = -1;
  std::vector<int32_t> routes_;
  // Into each replica of block 0.
  std::vector<std::shared_ptr<StreamClient>> streams_;
  std::vector<std::shared_ptr<ControlClient>> controls_;
  int64_t next_eval_ = 0;

  // Guarded by the event queue's lock: waits on it end when the chain
  // fails.
  std::map<int64_t, std::vector<EvalReport>> evals_;
  bool closing_ = false;
  int streams_live_ = 0;  // streams into block 0 not done yet
  // Step reports of replicated blocks, until every replica's is in.
  std::map<std::pair<int, int64_t>, std::vector<StepDone>> step_reports_;
  // Steps each block has applied (every replica of it).
  std::vector<int64_t> steps_done_;
  // Workers whose streams ended under them this attempt.
  std::set<std::string> dead_;
  int opened_ = 0;         // control streams the workers took
  int controls_live_ = 0;  // control streams not done yet
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_CHAIN_LINKS_H_
