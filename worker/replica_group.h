// The reduction group of a block's replicas, as a worker joins it.
#ifndef INTERLOCK_WORKER_REPLICA_GROUP_H_
#define INTERLOCK_WORKER_REPLICA_GROUP_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "services/collective.h"
#include "services/key_value_store.h"

namespace interlock {

// Replica `rank` of `size` in the group named `prefix` (run, generation and
// block), meeting at the rendezvous store `store_address` ("host:port",
// the coordinator's), reached through `store_client`.
// It connects on first use, not here: the coordinator configures replicas
// one after another, and the rendezvous waits for all of them. The Gloo
// device listens on `device_host` (empty: this machine's host name).
// A malformed `store_address` is INVALID_ARGUMENT.
absl::StatusOr<std::shared_ptr<Collective>> ReplicaGroup(
    const std::string& store_address,
    const std::function<std::shared_ptr<KeyValueClient>(const std::string&)>&
        store_client,
    const std::string& prefix, int rank, int size,
    const std::string& device_host);

}  // namespace interlock

#endif  // INTERLOCK_WORKER_REPLICA_GROUP_H_
