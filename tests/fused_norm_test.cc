// Channels-last ResNets train BatchNorm, the residual sum and ReLU fused
// (services/resnet.cc, services/norm_kernels.cc), and 1x1 convolutions of
// stride 1 with their weight gradient as a matrix product. The layers must
// compute what LibTorch's modules compute, within float rounding: outputs,
// every gradient, the running statistics and their counters, for basic and
// bottleneck blocks; partial backward passes (parameters only, input only)
// must give the full pass's values; and the bits must not depend on how the
// channels are split over threads, nor on which width's loop runs.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "services/config.h"
#include "services/models.h"
#include "services/norm_kernels.h"

namespace interlock {
namespace {

using interlock::v1::ResNetSpec;
using interlock::v1::RunConfig;

DataShape Images() {
  DataShape d;
  d.channels = 3;
  d.height = 12;
  d.width = 12;
  d.classes = 5;
  return d;
}

torch::nn::Sequential Model(const std::string& block_type,
                            ResNetSpec::MemoryFormat format) {
  auto c = ParseRunConfig(
      R"pb(
        model {
          resnet { architecture: "8,1/16,2" stem_planes: 12 }
          blocks: 1
          head: "gbpl_fc"
        }
        data { kind: SYNTHETIC_IMAGES }
        training { mode: E2E batch_size: 4 steps: 1 }
      )pb",
      "test");
  EXPECT_TRUE(c.ok()) << c.status();
  c->mutable_model()->mutable_resnet()->set_block_type(block_type);
  c->mutable_model()->mutable_resnet()->set_memory_format(format);
  ApplyDefaults(*c);
  auto blocks = BuildModel(c->model(), Images(), false, 7);
  EXPECT_TRUE(blocks.ok()) << blocks.status();
  torch::nn::Sequential m = (*blocks)[0].block;
  if (format == ResNetSpec::CHANNELS_LAST) {
    // What the trainer does (services/trainer.cc, ToChannelsLast).
    for (auto& t : m->parameters()) {
      if (t.dim() == 4) {
        t.set_data(t.contiguous(at::MemoryFormat::ChannelsLast));
      }
    }
  }
  m->train();
  return m;
}

// Calls visit(node) once for each node of the graph that produced `out`.
template <typename Visit>
void VisitGraph(const torch::Tensor& out, Visit visit) {
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo = {out.grad_fn().get()};
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    visit(*node);
    for (const auto& e : node->next_edges()) todo.push_back(e.function.get());
  }
}

bool IsFused(const torch::autograd::Node& node) {
  return node.name().find("BatchNormReluFunction") != std::string::npos;
}

// Nodes whose name has `name` in the graph that produced `out`.
int Nodes(const torch::Tensor& out, const std::string& name) {
  int n = 0;
  VisitGraph(out, [&](const torch::autograd::Node& node) {
    if (node.name().find(name) != std::string::npos) ++n;
  });
  return n;
}

struct Pass {
  int fused_nodes = 0;
  int conv1x1_nodes = 0;
  torch::Tensor out, input_grad;
  std::vector<std::pair<std::string, torch::Tensor>> grads, buffers;
};

// One forward and backward of a loss that weighs every output differently.
Pass Step(torch::nn::Sequential& m, const torch::Tensor& x_in, bool cl) {
  torch::Tensor x = x_in.clone();
  if (cl) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  x.requires_grad_(true);
  Pass p;
  p.out = m->forward(x);
  p.fused_nodes = Nodes(p.out, "BatchNormReluFunction");
  p.conv1x1_nodes = Nodes(p.out, "Conv1x1Function");
  const torch::Tensor w = torch::linspace(-1, 2, p.out.numel()).view_as(p.out);
  (p.out * w).sum().backward();
  p.input_grad = x.grad();
  for (const auto& kv : m->named_parameters()) {
    p.grads.emplace_back(kv.key(), kv.value().grad().clone());
  }
  for (const auto& kv : m->named_buffers()) {
    p.buffers.emplace_back(kv.key(), kv.value().clone());
  }
  return p;
}

