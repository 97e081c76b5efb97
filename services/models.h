// Models cut depth-wise into blocks, each with an optional auxiliary head.
#ifndef INTERLOCK_SERVICES_MODELS_H_
#define INTERLOCK_SERVICES_MODELS_H_

#include <torch/torch.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "plan/partition.h"
#include "proto/config.pb.h"
#include "services/data.h"

namespace interlock {

// One block of the partitioned model and its auxiliary head (empty for the
// last block and in E2E mode).
struct BlockModules {
  torch::nn::Sequential block{nullptr};
  torch::nn::Sequential head{nullptr};
};

// How the final block's output is turned into a loss.
struct FinalLoss {
  // 0: cross-entropy. Otherwise the test loss sum(scale * logits).
  float test_loss_scale = 0.0f;
};

// Number of blocks the model spec describes (model.blocks for "auto").
absl::StatusOr<int> NumBlocks(const interlock::v1::ModelSpec& spec);

// Number of units the model is built from (stem / embedding, residual
// blocks / decoder layers / hidden layers, classifier), from the spec alone:
// what a partition string counts (ParsePartition, plan/partition.h).
absl::StatusOr<int> NumUnits(const interlock::v1::ModelSpec& spec);

// Builds every block (and, when with_heads, the head of every block but the
// last). Parameters are initialised from `seed` in a fixed order that does not
// depend on which blocks a caller keeps, on with_heads, or on the thread: the
// block parameters of E2E and interlocking runs start identical, and a worker
// that keeps only block k gets the same values as the in-process engine.
// With keep_block >= 0 only that block need be usable: a family whose units
// are loaded rather than drawn from the seed (scripted) leaves the others as
// stand-ins that refuse to run, and so does kCheckOnly for every block (the
// cut and the head strings are still checked).
inline constexpr int kCheckOnly = -2;
absl::StatusOr<std::vector<BlockModules>> BuildModel(
    const interlock::v1::ModelSpec& spec, const DataShape& shape,
    bool with_heads, uint64_t seed, int keep_block = -1);

// Completes a spec with what its family reads from files before a run (a
// scripted model's model.pbtxt), so that the spec alone describes the model
// to the workers. Idempotent.
absl::Status ResolveModelSpec(interlock::v1::ModelSpec* spec);

// Tokens per sample of the text data the model reads (1 for other data).
int64_t TextContext(const interlock::v1::ModelSpec& spec);

// Whether the model computes in NHWC (model.resnet.memory_format).
bool ChannelsLast(const interlock::v1::ModelSpec& spec);

// Whether the model can read data of this kind: INVALID_ARGUMENT naming
// data.kind otherwise.
absl::Status CheckModelData(const interlock::v1::ModelSpec& spec,
                            interlock::v1::DataSpec::Kind kind);

// Shape of every block's output for one sample (batch dimension dropped),
// found by running one zero sample through the model in eval mode.
absl::StatusOr<std::vector<std::vector<int64_t>>> BlockOutputShapes(
    const interlock::v1::ModelSpec& spec, const DataShape& shape);

// The output shapes above and every block's trained parameter count (its
// own and, when with_heads, its head's): what the virtual clock needs, from
// one build of the model.
struct ModelProbe {
  std::vector<std::vector<int64_t>> output_shapes;
  std::vector<int64_t> trained_parameters;
};
absl::StatusOr<ModelProbe> ProbeModel(const interlock::v1::ModelSpec& spec,
                                      const DataShape& shape, bool with_heads);

// Shape of one sample of the data (no batch dimension) and its target.
std::vector<int64_t> SampleShape(const DataShape& shape);
std::vector<int64_t> TargetShape(const DataShape& shape);

FinalLoss FinalLossOf(const interlock::v1::ModelSpec& spec);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_MODELS_H_
