// ResNet: a stem, basic or bottleneck residual blocks and a classifier, each
// one unit.
#include <ATen/record_function.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "services/models_internal.h"
#include "services/norm_kernels.h"

namespace interlock {
namespace models_internal {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr auto kChannelsLast = at::MemoryFormat::ChannelsLast;
// Channels per task and rows per task of the fused layer's loops on more
// than one intra-op thread; each channel is summed in the same order
// whatever the split.
constexpr int64_t kChannelGrain = 16;
constexpr int64_t kRowGrain = 1024;

float* Floats(const torch::Tensor& t) { return t.data_ptr<float>(); }

// Training-mode BatchNorm, then the residual sum (if any), then ReLU, in two
// passes over a channels-last float tensor forward and two backward, where
// LibTorch's BatchNorm, add and ReLU make about six and eight
// (services/norm_kernels.h). Its statistics are
// summed in another order than ATen's, so a channels-last config trains to
// other bits than a contiguous one; every engine and topology still agree.
struct BatchNormReluFunction
    : public torch::autograd::Function<BatchNormReluFunction> {
  // residual: an empty tensor when there is none (a custom function's
  // inputs must be defined). factor: the running statistics'
  // update factor (BatchNormImplBase::forward's).
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& residual,
                               const torch::Tensor& weight,
                               const torch::Tensor& bias,
                               torch::Tensor running_mean,
                               torch::Tensor running_var, double factor,
                               double eps) {
    // Named for `train --profile-ops`: the loops run outside any LibTorch
    // operation.
    RECORD_FUNCTION("interlock::batch_norm_relu",
                    c10::ArrayRef<const c10::IValue>());
    const int64_t c = x.size(1);
    const int64_t rows = x.numel() / c;
    std::vector<double> mean(c), var(c);
    at::parallel_for(0, c, kChannelGrain, [&](int64_t c0, int64_t c1) {
      ChannelMoments(Floats(x), rows, c, c0, c1, mean.data(), var.data());
    });
    const auto opts = torch::TensorOptions().dtype(torch::kFloat32);
    torch::Tensor save_mean = torch::empty({c}, opts);
    torch::Tensor invstd = torch::empty({c}, opts);
    torch::Tensor scale = torch::empty({c}, opts);
    torch::Tensor shift = torch::empty({c}, opts);
    torch::Tensor unbiased = torch::empty({c}, opts);
    const float* w = Floats(weight);
    const float* b = Floats(bias);
    float* pm = Floats(save_mean);
    float* pi = Floats(invstd);
    float* psc = Floats(scale);
    float* psh = Floats(shift);
    float* pu = Floats(unbiased);
    for (int64_t j = 0; j < c; ++j) {
      const double inv = 1.0 / std::sqrt(var[j] + eps);
      pm[j] = static_cast<float>(mean[j]);
      pi[j] = static_cast<float>(inv);
      psc[j] = static_cast<float>(w[j] * inv);
      psh[j] = static_cast<float>(b[j] - mean[j] * w[j] * inv);
      pu[j] = static_cast<float>(var[j] * static_cast<double>(rows) /
                                 static_cast<double>(rows - 1));
    }
    BlendRunningStats(static_cast<float>(factor), pm, pu, c,
                      Floats(running_mean), Floats(running_var));
    torch::Tensor y = torch::empty_like(x, kChannelsLast);
    const bool has_residual = residual.numel() > 0;
    const float* r = has_residual ? Floats(residual) : nullptr;
    at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
      ScaleShiftRelu(Floats(x), r, r0, r1, c, Floats(scale), Floats(shift),
                     Floats(y));
    });
    ctx->saved_data["residual"] = has_residual;
    ctx->saved_data["mean"] = save_mean;
    ctx->saved_data["invstd"] = invstd;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["shift"] = shift;
    // With a residual the ReLU's mask is read from the output; without one
    // it is recomputed from x, which saves reading a tensor.
    if (has_residual) {
      ctx->save_for_backward({x, weight, y});
    } else {
      ctx->save_for_backward({x, weight});
    }
    // An output nobody used then has no gradient, rather than zeros.
    ctx->set_materialize_grads(false);
    // The second output has y's values and a gradient of its own (SecondUse).
    return {y, y.detach()};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(8);
    // Both outputs' gradients go into the first pass, so their sum is never
    // written out.
    torch::Tensor dy, dy2;
    for (const torch::Tensor& g : grads) {
      if (!g.defined()) continue;
      (dy.defined() ? dy2 : dy) = g.contiguous(kChannelsLast);
    }
    if (!dy.defined()) return out;
    const bool has_residual = ctx->saved_data["residual"].toBool();
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& weight = saved[1];
    const float* y = has_residual ? Floats(saved[2]) : nullptr;
    const torch::Tensor mean = ctx->saved_data["mean"].toTensor();
    const torch::Tensor invstd = ctx->saved_data["invstd"].toTensor();
    const torch::Tensor scale = ctx->saved_data["scale"].toTensor();
    const torch::Tensor shift = ctx->saved_data["shift"].toTensor();
    const bool need_x = ctx->needs_input_grad(0);
    const bool need_r = has_residual && ctx->needs_input_grad(1);
    const int64_t c = x.size(1);
    const int64_t rows = x.numel() / c;
    // With a residual, g (dy where the ReLU passed) is the residual's
    // gradient and the input of the second pass.
    torch::Tensor g;
    if (has_residual && (need_x || need_r)) {
      g = torch::empty_like(x, kChannelsLast);
    }
    std::vector<double> sum_g(c), sum_gx(c);
    at::parallel_for(0, c, kChannelGrain, [&](int64_t c0, int64_t c1) {
      ReluNormGradSums(Floats(dy), dy2.defined() ? Floats(dy2) : nullptr,
                       Floats(x), y, Floats(scale), Floats(shift), rows, c, c0,
                       c1, Floats(mean), g.defined() ? Floats(g) : nullptr,
                       sum_g.data(), sum_gx.data());
    });
    const auto opts = torch::TensorOptions().dtype(torch::kFloat32);
    const float* w = Floats(weight);
    const float* inv = Floats(invstd);
    if (ctx->needs_input_grad(2)) {
      out[2] = torch::empty({c}, opts);
      float* dw = Floats(out[2]);
      for (int64_t j = 0; j < c; ++j) {
        dw[j] = static_cast<float>(sum_gx[j] * inv[j]);
      }
    }
    if (ctx->needs_input_grad(3)) {
      out[3] = torch::empty({c}, opts);
      float* db = Floats(out[3]);
      for (int64_t j = 0; j < c; ++j) db[j] = static_cast<float>(sum_g[j]);
    }
    if (need_x) {
      // dx = w * invstd * (g - mean(g) - (x - mean) * invstd^2 *
      // mean(g * (x - mean))), per channel a * g + b * (x - mean) + k.
      torch::Tensor a = torch::empty({c}, opts);
      torch::Tensor b = torch::empty({c}, opts);
      torch::Tensor k = torch::empty({c}, opts);
      float* pa = Floats(a);
      float* pb = Floats(b);
      float* pk = Floats(k);
      const double n = static_cast<double>(rows);
      for (int64_t j = 0; j < c; ++j) {
        const double wi = static_cast<double>(w[j]) * inv[j];
        pa[j] = static_cast<float>(wi);
        pb[j] = static_cast<float>(-wi * inv[j] * inv[j] * sum_gx[j] / n);
        pk[j] = static_cast<float>(-wi * sum_g[j] / n);
      }
      out[0] = torch::empty_like(x, kChannelsLast);
      const float* src = g.defined() ? Floats(g) : Floats(dy);
      const float* src2 = g.defined() || !dy2.defined() ? nullptr : Floats(dy2);
      const float* sc = g.defined() ? nullptr : Floats(scale);
      at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
        NormInputGrad(src, src2, Floats(x), sc, Floats(shift), r0, r1, c,
                      Floats(mean), pa, pb, pk, Floats(out[0]));
      });
    }
    if (need_r) out[1] = g;
    return out;
  }
};

