// The Collective of a block's replicas over LibTorch's c10d Gloo process
// group, with our rendezvous store (services/key_value_store.h, served over
// gRPC by rpc/rendezvous.h; ARCHITECTURE: replicas). c10d and Gloo types
// stay in gloo_collective.cc: including this header needs no Gloo headers.
#ifndef INTERLOCK_COLLECTIVE_GLOO_COLLECTIVE_H_
#define INTERLOCK_COLLECTIVE_GLOO_COLLECTIVE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/collective.h"
#include "services/key_value_store.h"

namespace interlock {

struct GlooOptions {
  // The rendezvous store the members exchange their addresses through.
  std::shared_ptr<KeyValueClient> store;
  // Namespace of this group's keys in the store: one per block and
  // membership generation, so groups never read each other's addresses.
  std::string prefix;
  int rank = 0;
  int size = 1;
  // The address this member's Gloo transport binds to and advertises.
  std::string device_host = "127.0.0.1";
  // Bounds every reduction.
  absl::Duration timeout = absl::Seconds(30);
  // Bounds the rendezvous. Shorter: the members of a block split each
  // step's micro-batches, so they reach their first reduction within about
  // one micro-batch of each other; a member that dies while the group forms
  // (right after a topology change) holds the others only this long.
  absl::Duration rendezvous_timeout = absl::Seconds(10);
};

// Joins the group: connects to the store and waits (up to the rendezvous
// timeout) until all `size` members have exchanged addresses. Every member
// calls it with the same store, prefix and size and its own rank.
//
// The returned Collective is not thread-safe (one caller at a time, as c10d
// requires the same calls in the same order on every member). Once a
// reduction fails (a member gone, too slow), the group is broken: later
// calls fail at once, and the members must join a new group (a new prefix).
// A reduction that timed out may still be running inside Gloo and write
// into its tensor later: after an error, treat that tensor as garbage.
// Destroying the Collective waits for such an operation to end (bounded by
// Gloo's own timeouts).
absl::StatusOr<std::shared_ptr<Collective>> ConnectGloo(
    const GlooOptions& options);

}  // namespace interlock

#endif  // INTERLOCK_COLLECTIVE_GLOO_COLLECTIVE_H_
