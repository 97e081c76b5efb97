// The per-block trainer: the one place the interlocking rule lives
// (docs/ARCHITECTURE.md, "The rule, precisely"). Both the in-process runner and
// the worker service drive it; it has no gRPC types and knows nothing about
// transports or threads.
#ifndef INTERLOCK_SERVICES_TRAINER_H_
#define INTERLOCK_SERVICES_TRAINER_H_

#include <torch/torch.h>

#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "plan/gradient_lists.h"
#include "proto/config.pb.h"
#include "services/collective.h"
#include "services/data.h"
#include "services/models.h"
#include "services/optim.h"
#include "services/state_archive.h"

namespace interlock {

class Replication;

// What the trainer needs to know about the run it is part of.
struct TrainerOptions {
  int block = 0;       // k
  int num_blocks = 1;  // K
  bool e2e = false;    // no auxiliary heads; plain backprop through the chain
  int n = 1;           // interlocking width (ignored for E2E)
  bool sum_rule = false;
  int microbatches = 1;  // M: losses are scaled by 1/M
  float test_loss_scale = 0.0f;
  // training.nonfinite_policy SKIP_STEP (else STOP).
  bool skip_nonfinite = false;
  // training.compute_unused_gradients (GradientLists::compute_unused).
  bool compute_unused = false;
  // What the wire codecs carry (TensorCodec::range of wire.activations and
  // wire.gradients): an output sent down or a gradient sent up with a value
  // of this magnitude or more counts as non-finite, as it would reach the
  // next block as one. Infinity (FP32): only NaN and infinities do.
  float output_range = std::numeric_limits<float>::infinity();
  float upstream_range = std::numeric_limits<float>::infinity();
  // Where the block, its head and everything they compute live (the
  // process's choice, not the config's: services/device.h).
  c10::Device device = c10::Device(c10::kCPU);
  // model.resnet.memory_format CHANNELS_LAST: 4-D parameters, buffers and
  // every 4-D tensor the block is handed are kept channels-last.
  bool channels_last = false;
};

TrainerOptions TrainerOptionsFromConfig(const interlock::v1::RunConfig& config,
                                        int block, int num_blocks);

// Loss of one head on one micro-batch (unscaled mean over its samples).
struct LossReport {
  int block = 0;
  double loss = 0.0;
  int64_t correct = 0;  // argmax hits (tokens for text)
  int64_t count = 0;
};

// Duration of one operation, for the virtual clock and the metrics.
// kInputGrad: an input-gradient-only pass for one entry of the list that
// goes upstream (run as soon as that entry is known, see Entry()).
// kParamPass, kSharedPass and kInputPass time the three kinds of backward
// pass side by side on a few micro-batches (BlockTrainer::Calibrate): the
// parameters alone, the parameters and the block's input, the input alone.
// They are not part of the schedule; the virtual clock leaves them out and
// profile.json records their ratios for `interlock simulate`.
enum class Phase {
  kForward,
  kHead,
  kBackward,
  kOptimizer,
  kInputGrad,
  kParamPass,
  kSharedPass,
  kInputPass
};
const char* PhaseName(Phase p);
struct OpTiming {
  int block = 0;
  Phase phase = Phase::kForward;
  double seconds = 0.0;
};

struct ForwardResult {
  torch::Tensor output;  // detached; empty for the last block
  // The output is zeros standing for non-finite values (SKIP_STEP).
  bool output_nonfinite = false;
  std::vector<LossReport> reports;
  std::vector<OpTiming> timings;
};

struct BackwardResult {
  // The upstream entry computed by the parameter pass (SharedEntry()), if
  // any: the gradient with respect to this block's input.
  torch::Tensor shared;
  bool shared_nonfinite = false;  // zeros standing for non-finite values
  std::vector<OpTiming> timings;
};

// One entry of the upstream list: dL[k+i]/da[k-1] for list index i.
struct EntryResult {
  torch::Tensor grad;
  bool nonfinite = false;  // zeros standing for non-finite values
  OpTiming timing;
};

// Per-head evaluation of one batch.
struct EvalResult {
  torch::Tensor output;      // activation for the next block (or logits)
  std::vector<double> loss;  // summed (not mean) loss per head of this block
  std::vector<int64_t> correct;
  int64_t count = 0;
  bool output_nonfinite = false;  // output is zeros standing for NaN/inf
};

class BlockTrainer {
 public:
  // Builds block `block` of the model (with its head unless E2E) exactly as
  // every other process would (on the CPU, from the run's seed), moves it to
  // `device`, and builds its optimizer.
  static absl::StatusOr<std::unique_ptr<BlockTrainer>> Create(
      const interlock::v1::RunConfig& config, const DataShape& shape, int block,
      c10::Device device = c10::Device(c10::kCPU));
  // Wraps ready-made modules (the in-process engine builds all blocks once),
  // moved to `options.device`.
  //
  // Devices: tensors handed to Forward, Entry, Backward and Evaluate may be
  // on any device (decoded messages are on the CPU) and are moved to the
  // block's; the tensors it returns stay there (the wire codec and the next
  // block move them). Operation timings wait for the device
  // (services/device.h Synchronize), so they measure execution.
  static absl::StatusOr<std::unique_ptr<BlockTrainer>> FromModules(
      const TrainerOptions& options, BlockModules modules,
      const interlock::v1::OptimizerSpec& optimizer);
  ~BlockTrainer();

