// ProcessGroupGloo.hpp is behind USE_C10D_GLOO, which LibTorch's CMake
// package defines for its users.
#include "collective/gloo_collective.h"

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace interlock {
namespace {

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// The message of the exception being handled (c10 errors without their
// C++ backtrace).
std::string CurrentExceptionMessage() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

absl::Status GroupError(const std::string& group, const std::string& what,
                        const std::string& message) {
  const std::string text = absl::StrCat(group, ": ", what, ": ", message);
  // Gloo and c10d say "timed out" / "Timed out" when a peer is too slow.
  if (absl::StrContains(absl::AsciiStrToLower(message), "timed out")) {
    return absl::DeadlineExceededError(text);
  }
  return absl::UnavailableError(text);
}

class GlooCollective : public Collective {
 public:
  GlooCollective(std::string name,
                 c10::intrusive_ptr<c10d::ProcessGroupGloo> pg, int rank,
                 int size, std::chrono::milliseconds timeout)
      : name_(std::move(name)),
        pg_(std::move(pg)),
        rank_(rank),
        size_(size),
        timeout_(timeout) {}

  ~GlooCollective() override {
    std::lock_guard<std::mutex> l(signal_->mu);
    if (signal_->in_flight) {
      // The process group's destructor joins Gloo's thread, which stays in
      // the abandoned operation until Gloo's own timeout: let it run out
      // on its own rather than hold whoever destroys this (the worker's
      // executor, reconfiguring) that long. One group per abandonment.
      new c10::intrusive_ptr<c10d::ProcessGroupGloo>(std::move(pg_));
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduceSum(torch::Tensor& t) override {
    if (!broken_.ok()) return broken_;
    if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name_, ": all-reduce needs a defined, contiguous CPU tensor"));
    }
    {
      std::lock_guard<std::mutex> l(signal_->mu);
      if (signal_->abandoned) return broken_ = Abandoned();
    }
    try {
      std::vector<at::Tensor> tensors{t};
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      opts.timeout = timeout_;
      auto work = pg_->allreduce(tensors, opts);
      // Waits for the operation to end or for Abandon, whichever comes
      // first (the callback, run at once if it has ended already, keeps
      // the signal alive past this call).
      {
        std::lock_guard<std::mutex> l(signal_->mu);
        signal_->in_flight = true;
      }
      std::shared_ptr<Signal> signal = signal_;
      work->getFuture()->addCallback([signal](c10::ivalue::Future&) {
        std::lock_guard<std::mutex> l(signal->mu);
        signal->in_flight = false;
        signal->cv.notify_all();
      });
      {
        std::unique_lock<std::mutex> l(signal_->mu);
        // Gloo's own timeout (the group's) normally ends the operation
        // first; this bounds the wait even if it does not.
        signal_->cv.wait_for(l, timeout_, [&] {
          return !signal_->in_flight || signal_->abandoned;
        });
        if (signal_->in_flight) {
          return broken_ = signal_->abandoned
                               ? Abandoned()
                               : absl::DeadlineExceededError(absl::StrCat(
                                     name_, ": all-reduce timed out"));
        }
      }
      // Ended: its error, if any.
      work->wait(timeout_);
    } catch (...) {
      // The members' call sequences no longer match: nothing later on this
      // group can be trusted.
      broken_ = GroupError(name_, "all-reduce", CurrentExceptionMessage());
      return broken_;
    }
    return absl::OkStatus();
  }

  void Abandon() override {
    std::lock_guard<std::mutex> l(signal_->mu);
    signal_->abandoned = true;
    signal_->cv.notify_all();
  }

 private:
  // Shared with the completion callback of the operation in flight, which
  // may run after an abandoned call (or this group) is gone.
  struct Signal {
    std::mutex mu;
    std::condition_variable cv;
    bool in_flight = false;
    bool abandoned = false;
  };

  absl::Status Abandoned() const {
    return absl::UnavailableError(
        absl::StrCat(name_, ": all-reduce abandoned (block reconfigured)"));
  }

  const std::string name_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  absl::Status broken_;
  const std::shared_ptr<Signal> signal_ = std::make_shared<Signal>();
};

}  // namespace

absl::StatusOr<std::shared_ptr<Collective>> ConnectGloo(const GlooOptions& o) {
  const std::string name = absl::StrCat("gloo group '", o.prefix, "' (rank ",
                                        o.rank, " of ", o.size, ")");
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": rank outside [0, size)"));
  }
  if (o.prefix.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": empty prefix (groups would share keys)"));
  }
  if (o.store_host.empty() || o.store_port < 1 || o.store_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": store address '", o.store_host, ":", o.store_port, "'"));
  }
  if (o.timeout <= absl::ZeroDuration() ||
      o.rendezvous_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": timeouts must be positive"));
  }
  const std::chrono::milliseconds timeout = Millis(o.timeout);
  const std::chrono::milliseconds rendezvous = Millis(o.rendezvous_timeout);
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(o.store_port);
    so.isServer = false;
    so.waitWorkers = false;
    so.timeout = rendezvous;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(o.store_host, so);
    auto store = c10::make_intrusive<c10d::PrefixStore>(o.prefix, tcp);
    // The group's timeout bounds its rendezvous; each reduction passes its
    // own (GlooCollective).
    auto options = c10d::ProcessGroupGloo::Options::create(rendezvous);
    options->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(o.device_host));
    // Calls are made one at a time: one worker thread is enough.
    options->threads = 1;
    // The constructor is the rendezvous (bounded by the timeout).
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, o.rank, o.size,
                                                          options);
    return std::shared_ptr<Collective>(
        new GlooCollective(name, std::move(pg), o.rank, o.size, timeout));
  } catch (...) {
    return GroupError(name, "connect", CurrentExceptionMessage());
  }
}

struct StoreServer::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

StoreServer::StoreServer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

StoreServer::~StoreServer() = default;

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(
    const std::string& host, int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("store server: port ", port, " outside [0, 65535]"));
  }
  try {
    c10d::TCPStoreOptions so;
    // 0 works in LibTorch 1.13: the server binds an ephemeral port and
    // getPort() reports it.
    so.port = static_cast<std::uint16_t>(port);
    so.isServer = true;
    so.waitWorkers = false;  // members come and go with the membership
    // Two servers in one process on one explicit port share a listener
    // instead of failing (port 0 always gets a fresh one).
    so.multiTenant = true;
    auto impl = std::make_unique<Impl>();
    impl->store = c10::make_intrusive<c10d::TCPStore>(host, so);
    const int bound = impl->store->getPort();
    return std::unique_ptr<StoreServer>(
        new StoreServer(std::move(impl), bound));
  } catch (...) {
    return absl::UnavailableError(absl::StrCat(
        "store server on ", host, ":", port, ": ", CurrentExceptionMessage()));
  }
}

}  // namespace interlock
