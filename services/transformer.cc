// The decoder-only transformer over bytes: embeddings, decoder layers and the
// language-model head, each one unit.
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/models_internal.h"

namespace interlock {
namespace models_internal {
namespace {

// Token and position embeddings: [B, T] int64 -> [B, T, D].
struct EmbeddingImpl : nn::Module {
  EmbeddingImpl(int64_t vocab, int64_t context, int64_t d) {
    tokens = register_module("tokens", nn::Embedding(vocab, d));
    positions = register_module("positions", nn::Embedding(context, d));
    nn::init::normal_(tokens->weight, 0.0, 0.02);
    nn::init::normal_(positions->weight, 0.0, 0.02);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto pos = torch::arange(x.size(1), torch::dtype(torch::kInt64));
    return tokens(x) + positions(pos).unsqueeze(0);
  }
  nn::Embedding tokens{nullptr}, positions{nullptr};
};
TORCH_MODULE(Embedding);

}  // namespace

nn::Linear GptLinear(int64_t in, int64_t out) {
  nn::Linear l(in, out);
  nn::init::normal_(l->weight, 0.0, 0.02);
  nn::init::zeros_(l->bias);
  return l;
}

DecoderLayerImpl::DecoderLayerImpl(int64_t d, int64_t heads, int64_t d_ff)
    : heads_(heads) {
  ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})));
  qkv = register_module("qkv", GptLinear(d, 3 * d));
  proj = register_module("proj", GptLinear(d, d));
  ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})));
  fc1 = register_module("fc1", GptLinear(d, d_ff));
  fc2 = register_module("fc2", GptLinear(d_ff, d));
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
  return h + fc2(torch::gelu(fc1(ln2(h))));
}

namespace {

// Final LayerNorm and the language-model head.
struct LmHeadImpl : nn::Module {
  LmHeadImpl(int64_t d, int64_t vocab) {
    ln = register_module("ln", nn::LayerNorm(nn::LayerNormOptions({d})));
    fc = register_module("fc", GptLinear(d, vocab));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc(ln(x)); }
  nn::LayerNorm ln{nullptr};
  nn::Linear fc{nullptr};
};
TORCH_MODULE(LmHead);

}  // namespace

absl::StatusOr<std::vector<Unit>> TransformerUnits(
    const interlock::v1::TransformerSpec& t, const DataShape& data) {
  if (!data.is_text) {
    return absl::InvalidArgumentError(
        "model.transformer: needs text data (data.kind TEXT or "
        "SYNTHETIC_TEXT)");
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
  const int64_t d = t.d_model();
  const int64_t d_ff = t.d_ff() > 0 ? t.d_ff() : 4 * d;
  std::vector<Unit> units;
  Shape s{Shape::kSequence, d, t.context(), 1};
  units.push_back({nn::AnyModule(Embedding(data.classes, t.context(), d)), s});
  for (int i = 0; i < t.layers(); ++i) {
    units.push_back({nn::AnyModule(DecoderLayer(d, t.heads(), d_ff)), s});
  }
  units.push_back({nn::AnyModule(LmHead(d, data.classes)),
                   Shape{Shape::kSequence, data.classes, t.context(), 1}});
  return units;
}

}  // namespace models_internal
}  // namespace interlock
