#include "services/models.h"

#include <cmath>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace interlock {
namespace {

namespace nn = torch::nn;
using interlock::v1::ModelSpec;

// Shape of the activation between units (batch dimension omitted).
struct Shape {
  enum Kind { kImage, kVector, kSequence, kTokens } kind = kImage;
  int64_t c = 0, h = 0, w = 0;  // kImage: C,H,W; kVector/kSequence: c = width
};

torch::Tensor Relu(torch::Tensor x) { return torch::relu(x); }

// theta * x elementwise (the test model of DESIGN §1).
struct ScaleImpl : nn::Module {
  explicit ScaleImpl(const std::vector<float>& init) {
    theta = register_parameter(
        "theta", torch::tensor(init, torch::dtype(torch::kFloat32)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x * theta; }
  torch::Tensor theta;
};
TORCH_MODULE(Scale);

struct BasicBlockImpl : nn::Module {
  BasicBlockImpl(int64_t in, int64_t planes, int64_t stride) {
    conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(in, planes, 3)
                                                    .stride(stride)
                                                    .padding(1)
                                                    .bias(false)));
    bn1 = register_module("bn1", nn::BatchNorm2d(planes));
    conv2 = register_module(
        "conv2",
        nn::Conv2d(
            nn::Conv2dOptions(planes, planes, 3).padding(1).bias(false)));
    bn2 = register_module("bn2", nn::BatchNorm2d(planes));
    if (stride != 1 || in != planes) {
      shortcut = register_module(
          "shortcut",
          nn::Sequential(
              nn::Conv2d(
                  nn::Conv2dOptions(in, planes, 1).stride(stride).bias(false)),
              nn::BatchNorm2d(planes)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = torch::relu(bn1(conv1(x)));
    out = bn2(conv2(out));
    out = out + (shortcut ? shortcut->forward(x) : x);
    return torch::relu(out);
  }
  nn::Conv2d conv1{nullptr}, conv2{nullptr};
  nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(BasicBlock);

struct BottleneckImpl : nn::Module {
  static constexpr int64_t kExpansion = 4;
  BottleneckImpl(int64_t in, int64_t planes, int64_t stride) {
    const int64_t out_planes = planes * kExpansion;
    conv1 = register_module(
        "conv1", nn::Conv2d(nn::Conv2dOptions(in, planes, 1).bias(false)));
    bn1 = register_module("bn1", nn::BatchNorm2d(planes));
    conv2 =
        register_module("conv2", nn::Conv2d(nn::Conv2dOptions(planes, planes, 3)
                                                .stride(stride)
                                                .padding(1)
                                                .bias(false)));
    bn2 = register_module("bn2", nn::BatchNorm2d(planes));
    conv3 = register_module(
        "conv3",
        nn::Conv2d(nn::Conv2dOptions(planes, out_planes, 1).bias(false)));
    bn3 = register_module("bn3", nn::BatchNorm2d(out_planes));
    if (stride != 1 || in != out_planes) {
      shortcut = register_module(
          "shortcut",
          nn::Sequential(nn::Conv2d(nn::Conv2dOptions(in, out_planes, 1)
                                        .stride(stride)
                                        .bias(false)),
                         nn::BatchNorm2d(out_planes)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = torch::relu(bn1(conv1(x)));
    out = torch::relu(bn2(conv2(out)));
    out = bn3(conv3(out));
    out = out + (shortcut ? shortcut->forward(x) : x);
    return torch::relu(out);
  }
  nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(Bottleneck);

// Global average pooling to [B, C].
struct GlobalPoolImpl : nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x.mean({2, 3}); }
};
TORCH_MODULE(GlobalPool);

// Conv3x3 + BatchNorm + ReLU stem fitted to the input channels.
struct StemImpl : nn::Module {
  StemImpl(int64_t in, int64_t out) {
    conv = register_module(
        "conv",
        nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1).bias(false)));
    bn = register_module("bn", nn::BatchNorm2d(out));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::relu(bn(conv(x)));
  }
  nn::Conv2d conv{nullptr};
  nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(Stem);

// Global average pooling and the linear classifier.
struct ClassifierImpl : nn::Module {
  ClassifierImpl(int64_t in, int64_t classes) {
    fc = register_module("fc", nn::Linear(in, classes));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc(x.dim() == 4 ? x.mean({2, 3}) : x);
  }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(Classifier);

// Hidden layer of the MLP: (flatten) + linear + ReLU.
struct MlpLayerImpl : nn::Module {
  MlpLayerImpl(int64_t in, int64_t out) {
    fc = register_module("fc", nn::Linear(in, out));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::relu(fc(x.dim() > 2 ? x.flatten(1) : x));
  }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(MlpLayer);

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

nn::Linear GptLinear(int64_t in, int64_t out) {
  nn::Linear l(in, out);
  nn::init::normal_(l->weight, 0.0, 0.02);
  nn::init::zeros_(l->bias);
  return l;
}

// Pre-LayerNorm decoder layer with causal multi-head self-attention.
struct DecoderLayerImpl : nn::Module {
  DecoderLayerImpl(int64_t d, int64_t heads, int64_t d_ff) : heads_(heads) {
    ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})));
    qkv = register_module("qkv", GptLinear(d, 3 * d));
    proj = register_module("proj", GptLinear(d, d));
    ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", GptLinear(d, d_ff));
    fc2 = register_module("fc2", GptLinear(d_ff, d));
  }
  torch::Tensor forward(const torch::Tensor& x) {
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
  int64_t heads_;
  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(DecoderLayer);

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

// One unit of the model and the shape it produces.
struct Unit {
  nn::AnyModule module;
  Shape out;
};

absl::StatusOr<std::vector<int64_t>> ParseIntList(const std::string& s,
                                                  const std::string& what) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(s, ',')) {
    int64_t v;
    if (!absl::SimpleAtoi(part, &v) || v <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": '", part, "' in '", s, "' is not a positive integer"));
    }
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<std::vector<Unit>> ResNetUnits(
    const interlock::v1::ResNetSpec& r, const DataShape& data) {
  if (data.is_text || data.is_vector) {
    return absl::InvalidArgumentError(
        "model.resnet: needs image data (channels x height x width)");
  }
  if (data.channels != 1 && data.channels != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.resnet: input has ", data.channels,
                     " channels, expected 1 or 3"));
  }
  const std::string type = r.block_type().empty() ? "basic" : r.block_type();
  if (type != "basic" && type != "bottleneck") {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.resnet.block_type: '", type, "', expected basic or bottleneck"));
  }
  if (r.architecture().empty()) {
    return absl::InvalidArgumentError(
        "model.resnet.architecture: empty, expected 'planes,blocks/...'");
  }
  std::vector<std::pair<int64_t, int64_t>> stages;
  for (absl::string_view stage : absl::StrSplit(r.architecture(), '/')) {
    auto nums = ParseIntList(std::string(stage), "model.resnet.architecture");
    if (!nums.ok()) return nums.status();
    if (nums->size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.resnet.architecture: stage '", stage,
                       "' must be 'planes,blocks'"));
    }
    stages.emplace_back((*nums)[0], (*nums)[1]);
  }
  std::vector<Unit> units;
  const int64_t stem = r.stem_planes() > 0 ? r.stem_planes() : stages[0].first;
  Shape s{Shape::kImage, stem, data.height, data.width};
  units.push_back({nn::AnyModule(Stem(data.channels, stem)), s});
  int64_t in = stem;
  for (size_t i = 0; i < stages.size(); ++i) {
    for (int64_t b = 0; b < stages[i].second; ++b) {
      const int64_t stride = (i > 0 && b == 0) ? 2 : 1;
      const int64_t planes = stages[i].first;
      if (stride == 2) {
        s.h = (s.h + 1) / 2;
        s.w = (s.w + 1) / 2;
      }
      if (type == "basic") {
        units.push_back({nn::AnyModule(BasicBlock(in, planes, stride)), s});
        in = planes;
      } else {
        units.push_back({nn::AnyModule(Bottleneck(in, planes, stride)), s});
        in = planes * BottleneckImpl::kExpansion;
      }
      units.back().out.c = in;
      s.c = in;
    }
  }
  units.push_back({nn::AnyModule(Classifier(in, data.classes)),
                   Shape{Shape::kVector, data.classes, 1, 1}});
  return units;
}

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

