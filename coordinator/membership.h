// Elastic membership (ARCHITECTURE: replicas): workers that ask to join a
// block's replicas (Register) or to leave it (Leave, on scale-down). Requests
// are checked at once and applied by the cluster engine at the next step
// boundary; a leaver hears back once it is out of the topology. No gRPC
// types: coordinator_service.h is the adapter.
#ifndef INTERLOCK_COORDINATOR_MEMBERSHIP_H_
#define INTERLOCK_COORDINATOR_MEMBERSHIP_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "plan/topology.h"

namespace interlock {

enum class MemberChangeKind { kJoin, kLeave, kFailure };
const char* MemberChangeName(MemberChangeKind kind);

struct MemberChange {
  MemberChangeKind kind = MemberChangeKind::kJoin;
  int block = 0;
  std::string address;
  // A joiner's process identity, as it answered Identify.
  std::string instance_id;
};

// A topology change the engine applied: the step it took effect before,
// the new generation and what changed.
struct TopologyEvent {
  int64_t step = 0;
  int64_t generation = 0;
  std::vector<MemberChange> changes;
  std::vector<int> replicas;  // per block, after the change
  // Block state sent to the joiners (the other replicas keep their own).
  int64_t state_bytes = 0;
  // The change's parts: the joiners' state taken from live replicas,
  // every worker configured (those that stay restore their snapshots),
  // the joiners loaded.
  double save_seconds = 0;
  double configure_seconds = 0;
  double load_seconds = 0;
};

class Membership {
 public:
  // `config_sha256`: the run's config fingerprint (ConfigFingerprint);
  // a worker that names another is refused.
  Membership(int num_blocks, int microbatches, std::string config_sha256);

  // Every reason a request can be refused for; metrics export each at 0
  // so an alert sees the first refusal as an increase.
  static const std::vector<std::string>& RefusalReasons();
  // Called with the reason (one of RefusalReasons) of every refused request.
  void set_on_refused(std::function<void(const std::string&)> f) {
    on_refused_ = std::move(f);
  }

  // The run and topology in force (the engine, whenever it changes), with
  // each worker's instance id (same shape; empty where unknown).
  void SetTopology(const std::string& run_id, const Topology& t,
                   int64_t generation, const Topology& instances = {});

  struct Accepted {
    std::string run_id;
    int64_t generation = 0;  // the one the worker will be configured under
  };
  // The checks that need no call to the worker, and the rate limit: at
  // most kRegistrationsPerSecond, kRegistrationBurst at once. Before the
  // caller asks the address who it is.
  absl::Status Admit(int block, const std::string& address,
                     const std::string& config_sha256);
  // Accepts `address`, whose process answered `instance_id`, as a joiner
  // of `block`: refused when that process is in the topology or joining
  // already, under any address.
  absl::StatusOr<Accepted> Register(int block, const std::string& address,
                                    const std::string& config_sha256,
                                    const std::string& instance_id);
  static constexpr double kRegistrationsPerSecond = 5;
  static constexpr double kRegistrationBurst = 10;
  // Blocks until `address` is out of the topology (answers that
  // generation), the run ends (ABORTED) or `deadline` passes.
  absl::StatusOr<int64_t> Leave(const std::string& address,
                                absl::Time deadline);
  // Counts a refusal made before the request reached this class (a missing
  // or wrong token).
  void Refused(const std::string& reason);

  // Whether joins or leaves wait for the next step boundary.
  bool Pending() const;
  // The waiting changes, taken; the engine applies them and then calls
  // SetTopology.
  std::vector<MemberChange> TakePending();
  // The run is over: leavers still waiting are answered ABORTED.
  void Close();

 private:
  // Whether `address` is in the topology or waits to join.
  bool KnownLocked(const std::string& address) const;
  // The address under which process `instance_id` is in the topology or
  // joining; empty if none.
  std::string InstanceLocked(const std::string& instance_id) const;
  absl::Status CheckLocked(int block, const std::string& address,
                           const std::string& config_sha256);
  absl::Status RefuseLocked(const std::string& reason, absl::Status s);

  const int num_blocks_;
  const int microbatches_;
  const std::string config_sha256_;
  std::function<void(const std::string&)> on_refused_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string run_id_;
  Topology topology_;
  Topology instances_;
  int64_t generation_ = 0;
  // The registration rate limit's bucket.
  double tokens_ = kRegistrationBurst;
  absl::Time refilled_ = absl::InfinitePast();
  std::vector<MemberChange> pending_;
  bool closed_ = false;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_MEMBERSHIP_H_
