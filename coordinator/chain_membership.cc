#include "coordinator/chain_membership.h"

#include <algorithm>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "plan/replica_routes.h"
#include "plan/status_macros.h"
#include "rpc/rendezvous.h"
#include "rpc/status.h"
#include "services/logging.h"

namespace interlock {

absl::Status ChainMembership::Start() {
  elastic_ = options_.membership != nullptr || Replicated(links_->replicas());
  links_->set_snapshots(elastic_ || options_.keep_snapshots);
  // The rendezvous of every block's reduction group; the groups themselves
  // connect worker to worker.
  if (elastic_) RETURN_IF_ERROR(StartStore());
  return absl::OkStatus();
}

absl::Status ChainMembership::StartStore() {
  store_.reset();
  // Served with the run's token and TLS, as the membership service.
  ASSIGN_OR_RETURN(store_, RendezvousServer::Start(options_.collective_host,
                                                   options_.collective_port,
                                                   options_.server_security));
  links_->set_collective_address(
      absl::StrCat(options_.collective_host, ":", store_->port()));
  return absl::OkStatus();
}

void ChainMembership::Publish() {
  if (options_.membership) {
    options_.membership->SetTopology(links_->run_id(), links_->workers(),
                                     links_->generation(), links_->instances());
  }
}

ChainMembership::~ChainMembership() { gone_->store(true); }

void ChainMembership::TellDropped(
    const std::vector<std::pair<int, std::string>>& dropped,
    const std::vector<std::string>& keys) {
  for (const auto& [block, address] : dropped) {
    v1::ReleaseRequest request;
    request.set_run_id(links_->run_id());
    request.set_generation(links_->generation());
    request.set_stream_key(keys[block]);
    std::thread([client = links_->NewClient(
                     absl::StrCat("dropped worker ", block), address),
                 request, gone = gone_] {
      const absl::Time until = absl::Now() + absl::Minutes(10);
      while (!gone->load() && absl::Now() < until) {
        absl::Status s =
            client->Release(request, absl::Now() + absl::Seconds(2));
        if (s.ok()) {
          LOG(INFO) << client->label() << " (" << client->address()
                    << ") was told it is no longer in the run";
          return;
        }
        if (!IsTransient(s)) return;  // restarted, or another run's now
        absl::SleepFor(absl::Seconds(1));
      }
    }).detach();
  }
}

void ChainMembership::Close() {
  if (options_.membership) options_.membership->Close();
}

bool ChainMembership::Pending() const {
  return options_.membership != nullptr && options_.membership->Pending();
}

absl::Status ChainMembership::Apply(int64_t step) {
  if (!options_.membership) return absl::OkStatus();
  std::vector<MemberChange> changes = options_.membership->TakePending();
  if (changes.empty()) return absl::OkStatus();
  Topology next = links_->workers();
  std::vector<MemberChange> applied;
  for (const auto& c : changes) {
    auto& block = next[c.block];
    if (c.kind == MemberChangeKind::kJoin) {
      // A joiner that went away meanwhile is dropped, not waited for. A
      // health call, not the channel's state: a refused connection fails
      // it at once, where waiting to connect takes the whole deadline.
      WorkerClient probe("joining worker", c.address, /*max_bytes=*/1 << 20,
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
    Publish();
    return absl::OkStatus();
  }
  // The chain is idle at the boundary and every replica holds the same
  // state: the other replicas keep theirs (their own snapshot), and replica
  // 0 of a block that gains one hands it to the joiner.
  const absl::Time t0 = absl::Now();
  std::vector<std::string> states(links_->num_blocks());
  for (const auto& c : applied) {
    if (c.kind != MemberChangeKind::kJoin || !states[c.block].empty()) {
      continue;
    }
    ASSIGN_OR_RETURN(states[c.block], links_->SaveBlockState(c.block));
  }
  return Reconfigure(next, step, states, std::move(applied), absl::Now() - t0);
}

absl::StatusOr<int64_t> ChainMembership::FailOver(int64_t accounted) {
  if (!elastic_) return absl::UnimplementedError("no replicas");
  links_->Close(/*drain=*/false);
  std::set<std::string> dead = links_->Dead();
  const int64_t from = std::min(accounted, links_->MinStepDone());
  links_->ResetAttempt();
  // A worker that does not answer a health check within a second is gone
  // too. A call, not the channel's state: a peer killed a moment ago (its
  // replica's reduction broke first) can still look connected.
  for (const auto& block : links_->peers()) {
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
  // connection to it, so a survivor held in a group's rendezvous for a peer
  // that died (the first reduction after a topology change) fails now
  // instead of after Gloo's timeout, and can be reconfigured.
  if (store_) RETURN_IF_ERROR(StartStore());
  const Topology& now = links_->workers();
  Topology next(now.size());
  std::vector<MemberChange> changes;
  for (int k = 0; k < static_cast<int>(now.size()); ++k) {
    for (const std::string& a : now[k]) {
      if (dead.count(a)) {
        changes.push_back({MemberChangeKind::kFailure, k, a, ""});
      } else {
        next[k].push_back(a);
      }
    }
    if (next[k].empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("block ", k, " has no replica to fail over to"));
    }
  }
  std::vector<std::pair<int, std::string>> dropped;
  for (const auto& c : changes) dropped.emplace_back(c.block, c.address);
  std::vector<std::string> keys;
  for (int k = 0; k < static_cast<int>(now.size()); ++k) {
    keys.push_back(links_->stream_key(k));
  }
  // Every survivor continues from its own snapshot at the boundary every
  // block passed; one that has none fails the reconfiguration, and the run
  // falls back to its checkpoint.
  RETURN_IF_ERROR(
      Reconfigure(next, from, std::vector<std::string>(), std::move(changes)));
  // A dropped worker that was only hung wakes to a run without it: it is
  // told so, and registers again or exits (worker/main.cc).
  TellDropped(dropped, keys);
  return from;
}

absl::Status ChainMembership::Reconfigure(
    const Topology& next, int64_t step, const std::vector<std::string>& states,
    std::vector<MemberChange> changes, absl::Duration saved) {
  links_->Close(/*drain=*/true);
  std::set<std::string> kept;
  std::vector<std::pair<int, int>> joiners;
  for (int k = 0; k < static_cast<int>(next.size()); ++k) {
    const auto& now = links_->workers()[k];
    for (int r = 0; r < static_cast<int>(next[k].size()); ++r) {
      if (std::find(now.begin(), now.end(), next[k][r]) != now.end()) {
        kept.insert(next[k][r]);
      } else {
        joiners.emplace_back(k, r);
      }
    }
  }
  links_->ResetAttempt();
  RETURN_IF_ERROR(CheckReplicas(ReplicaCounts(next), links_->num_blocks(),
                                links_->microbatches(), "topology"));
  links_->SetTopology(next);
  links_->NextGeneration();
  const absl::Time t0 = absl::Now();
  RETURN_IF_ERROR(
      links_->Connect(options_.connect_timeout, /*parallel=*/true, kept, step));
  const absl::Time t1 = absl::Now();
  int64_t state_bytes = 0;
  for (const auto& [k, r] : joiners) {
    if (k >= static_cast<int>(states.size()) || states[k].empty()) {
      return absl::InternalError(
          absl::StrCat(links_->peer(k, r).label(), " joins with no state"));
    }
    RETURN_IF_ERROR(links_->LoadStateInto(k, r, step, states[k]));
    state_bytes += static_cast<int64_t>(states[k].size());
  }
  links_->ResetProgress(step);
  history_.push_back({step, links_->generation(), std::move(changes),
                      links_->replicas(), state_bytes,
                      absl::ToDoubleSeconds(saved),
                      absl::ToDoubleSeconds(t1 - t0),
                      absl::ToDoubleSeconds(absl::Now() - t1)});
  Publish();
  if (options_.on_topology) options_.on_topology(history_.back());
  return absl::OkStatus();
}

}  // namespace interlock
