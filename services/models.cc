// Models cut depth-wise into blocks: the registry of model families (the MLP
// here, ResNet, the transformer and scripted TorchScript units in files of
// their own), the scale test model, the partition into blocks, the
// auxiliary heads and the blocks' output shapes.
#include "services/models.h"

#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "plan/status_macros.h"
#include "services/models_internal.h"

namespace interlock {
namespace {

namespace nn = torch::nn;
using interlock::v1::ModelSpec;
using models_internal::DecoderLayer;
using models_internal::Family;
using models_internal::Shape;
using models_internal::Unit;

torch::Tensor Relu(torch::Tensor x) { return torch::relu(x); }

// theta * x elementwise (the worked examples' test model).
struct ScaleImpl : nn::Module {
  explicit ScaleImpl(const std::vector<float>& init) {
    theta = register_parameter(
        "theta", torch::tensor(init, torch::dtype(torch::kFloat32)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x * theta; }
  torch::Tensor theta;
};
TORCH_MODULE(Scale);

// Global average pooling to [B, C].
struct GlobalPoolImpl : nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x.mean({2, 3}); }
};
TORCH_MODULE(GlobalPool);

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

class Mlp : public Family {
 public:
  const char* name() const override { return "mlp"; }
  bool Describes(const ModelSpec& spec) const override {
    return spec.has_mlp();
  }
  absl::StatusOr<int> NumUnits(const ModelSpec& spec) const override {
    // The hidden layers and the classifier.
    return spec.mlp().hidden_size() + 1;
  }
  absl::StatusOr<std::vector<Unit>> Units(
      const ModelSpec& spec, const DataShape& data,
      const std::vector<bool>& wanted) const override {
    return MlpUnits(spec.mlp(), data);
  }
};

// Every family, in the order of ModelSpec's fields.
const std::vector<const Family*>& Families() {
  static const auto* families = new std::vector<const Family*>{
      &models_internal::ResNetFamily(), &models_internal::TransformerFamily(),
      &models_internal::MlpFamily(), &models_internal::ScriptedFamily()};
  return *families;
}

// The family of the spec; INVALID_ARGUMENT when it names none (the scale
// test model is built as blocks, not units, and has none).
absl::StatusOr<const Family*> FamilyOf(const ModelSpec& spec) {
  for (const Family* f : Families()) {
    if (f->Describes(spec)) return f;
  }
  std::vector<std::string> names;
  for (const Family* f : Families()) names.push_back(f->name());
  return absl::InvalidArgumentError(
      absl::StrCat("model: no family set (", absl::StrJoin(names, ", "),
                   "; or scale for the worked examples)"));
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
      ASSIGN_OR_RETURN(const auto o,
                       models_internal::ResolveTransformer(spec.transformer()));
      head->push_back(DecoderLayer(o));
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
        ASSIGN_OR_RETURN(const auto o, models_internal::ResolveTransformer(
                                           spec.transformer()));
        head->push_back(models_internal::TransformerLinear(
            s.c, out, o, models_internal::LinearRole::kOutput));
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

namespace models_internal {
const Family& MlpFamily() {
  static const Mlp* family = new Mlp;
  return *family;
}
}  // namespace models_internal

absl::StatusOr<int> NumBlocks(const ModelSpec& spec) {
  if (spec.has_scale()) return spec.scale().block_init_size();
  if (spec.partition() == kAutoPartition) {
    if (spec.blocks() <= 0) {
      return absl::InvalidArgumentError(
          "model.partition: 'auto' needs model.blocks, the number of blocks "
          "K to cut the model into");
    }
    return spec.blocks();
  }
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

absl::StatusOr<int> NumUnits(const ModelSpec& spec) {
  if (spec.has_scale()) {
    return absl::InvalidArgumentError(
        "model.scale: built as blocks, not from units that a partition cuts");
  }
  ASSIGN_OR_RETURN(const Family* family, FamilyOf(spec));
  return family->NumUnits(spec);
}

absl::Status ResolveModelSpec(ModelSpec* spec) {
  if (spec->has_scale()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const Family* family, FamilyOf(*spec));
  return family->Resolve(spec);
}

int64_t TextContext(const ModelSpec& spec) {
  auto family = FamilyOf(spec);
  return family.ok() ? (*family)->TextContext(spec) : 1;
}

bool ChannelsLast(const ModelSpec& spec) {
  auto family = FamilyOf(spec);
  return family.ok() && (*family)->ChannelsLast(spec);
}

absl::Status CheckModelData(const ModelSpec& spec,
                            interlock::v1::DataSpec::Kind kind) {
  auto family = FamilyOf(spec);
  if (!family.ok()) return absl::OkStatus();
  return (*family)->CheckData(spec, kind);
}

FinalLoss FinalLossOf(const ModelSpec& spec) {
  FinalLoss f;
  if (spec.has_scale()) f.test_loss_scale = spec.scale().test_loss_scale();
  return f;
}

absl::StatusOr<std::vector<BlockModules>> BuildModel(const ModelSpec& spec,
                                                     const DataShape& shape,
                                                     bool with_heads,
                                                     uint64_t seed,
                                                     int keep_block) {
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
    ASSIGN_OR_RETURN(const Family* family, FamilyOf(spec));
    ASSIGN_OR_RETURN(const int num_units, family->NumUnits(spec));
    ASSIGN_OR_RETURN(
        const std::vector<int> counts,
        ParsePartition(spec.partition(), num_units, spec.blocks()));
    if (keep_block >= static_cast<int>(counts.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", keep_block, " outside [0, ", counts.size(), ")"));
    }
    std::vector<bool> wanted(num_units, keep_block == -1);
    std::vector<int> last_unit;  // of each block
    for (int k = 0, next = 0; k < static_cast<int>(counts.size()); ++k) {
      for (int i = 0; i < counts[k]; ++i, ++next) {
        if (k == keep_block) wanted[next] = true;
      }
      last_unit.push_back(next - 1);
    }
    ASSIGN_OR_RETURN(std::vector<Unit> units,
                     family->Units(spec, shape, wanted));
    if (static_cast<int>(units.size()) != num_units) {
      return absl::InternalError(absl::StrCat("model.", family->name(),
                                              ": built ", units.size(),
                                              " units, counted ", num_units));
    }
    size_t next = 0;
    for (int c : counts) {
      BlockModules b;
      b.block = nn::Sequential();
      for (int i = 0; i < c; ++i, ++next) {
        b.block->push_back(units[next].module);
      }
      blocks.push_back(std::move(b));
    }
    if (with_heads) {
      for (size_t k = 0; k + 1 < blocks.size(); ++k) {
        const int unit = last_unit[k];
        if (family->HasUserHead(spec, unit)) {
          // Loaded only where it will be used.
          if (keep_block == -1 || keep_block == static_cast<int>(k)) {
            ASSIGN_OR_RETURN(blocks[k].head, family->UserHead(spec, unit));
          }
          continue;
        }
        // Heads draw from their own stream so block values do not depend on
        // whether heads exist.
        torch::manual_seed(seed ^ (0x9E3779B97F4A7C15ULL * (k + 1)));
        ASSIGN_OR_RETURN(blocks[k].head,
                         BuildHead(spec, units[unit].out, shape));
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
  // A family that knows its units' shapes is not built (a worker holds only
  // its own block's scripted units).
  if (!spec.has_scale()) {
    ASSIGN_OR_RETURN(const Family* family, FamilyOf(spec));
    ASSIGN_OR_RETURN(auto unit_shapes, family->UnitOutputShapes(spec));
    if (!unit_shapes.empty()) {
      ASSIGN_OR_RETURN(
          const std::vector<int> counts,
          ParsePartition(spec.partition(), static_cast<int>(unit_shapes.size()),
                         spec.blocks()));
      std::vector<std::vector<int64_t>> out;
      int next = 0;
      for (int c : counts) {
        next += c;
        out.push_back(unit_shapes[next - 1]);
      }
      return out;
    }
  }
  ASSIGN_OR_RETURN(ModelProbe probe,
                   ProbeModel(spec, shape, /*with_heads=*/false));
  return std::move(probe.output_shapes);
}

absl::StatusOr<ModelProbe> ProbeModel(const ModelSpec& spec,
                                      const DataShape& shape, bool with_heads) {
  auto blocks = BuildModel(spec, shape, with_heads, 0);
  if (!blocks.ok()) return blocks.status();
  try {
    torch::NoGradGuard no_grad;
    std::vector<int64_t> dims = SampleShape(shape);
    dims.insert(dims.begin(), 1);
    torch::Tensor x = shape.is_text
                          ? torch::zeros(dims, torch::dtype(torch::kInt64))
                          : torch::zeros(dims);
    ModelProbe out;
    for (auto& b : *blocks) {
      b.block->eval();
      x = b.block->forward(x);
      out.output_shapes.emplace_back(x.sizes().begin() + 1, x.sizes().end());
      int64_t count = 0;
      for (const auto* part : {&b.block, &b.head}) {
        if (!*part) continue;
        for (const auto& p : (*part)->parameters()) count += p.numel();
      }
      out.trained_parameters.push_back(count);
    }
    return out;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: probing block shapes failed: ", e.what()));
  }
}

}  // namespace interlock