absl::StatusOr<std::vector<Unit>> MlpUnits(const interlock::v1::MlpSpec& m,
                                           const DataShape& data) {
  if (data.is_text) {
    return absl::InvalidArgumentError("model.mlp: needs image or vector data");
  }
  if (m.hidden_size() == 0) {
    return absl::InvalidArgumentError(
        "model.mlp.hidden: needs at least one width");
  }
  int64_t in = data.channels * data.height * data.width;
  std::vector<Unit> units;
  for (int i = 0; i < m.hidden_size(); ++i) {
    if (m.hidden(i) <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.mlp.hidden[", i, "]: must be > 0"));
    }
    units.push_back({nn::AnyModule(MlpLayer(in, m.hidden(i))),
                     Shape{Shape::kVector, m.hidden(i), 1, 1}});
    in = m.hidden(i);
  }
  units.push_back({nn::AnyModule(nn::Linear(in, data.classes)),
                   Shape{Shape::kVector, data.classes, 1, 1}});
  return units;
}

absl::StatusOr<std::vector<float>> ScaleValues(
    const interlock::v1::ScaleSpec::Values& v, const std::string& what) {
  if (v.value_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": no values"));
  }
  return std::vector<float>(v.value().begin(), v.value().end());
}

// Builds an auxiliary head from a string such as "conv128_bn_gbpl_fc".
absl::StatusOr<nn::Sequential> BuildHead(const ModelSpec& spec, Shape s,
                                         const DataShape& data) {
  nn::Sequential head;
  if (spec.head().empty()) {
    return absl::InvalidArgumentError(
        "model.head: empty; every block but the last needs an auxiliary head "
        "(e.g. 'gbpl_fc', 'fc' or 'ln_fc')");
  }
  for (absl::string_view tok : absl::StrSplit(spec.head(), '_')) {
    int64_t width = 0;
    const bool image = s.kind == Shape::kImage;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model.head: layer '", tok, "' in '", spec.head(), "' ", why));
    };
    if (absl::ConsumePrefix(&tok, "conv")) {
      if (!image) return bad("needs an image activation");
      if (!absl::SimpleAtoi(tok, &width) || width <= 0) {
        return bad("needs a positive channel count, e.g. conv64");
      }
      head->push_back(
          nn::Conv2d(nn::Conv2dOptions(s.c, width, 3).padding(1).bias(false)));
      s.c = width;
    } else if (tok == "bn") {
      if (!image) return bad("needs an image activation");
      head->push_back(nn::BatchNorm2d(s.c));
      head->push_back(nn::Functional(Relu));
    } else if (tok == "relu") {
      head->push_back(nn::Functional(Relu));
    } else if (tok == "gbpl") {
      if (!image) return bad("needs an image activation");
      head->push_back(GlobalPool());
      s = Shape{Shape::kVector, s.c, 1, 1};
    } else if (tok == "ln") {
      if (image) return bad("needs a vector or sequence activation");
      head->push_back(nn::LayerNorm(nn::LayerNormOptions({s.c})));
    } else if (tok == "layer") {
      if (s.kind != Shape::kSequence || !spec.has_transformer()) {
        return bad("is only valid for the transformer");
      }
      const auto& t = spec.transformer();
      head->push_back(DecoderLayer(t.d_model(), t.heads(),
                                   t.d_ff() > 0 ? t.d_ff() : 4 * t.d_model()));
    } else if (absl::ConsumePrefix(&tok, "fc")) {
      if (image) {
        head->push_back(nn::Flatten());
        s = Shape{Shape::kVector, s.c * s.h * s.w, 1, 1};
      }
      const bool hidden = !tok.empty();
      if (hidden && (!absl::SimpleAtoi(tok, &width) || width <= 0)) {
        return bad("needs a positive width, e.g. fc or fc128");
      }
      const int64_t out = hidden ? width : data.classes;
      if (spec.has_transformer()) {
        head->push_back(GptLinear(s.c, out));
      } else {
        head->push_back(nn::Linear(s.c, out));
      }
      if (hidden) head->push_back(nn::Functional(Relu));
      s.c = out;
    } else {
      return bad(
          "is unknown; known layers: convN, bn, relu, gbpl, ln, layer, fc, "
          "fcN");
    }
  }
  const bool ends_in_classes =
      s.c == data.classes && s.kind != Shape::kImage && head->size() > 0;
  if (!ends_in_classes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.head: '", spec.head(), "' must end in 'fc' (a linear layer to ",
        data.classes, " outputs)"));
  }
  return head;
}

