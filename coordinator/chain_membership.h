// Elastic membership of a cluster run: the reduction groups' rendezvous
// store, joins and leaves applied at a step boundary, fail-over to the
// replicas that survive, and the history of topology changes. It decides
// what the next topology is and which state each of its workers starts
// from; the links (chain_links.h) carry it out under a new generation.
#ifndef INTERLOCK_COORDINATOR_CHAIN_MEMBERSHIP_H_
#define INTERLOCK_COORDINATOR_CHAIN_MEMBERSHIP_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/chain_links.h"
#include "coordinator/cluster_engine.h"
#include "coordinator/membership.h"
#include "rpc/rendezvous.h"

namespace interlock {

class ChainMembership {
 public:
  ChainMembership(ChainLinks* links, const ClusterOptions& options)
      : links_(links), options_(options) {}
  ~ChainMembership();

  // With a membership service or replicas: starts the rendezvous store and
  // has every worker keep step-boundary snapshots. Before the first Connect.
  absl::Status Start();
  bool elastic() const { return elastic_; }
  // Tells the membership service the topology in force.
  void Publish();
  void Close();

  bool Pending() const;
  // The joins and leaves registered so far, applied with the chain idle
  // before `step`: a joiner is probed first (one that went away is dropped),
  // and replica 0 of a block that gains one hands it its state.
  absl::Status Apply(int64_t step);
  // Continues without the workers that died, from the last boundary every
  // block passed (no later than `accounted`), from the survivors' own
  // snapshots; returns that step.
  absl::StatusOr<int64_t> FailOver(int64_t accounted);
  const std::vector<TopologyEvent>& history() const { return history_; }

 private:
  // Starts the rendezvous store, closing the one running first.
  absl::Status StartStore();
  // A new generation with topology `next` at the boundary before `step`:
  // the workers `next` keeps continue from their own snapshots there, a
  // joiner of block k loads `states[k]`. `saved`: the time `states` took.
  absl::Status Reconfigure(const Topology& next, int64_t step,
                           const std::vector<std::string>& states,
                           std::vector<MemberChange> changes,
                           absl::Duration saved = absl::ZeroDuration());

  // Tells each worker of `dropped` (block, address) that the generation in
  // force left it out, from a thread of its own that retries while the
  // worker does not answer (a hung one may wake much later), for up to
  // ten minutes or until this object goes.
  void TellDropped(const std::vector<std::pair<int, std::string>>& dropped,
                   const std::vector<std::string>& keys);

  ChainLinks* const links_;
  const ClusterOptions& options_;
  // Set when this object goes: the TellDropped threads stop.
  std::shared_ptr<std::atomic<bool>> gone_ =
      std::make_shared<std::atomic<bool>>(false);
  bool elastic_ = false;
  // The rendezvous store of the reduction groups (elastic runs only).
  std::unique_ptr<RendezvousServer> store_;
  std::vector<TopologyEvent> history_;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_CHAIN_MEMBERSHIP_H_