void ExpectClose(const torch::Tensor& a, const torch::Tensor& b,
                 const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  if (!a.is_floating_point()) {
    EXPECT_TRUE(torch::equal(a, b)) << what;
    return;
  }
  const double scale = std::max(1.0, b.abs().max().item<double>());
  const double diff = (a - b).abs().max().item<double>();
  EXPECT_LE(diff, 2e-4 * scale) << what << ": differs by " << diff;
}

void ExpectFusedMatchesLibTorch(const std::string& block_type) {
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({4, 3, 12, 12}) * 2 + 0.5;
  auto plain = Model(block_type, ResNetSpec::CONTIGUOUS);
  auto fused = Model(block_type, ResNetSpec::CHANNELS_LAST);
  // Two steps, so the running statistics are blended once more.
  for (int step = 0; step < 2; ++step) {
    plain->zero_grad();
    fused->zero_grad();
    const Pass p = Step(plain, x, false);
    const Pass f = Step(fused, x, true);
    const std::string at = block_type + " step " + std::to_string(step);
    // The stem's and each of the three residual blocks' BatchNorm+ReLU.
    EXPECT_EQ(f.fused_nodes, block_type == "basic" ? 1 + 3 * 2 : 1 + 3 * 3)
        << at;
    EXPECT_EQ(p.fused_nodes, 0) << at;
    // The 1x1 convolutions of stride 1: the first block's shortcut; in
    // bottlenecks also every block's first and last convolution.
    EXPECT_EQ(f.conv1x1_nodes, block_type == "basic" ? 1 : 1 + 3 * 2) << at;
    EXPECT_EQ(p.conv1x1_nodes, 0) << at;
    ExpectClose(f.out, p.out, at + " output");
    ExpectClose(f.input_grad, p.input_grad, at + " input gradient");
    ASSERT_EQ(f.grads.size(), p.grads.size());
    for (size_t i = 0; i < p.grads.size(); ++i) {
      ExpectClose(f.grads[i].second, p.grads[i].second,
                  at + " gradient of " + p.grads[i].first);
    }
    ASSERT_EQ(f.buffers.size(), p.buffers.size());
    for (size_t i = 0; i < p.buffers.size(); ++i) {
      ExpectClose(f.buffers[i].second, p.buffers[i].second,
                  at + " buffer " + p.buffers[i].first);
    }
  }
}

TEST(FusedNorm, BasicBlocksMatchLibTorch) {
  ExpectFusedMatchesLibTorch("basic");
}

TEST(FusedNorm, BottleneckBlocksMatchLibTorch) {
  ExpectFusedMatchesLibTorch("bottleneck");
}

// The fused path only runs in training: eval mode uses the running
// statistics through LibTorch's modules, and gives LibTorch's output.
TEST(FusedNorm, EvalModeIsLibTorchs) {
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({4, 3, 12, 12});
  auto plain = Model("basic", ResNetSpec::CONTIGUOUS);
  auto fused = Model("basic", ResNetSpec::CHANNELS_LAST);
  Step(plain, x, false);
  Step(fused, x, true);
  plain->eval();
  fused->eval();
  torch::NoGradGuard no_grad;
  ExpectClose(fused->forward(x.contiguous(at::MemoryFormat::ChannelsLast)),
              plain->forward(x), "eval output");
}

// The calibration and SUM passes ask for parameter gradients alone or the
// input gradient alone: each must be bitwise what the full pass gives.
TEST(FusedNorm, PartialBackwardPassesGiveTheFullPassesBits) {
  torch::manual_seed(5);
  auto m = Model("basic", ResNetSpec::CHANNELS_LAST);
  torch::Tensor x = torch::randn({4, 3, 12, 12})
                        .contiguous(at::MemoryFormat::ChannelsLast)
                        .requires_grad_(true);
  const torch::Tensor out = m->forward(x);
  const torch::Tensor loss =
      (out * torch::linspace(-1, 1, out.numel()).view_as(out)).sum();
  std::vector<torch::Tensor> params = m->parameters();
  std::vector<torch::Tensor> all = params;
  all.push_back(x);
  const auto full = torch::autograd::grad({loss}, all, {}, true);
  const auto only_params = torch::autograd::grad({loss}, params, {}, true);
  const auto only_input = torch::autograd::grad({loss}, {x}, {}, true);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::equal(only_params[i], full[i])) << "parameter " << i;
  }
  EXPECT_TRUE(torch::equal(only_input[0], full.back()));
}