  // Makes this trainer one of the replicas of its block (ARCHITECTURE:
  // replicas), at a step boundary. The caller then runs Forward, Entry and
  // Backward only for the micro-batches routed here (in increasing order; every
  // replica at least one per step), and Step reduces with `group` (every
  // replica calls it) before all apply the same update. ORDERED gives
  // parameters, buffers and optimizer state bitwise equal to one trainer that
  // ran every micro-batch; RING sums per-replica gradients
  // (services/replication.h). A null group or one of size 1 restores the single
  // trainer.
  void SetReplicas(std::shared_ptr<Collective> group,
                   interlock::v1::TrainingSpec::Reduction mode);

  const TrainerOptions& options() const { return options_; }
  const c10::Device& device() const { return options_.device; }
  bool is_last() const { return options_.block + 1 == options_.num_blocks; }
  // What the block's output must stay below in magnitude: the activations
  // codec's range, unless nothing is sent down.
  float SentRange() const {
    return is_last() ? std::numeric_limits<float>::infinity()
                     : options_.output_range;
  }
  // Whether Backward needs gradients from the next block.
  bool NeedsDownstream() const;
  // How many gradient tensors the next block sends up (0 if none).
  int DownstreamListSize() const;
  // How many gradient tensors this block sends upstream (0 for block 0).
  int UpstreamListSize() const;
  // The list of gradients w.r.t. this block's output is [own, downstream
  // 0, downstream 1, ...] (E2E: [downstream 0], or [own] for the last
  // block). Entry i < UpstreamListSize() of the upstream list is that list's
  // entry i carried through the block. SharedEntry() is the one the
  // parameter pass also yields (-1: none); every other upstream entry is
  // "early": an input-gradient-only pass that can run as soon as list entry
  // i is known, so the wait chain is n blocks long, not K.
  int SharedEntry() const;
  bool IsEarlyEntry(int i) const { return lists().Early(options_.block, i); }
  // Downstream entries that train no block (FURTHEST, the first ones when
  // the block is near the top of the chain): the next block never computes
  // or sends them, and Backward takes them undefined.
  int UnusedDownstream() const { return lists().UnusedDown(options_.block); }

