#include "worker/block_run_spec.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "services/config.h"
#include "services/models.h"
#include "services/wire.h"

namespace interlock {

namespace {

// Far beyond any useful pipeline; keeps the bounds below from overflowing.
constexpr int kMaxWindow = 1 << 20;

}  // namespace

absl::StatusOr<BlockRunSpec> ResolveBlockRun(const v1::ConfigureRequest& req,
                                             int64_t max_message_bytes) {
  if (req.run_id().empty()) {
    return absl::InvalidArgumentError("configure: run_id is empty");
  }
  BlockRunSpec spec;
  spec.run_id = req.run_id();
  spec.generation = req.generation();
  spec.block = req.block();
  spec.config = req.config();
  if (spec.config.model().has_scripted()) {
    spec.config.mutable_model()->mutable_scripted()->clear_path();
  }
  ApplyDefaults(spec.config);
  RETURN_IF_ERROR(ValidateRunConfig(spec.config));
  const auto& training = spec.config.training();
  ASSIGN_OR_RETURN(spec.num_blocks, NumBlocks(spec.config.model()));
  const int k_blocks = spec.num_blocks;
  if (req.num_blocks() != k_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("configure: num_blocks ", req.num_blocks(),
                     " but the model has ", k_blocks, " blocks"));
  }
  if (req.block() < 0 || req.block() >= k_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "configure: block ", req.block(), " outside [0, ", k_blocks, ")"));
  }
  spec.replicas = req.replicas() > 0 ? req.replicas() : 1;
  spec.replica = req.replica();
  if (req.replica() < 0 || req.replica() >= spec.replicas) {
    return absl::InvalidArgumentError(
        absl::StrCat("configure: replica ", req.replica(), " outside [0, ",
                     spec.replicas, ")"));
  }
  // Every replica runs at least one micro-batch of each step: it must
  // reach the step's reduction, or its peers would wait for it.
  spec.microbatches = training.microbatches();
  if (spec.replicas > spec.microbatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("configure: block ", req.block(), " has ", spec.replicas,
                     " replicas but a step has only ", spec.microbatches,
                     " micro-batches: at most one replica per micro-batch"));
  }
  spec.collective_address = req.collective_address();
  if (spec.replicas > 1 && spec.collective_address.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "configure: ", spec.replicas, " replicas need collective_address"));
  }
  auto& next = spec.next_addresses;
  next.assign(req.next_addresses().begin(), req.next_addresses().end());
  if (next.empty() && !req.next_address().empty()) {
    next.push_back(req.next_address());
  }
  if (!req.next_address().empty() && req.next_address() != next[0]) {
    return absl::InvalidArgumentError(
        "configure: next_address is not the first of next_addresses");
  }
  if (req.block() + 1 < k_blocks && next.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("configure: block ", req.block(), " needs next_address"));
  }
  if (static_cast<int>(next.size()) > spec.microbatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "configure: ", next.size(), " replicas of block ", req.block() + 1,
        " but a step has only ", spec.microbatches, " micro-batches"));
  }
  for (const auto& a : next) {
    if (a.empty()) {
      return absl::InvalidArgumentError(
          "configure: an empty address in next_addresses");
    }
  }
  if (req.window() < 0 || req.window() > kMaxWindow) {
    return absl::InvalidArgumentError(absl::StrCat(
        "configure: window ", req.window(), " outside [0, ", kMaxWindow, "]"));
  }
  if (req.max_message_bytes() > max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "configure: the run needs messages of ", req.max_message_bytes(),
        " bytes but this worker accepts at most ", max_message_bytes,
        " (raise --max_message_bytes)"));
  }
  spec.max_message_bytes = req.max_message_bytes();
  spec.shape = DecodeShape(req.shape());
  ASSIGN_OR_RETURN(auto outputs,
                   BlockOutputShapes(spec.config.model(), spec.shape));
  spec.sample_shape =
      req.block() == 0 ? SampleShape(spec.shape) : outputs[req.block() - 1];
  spec.output_shape = outputs[req.block()];
  spec.target_shape = TargetShape(spec.shape);
  spec.input_dtype =
      req.block() == 0 && spec.shape.is_text ? torch::kInt64 : torch::kFloat32;
  spec.classes = spec.shape.classes;
  spec.mb_size = training.batch_size() / spec.microbatches;
  spec.eval_batch =
      std::max<int64_t>(training.eval_batch_size(), training.batch_size());
  spec.window =
      req.window() > 0 ? req.window() : 2 * k_blocks * spec.microbatches;
  // With W micro-batches in flight, a forward for step s reaches this block
  // only while some micro-batch of its current step c is unfinished, and
  // every micro-batch of steps c+1..s-1 is unfinished too (the block runs
  // none of them before stepping c): (s-c-1)*M + 2 <= W. Two steps more
  // of margin. Forwards waiting in the queue are all in flight: fewer
  // than W, M more of margin. Each has the exact input and target shape,
  // so this also bounds their bytes.
  spec.max_steps_ahead =
      (spec.window + spec.microbatches - 1) / spec.microbatches + 2;
  spec.max_queued = int64_t{spec.window} + spec.microbatches;
  constexpr size_t kMaxKey = 64;
  if (req.stream_key().size() > kMaxKey ||
      req.next_stream_key().size() > kMaxKey) {
    return absl::InvalidArgumentError(
        absl::StrCat("configure: stream keys are at most ", kMaxKey, " bytes"));
  }
  spec.stream_key = req.stream_key();
  spec.next_stream_key = req.next_stream_key();
  spec.snapshots = req.snapshots();
  if (req.has_restore_step()) spec.restore_step = req.restore_step();
  for (const auto& f : req.model_files()) {
    spec.model_files.push_back({f.name(), f.sha256(), f.data()});
  }
  return spec;
}

int64_t MaxStateBytes(int64_t tensor_bytes, int64_t entries, int64_t cap) {
  // SaveState's archive holds every parameter and buffer and, per tensor,
  // at most three optimizer tensors of its size (Adam's exp_avg,
  // exp_avg_sq, max_exp_avg_sq) and a step scalar, each entry with its
  // name and zip and pickle records (4 KiB each is generous). Twice that
  // plus 1 MiB bounds what LoadState can legitimately receive.
  return std::min(
      cap, 2 * (4 * tensor_bytes + 5 * entries * 4096) + (int64_t{1} << 20));
}

}  // namespace interlock