// Edges into a fused layer's second output (services/resnet.cc, SecondUse).
int SecondUses(const torch::Tensor& out) {
  int n = 0;
  VisitGraph(out, [&](const torch::autograd::Node& node) {
    for (const auto& e : node.next_edges()) {
      if (e.function != nullptr && e.input_nr == 1 && IsFused(*e.function)) {
        ++n;
      }
    }
  });
  return n;
}

// A residual block's input feeds its first convolution and its shortcut.
// Where a fused layer made it, the layer receives the two gradients apart
// and adds them itself: the same bits as autograd's sum, which it gets when
// each unit's output goes through x * 1 first.
TEST(FusedNorm, TwoUsesOfAnOutputGiveAutogradsSumsBits) {
  torch::manual_seed(8);
  auto m = Model("basic", ResNetSpec::CHANNELS_LAST);
  const torch::Tensor x0 = (torch::randn({4, 3, 12, 12}) * 2 + 0.5)
                               .contiguous(at::MemoryFormat::ChannelsLast);
  std::vector<torch::Tensor> grads[2];
  torch::Tensor outs[2];
  for (const bool through_mul : {false, true}) {
    m->zero_grad();
    torch::Tensor x = x0.clone().requires_grad_(true);
    torch::Tensor h = x;
    for (auto& unit : *m) {
      h = unit.forward(h);
      if (through_mul) h = h * 1;
    }
    EXPECT_EQ(SecondUses(h), through_mul ? 0 : 3) << through_mul;
    (h * torch::linspace(-1, 2, h.numel()).view_as(h)).sum().backward();
    outs[through_mul] = h.detach();
    for (const auto& p : m->parameters()) {
      grads[through_mul].push_back(p.grad().clone());
    }
    grads[through_mul].push_back(x.grad().clone());
  }
  EXPECT_TRUE(torch::equal(outs[0], outs[1]));
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_TRUE(torch::equal(grads[0][i], grads[1][i])) << "gradient " << i;
  }
}

// Each channel is summed row after row whatever range of channels a call
// covers, so splitting the channels over threads (at::parallel_for in
// services/resnet.cc) cannot change a bit.
TEST(FusedNorm, SumsDoNotDependOnTheChannelSplit) {
  constexpr int64_t kRows = 1000, kChannels = 37;
  torch::manual_seed(6);
  const torch::Tensor x = torch::randn({kRows, kChannels}) * 3 + 100;
  const torch::Tensor dy = torch::randn({kRows, kChannels});
  const torch::Tensor y = torch::relu(torch::randn({kRows, kChannels}));
  const torch::Tensor mean = x.mean(0);
  const float* px = x.data_ptr<float>();
  std::vector<double> m1(kChannels), v1(kChannels), m2(kChannels),
      v2(kChannels);
  ChannelMoments(px, kRows, kChannels, 0, kChannels, m1.data(), v1.data());
  const std::vector<std::pair<int64_t, int64_t>> ranges = {
      {0, 5}, {5, 6}, {6, 21}, {21, kChannels}};
  for (const auto& [c0, c1] : ranges) {
    ChannelMoments(px, kRows, kChannels, c0, c1, m2.data(), v2.data());
  }
  EXPECT_EQ(m1, m2);
  EXPECT_EQ(v1, v2);
  // The moments themselves, against LibTorch in double: the mean of 100
  // does not cancel the variance of 9 away.
  const torch::Tensor xd = x.to(torch::kFloat64);
  for (int64_t c = 0; c < kChannels; ++c) {
    EXPECT_NEAR(m1[c], xd.select(1, c).mean().item<double>(), 1e-6);
    EXPECT_NEAR(v1[c], xd.select(1, c).var(false).item<double>(), 1e-4);
  }
  std::vector<double> g1(kChannels), q1(kChannels), g2(kChannels),
      q2(kChannels);
  torch::Tensor out1 = torch::empty_like(x), out2 = torch::empty_like(x);
  ReluNormGradSums(dy.data_ptr<float>(), nullptr, px, y.data_ptr<float>(),
                   nullptr, nullptr, kRows, kChannels, 0, kChannels,
                   mean.data_ptr<float>(), out1.data_ptr<float>(), g1.data(),
                   q1.data());
  for (const auto& [c0, c1] : ranges) {
    ReluNormGradSums(dy.data_ptr<float>(), nullptr, px, y.data_ptr<float>(),
                     nullptr, nullptr, kRows, kChannels, c0, c1,
                     mean.data_ptr<float>(), out2.data_ptr<float>(), g2.data(),
                     q2.data());
  }
  EXPECT_EQ(g1, g2);
  EXPECT_EQ(q1, q2);
  EXPECT_TRUE(torch::equal(out1, out2));
  EXPECT_TRUE(
      torch::equal(out1, torch::where(y > 0, dy, torch::zeros_like(dy))));
}

