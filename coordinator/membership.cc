#include "coordinator/membership.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace interlock {
namespace {

// "host:port" with a port in range ("[v6]:port" too).
bool IsHostPort(const std::string& a) {
  const size_t colon = a.rfind(':');
  int port = 0;
  return colon != std::string::npos && colon > 0 && a.size() <= 256 &&
         absl::SimpleAtoi(a.substr(colon + 1), &port) && port >= 1 &&
         port <= 65535;
}

std::string Cut(const std::string& s) {
  return s.size() > 64 ? s.substr(0, 64) + "..." : s;
}

}  // namespace

const char* MemberChangeName(MemberChangeKind kind) {
  switch (kind) {
    case MemberChangeKind::kJoin:
      return "join";
    case MemberChangeKind::kLeave:
      return "leave";
    case MemberChangeKind::kFailure:
      return "failure";
  }
  return "unknown";
}

Membership::Membership(int num_blocks, int microbatches,
                       std::string config_sha256)
    : num_blocks_(num_blocks),
      microbatches_(microbatches),
      config_sha256_(std::move(config_sha256)) {}

void Membership::SetTopology(const std::string& run_id, const Topology& t,
                             int64_t generation, const Topology& instances) {
  std::lock_guard<std::mutex> l(mu_);
  run_id_ = run_id;
  topology_ = t;
  instances_ = instances;
  generation_ = generation;
  cv_.notify_all();
}

bool Membership::KnownLocked(const std::string& address) const {
  for (const auto& block : topology_) {
    if (std::find(block.begin(), block.end(), address) != block.end()) {
      return true;
    }
  }
  for (const auto& c : pending_) {
    if (c.kind == MemberChangeKind::kJoin && c.address == address) return true;
  }
  return false;
}

std::string Membership::InstanceLocked(const std::string& instance_id) const {
  if (instance_id.empty()) return "";
  for (size_t k = 0; k < instances_.size() && k < topology_.size(); ++k) {
    for (size_t r = 0; r < instances_[k].size() && r < topology_[k].size();
         ++r) {
      if (instances_[k][r] == instance_id) return topology_[k][r];
    }
  }
  for (const auto& c : pending_) {
    if (c.kind == MemberChangeKind::kJoin && c.instance_id == instance_id) {
      return c.address;
    }
  }
  return "";
}

absl::Status Membership::RefuseLocked(const std::string& reason,
                                      absl::Status s) {
  if (on_refused_) on_refused_(reason);
  return s;
}

const std::vector<std::string>& Membership::RefusalReasons() {
  static const auto* reasons = new std::vector<std::string>{
      "token",    "block",   "address", "config", "duplicate",
      "replicas", "unknown", "last",    "gone",   "rate"};
  return *reasons;
}

void Membership::Refused(const std::string& reason) {
  if (on_refused_) on_refused_(reason);
}

absl::Status Membership::Admit(int block, const std::string& address,
                               const std::string& config_sha256) {
  std::lock_guard<std::mutex> l(mu_);
  const absl::Time now = absl::Now();
  if (refilled_ != absl::InfinitePast()) {
    tokens_ = std::min(kRegistrationBurst,
                       tokens_ + kRegistrationsPerSecond *
                                     absl::ToDoubleSeconds(now - refilled_));
  }
  refilled_ = now;
  if (tokens_ < 1) {
    return RefuseLocked("rate",
                        absl::ResourceExhaustedError(absl::StrCat(
                            "register: more than ", kRegistrationsPerSecond,
                            " registrations a second; try again in a second")));
  }
  tokens_ -= 1;
  return CheckLocked(block, address, config_sha256);
}