  // Forward of micro-batch `mb`: runs the block, keeps its graph, and runs
  // the auxiliary head (forward and backward, on the detached output) or, for
  // the last block, the final loss.
  //
  // Non-finite values (training.nonfinite_policy): a block checks its
  // output, its loss, every gradient it sends upstream and its accumulated
  // gradients. STOP returns an error naming the value. SKIP_STEP replaces
  // the value by zeros marked non-finite (what is derived from a marked value
  // is marked too) and skips this step's update of every block the value
  // would have trained. `input_nonfinite` and `entry_nonfinite` are such
  // marks received from the neighbours.
  absl::StatusOr<ForwardResult> Forward(int mb, const torch::Tensor& input,
                                        const torch::Tensor& target,
                                        bool input_nonfinite = false);
  // Forward in two halves, so that a driver can send the output down before
  // the head runs (the next block never waits for this block's head):
  // ForwardBlock runs the block (output, its mark, the forward's timing),
  // ForwardHead then the head or final loss (reports, the head's timing).
  // Forward is both in one call. Entry and Backward need the head done.
  absl::StatusOr<ForwardResult> ForwardBlock(int mb, const torch::Tensor& input,
                                             const torch::Tensor& target,
                                             bool input_nonfinite = false);
  absl::StatusOr<ForwardResult> ForwardHead(int mb);
  // Input gradient of early upstream entry i of micro-batch `mb`; `entry` is
  // list entry i (ignored for i = 0 when it is the block's own gradient).
  // Must run before Backward() of the micro-batch, which frees its graph.
  absl::StatusOr<EntryResult> Entry(int mb, int i, const torch::Tensor& entry,
                                    bool entry_nonfinite = false);
  // Parameter backward of micro-batch `mb` given the next block's gradient
  // list (`DownstreamListSize()` entries, the first `UnusedDownstream()`
  // undefined; empty when !NeedsDownstream()) and
  // which of its entries are marked non-finite (empty: none).
  // Accumulates parameter gradients and frees the micro-batch's graph.
  absl::StatusOr<BackwardResult> Backward(
      int mb, std::vector<torch::Tensor> downstream,
      const std::vector<bool>& downstream_nonfinite = {});
  // Applies the accumulated gradients with this learning rate, zeroes them;
  // under SKIP_STEP a step that met non-finite values only drops them.
  // With replicas it first reduces: the skip decision and last_applied()
  // are then the whole block's. A failed reduction drops the step's
  // gradients and changes no parameter; the replica must then reload its
  // state from a live one.
  absl::StatusOr<OpTiming> Step(double lr);
  // Seconds the last Step spent reducing with the other replicas (part of
  // its optimizer timing; 0 without replicas).
  double last_reduction_seconds() const { return last_reduction_seconds_; }
  // The part of it spent waiting for the slowest replica to arrive.
  double last_reduction_wait_seconds() const {
    return last_reduction_wait_seconds_;
  }
  // Whether the last Step skipped the update.
  bool last_step_skipped() const { return last_step_skipped_; }
  // Non-finite losses and gradients met so far (the policy's counter).
  int64_t nonfinite_count() const { return nonfinite_count_; }
  // Micro-batch gradients accumulated since the last Step (what the next
  // Step applies), and how many the last Step applied.
  int accumulated() const { return accumulated_; }
  int last_applied() const { return last_applied_; }
  // Micro-batches forwarded but not yet backwarded.
  size_t pending() const { return pending_.size(); }

  // Forward-only evaluation (eval mode, no graph): the block's output and its
  // head's (or, for the last block, the model's) loss and hits.
  // A non-finite output is passed on as zeros marked `output_nonfinite`,
  // and a marked input gives NaN losses, so evaluation of a diverged model
  // reports NaN on both engines instead of failing on the cluster.
  absl::StatusOr<EvalResult> Evaluate(const torch::Tensor& input,
                                      const torch::Tensor& target,
                                      bool input_nonfinite = false);

  // The block's whole training state (parameters, buffers, optimizer state)
  // as a LibTorch archive tagged with the block index and `step`, of CPU
  // tensors whatever the block's device (trainer_state.cc). Only between
  // steps: nothing in flight, no gradient accumulated.
  absl::StatusOr<std::string> SaveState(int64_t step) const;
  // Restores an archive SaveState wrote for this block at `step` (-1: any
  // step), onto the block's device, and returns its step.
  // Tensors are only read from the archive, never code. Every name, dtype
  // and shape is checked before anything changes; on error the trainer is
  // unchanged.
  absl::StatusOr<int64_t> LoadState(const std::string& archive,
                                    int64_t step = -1);
  // The same state as a record of CPU tensors (a snapshot kept in memory),
  // copied into `into`'s tensors where names, dtypes and shapes match, so a
  // snapshot per step allocates nothing and serialises nothing. Between
  // steps only, as SaveState.
  absl::Status CopyState(int64_t step, BlockStateRecord* into) const;
  // Restores a record (CopyState's, or a decoded archive's) as LoadState
  // does, with the same checks; the record is only read.
  absl::StatusOr<int64_t> LoadRecord(const BlockStateRecord& record,
                                     int64_t step = -1);