// The loops have fixed-width versions for 16, 32, 64 and 128 channels
// (services/norm_kernels.cc) and a general one: per channel they must give
// the general loop's bits (a split into odd ranges runs the general one), and
// the per-row loops the plain expression's bits (computed here value by
// value; the test is built without FMA, so nothing is contracted).
TEST(FusedNorm, FixedWidthLoopsGiveTheGeneralLoopsBits) {
  constexpr int64_t kRows = 300;
  for (const int64_t c : {16, 24, 32, 64, 128}) {
    SCOPED_TRACE(::testing::Message() << c << " channels");
    torch::manual_seed(c);
    const torch::Tensor x = torch::randn({kRows, c}) * 2 + 1;
    const torch::Tensor dy = torch::randn({kRows, c});
    const torch::Tensor dy2 = torch::randn({kRows, c});
    const torch::Tensor sum = dy + dy2;
    const torch::Tensor res = torch::randn({kRows, c});
    const torch::Tensor mean = x.mean(0);
    const torch::Tensor scale = torch::randn({c});
    const torch::Tensor shift = torch::randn({c});
    const torch::Tensor a = torch::randn({c}), b = torch::randn({c}),
                        k = torch::randn({c});
    const float* px = x.data_ptr<float>();
    const float* pdy = dy.data_ptr<float>();
    const float* pdy2 = dy2.data_ptr<float>();
    const float* psc = scale.data_ptr<float>();
    const float* psh = shift.data_ptr<float>();
    const float* pmu = mean.data_ptr<float>();
    const std::vector<std::pair<int64_t, int64_t>> odd = {
        {0, 5}, {5, 6}, {6, c - 3}, {c - 3, c}};

    std::vector<double> m1(c), v1(c), m2(c), v2(c);
    ChannelMoments(px, kRows, c, 0, c, m1.data(), v1.data());
    for (const auto& [c0, c1] : odd) {
      ChannelMoments(px, kRows, c, c0, c1, m2.data(), v2.data());
    }
    EXPECT_EQ(m1, m2);
    EXPECT_EQ(v1, v2);

    torch::Tensor y = torch::empty_like(x);
    ScaleShiftRelu(px, res.data_ptr<float>(), 0, kRows, c, psc, psh,
                   y.data_ptr<float>());
    torch::Tensor y_plain = torch::empty_like(x);
    torch::Tensor dx = torch::empty_like(x), dx_plain = torch::empty_like(x);
    NormInputGrad(pdy, nullptr, px, psc, psh, 0, kRows, c, pmu,
                  a.data_ptr<float>(), b.data_ptr<float>(), k.data_ptr<float>(),
                  dx.data_ptr<float>());
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t j = 0; j < c; ++j) {
        const int64_t i = r * c + j;
        float z = px[i] * psc[j];
        z = z + psh[j];
        const float pre = z;
        z = z + res.data_ptr<float>()[i];
        y_plain.data_ptr<float>()[i] = z <= 0.0f ? 0.0f : z;
        const float g = pre <= 0.0f ? 0.0f : pdy[i];
        float d = g * a.data_ptr<float>()[j];
        float e = px[i] - pmu[j];
        e = e * b.data_ptr<float>()[j];
        d = d + e;
        dx_plain.data_ptr<float>()[i] = d + k.data_ptr<float>()[j];
      }
    }
    EXPECT_TRUE(torch::equal(y, y_plain));
    EXPECT_TRUE(torch::equal(dx, dx_plain));

    for (const bool with_y : {true, false}) {
      std::vector<double> g1(c), q1(c), g2(c), q2(c);
      torch::Tensor out1 = torch::empty_like(x), out2 = torch::empty_like(x);
      const float* py = with_y ? y.data_ptr<float>() : nullptr;
      ReluNormGradSums(pdy, nullptr, px, py, psc, psh, kRows, c, 0, c, pmu,
                       with_y ? out1.data_ptr<float>() : nullptr, g1.data(),
                       q1.data());
      for (const auto& [c0, c1] : odd) {
        ReluNormGradSums(pdy, nullptr, px, py, psc, psh, kRows, c, c0, c1, pmu,
                         with_y ? out2.data_ptr<float>() : nullptr, g2.data(),
                         q2.data());
      }
      EXPECT_EQ(g1, g2) << "with y " << with_y;
      EXPECT_EQ(q1, q2) << "with y " << with_y;
      if (with_y) {
        EXPECT_TRUE(torch::equal(out1, out2));
      }
      // Two gradients, dy2 beside dy, in the fixed-width loop (all channels)
      // and the general one (odd ranges): the bits of their sum given as one.
      ReluNormGradSums(sum.data_ptr<float>(), nullptr, px, py, psc, psh, kRows,
                       c, 0, c, pmu, with_y ? out1.data_ptr<float>() : nullptr,
                       g1.data(), q1.data());
      for (const bool split : {false, true}) {
        std::vector<double> g3(c), q3(c);
        torch::Tensor out3 = torch::empty_like(x);
        for (const auto& [c0, c1] :
             split ? odd : std::vector<std::pair<int64_t, int64_t>>{{0, c}}) {
          ReluNormGradSums(pdy, pdy2, px, py, psc, psh, kRows, c, c0, c1, pmu,
                           with_y ? out3.data_ptr<float>() : nullptr, g3.data(),
                           q3.data());
        }
        const std::string at = std::string("two gradients, with y ") +
                               (with_y ? "1" : "0") + ", split " +
                               (split ? "1" : "0");
        EXPECT_EQ(g1, g3) << at;
        EXPECT_EQ(q1, q3) << at;
        if (with_y) {
          EXPECT_TRUE(torch::equal(out1, out3)) << at;
        }
      }
    }
    for (const float* sc : {psc, static_cast<const float*>(nullptr)}) {
      torch::Tensor d1 = torch::empty_like(x), d2 = torch::empty_like(x);
      NormInputGrad(sum.data_ptr<float>(), nullptr, px, sc, psh, 0, kRows, c,
                    pmu, a.data_ptr<float>(), b.data_ptr<float>(),
                    k.data_ptr<float>(), d1.data_ptr<float>());
      NormInputGrad(pdy, pdy2, px, sc, psh, 0, kRows, c, pmu,
                    a.data_ptr<float>(), b.data_ptr<float>(),
                    k.data_ptr<float>(), d2.data_ptr<float>());
      EXPECT_TRUE(torch::equal(d1, d2)) << "two gradients, mask " << !!sc;
    }
  }
}

// ReLU lets NaN through, as LibTorch's does, so a diverged activation is
// seen downstream instead of silently zeroed.
TEST(FusedNorm, NaNReachesTheOutput) {
  auto m = Model("basic", ResNetSpec::CHANNELS_LAST);
  torch::Tensor x = torch::randn({4, 3, 12, 12});
  x[1][2][3][4] = std::nanf("");
  torch::NoGradGuard no_grad;
  const torch::Tensor out =
      m->forward(x.contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(out.isnan().any().item<bool>());
}

}  // namespace
}  // namespace interlock