std::mutex& InitMutex() {
  static std::mutex* m = new std::mutex;
  return *m;
}

}  // namespace

absl::StatusOr<std::vector<int>> ParsePartition(const std::string& partition,
                                                int units, int blocks) {
  std::vector<int> counts;
  if (partition.empty()) {
    if (blocks <= 0) {
      return absl::InvalidArgumentError(
          "model.partition: empty and model.blocks not set; give one of them");
    }
    if (blocks > units) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.blocks: ", blocks,
                       " blocks but the model has only ", units, " units"));
    }
    for (int k = 0; k < blocks; ++k) {
      counts.push_back((k + 1) * units / blocks - k * units / blocks);
    }
    return counts;
  }
  std::vector<std::string> parts = absl::StrSplit(partition, ',');
  int used = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    if (p == "rest") {
      if (i + 1 != parts.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model.partition: 'rest' may only be last in '", partition, "'"));
      }
      if (units - used <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("model.partition: '", partition,
                         "' leaves no unit for 'rest' (the "
                         "model has ",
                         units, " units)"));
      }
      counts.push_back(units - used);
      used = units;
      continue;
    }
    int v;
    if (!absl::SimpleAtoi(p, &v) || v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.partition: '", p, "' in '", partition,
                       "' is not a positive integer or 'rest'"));
    }
    counts.push_back(v);
    used += v;
  }
  if (used != units) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.partition: '", partition, "' covers ", used,
        " units but the model has ", units,
        " (stem/embedding + residual blocks/layers + classifier)"));
  }
  if (blocks > 0 && static_cast<int>(counts.size()) != blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.partition: '", partition, "' gives ", counts.size(),
                     " blocks but model.blocks is ", blocks));
  }
  return counts;
}

