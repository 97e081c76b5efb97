// The transformer's spec options take effect: each initialisation scheme
// gives its documented spread, the activation changes the output, the
// defaults are the documented choices, and unknown values are refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>

#include "services/config.h"
#include "services/models.h"

namespace interlock {
namespace {

using interlock::v1::RunConfig;
using interlock::v1::TransformerSpec;

constexpr int kLayers = 4;
constexpr int kD = 64;

RunConfig Config(TransformerSpec::Init init,
                 TransformerSpec::Activation activation) {
  auto c = ParseRunConfig(
      R"pb(
        model {
          transformer { d_model: 64 layers: 4 heads: 4 context: 16 }
          blocks: 2
          head: "ln_fc"
        }
        data { kind: SYNTHETIC_TEXT }
        training { mode: E2E batch_size: 4 steps: 1 }
      )pb",
      "test");
  EXPECT_TRUE(c.ok()) << c.status();
  c->mutable_model()->mutable_transformer()->set_init(init);
  c->mutable_model()->mutable_transformer()->set_activation(activation);
  ApplyDefaults(*c);
  return *c;
}

DataShape Text() {
  DataShape s;
  s.is_text = true;
  s.classes = 256;
  s.context = 16;
  return s;
}

// Every parameter of the model by "block<k>.<name>".
std::map<std::string, torch::Tensor> Params(const RunConfig& c) {
  auto blocks = BuildModel(c.model(), Text(), false, 3);
  EXPECT_TRUE(blocks.ok()) << blocks.status();
  std::map<std::string, torch::Tensor> out;
  if (!blocks.ok()) return out;
  for (size_t k = 0; k < blocks->size(); ++k) {
    for (const auto& kv : (*blocks)[k].block->named_parameters()) {
      out["block" + std::to_string(k) + "." + kv.key()] = kv.value().detach();
    }
  }
  return out;
}

double Std(const torch::Tensor& t) { return t.std().item<double>(); }

TEST(TransformerSpec, Gpt2ScalesTheResidualProjections) {
  auto p = Params(Config(TransformerSpec::GPT2, TransformerSpec::GELU));
  // Block 0 holds the embedding (unit 0) and layers 1 and 2.
  const double residual = 0.02 / std::sqrt(2.0 * kLayers);
  EXPECT_NEAR(Std(p.at("block0.1.proj.weight")), residual, 0.1 * residual);
  EXPECT_NEAR(Std(p.at("block0.1.fc2.weight")), residual, 0.1 * residual);
  EXPECT_NEAR(Std(p.at("block0.1.qkv.weight")), 0.02, 0.002);
  EXPECT_NEAR(Std(p.at("block0.1.fc1.weight")), 0.02, 0.002);
  EXPECT_NEAR(Std(p.at("block0.0.tokens.weight")), 0.02, 0.002);
  EXPECT_EQ(p.at("block0.1.fc1.bias").abs().max().item<float>(), 0.0f);
}

TEST(TransformerSpec, NormalLeavesTheResidualProjectionsUnscaled) {
  auto p = Params(Config(TransformerSpec::NORMAL, TransformerSpec::GELU));
  EXPECT_NEAR(Std(p.at("block0.1.proj.weight")), 0.02, 0.002);
  EXPECT_NEAR(Std(p.at("block0.1.fc2.weight")), 0.02, 0.002);
  EXPECT_NEAR(Std(p.at("block0.0.positions.weight")), 0.02, 0.002);
}

TEST(TransformerSpec, PytorchDefaultIsWhatTorchNnDoes) {
  auto p =
      Params(Config(TransformerSpec::PYTORCH_DEFAULT, TransformerSpec::GELU));
  // nn.Embedding: N(0, 1).
  EXPECT_NEAR(Std(p.at("block0.0.tokens.weight")), 1.0, 0.05);
  // nn.MultiheadAttention's in_proj: Xavier-uniform over [3d, d], zero bias.
  const double xavier = std::sqrt(6.0 / (kD + 3 * kD));
  const auto& qkv = p.at("block0.1.qkv.weight");
  EXPECT_LE(qkv.abs().max().item<double>(), xavier);
  EXPECT_NEAR(Std(qkv), xavier / std::sqrt(3.0), 0.05 * xavier);
  EXPECT_EQ(p.at("block0.1.qkv.bias").abs().max().item<float>(), 0.0f);
  EXPECT_EQ(p.at("block0.1.proj.bias").abs().max().item<float>(), 0.0f);
  // nn.Linear: U(+-1/sqrt(fan_in)) for weight and bias.
  const double bound = 1.0 / std::sqrt(4.0 * kD);
  const auto& fc2 = p.at("block0.1.fc2.weight");
  EXPECT_LE(fc2.abs().max().item<double>(), bound);
  EXPECT_NEAR(Std(fc2), bound / std::sqrt(3.0), 0.05 * bound);
  EXPECT_GT(p.at("block0.1.fc1.bias").abs().max().item<float>(), 0.0f);
}

torch::Tensor Logits(const RunConfig& c) {
  auto blocks = BuildModel(c.model(), Text(), false, 3);
  EXPECT_TRUE(blocks.ok()) << blocks.status();
  torch::NoGradGuard no_grad;
  torch::Tensor x =
      torch::arange(32, torch::dtype(torch::kInt64)).view({2, 16}) * 7 % 256;
  for (auto& b : *blocks) x = b.block->forward(x);
  return x;
}

TEST(TransformerSpec, ActivationChangesTheOutput) {
  const auto gelu =
      Logits(Config(TransformerSpec::PYTORCH_DEFAULT, TransformerSpec::GELU));
  const auto relu =
      Logits(Config(TransformerSpec::PYTORCH_DEFAULT, TransformerSpec::RELU));
  EXPECT_FALSE(torch::allclose(gelu, relu));
}

TEST(TransformerSpec, DefaultsAreTheDocumentedChoices) {
  const auto unset = Logits(Config(TransformerSpec::INIT_UNSPECIFIED,
                                   TransformerSpec::ACTIVATION_UNSPECIFIED));
  const auto documented =
      Logits(Config(TransformerSpec::PYTORCH_DEFAULT, TransformerSpec::GELU));
  EXPECT_TRUE(torch::equal(unset, documented));
}

TEST(TransformerSpec, UnknownValuesAreRefused) {
  RunConfig c = Config(TransformerSpec::PYTORCH_DEFAULT, TransformerSpec::GELU);
  c.mutable_model()->mutable_transformer()->set_activation(
      static_cast<TransformerSpec::Activation>(9));
  absl::Status s = ValidateRunConfig(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("model.transformer.activation: unknown value 9"),
            std::string::npos)
      << s;
  c = Config(static_cast<TransformerSpec::Init>(7), TransformerSpec::GELU);
  s = ValidateRunConfig(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("model.transformer.init: unknown value 7"),
            std::string::npos)
      << s;
  // Text format names only the known values.
  auto parsed = ParseRunConfig(
      "model { transformer { d_model: 8 layers: 1 heads: 1 context: 4 "
      "activation: SWISH } }",
      "bad.pbtxt");
  EXPECT_FALSE(parsed.ok());
}

}  // namespace
}  // namespace interlock
