// The decoder-only transformer over bytes: embeddings, decoder layers and the
// language-model head, each one unit.
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "services/models_internal.h"

namespace interlock {
namespace models_internal {
namespace {

using interlock::v1::TransformerSpec;

// Token and position embeddings: [B, T] int64 -> [B, T, D].
struct EmbeddingImpl : nn::Module {
  EmbeddingImpl(int64_t vocab, int64_t context, const TransformerOptions& o) {
    // nn::Embedding starts N(0, 1), PyTorch's default.
    tokens = register_module("tokens", nn::Embedding(vocab, o.d));
    positions = register_module("positions", nn::Embedding(context, o.d));
    if (o.init != TransformerSpec::PYTORCH_DEFAULT) {
      nn::init::normal_(tokens->weight, 0.0, 0.02);
      nn::init::normal_(positions->weight, 0.0, 0.02);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto pos = torch::arange(x.size(1), torch::dtype(torch::kInt64));
    return tokens(x) + positions(pos).unsqueeze(0);
  }
  nn::Embedding tokens{nullptr}, positions{nullptr};
};
TORCH_MODULE(Embedding);

}  // namespace

absl::StatusOr<TransformerOptions> ResolveTransformer(
    const TransformerSpec& t) {
  TransformerOptions o;
  o.d = t.d_model();
  o.heads = t.heads();
  o.d_ff = t.d_ff() > 0 ? t.d_ff() : 4 * t.d_model();
  o.layers = t.layers();
  switch (t.activation()) {
    case TransformerSpec::ACTIVATION_UNSPECIFIED:
    case TransformerSpec::GELU:
      o.gelu = true;
      break;
    case TransformerSpec::RELU:
      o.gelu = false;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("model.transformer.activation: unknown value ",
                       t.activation(), "; expected GELU or RELU"));
  }
  switch (t.init()) {
    case TransformerSpec::INIT_UNSPECIFIED:
    case TransformerSpec::PYTORCH_DEFAULT:
      o.init = TransformerSpec::PYTORCH_DEFAULT;
      break;
    case TransformerSpec::GPT2:
    case TransformerSpec::NORMAL:
      o.init = t.init();
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("model.transformer.init: unknown value ", t.init(),
                       "; expected PYTORCH_DEFAULT, GPT2 or NORMAL"));
  }
  return o;
}

nn::Linear TransformerLinear(int64_t in, int64_t out,
                             const TransformerOptions& o, LinearRole role) {
  // nn::Linear starts as PyTorch's: U(+-1/sqrt(in)) for weight and bias. The
  // schemes overwrite that after construction, so one scheme's draws never
  // depend on another's.
  nn::Linear l(in, out);
  const bool residual =
      role == LinearRole::kAttentionOut || role == LinearRole::kFeedForwardOut;
  switch (o.init) {
    case TransformerSpec::PYTORCH_DEFAULT:
      // nn.MultiheadAttention: Xavier-uniform input projection, zero biases.
      if (role == LinearRole::kAttentionIn) {
        nn::init::xavier_uniform_(l->weight);
      }
      if (role == LinearRole::kAttentionIn ||
          role == LinearRole::kAttentionOut) {
        nn::init::zeros_(l->bias);
      }
      break;
    case TransformerSpec::GPT2:
      // Each layer adds two residual projections: keep the stream's variance
      // growth independent of depth.
      nn::init::normal_(l->weight, 0.0,
                        residual ? 0.02 / std::sqrt(2.0 * o.layers) : 0.02);
      nn::init::zeros_(l->bias);
      break;
    default:
      nn::init::normal_(l->weight, 0.0, 0.02);
      nn::init::zeros_(l->bias);
  }
  return l;
}

DecoderLayerImpl::DecoderLayerImpl(const TransformerOptions& o)
    : heads_(o.heads), gelu_(o.gelu) {
  const int64_t d = o.d;
  ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})));
  qkv = register_module(
      "qkv", TransformerLinear(d, 3 * d, o, LinearRole::kAttentionIn));
  proj = register_module("proj",
                         TransformerLinear(d, d, o, LinearRole::kAttentionOut));
  ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})));
  fc1 = register_module(
      "fc1", TransformerLinear(d, o.d_ff, o, LinearRole::kFeedForwardIn));
  fc2 = register_module(
      "fc2", TransformerLinear(o.d_ff, d, o, LinearRole::kFeedForwardOut));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
  const int64_t dh = d / heads_;
  auto parts = qkv(ln1(x)).split(d, 2);
  auto q = parts[0].view({b, t, heads_, dh}).transpose(1, 2);
  auto k = parts[1].view({b, t, heads_, dh}).transpose(1, 2);
  auto v = parts[2].view({b, t, heads_, dh}).transpose(1, 2);
  auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(dh));
  auto mask = torch::ones({t, t}, torch::dtype(torch::kBool)).triu(1);
  att = att.masked_fill(mask, -std::numeric_limits<float>::infinity());
  att = torch::softmax(att, -1);
  auto y = torch::matmul(att, v).transpose(1, 2).reshape({b, t, d});
  auto h = x + proj(y);
  auto f = fc1(ln2(h));
  return h + fc2(gelu_ ? torch::gelu(f) : torch::relu(f));
}

