// The cluster engine: drives a chain of interlock-worker services over gRPC.
// It configures each worker with its block (and replica), streams
// micro-batches into block 0's replicas along the routes it chooses, and
// receives completions from block 0's upward streams and step reports,
// evaluation results and failures from every worker's control stream.
#ifndef INTERLOCK_COORDINATOR_CLUSTER_ENGINE_H_
#define INTERLOCK_COORDINATOR_CLUSTER_ENGINE_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/engine.h"
#include "coordinator/live_run.h"
#include "coordinator/membership.h"
#include "coordinator/resolved_run.h"
#include "plan/topology.h"
#include "proto/config.pb.h"
#include "rpc/security.h"

namespace interlock {

struct ClusterOptions {
  // Worker addresses by block, then replica (plan/topology.h).
  Topology workers;
  // With replicas: the address of this process the workers reach the
  // reduction groups' rendezvous store at.
  std::string collective_host = "127.0.0.1";
  // The store's port (0: any free one; fixed where a firewall or a
  // Kubernetes Service must name it).
  int collective_port = 0;
  // Micro-batches kept in flight (0: 2 x blocks x micro-batches); workers
  // bound what they queue by it.
  int window = 0;
  // A worker not reachable within this stops the run, naming it.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Deadline of unary calls (Configure builds the block, so it is generous).
  absl::Duration rpc_deadline = absl::Seconds(120);
  // No event for this long stops the run (a stalled chain never hangs).
  absl::Duration stall_timeout = absl::Seconds(600);
  // Bearer token and TLS for every call to the workers.
  TransportSecurity security;
  // Token and TLS the coordinator's own services (membership, rendezvous
  // store) require of their callers.
  TransportSecurity server_security;
  // Recover() calls this first: restart workers that died (a local cluster
  // restarts its processes on the same ports; elsewhere an orchestrator
  // does, and this stays empty).
  std::function<void()> revive;
  // Told whenever a worker is known to be down (false) or reachable again.
  std::function<void(int block, bool up)> on_worker_state;
  // Elastic membership: joins and leaves from the coordinator service, and
  // step-boundary snapshots on every worker so that a dead replica's block
  // fails over to its survivors. Null: the topology stays as given (with
  // replicas, snapshots are kept all the same).
  Membership* membership = nullptr;
  // Told of every topology change the engine applied.
  std::function<void(const TopologyEvent&)> on_topology;
  // Workers that live on their own (EngineOptions::keep_snapshots,
  // on_generation, adopt).
  bool keep_snapshots = false;
  std::function<void(const std::string& run_id, int64_t generation)>
      on_generation;
  std::optional<LiveRun> adopt;
  // Told of a registered joiner that no longer answered at the step
  // boundary, and why; it is dropped and counted as refused ("gone").
  std::function<void(const MemberChange&, const absl::Status&)> on_join_dropped;
};

// `options.workers` is the topology `run` was resolved with.
absl::StatusOr<std::unique_ptr<Engine>> MakeClusterEngine(
    const ResolvedRun& run, const DataShape& shape,
    const ClusterOptions& options);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_CLUSTER_ENGINE_H_
