// What the model files share: the unit a family is built from, the family
// interface every model family implements (one file each: resnet.cc,
// transformer.cc, scripted.cc, the MLP in models.cc), and the transformer
// layers that auxiliary heads reuse. Private to services/models.cc and its
// families.
#ifndef INTERLOCK_SERVICES_MODELS_INTERNAL_H_
#define INTERLOCK_SERVICES_MODELS_INTERNAL_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/config.pb.h"
#include "services/data.h"

namespace interlock {
namespace models_internal {

namespace nn = torch::nn;

// Shape of the activation between units (batch dimension omitted).
struct Shape {
  enum Kind { kImage, kVector, kSequence, kTokens } kind = kImage;
  int64_t c = 0, h = 0, w = 0;  // kImage: C,H,W; kVector/kSequence: c = width
};

// One unit of the model and the shape it produces.
struct Unit {
  nn::AnyModule module;
  Shape out;
};

// A model family: what the `family` field of a ModelSpec names. A family
// is built from units that a partition cuts into blocks; everything else
// (the cut, the heads, initial seeds, the trainer, checkpoints, the clock)
// is the same for every family. Adding one: a class in its own file, its
// ModelSpec field in proto/config.proto, one line in Families()
// (models.cc).
class Family {
 public:
  virtual ~Family() = default;
  // Its ModelSpec field: "resnet", "transformer", ...
  virtual const char* name() const = 0;
  virtual bool Describes(const interlock::v1::ModelSpec& spec) const = 0;
  // Completes the spec with what the family reads from files before a run
  // (ResolveModelSpec, models.h).
  virtual absl::Status Resolve(interlock::v1::ModelSpec* spec) const {
    return absl::OkStatus();
  }
  // The units a partition counts, from the spec alone.
  virtual absl::StatusOr<int> NumUnits(
      const interlock::v1::ModelSpec& spec) const = 0;
  // Builds the units in order under the caller's seed. `wanted[u]` says
  // whether unit u will be kept (a worker keeps one block's); a family whose
  // initial values come from the seed builds every unit anyway, so values do
  // not depend on what is kept, and one that loads them may leave the
  // others as stand-ins that refuse to run.
  virtual absl::StatusOr<std::vector<Unit>> Units(
      const interlock::v1::ModelSpec& spec, const DataShape& data,
      const std::vector<bool>& wanted) const = 0;
  // The output shape of every unit without building any, when the family
  // knows them (empty otherwise: the caller runs a zero sample through).
  virtual absl::StatusOr<std::vector<std::vector<int64_t>>> UnitOutputShapes(
      const interlock::v1::ModelSpec& spec) const {
    return std::vector<std::vector<int64_t>>{};
  }
  // Whether the user gave the head of a block ending at unit `unit` (else
  // model.head builds it), and that head.
  virtual bool HasUserHead(const interlock::v1::ModelSpec& spec,
                           int unit) const {
    return false;
  }
  virtual absl::StatusOr<nn::Sequential> UserHead(
      const interlock::v1::ModelSpec& spec, int unit) const {
    return absl::UnimplementedError("no user heads in this family");
  }
  // Tokens per sample of the text data the model reads (1: not text).
  virtual int64_t TextContext(const interlock::v1::ModelSpec& spec) const {
    return 1;
  }
  // Whether the model can read data of this kind.
  virtual absl::Status CheckData(const interlock::v1::ModelSpec& spec,
                                 interlock::v1::DataSpec::Kind kind) const {
    return absl::OkStatus();
  }
  // Whether blocks and heads compute in NHWC (the trainer converts them).
  virtual bool ChannelsLast(const interlock::v1::ModelSpec& spec) const {
    return false;
  }
};

// The families, one instance each: ResNet (resnet.cc), the transformer
// (transformer.cc), the MLP (models.cc), scripted TorchScript units
// (scripted.cc).
const Family& ResNetFamily();
const Family& TransformerFamily();
const Family& MlpFamily();
const Family& ScriptedFamily();

// The transformer's choices with the spec's defaults resolved.
struct TransformerOptions {
  int64_t d = 0, heads = 0, d_ff = 0, layers = 0;
  bool gelu = true;
  interlock::v1::TransformerSpec::Init init =
      interlock::v1::TransformerSpec::PYTORCH_DEFAULT;
};

// Resolves the defaults; refuses unknown activation or init values.
absl::StatusOr<TransformerOptions> ResolveTransformer(
    const interlock::v1::TransformerSpec& t);

// Where a linear layer sits: the initialisation schemes treat them apart.
enum class LinearRole {
  kAttentionIn,     // query, key and value projection
  kAttentionOut,    // attention output, into the residual stream
  kFeedForwardIn,   // first feed-forward layer
  kFeedForwardOut,  // second feed-forward layer, into the residual stream
  kOutput,          // LM head and the auxiliary heads' linear layers
};

// A linear layer of the transformer initialised per o.init.
nn::Linear TransformerLinear(int64_t in, int64_t out,
                             const TransformerOptions& o, LinearRole role);

// Pre-LayerNorm decoder layer with causal multi-head self-attention.
struct DecoderLayerImpl : nn::Module {
  explicit DecoderLayerImpl(const TransformerOptions& o);
  torch::Tensor forward(const torch::Tensor& x);
  int64_t heads_;
  bool gelu_;
  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(DecoderLayer);

}  // namespace models_internal
}  // namespace interlock

#endif  // INTERLOCK_SERVICES_MODELS_INTERNAL_H_
