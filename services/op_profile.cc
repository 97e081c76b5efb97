#include "services/op_profile.h"

#include <torch/csrc/autograd/profiler_legacy.h>

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace interlock {
namespace {

namespace lp = torch::autograd::profiler;
using torch::autograd::profiler::EventKind;

struct Open {
  const lp::LegacyEvent* push;
  double callees_us = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<OpProfile>> OpProfile::Start() {
  std::unique_ptr<OpProfile> p(new OpProfile());
  try {
    lp::enableProfilerLegacy(torch::profiler::impl::ProfilerConfig(
        torch::profiler::impl::ProfilerState::CPU));
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot start the operation profiler: ", e.what()));
  }
  p->running_ = true;
  p->start_ = absl::Now();
  return p;
}

OpProfile::~OpProfile() {
  if (!running_) return;
  try {
    lp::disableProfilerLegacy();
  } catch (const std::exception&) {
    // Nothing to report to: the profile is dropped.
  }
}

absl::StatusOr<OpProfileResult> OpProfile::Stop() {
  if (!running_) {
    return absl::FailedPreconditionError("operation profiler not running");
  }
  running_ = false;
  OpProfileResult r;
  r.wall_seconds = absl::ToDoubleSeconds(absl::Now() - start_);
  lp::thread_event_lists lists;
  try {
    lists = lp::disableProfilerLegacy();
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("stopping the operation profiler: ", e.what()));
  }
  std::map<std::string, OpTime> by_name;
  for (const auto& events : lists) {
    // Ranges nest on one thread: a stack gives each its callees' time.
    std::vector<Open> open;
    for (const auto& e : events) {
      if (e.kind() == EventKind::PushRange) {
        open.push_back({&e});
        continue;
      }
      if (e.kind() != EventKind::PopRange || open.empty()) continue;
      // A pop closes the innermost range of its handle; ranges opened
      // inside it and never closed (none expected) are dropped.
      auto it = std::find_if(open.rbegin(), open.rend(), [&](const Open& o) {
        return o.push->handle() == e.handle();
      });
      if (it == open.rend()) continue;
      const Open o = *it;
      open.erase(std::next(it).base(), open.end());
      const double us = o.push->cpuElapsedUs(e);
      OpTime& t = by_name[o.push->name()];
      ++t.calls;
      t.total_seconds += us * 1e-6;
      t.self_seconds += std::max(0.0, us - o.callees_us) * 1e-6;
      if (open.empty()) {
        r.in_ops_seconds += us * 1e-6;
      } else {
        open.back().callees_us += us;
      }
    }
  }
  for (auto& [name, t] : by_name) {
    t.name = name;
    r.ops.push_back(std::move(t));
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
      "operations (the rest: the engine's own code between them).\n\n",
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
