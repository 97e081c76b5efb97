#include "services/op_profile.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace interlock {
namespace {

using Clock = std::chrono::steady_clock;

struct Frame {
  Clock::time_point start;
  int64_t callees_ns = 0;
};

struct Totals {
  int64_t calls = 0;
  int64_t self_ns = 0;
  int64_t total_ns = 0;
};

}  // namespace

struct OpProfile::State {
  // Ranges nest on one thread: the open ones, innermost last.
  std::vector<Frame> open;
  // Looked up by string_view: a name seen before allocates nothing.
  absl::flat_hash_map<std::string, Totals> by_name;
  int64_t in_ops_ns = 0;
  at::CallbackHandle handle = 0;
  bool was_enabled = true;
  absl::Time start;
  bool running = false;
};

namespace {

// The profile of this thread, if one runs (callbacks propagated to other
// threads, autograd's or LibTorch's pools, see none and do nothing).
thread_local OpProfile::State* t_state = nullptr;

std::unique_ptr<at::ObserverContext> OnStart(const at::RecordFunction&) {
  if (OpProfile::State* s = t_state) s->open.push_back({Clock::now(), 0});
  return nullptr;
}

void OnEnd(const at::RecordFunction& fn, at::ObserverContext*) {
  OpProfile::State* s = t_state;
  // Ranges begun before the profile started end without a frame.
  if (s == nullptr || s->open.empty()) return;
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         Clock::now() - s->open.back().start)
                         .count();
  const int64_t callees = s->open.back().callees_ns;
  s->open.pop_back();
  const absl::string_view name = fn.name();
  auto it = s->by_name.find(name);
  if (it == s->by_name.end()) {
    it = s->by_name.emplace(std::string(name), Totals()).first;
  }
  Totals& t = it->second;
  ++t.calls;
  t.total_ns += ns;
  t.self_ns += std::max<int64_t>(0, ns - callees);
  if (s->open.empty()) {
    s->in_ops_ns += ns;
  } else {
    s->open.back().callees_ns += ns;
  }
}

}  // namespace

OpProfile::OpProfile() : state_(std::make_unique<State>()) {}

absl::StatusOr<std::unique_ptr<OpProfile>> OpProfile::Start() {
  if (t_state != nullptr) {
    return absl::FailedPreconditionError(
        "an operation profile already runs on this thread");
  }
  std::unique_ptr<OpProfile> p(new OpProfile());
  State& s = *p->state_;
  s.open.reserve(256);
  s.by_name.reserve(512);
  s.was_enabled = at::isRecordFunctionEnabled();
  at::enableRecordFunction(true);
  t_state = &s;
  s.handle =
      at::addThreadLocalCallback(at::RecordFunctionCallback(&OnStart, &OnEnd));
  s.running = true;
  s.start = absl::Now();
  return p;
}

OpProfile::~OpProfile() {
  if (!state_->running) return;
  at::removeCallback(state_->handle);
  at::enableRecordFunction(state_->was_enabled);
  t_state = nullptr;
}

absl::StatusOr<OpProfileResult> OpProfile::Stop() {
  State& s = *state_;
  if (!s.running || t_state != &s) {
    return absl::FailedPreconditionError(
        "operation profile not running on this thread");
  }
  OpProfileResult r;
  r.wall_seconds = absl::ToDoubleSeconds(absl::Now() - s.start);
  at::removeCallback(s.handle);
  at::enableRecordFunction(s.was_enabled);
  t_state = nullptr;
  s.running = false;
  r.in_ops_seconds = s.in_ops_ns * 1e-9;
  for (const auto& [name, t] : s.by_name) {
    r.ops.push_back({name, t.calls, t.self_ns * 1e-9, t.total_ns * 1e-9});
  }
  std::sort(r.ops.begin(), r.ops.end(), [](const OpTime& a, const OpTime& b) {
    return a.self_seconds != b.self_seconds ? a.self_seconds > b.self_seconds
                                            : a.name < b.name;
  });
  return r;
}

std::string FormatOpProfile(const OpProfileResult& r, const std::string& title,
                            int64_t steps, int top) {
  const double per = 1.0 / static_cast<double>(std::max<int64_t>(steps, 1));
  double self_sum = 0;
  for (const auto& o : r.ops) self_sum += o.self_seconds;
  auto share = [&](double s) {
    return self_sum > 0 ? 100.0 * s / self_sum : 0.0;
  };
  std::string out = absl::StrCat("# ", title, "\n\n");
  absl::StrAppendFormat(
      &out,
      "%d steps; %.4f s wall per step, %.1f %% of it inside LibTorch "
      "operations and interlock::batch_norm_relu, the forward of our fused "
      "layers (the rest: the engine's own code between them).\n\n",
      steps, r.wall_seconds * per,
      r.wall_seconds > 0 ? 100.0 * r.in_ops_seconds / r.wall_seconds : 0.0);
  out +=
      "Self: time in the operation less the operations it called; total: "
      "callees included. Per step, heaviest self time first.\n\n"
      "| operation | calls | self ms | self % | total ms |\n"
      "|---|---:|---:|---:|---:|\n";
  double rest = 0;
  int64_t rest_calls = 0;
  for (size_t i = 0; i < r.ops.size(); ++i) {
    const OpTime& o = r.ops[i];
    if (static_cast<int>(i) >= top) {
      rest += o.self_seconds;
      rest_calls += o.calls;
      continue;
    }
    absl::StrAppendFormat(&out, "| %s | %.1f | %.3f | %.1f | %.3f |\n", o.name,
                          o.calls * per, o.self_seconds * per * 1e3,
                          share(o.self_seconds), o.total_seconds * per * 1e3);
  }
  if (rest_calls > 0) {
    absl::StrAppendFormat(&out, "| (%d others) | %.1f | %.3f | %.1f | |\n",
                          r.ops.size() - top, rest_calls * per,
                          rest * per * 1e3, share(rest));
  }
  return out;
}

}  // namespace interlock