namespace {

// Final LayerNorm and the language-model head.
struct LmHeadImpl : nn::Module {
  LmHeadImpl(int64_t vocab, const TransformerOptions& o) {
    ln = register_module("ln", nn::LayerNorm(nn::LayerNormOptions({o.d})));
    fc = register_module("fc",
                         TransformerLinear(o.d, vocab, o, LinearRole::kOutput));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc(ln(x)); }
  nn::LayerNorm ln{nullptr};
  nn::Linear fc{nullptr};
};
TORCH_MODULE(LmHead);

absl::StatusOr<std::vector<Unit>> TransformerUnits(
    const interlock::v1::TransformerSpec& t, const DataShape& data) {
  if (!data.is_text) {
    return absl::InvalidArgumentError(
        "model.transformer: needs text data (data.kind TEXT, "
        "SYNTHETIC_TEXT or TOKEN_FILE)");
  }
  if (t.d_model() <= 0 || t.layers() <= 0 || t.heads() <= 0 ||
      t.context() <= 0) {
    return absl::InvalidArgumentError(
        "model.transformer: d_model, layers, heads and context must be > 0");
  }
  if (t.d_model() % t.heads() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.transformer.heads: ", t.heads(),
                     " does not divide d_model ", t.d_model()));
  }
  ASSIGN_OR_RETURN(const TransformerOptions o, ResolveTransformer(t));
  std::vector<Unit> units;
  Shape s{Shape::kSequence, o.d, t.context(), 1};
  units.push_back({nn::AnyModule(Embedding(data.classes, t.context(), o)), s});
  for (int i = 0; i < t.layers(); ++i) {
    units.push_back({nn::AnyModule(DecoderLayer(o)), s});
  }
  units.push_back({nn::AnyModule(LmHead(data.classes, o)),
                   Shape{Shape::kSequence, data.classes, t.context(), 1}});
  return units;
}

class Transformer : public Family {
 public:
  const char* name() const override { return "transformer"; }
  bool Describes(const interlock::v1::ModelSpec& spec) const override {
    return spec.has_transformer();
  }
  absl::StatusOr<int> NumUnits(
      const interlock::v1::ModelSpec& spec) const override {
    // The embedding, the decoder layers, the final norm and LM head.
    return spec.transformer().layers() + 2;
  }
  absl::StatusOr<std::vector<Unit>> Units(
      const interlock::v1::ModelSpec& spec, const DataShape& data,
      const std::vector<bool>& wanted) const override {
    return TransformerUnits(spec.transformer(), data);
  }
  int64_t TextContext(const interlock::v1::ModelSpec& spec) const override {
    return spec.transformer().context();
  }
  absl::Status CheckData(const interlock::v1::ModelSpec& spec,
                         interlock::v1::DataSpec::Kind kind) const override {
    if (!IsTextKind(kind)) {
      return absl::InvalidArgumentError(
          "data.kind: the transformer needs TEXT, SYNTHETIC_TEXT or "
          "TOKEN_FILE data");
    }
    return absl::OkStatus();
  }
};

}  // namespace

const Family& TransformerFamily() {
  static const Transformer* family = new Transformer;
  return *family;
}

}  // namespace models_internal
}  // namespace interlock
