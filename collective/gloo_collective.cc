// ProcessGroupGloo.hpp is behind USE_C10D_GLOO, which LibTorch's CMake
// package defines for its users.
#include "collective/gloo_collective.h"

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

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

// c10d's Store over our KeyValueClient. Waits poll Check every 5 ms until
// the timeout: a rendezvous waits a few times per group, so polling costs
// milliseconds, and the store's server stays a plain unary service. Errors
// are exceptions, as c10d expects of a store.
class ClientStore : public c10d::Store {
 public:
  ClientStore(std::shared_ptr<KeyValueClient> client,
              std::chrono::milliseconds timeout)
      : Store(timeout), client_(std::move(client)) {}

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    Ok(client_->Set(key, Text(value)));
  }
  std::vector<uint8_t> compareSet(
      const std::string& key, const std::vector<uint8_t>& expected,
      const std::vector<uint8_t>& desired) override {
    return Bytes(Ok(client_->CompareSet(key, Text(expected), Text(desired))));
  }
  std::vector<uint8_t> get(const std::string& key) override {
    wait({key});
    std::optional<std::string> v = Ok(client_->Get(key));
    if (!v) throw std::runtime_error("rendezvous store: " + key + " vanished");
    return Bytes(*v);
  }
  int64_t add(const std::string& key, int64_t value) override {
    return Ok(client_->Add(key, value));
  }
  bool deleteKey(const std::string& key) override {
    return Ok(client_->Delete(key));
  }
  bool check(const std::vector<std::string>& keys) override {
    return Ok(client_->Check(keys));
  }
  int64_t getNumKeys() override { return Ok(client_->NumKeys()); }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, timeout_);
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    const auto bound = timeout == kNoTimeout ? timeout_ : timeout;
    const auto until = std::chrono::steady_clock::now() + bound;
    while (!check(keys)) {
      if (std::chrono::steady_clock::now() >= until) {
        throw std::runtime_error(absl::StrCat("rendezvous store: wait for ",
                                              keys.size(), " keys timed out"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

 private:
  static std::string Text(const std::vector<uint8_t>& v) {
    return std::string(v.begin(), v.end());
  }
  static std::vector<uint8_t> Bytes(const std::string& s) {
    return std::vector<uint8_t>(s.begin(), s.end());
  }
  static void Ok(const absl::Status& s) {
    if (!s.ok()) throw std::runtime_error(std::string(s.message()));
  }
  template <typename T>
  static T Ok(absl::StatusOr<T> r) {
    Ok(r.status());
    return *std::move(r);
  }

  const std::shared_ptr<KeyValueClient> client_;
};

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
  if (!o.store) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": no rendezvous store"));
  }
  if (o.timeout <= absl::ZeroDuration() ||
      o.rendezvous_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": timeouts must be positive"));
  }
  const std::chrono::milliseconds timeout = Millis(o.timeout);
  const std::chrono::milliseconds rendezvous = Millis(o.rendezvous_timeout);
  try {
    auto client = c10::make_intrusive<ClientStore>(o.store, rendezvous);
    auto store = c10::make_intrusive<c10d::PrefixStore>(o.prefix, client);
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

}  // namespace interlock
