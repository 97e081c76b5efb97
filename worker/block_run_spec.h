// What a ConfigureRequest asks of this worker, checked and defaulted: a pure
// function of the request and the worker's own limits. It builds no block
// and touches no state, so every refusal of a configuration is decided (and
// unit-tested) here, before the worker lets go of the run it has.
#ifndef INTERLOCK_WORKER_BLOCK_RUN_SPEC_H_
#define INTERLOCK_WORKER_BLOCK_RUN_SPEC_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/worker.pb.h"
#include "services/data.h"
#include "services/scripted.h"

namespace interlock {

struct BlockRunSpec {
  std::string run_id;
  int64_t generation = 0;
  int block = 0;
  int num_blocks = 1;
  // Replica `replica` of `replicas` hosting the block; the replicas of the
  // next block, in order.
  int replica = 0;
  int replicas = 1;
  std::vector<std::string> next_addresses;
  // Where the block's replicas meet for their reduction (replicas > 1).
  std::string collective_address;
  // The run's configuration with defaults applied; a scripted model's path
  // cleared (a worker builds only from the files the request carried).
  interlock::v1::RunConfig config;
  std::vector<ScriptedFile> model_files;
  DataShape shape;
  int microbatches = 1;
  int64_t mb_size = 1;
  int64_t eval_batch = 1;
  int64_t classes = 0;
  int64_t max_message_bytes = 0;
  std::vector<int64_t> sample_shape;  // block input, no batch dimension
  std::vector<int64_t> output_shape;  // block output, no batch dimension
  std::vector<int64_t> target_shape;  // no batch dimension
  torch::ScalarType input_dtype = torch::kFloat32;
  // Micro-batches the coordinator keeps in flight, and what follows from
  // it: how many steps ahead of the block a forward can be, how many
  // forwards can wait in the driver's queue.
  int window = 0;
  int64_t max_steps_ahead = 0;
  int64_t max_queued = 0;
  // What a new incoming stream must carry, and what this block's links to
  // the next carry (ConfigureRequest.stream_key, next_stream_key).
  std::string stream_key;
  std::string next_stream_key;
  // Keep step-boundary snapshots; continue from the one at this step.
  bool snapshots = false;
  std::optional<int64_t> restore_step;
};

// Every check a configuration gets before anything is built: run id, block
// and replica ranges, micro-batches per replica, next addresses, window,
// message size against `max_message_bytes` (the worker's receive limit), the
// run configuration itself and the model's shapes.
absl::StatusOr<BlockRunSpec> ResolveBlockRun(
    const interlock::v1::ConfigureRequest& request, int64_t max_message_bytes);

// The largest block-state archive LoadState accepts for a block whose named
// state holds `tensor_bytes` bytes in `entries` tensors, capped at `cap`.
int64_t MaxStateBytes(int64_t tensor_bytes, int64_t entries, int64_t cap);

}  // namespace interlock

#endif  // INTERLOCK_WORKER_BLOCK_RUN_SPEC_H_
