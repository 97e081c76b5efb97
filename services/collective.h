// A group of processes that reduce tensors together: the replicas of one
// block (ARCHITECTURE: replicas). The interface has no collective library's
// types; the implementation over LibTorch's c10d Gloo process group is in
// collective/.
#ifndef INTERLOCK_SERVICES_COLLECTIVE_H_
#define INTERLOCK_SERVICES_COLLECTIVE_H_

#include <torch/torch.h>

#include "absl/status/status.h"

namespace interlock {

class Collective {
 public:
  virtual ~Collective() = default;
  // This member's index in [0, size()).
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Element-wise sum of `t` (a contiguous CPU tensor) over every member, in
  // place; every member ends with the same values. Integer dtypes are exact.
  // Every member must make the same calls in the same order. A member that
  // is gone or too slow makes it fail with an error (never hang).
  virtual absl::Status AllReduceSum(torch::Tensor& t) = 0;
  // Ends a reduction in progress, and fails every later one, at once: the
  // caller is being reconfigured into a new group, and a peer that hangs
  // (stopped, not dead) would otherwise hold it until the timeout. Safe
  // from any thread. The abandoned call's tensor is garbage afterwards.
  virtual void Abandon() {}
};

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_COLLECTIVE_H_
