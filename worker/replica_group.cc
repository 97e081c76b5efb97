#include "worker/replica_group.h"

#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "collective/gloo_collective.h"

namespace interlock {
namespace {

// A rendezvous in progress. It runs on a thread of its own so that Abandon
// can end the wait for it: Gloo waits up to five times the rendezvous
// timeout (50 s) for a peer that published its address and then died.
struct Connecting {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;       // guarded by mu
  bool abandoned = false;  // guarded by mu
  absl::StatusOr<std::shared_ptr<Collective>> group =
      absl::UnknownError("not connected");  // guarded by mu
};

class LazyGroup : public Collective {
 public:
  explicit LazyGroup(GlooOptions options) : options_(std::move(options)) {}

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }

  // A group that failed once stays failed: the block waits to be
  // reconfigured, and a step it still runs meanwhile must not wait out
  // another rendezvous timeout against a store or peer that is gone.
  absl::Status AllReduceSum(torch::Tensor& t) override {
    std::lock_guard<std::mutex> l(mu_);
    if (!failed_.ok()) return failed_;
    std::shared_ptr<Collective> group;
    std::shared_ptr<Connecting> connecting;
    {
      std::lock_guard<std::mutex> g(group_mu_);
      if (abandoned_) return failed_ = Abandoned();
      group = group_;
      if (!group) connecting_ = connecting = std::make_shared<Connecting>();
    }
    if (!group) {
      // Detached: after an Abandon it runs out on its own, bounded by Gloo's
      // timeouts, and closes whatever group it got.
      try {
        std::thread([connecting, options = options_] {
          auto g = ConnectGloo(options);
          std::lock_guard<std::mutex> cl(connecting->mu);
          connecting->group = std::move(g);
          connecting->done = true;
          connecting->cv.notify_all();
        }).detach();
      } catch (const std::system_error& e) {
        std::lock_guard<std::mutex> gl(group_mu_);
        connecting_.reset();
        return failed_ = absl::ResourceExhaustedError(
                   absl::StrCat("gloo group '", options_.prefix,
                                "': no thread for the rendezvous: ", e.what()));
      }
      absl::StatusOr<std::shared_ptr<Collective>> g = Abandoned();
      {
        std::unique_lock<std::mutex> cl(connecting->mu);
        connecting->cv.wait(
            cl, [&] { return connecting->done || connecting->abandoned; });
        if (!connecting->abandoned) g = std::move(connecting->group);
      }
      std::lock_guard<std::mutex> gl(group_mu_);
      connecting_.reset();
      if (!g.ok()) return failed_ = g.status();
      group = *std::move(g);
      group_ = group;
      if (abandoned_) group->Abandon();
    }
    absl::Status s = group->AllReduceSum(t);
    if (!s.ok()) failed_ = s;
    return s;
  }

  // Not under mu_, which a reduction or rendezvous in progress holds.
  void Abandon() override {
    std::lock_guard<std::mutex> g(group_mu_);
    abandoned_ = true;
    if (group_) group_->Abandon();
    if (connecting_) {
      std::lock_guard<std::mutex> cl(connecting_->mu);
      connecting_->abandoned = true;
      connecting_->cv.notify_all();
    }
  }

 private:
  absl::Status Abandoned() const {
    return absl::UnavailableError(
        absl::StrCat("gloo group '", options_.prefix, "' abandoned"));
  }

  const GlooOptions options_;
  std::mutex mu_;  // one reduction at a time
  absl::Status failed_;
  std::mutex group_mu_;
  std::shared_ptr<Collective> group_;       // guarded by group_mu_
  std::shared_ptr<Connecting> connecting_;  // guarded by group_mu_
  bool abandoned_ = false;                  // guarded by group_mu_
};

}  // namespace

absl::StatusOr<std::shared_ptr<Collective>> ReplicaGroup(
    const std::string& store_address,
    const std::function<std::shared_ptr<KeyValueClient>(const std::string&)>&
        store_client,
    const std::string& prefix, int rank, int size,
    const std::string& device_host) {
  GlooOptions o;
  const size_t colon = store_address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(store_address.substr(colon + 1), &port) || port < 1 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("collective_address '",
                                                   store_address.substr(0, 64),
                                                   "' is not host:port"));
  }
  if (!store_client) {
    return absl::FailedPreconditionError("no rendezvous store client");
  }
  o.store = store_client(store_address);
  o.prefix = prefix;
  o.rank = rank;
  o.size = size;
  if (device_host.empty()) {
    char name[256] = {0};
    if (gethostname(name, sizeof(name) - 1) == 0) o.device_host = name;
  } else {
    o.device_host = device_host;
  }
  return std::shared_ptr<Collective>(std::make_shared<LazyGroup>(std::move(o)));
}

}  // namespace interlock