// relu(bn(x) (+ residual)): fused where the model computes channels-last
// and the layer trains with affine running statistics, else LibTorch's
// modules. The fused path keeps BatchNormImplBase::forward's bookkeeping.
torch::Tensor BatchNormRelu(bool fuse, nn::BatchNorm2d& bn,
                            const torch::Tensor& x,
                            const torch::Tensor& residual = {}) {
  const auto& o = bn->options;
  if (!fuse || !bn->is_training() || !o.affine() || !o.track_running_stats() ||
      !x.device().is_cpu() || x.scalar_type() != torch::kFloat32 ||
      x.dim() != 4 || bn->weight.scalar_type() != torch::kFloat32 ||
      bn->running_mean.scalar_type() != torch::kFloat32 ||
      x.numel() <= x.size(1) || !bn->num_batches_tracked.defined()) {
    torch::Tensor out = bn(x);
    if (residual.defined()) out = out + residual;
    return torch::relu(out);
  }
  double factor;
  {
    torch::NoGradGuard no_grad;
    bn->num_batches_tracked += 1;
    factor = o.momentum().has_value()
                 ? *o.momentum()
                 : 1.0 / bn->num_batches_tracked.item<double>();
  }
  const torch::Tensor r = residual.defined()
                              ? residual.contiguous(kChannelsLast)
                              : torch::empty({0}, x.options());
  return BatchNormReluFunction::apply(x.contiguous(kChannelsLast), r,
                                      bn->weight, bn->bias, bn->running_mean,
                                      bn->running_var, factor, o.eps())[0];
}