  // Parameters (and buffers) by name: "block.<name>" and "head.<name>",
  // the live tensors, on the block's device.
  std::vector<std::pair<std::string, torch::Tensor>> NamedState() const;
  torch::nn::Sequential block() const { return modules_.block; }
  torch::nn::Sequential head() const { return modules_.head; }

 private:
  // Saving or copying the state needs a step boundary.
  absl::Status CheckBoundary(const char* what) const;
  BlockTrainer(TrainerOptions options, BlockModules modules,
               interlock::v1::OptimizerSpec optimizer);
  GradientLists lists() const;
  // `t` on the block's device (itself when it is there, or undefined).
  torch::Tensor OnDevice(torch::Tensor t) const;
  std::vector<torch::Tensor> TrainedParams() const;

  struct Pending {
    torch::Tensor input;     // leaf requiring grad when gradients go upstream
    torch::Tensor output;    // graph root
    torch::Tensor target;    // for the head
    torch::Tensor own_grad;  // dL[k]/da[k] (own head or final loss)
    bool own_nonfinite = false;     // own_grad zeroed: the loss was not finite
    bool input_nonfinite = false;   // nothing of it may train or go upstream
    bool output_nonfinite = false;  // the output stands for non-finite values
    bool head_done = false;         // RunHead has run (or there is no head)
    bool calibrate = false;         // time the three passes (Calibrate)
  };
  // The halves of Forward.
  absl::Status RunBlock(int mb, const torch::Tensor& input,
                        const torch::Tensor& target, bool input_nonfinite,
                        Pending& p, ForwardResult& r);
  absl::Status RunHead(int mb, Pending& p, ForwardResult& r);

  // Times, on p's graph and before its parameter pass, a parameter-only, a
  // parameter-and-input and an input-only pass, none of which accumulates
  // into a parameter's gradient.
  void Calibrate(const Pending& p, const torch::Tensor& theta_grad,
                 std::vector<OpTiming>& timings);

  // Applies training.nonfinite_policy to a non-finite value described by
  // `what`: STOP returns the error; SKIP_STEP marks this step skipped.
  absl::Status OnNonFinite(const std::string& what);
  // An upstream gradient about to leave: zeros (and true) when it is marked
  // or, under SKIP_STEP, not finite.
  absl::StatusOr<bool> CheckUpstream(int mb, int i, bool marked,
                                     torch::Tensor& grad);

  TrainerOptions options_;
  BlockModules modules_;
  std::vector<torch::Tensor> block_params_;
  const interlock::v1::OptimizerSpec optimizer_spec_;
  std::unique_ptr<Optimizer> optimizer_;
  std::map<int, Pending> pending_;
  bool skip_step_ = false;
  bool last_step_skipped_ = false;
  int64_t nonfinite_count_ = 0;
  int accumulated_ = 0;
  int64_t forwards_ = 0;  // micro-batches forwarded, for Calibrate's choice
  int last_applied_ = 0;
  std::unique_ptr<Replication> replication_;  // null: the only replica
  double last_reduction_seconds_ = 0.0;
  double last_reduction_wait_seconds_ = 0.0;
};

// Whether every value of a floating-point tensor is finite.
bool AllFinite(const torch::Tensor& t);
// Whether every value of a floating-point tensor is below `range` in
// magnitude (AllFinite for an infinite range).
bool AllWithin(const torch::Tensor& t, float range);

// Cross-entropy over the last dimension (any leading shape), mean reduction.
torch::Tensor CrossEntropy(const torch::Tensor& logits,
                           const torch::Tensor& target);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_TRAINER_H_
