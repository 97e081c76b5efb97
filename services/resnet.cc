// ResNet: a stem, basic or bottleneck residual blocks and a classifier, each
// one unit.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "services/models_internal.h"

namespace interlock {
namespace models_internal {
namespace {

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

}  // namespace

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
  if (!interlock::v1::ResNetSpec::MemoryFormat_IsValid(r.memory_format())) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.resnet.memory_format: ", r.memory_format(),
                     ", expected CONTIGUOUS or CHANNELS_LAST"));
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

}  // namespace models_internal
}  // namespace interlock