absl::StatusOr<Membership::Accepted> Membership::Register(
    int block, const std::string& address, const std::string& config_sha256,
    const std::string& instance_id) {
  std::lock_guard<std::mutex> l(mu_);
  if (absl::Status s = CheckLocked(block, address, config_sha256); !s.ok()) {
    return s;
  }
  if (const std::string known = InstanceLocked(instance_id); !known.empty()) {
    return RefuseLocked(
        "duplicate",
        absl::AlreadyExistsError(absl::StrCat(
            "register: the worker at ", Cut(address),
            " is the process already in the run (or joining) as ", known)));
  }
  int replicas = static_cast<int>(topology_[block].size());
  for (const auto& c : pending_) {
    if (c.block != block) continue;
    replicas += c.kind == MemberChangeKind::kJoin ? 1 : -1;
  }
  if (replicas + 1 > microbatches_) {
    return RefuseLocked(
        "replicas",
        absl::ResourceExhaustedError(absl::StrCat(
            "register: block ", block, " would have ", replicas + 1,
            " replicas but a step has only ", microbatches_,
            " micro-batches: at most one replica per micro-batch")));
  }
  pending_.push_back({MemberChangeKind::kJoin, block, address, instance_id});
  return Accepted{run_id_, generation_ + 1};
}

absl::Status Membership::CheckLocked(int block, const std::string& address,
                                     const std::string& config_sha256) {
  if (block < 0 || block >= num_blocks_) {
    return RefuseLocked("block", absl::InvalidArgumentError(absl::StrCat(
                                     "register: block ", block, " outside [0, ",
                                     num_blocks_, ")")));
  }
  if (!IsHostPort(address)) {
    return RefuseLocked("address", absl::InvalidArgumentError(absl::StrCat(
                                       "register: address '", Cut(address),
                                       "' is not host:port")));
  }
  if (!config_sha256.empty() && config_sha256 != config_sha256_) {
    return RefuseLocked(
        "config",
        absl::FailedPreconditionError(absl::StrCat(
            "register: the worker's run config (SHA-256 ", Cut(config_sha256),
            ") is not this run's (", config_sha256_, ")")));
  }
  if (closed_ || run_id_.empty()) {
    return absl::UnavailableError("register: no run is in progress");
  }
  if (KnownLocked(address)) {
    return RefuseLocked(
        "duplicate",
        absl::AlreadyExistsError(absl::StrCat(
            "register: ", address, " is already in the topology or joining")));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Membership::Leave(const std::string& address,
                                          absl::Time deadline) {
  std::unique_lock<std::mutex> l(mu_);
  int block = -1;
  for (int b = 0; b < static_cast<int>(topology_.size()); ++b) {
    const auto& r = topology_[b];
    if (std::find(r.begin(), r.end(), address) != r.end()) block = b;
  }
  if (block < 0) {
    return RefuseLocked(
        "unknown", absl::NotFoundError(absl::StrCat(
                       "leave: ", Cut(address), " is not in the topology")));
  }
  int leaving = 0;
  bool already = false;
  for (const auto& c : pending_) {
    if (c.kind != MemberChangeKind::kLeave || c.block != block) continue;
    ++leaving;
    already = already || c.address == address;
  }
  if (!already) {
    if (static_cast<int>(topology_[block].size()) - leaving <= 1) {
      return RefuseLocked(
          "last", absl::FailedPreconditionError(absl::StrCat(
                      "leave: ", address, " is the last replica of block ",
                      block, "; the run needs it")));
    }
    pending_.push_back({MemberChangeKind::kLeave, block, address, ""});
    cv_.notify_all();
  }
  auto gone = [&] {
    if (closed_) return true;
    const auto& r = topology_[block];
    return std::find(r.begin(), r.end(), address) == r.end();
  };
  if (!cv_.wait_until(l, absl::ToChronoTime(deadline), gone)) {
    return absl::DeadlineExceededError(
        absl::StrCat("leave: ", address,
                     " is still in the topology (no step boundary yet)"));
  }
  const auto& r = topology_[block];
  if (std::find(r.begin(), r.end(), address) != r.end()) {
    return absl::AbortedError("leave: the run ended");
  }
  return generation_;
}

bool Membership::Pending() const {
  std::lock_guard<std::mutex> l(mu_);
  return !pending_.empty();
}

std::vector<MemberChange> Membership::TakePending() {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<MemberChange> out;
  out.swap(pending_);
  return out;
}

void Membership::Close() {
  std::lock_guard<std::mutex> l(mu_);
  closed_ = true;
  cv_.notify_all();
}

}  // namespace interlock
