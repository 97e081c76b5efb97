// Where a step's time goes, per LibTorch operation (issue 15): a
// RecordFunction observer on the calls one thread makes, including the
// autograd work it drives, summed per operation name as they end. Not
// LibTorch's profiler: its event lists grow all through a profile, and on
// our allocator settings (services/runtime.h) that growth split the heap's
// free tensor blocks, so every step took fresh pages and elementwise
// operations ran several times slower than unprofiled.
#ifndef INTERLOCK_SERVICES_OP_PROFILE_H_
#define INTERLOCK_SERVICES_OP_PROFILE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace interlock {

struct OpTime {
  std::string name;  // e.g. "aten::convolution_backward"
  int64_t calls = 0;
  // Time inside the operation, less the operations it called.
  double self_seconds = 0;
  // Time inside it, callees included (nested calls of the same name count
  // once per level).
  double total_seconds = 0;
};

struct OpProfileResult {
  // Heaviest self time first.
  std::vector<OpTime> ops;
  // From Start to Stop.
  double wall_seconds = 0;
  // Inside an outermost operation: the rest of the wall time is our own
  // code between calls (messages, bookkeeping, the data).
  double in_ops_seconds = 0;
};

// Profiles the calling thread from Start until Stop (or destruction).
// Only that thread's calls are seen: the in-process engine's sequential
// schedule runs every block on it.
class OpProfile {
 public:
  // FAILED_PRECONDITION when a profile already runs on this thread.
  static absl::StatusOr<std::unique_ptr<OpProfile>> Start();
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // Call on the thread that called Start, once.
  absl::StatusOr<OpProfileResult> Stop();

  // What the observer fills in (op_profile.cc).
  struct State;

 private:
  OpProfile();
  std::unique_ptr<State> state_;
};

// A Markdown report: `title`, then per step (`steps` > 0) the wall time, the
// share inside operations and a table of the `top` heaviest operations by
// self time, the rest summed in one line.
std::string FormatOpProfile(const OpProfileResult& r, const std::string& title,
                            int64_t steps, int top = 40);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_OP_PROFILE_H_
