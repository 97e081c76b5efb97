// The Collective of a block's replicas over LibTorch's c10d Gloo process
// group, with a TCPStore rendezvous (ARCHITECTURE: replicas). c10d and Gloo
// types stay in gloo_collective.cc: including this header needs no Gloo
// headers.
#ifndef INTERLOCK_COLLECTIVE_GLOO_COLLECTIVE_H_
#define INTERLOCK_COLLECTIVE_GLOO_COLLECTIVE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/collective.h"

namespace interlock {

struct GlooOptions {
  // Where the rendezvous store (a StoreServer) listens.
  std::string store_host;
  int store_port = 0;
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

// The rendezvous store: a c10d TCPStore server. It serves every group whose
// members point at it; groups keep apart by their prefixes.
class StoreServer {
 public:
  // `port` 0 picks a free port (see port()). LibTorch 1.13's server listens
  // on every interface whatever `host` says; `host` is the address its own
  // client connects to. The store has no authentication: keep its port on a
  // trusted network.
  static absl::StatusOr<std::unique_ptr<StoreServer>> Start(
      const std::string& host, int port);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }

 private:
  struct Impl;
  StoreServer(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_;
};

}  // namespace interlock

#endif  // INTERLOCK_COLLECTIVE_GLOO_COLLECTIVE_H_
