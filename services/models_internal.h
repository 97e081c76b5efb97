// What the model files share: the unit a family is built from, the family
// builders of resnet.cc and transformer.cc, and the transformer layers that
// auxiliary heads reuse. Private to services/models.cc and its families.
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

// resnet.cc
absl::StatusOr<std::vector<Unit>> ResNetUnits(
    const interlock::v1::ResNetSpec& r, const DataShape& data);

// transformer.cc
absl::StatusOr<std::vector<Unit>> TransformerUnits(
    const interlock::v1::TransformerSpec& t, const DataShape& data);

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