absl::StatusOr<int> NumBlocks(const ModelSpec& spec) {
  if (spec.has_scale()) return spec.scale().block_init_size();
  if (!spec.partition().empty()) {
    return static_cast<int>(
        std::vector<std::string>(absl::StrSplit(spec.partition(), ',')).size());
  }
  if (spec.blocks() <= 0) {
    return absl::InvalidArgumentError(
        "model: set model.partition or model.blocks");
  }
  return spec.blocks();
}

FinalLoss FinalLossOf(const ModelSpec& spec) {
  FinalLoss f;
  if (spec.has_scale()) f.test_loss_scale = spec.scale().test_loss_scale();
  return f;
}

absl::StatusOr<std::vector<BlockModules>> BuildModel(const ModelSpec& spec,
                                                     const DataShape& shape,
                                                     bool with_heads,
                                                     uint64_t seed) {
  // The default generator is process-wide: building under one lock keeps
  // initial values independent of what other threads do.
  std::lock_guard<std::mutex> lock(InitMutex());
  try {
    torch::manual_seed(seed);
    std::vector<BlockModules> blocks;
    if (spec.has_scale()) {
      const auto& sc = spec.scale();
      const int k_blocks = sc.block_init_size();
      if (k_blocks == 0) {
        return absl::InvalidArgumentError("model.scale.block_init: no blocks");
      }
      if (with_heads && sc.head_init_size() != k_blocks - 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("model.scale.head_init: ", sc.head_init_size(),
                         " heads given, expected one per block but the last (",
                         k_blocks - 1, ")"));
      }
      for (int k = 0; k < k_blocks; ++k) {
        auto v = ScaleValues(sc.block_init(k),
                             absl::StrCat("model.scale.block_init[", k, "]"));
        if (!v.ok()) return v.status();
        BlockModules b;
        b.block = nn::Sequential(Scale(*v));
        if (with_heads && k + 1 < k_blocks) {
          auto h = ScaleValues(sc.head_init(k),
                               absl::StrCat("model.scale.head_init[", k, "]"));
          if (!h.ok()) return h.status();
          b.head = nn::Sequential(Scale(*h));
        }
        blocks.push_back(std::move(b));
      }
      return blocks;
    }
    absl::StatusOr<std::vector<Unit>> units;
    if (spec.has_resnet()) {
      units = ResNetUnits(spec.resnet(), shape);
    } else if (spec.has_transformer()) {
      units = TransformerUnits(spec.transformer(), shape);
    } else if (spec.has_mlp()) {
      units = MlpUnits(spec.mlp(), shape);
    } else {
      return absl::InvalidArgumentError(
          "model: no family set (resnet, transformer, mlp or scale)");
    }
    if (!units.ok()) return units.status();
    auto counts = ParsePartition(
        spec.partition(), static_cast<int>(units->size()), spec.blocks());
    if (!counts.ok()) return counts.status();
    size_t next = 0;
    std::vector<Shape> out_shapes;
    for (int c : *counts) {
      BlockModules b;
      b.block = nn::Sequential();
      for (int i = 0; i < c; ++i, ++next) {
        b.block->push_back((*units)[next].module);
      }
      out_shapes.push_back((*units)[next - 1].out);
      blocks.push_back(std::move(b));
    }
    if (with_heads) {
      for (size_t k = 0; k + 1 < blocks.size(); ++k) {
        // Heads draw from their own stream so block values do not depend on
        // whether heads exist.
        torch::manual_seed(seed ^ (0x9E3779B97F4A7C15ULL * (k + 1)));
        auto head = BuildHead(spec, out_shapes[k], shape);
        if (!head.ok()) return head.status();
        blocks[k].head = *head;
      }
    }
    return blocks;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: building failed: ", e.what()));
  }
}

std::vector<int64_t> SampleShape(const DataShape& shape) {
  if (shape.is_text) return {shape.context};
  if (shape.is_vector) return {shape.channels};
  return {shape.channels, shape.height, shape.width};
}

std::vector<int64_t> TargetShape(const DataShape& shape) {
  if (shape.is_text) return {shape.context};
  return {};
}

absl::StatusOr<std::vector<std::vector<int64_t>>> BlockOutputShapes(
    const ModelSpec& spec, const DataShape& shape) {
  auto blocks = BuildModel(spec, shape, /*with_heads=*/false, 0);
  if (!blocks.ok()) return blocks.status();
  try {
    torch::NoGradGuard no_grad;
    std::vector<int64_t> dims = SampleShape(shape);
    dims.insert(dims.begin(), 1);
    torch::Tensor x = shape.is_text
                          ? torch::zeros(dims, torch::dtype(torch::kInt64))
                          : torch::zeros(dims);
    std::vector<std::vector<int64_t>> out;
    for (auto& b : *blocks) {
      b.block->eval();
      x = b.block->forward(x);
      out.emplace_back(x.sizes().begin() + 1, x.sizes().end());
    }
    return out;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: probing block shapes failed: ", e.what()));
  }
}

}  // namespace interlock
