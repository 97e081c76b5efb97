// How the run driver reaches the chain of blocks: in one process (a chain of
// BlockDrivers) or over gRPC (a chain of workers). The interface has no gRPC
// types; the driver above it owns data, schedule, metrics and reports.
#ifndef INTERLOCK_COORDINATOR_ENGINE_H_
#define INTERLOCK_COORDINATOR_ENGINE_H_

#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "services/driver.h"

namespace interlock {

// Something the chain tells the driver: a micro-batch finished everywhere
// (block 0's upward message), or a block took its optimizer step.
using EngineEvent = std::variant<UpwardMsg, StepDone>;

// Evaluation of one batch by every head (aux heads, then the final one).
struct HeadEval {
  int block = 0;
  double loss_sum = 0.0;
  int64_t correct = 0;
  int64_t count = 0;
};

struct BlockState {
  std::vector<std::pair<std::string, torch::Tensor>> block;
  std::vector<std::pair<std::string, torch::Tensor>> head;
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual int num_blocks() const = 0;
  // Hands a micro-batch to block 0. Never blocks for long: the driver keeps
  // the number in flight bounded.
  virtual absl::Status Submit(ForwardMsg msg) = 0;
  // The next event; blocks until one is there or the chain failed.
  virtual absl::StatusOr<EngineEvent> Next() = 0;
  // Whether Next() would return at once (an event or an error is waiting).
  virtual bool Ready() = 0;
  // Forward-only pass of a batch through the chain (training must be idle).
  virtual absl::StatusOr<std::vector<HeadEval>> Evaluate(
      const torch::Tensor& input, const torch::Tensor& target) = 0;
  // Every block's parameters and buffers (training must be idle).
  virtual absl::StatusOr<std::vector<BlockState>> FetchState() = 0;
  virtual void Shutdown() = 0;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_ENGINE_H_