// For the second use of a residual block's input x (its shortcut): where x is
// a fused layer's output, a tensor with x's values tied to that layer's
// second output, so the layer's backward receives the gradients of the two
// uses apart and adds them in its first pass. Otherwise autograd adds them
// into a new tensor that the layer then reads (about 2 ms of a 0.13 s
// resnet_ref_k4 step, most of it at the stem's output). The sum is the same
// float addition either way, so the bits do not change.
torch::Tensor SecondUse(const torch::Tensor& x) {
  const std::shared_ptr<torch::autograd::Node>& fn = x.grad_fn();
  if (!torch::GradMode::is_enabled() || x.output_nr() != 0 ||
      dynamic_cast<torch::autograd::CppNode<BatchNormReluFunction>*>(
          fn.get()) == nullptr) {
    return x;
  }
  torch::Tensor alias = x.detach();
  torch::autograd::impl::set_gradient_edge(alias, {fn, 1});
  return alias;
}

// A 1x1 convolution of stride 1 on channels-last float tensors: the
// forward and the input gradient are LibTorch's (oneDNN's), the weight
// gradient is one matrix product of the gradient's rows with the input's
// (the layout already is rows of channels). oneDNN's weight gradient for the
// stride-1 1x1 layer from 64 to 16 channels at 32x32 took 4.6 ms of a 0.124 s
// resnet_ref_k4 step (29 GFLOP/s); the product takes about 2.3.
struct Conv1x1Function : public torch::autograd::Function<Conv1x1Function> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight) {
    ctx->save_for_backward({x, weight});
    return at::conv2d(x, weight);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(2);
    if (!grads[0].defined()) return out;
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& w = saved[1];
    const torch::Tensor dy = grads[0].contiguous(kChannelsLast);
    if (ctx->needs_input_grad(0)) {
      out[0] = std::get<0>(at::convolution_backward(
          dy, x, w, c10::nullopt, {1, 1}, {0, 0}, {1, 1}, false, {0, 0}, 1,
          {true, false, false}));
    }
    if (ctx->needs_input_grad(1)) {
      // NHWC memory: [rows, channels] without a copy.
      const auto rows = [](const torch::Tensor& t) {
        return t.permute({0, 2, 3, 1}).reshape({-1, t.size(1)});
      };
      out[1] = at::mm(rows(dy).t(), rows(x)).view(w.sizes());
    }
    return out;
  }
};

// conv(x), through Conv1x1Function where it applies: a channels-last model
// (fuse), a 1x1 kernel of stride 1 without bias or groups, training.
torch::Tensor Conv(bool fuse, nn::Conv2dImpl& conv, const torch::Tensor& x) {
  const auto& o = conv.options;
  const auto* pad = c10::get_if<torch::ExpandingArray<2>>(&o.padding());
  const bool one_by_one =
      o.kernel_size()->at(0) == 1 && o.kernel_size()->at(1) == 1 &&
      o.stride()->at(0) == 1 && o.stride()->at(1) == 1 &&
      o.dilation()->at(0) == 1 && o.dilation()->at(1) == 1 && pad != nullptr &&
      (*pad)->at(0) == 0 && (*pad)->at(1) == 0 && o.groups() == 1 &&
      !o.bias() &&
      c10::get_if<torch::enumtype::kZeros>(&o.padding_mode()) != nullptr;
  if (!fuse || !one_by_one || !torch::GradMode::is_enabled() ||
      !conv.is_training() || !x.device().is_cpu() ||
      x.scalar_type() != torch::kFloat32 || x.dim() != 4 ||
      conv.weight.scalar_type() != torch::kFloat32 ||
      !x.is_contiguous(kChannelsLast) ||
      !conv.weight.is_contiguous(kChannelsLast)) {
    return conv.forward(x);
  }
  return Conv1x1Function::apply(x, conv.weight);
}

