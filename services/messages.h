// The messages a block exchanges with its neighbours and the coordinator, as
// the engine sees them (LibTorch tensors, no wire types). The block driver
// produces and consumes them; services/wire_codec.h is the one place they
// become protobuf messages and back.
#ifndef INTERLOCK_SERVICES_MESSAGES_H_
#define INTERLOCK_SERVICES_MESSAGES_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "services/trainer.h"

namespace interlock {

// Activations (and targets) travelling down the chain.
struct ForwardMsg {
  int64_t step = 0;
  int mb = 0;
  double lr = 0.0;
  torch::Tensor input;
  torch::Tensor target;
  // The input is zeros standing for non-finite values (SKIP_STEP).
  bool nonfinite = false;
  // Decoding found every input value finite in the pass that copied them;
  // false: the receiver checks (services/wire_codec.h).
  bool input_finite = false;
  // The step's routing when blocks have replicas (ARCHITECTURE: replicas):
  // routes[m * K + k] is the replica of block k that runs micro-batch m.
  // Empty: every block has one replica.
  std::vector<int32_t> routes;
};

// Gradients, reports and timings travelling up the chain. Gradient entries
// travel as soon as each is computed: `grads` are entries first_entry,
// first_entry+1, ... of the receiver's downstream list. The final message of
// a micro-batch carries the reports and timings of this block and all below;
// from block 0 it is the completion: finished everywhere.
struct UpwardMsg {
  int64_t step = 0;
  int mb = 0;
  int first_entry = 0;
  bool final = true;
  std::vector<torch::Tensor> grads;
  // Parallel to grads (or empty): entries sent as zeros because they were
  // derived from non-finite values (training.nonfinite_policy SKIP_STEP).
  std::vector<bool> nonfinite;
  // Decoding found every value of every entry finite (as input_finite).
  bool grads_finite = false;
  std::vector<LossReport> reports;
  std::vector<OpTiming> timings;
};

// A block took its optimizer step.
struct StepDone {
  int block = 0;
  int64_t step = 0;
  OpTiming timing;
  bool skipped = false;  // the update was skipped (non-finite values)
  int microbatches = 0;  // micro-batch gradients the step applied
};

// An evaluation batch travelling down the chain (forward passes only).
struct EvalMsg {
  int64_t batch = 0;
  torch::Tensor input;
  torch::Tensor target;
  bool nonfinite = false;  // the input is zeros standing for non-finite values
  bool input_finite = false;  // as ForwardMsg::input_finite
};

// One block's evaluation of a batch, for the coordinator.
struct EvalReport {
  int64_t batch = 0;
  int block = 0;
  bool has_head = false;
  double loss_sum = 0.0;
  int64_t correct = 0;
  int64_t count = 0;
};

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_MESSAGES_H_
