// How the run driver reaches the chain of blocks: in one process (a chain of
// block hosts) or over gRPC (a chain of workers). The interface has no gRPC
// types; the driver above it owns data, schedule, metrics and reports.
#ifndef INTERLOCK_COORDINATOR_ENGINE_H_
#define INTERLOCK_COORDINATOR_ENGINE_H_

#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/live_run.h"
#include "coordinator/membership.h"
#include "services/messages.h"

namespace interlock {

// Something the chain tells the driver: a micro-batch finished everywhere
// (block 0's upward message), or a block took its optimizer step.
// A worker acknowledged a forward micro-batch it had already applied (and
// did not apply it again).
struct DuplicateAck {
  int block = 0;
  int64_t step = 0;
  int mb = 0;
};
using EngineEvent = std::variant<UpwardMsg, StepDone, DuplicateAck>;

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
  // Every block's parameters and buffers, on the CPU (training must be
  // idle).
  virtual absl::StatusOr<std::vector<BlockState>> FetchState() = 0;
  // Every block's whole training state at a step boundary (training idle):
  // one LibTorch archive per block (parameters, buffers, optimizer state).
  virtual absl::StatusOr<std::vector<std::string>> SaveState() = 0;
  // Restores every block from archives SaveState produced at `step`; the
  // chain then expects step `step` next.
  virtual absl::Status LoadState(int64_t step,
                                 const std::vector<std::string>& blocks) = 0;
  // After a failure (Next or Submit returned an error): waits up to
  // `timeout` for every worker to be reachable again, resets every block to
  // its initial state under a new generation (so nothing of the failed
  // attempt is applied) and reopens the chain. Engines that cannot fail
  // this way answer UNIMPLEMENTED.
  virtual absl::Status Recover(absl::Duration timeout) = 0;
  // Its elastic operations; null for an engine with no workers to change.
  virtual class ElasticEngine* elastic() { return nullptr; }
  virtual void Shutdown() = 0;
};

// An engine whose workers can join, leave and fail over (ARCHITECTURE:
// replicas). Only the cluster engine is one: the in-process engine carries
// none of this.
class ElasticEngine : public Engine {
 public:
  ElasticEngine* elastic() final { return this; }
  // Whether joins or leaves wait for a step boundary.
  virtual bool MembershipPending() = 0;
  // Applies them with the chain idle before `step`: the state of every
  // block moves from a live replica to the new topology in memory.
  virtual absl::Status ApplyMembership(int64_t step) = 0;
  // After a failure in which replicas died but every block kept one:
  // continues without them from the last step boundary every block passed,
  // from the survivors' snapshots (no checkpoint), and returns that step.
  // UNIMPLEMENTED or FAILED_PRECONDITION when it cannot (then Recover).
  // `accounted`: the driver has taken in every event of steps before it
  // (events still queued in the engine are dropped), so the run continues
  // no later than there.
  virtual absl::StatusOr<int64_t> RecoverFromReplicas(int64_t accounted) = 0;
  // The topology changes so far (empty: it never changed).
  virtual std::vector<TopologyEvent> TopologyHistory() const = 0;
  // The workers of every block now, replicas in routing order.
  virtual Topology Workers() const = 0;
  // What a coordinator started again would adopt: the run's id, its
  // generation now, the workers, and (as `step`) the boundary this
  // generation's workers started from (their snapshots begin there).
  virtual LiveRun Live() const = 0;
  // The step the engine continued the live workers of EngineOptions::adopt
  // from (nullopt: it started them afresh).
  virtual std::optional<int64_t> Adopted() const = 0;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_ENGINE_H_