// A residual block's shortcut where the shape changes: a 1x1 convolution
// (through Conv) and a BatchNorm, registered as one Sequential.
torch::Tensor Shortcut(bool fuse, nn::Sequential& shortcut,
                       const torch::Tensor& x) {
  if (!fuse) return shortcut->forward(x);
  auto conv = std::dynamic_pointer_cast<nn::Conv2dImpl>(shortcut->ptr(0));
  auto bn = std::dynamic_pointer_cast<nn::BatchNorm2dImpl>(shortcut->ptr(1));
  return bn->forward(Conv(fuse, *conv, x));
}

struct BasicBlockImpl : nn::Module {
  BasicBlockImpl(int64_t in, int64_t planes, int64_t stride, bool fuse)
      : fuse(fuse) {
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
    auto out = BatchNormRelu(fuse, bn1, conv1(x));
    const auto x2 = SecondUse(x);
    const auto residual = shortcut ? Shortcut(fuse, shortcut, x2) : x2;
    return BatchNormRelu(fuse, bn2, conv2(out), residual);
  }
  bool fuse;
  nn::Conv2d conv1{nullptr}, conv2{nullptr};
  nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(BasicBlock);

struct BottleneckImpl : nn::Module {
  static constexpr int64_t kExpansion = 4;
  BottleneckImpl(int64_t in, int64_t planes, int64_t stride, bool fuse)
      : fuse(fuse) {
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
    auto out = BatchNormRelu(fuse, bn1, Conv(fuse, *conv1, x));
    out = BatchNormRelu(fuse, bn2, conv2(out));
    const auto x2 = SecondUse(x);
    const auto residual = shortcut ? Shortcut(fuse, shortcut, x2) : x2;
    return BatchNormRelu(fuse, bn3, Conv(fuse, *conv3, out), residual);
  }
  bool fuse;
  nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  nn::Sequential shortcut{nullptr};
};
TORCH_MODULE(Bottleneck);

// Conv3x3 + BatchNorm + ReLU stem fitted to the input channels.
struct StemImpl : nn::Module {
  StemImpl(int64_t in, int64_t out, bool fuse) : fuse(fuse) {
    conv = register_module(
        "conv",
        nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1).bias(false)));
    bn = register_module("bn", nn::BatchNorm2d(out));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return BatchNormRelu(fuse, bn, conv(x));
  }
  bool fuse;
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
  // Channels-last models train BatchNorm and ReLU fused.
  const bool fuse =
      r.memory_format() == interlock::v1::ResNetSpec::CHANNELS_LAST;
  units.push_back({nn::AnyModule(Stem(data.channels, stem, fuse)), s});
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
        units.push_back(
            {nn::AnyModule(BasicBlock(in, planes, stride, fuse)), s});
        in = planes;
      } else {
        units.push_back(
            {nn::AnyModule(Bottleneck(in, planes, stride, fuse)), s});
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

class ResNet : public Family {
 public:
  const char* name() const override { return "resnet"; }
  bool Describes(const interlock::v1::ModelSpec& spec) const override {
    return spec.has_resnet();
  }
  absl::StatusOr<int> NumUnits(
      const interlock::v1::ModelSpec& spec) const override {
    // "planes,blocks/planes,blocks/...": stem, the residual blocks, the
    // classifier. ResNetUnits checks the string in full.
    int units = 2;
    for (absl::string_view stage :
         absl::StrSplit(spec.resnet().architecture(), '/')) {
      std::vector<absl::string_view> parts = absl::StrSplit(stage, ',');
      int blocks = 0;
      if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &blocks) ||
          blocks <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("model.resnet.architecture: stage '", stage,
                         "' must be 'planes,blocks'"));
      }
      units += blocks;
    }
    return units;
  }
  absl::StatusOr<std::vector<Unit>> Units(
      const interlock::v1::ModelSpec& spec, const DataShape& data,
      const std::vector<bool>& wanted) const override {
    return ResNetUnits(spec.resnet(), data);
  }
  bool ChannelsLast(const interlock::v1::ModelSpec& spec) const override {
    return spec.resnet().memory_format() ==
           interlock::v1::ResNetSpec::CHANNELS_LAST;
  }
};

}  // namespace

const Family& ResNetFamily() {
  static const ResNet* family = new ResNet;
  return *family;
}

}  // namespace models_internal
}  // namespace interlock
