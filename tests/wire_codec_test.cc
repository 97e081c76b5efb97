// The wire codec: FP32 writes exactly the bytes of the raw tensor encoding,
// every message round-trips, and the message-size limit comes from the
// codec's per-tensor bound.
#include "services/wire_codec.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "services/config.h"
#include "services/models.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

const WireCodec& Fp32() {
  static const auto* codec = new WireCodec(Fp32Codec(), Fp32Codec());
  return *codec;
}

bool Same(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         torch::equal(a, b);
}

TEST(WireCodec, Fp32ForwardIsTheRawEncoding) {
  ForwardMsg m;
  m.step = 7;
  m.mb = 2;
  m.lr = 0.125;
  m.input = torch::randn({2, 3, 4});
  m.target = torch::tensor({1, 0}, torch::kInt64);
  v1::ForwardData d;
  Fp32().EncodeForward(m, 4, &d);
  // What the coordinator and the workers wrote before the codec.
  v1::ForwardData want;
  want.set_step(7);
  want.set_microbatch(2);
  want.set_microbatches(4);
  want.set_learning_rate(0.125);
  EncodeTensor(m.input, want.mutable_input());
  EncodeTensor(m.target, want.mutable_target());
  EXPECT_EQ(d.SerializeAsString(), want.SerializeAsString());

  auto back = Fp32().DecodeForward(d, "fwd", {});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step, 7);
  EXPECT_EQ(back->mb, 2);
  EXPECT_EQ(back->lr, 0.125);
  EXPECT_FALSE(back->nonfinite);
  EXPECT_TRUE(Same(back->input, m.input));
  EXPECT_TRUE(Same(back->target, m.target));
}

TEST(WireCodec, DecodeKeepsTheTensorChecks) {
  ForwardMsg m;
  m.input = torch::zeros({2, 3});
  m.target = torch::zeros({2}, torch::kInt64);
  v1::ForwardData d;
  Fp32().EncodeForward(m, 1, &d);
  d.mutable_input()->mutable_data()->resize(5);
  auto r = Fp32().DecodeForward(d, "block 1 step 0", {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("block 1 step 0 input"),
            std::string::npos)
      << r.status();

  v1::EvalData e;
  Fp32().EncodeEval({3, m.input, m.target, true}, &e);
  e.mutable_target()->set_dtype(static_cast<v1::Tensor::DType>(99));
  auto er = Fp32().DecodeEval(e, "eval", {});
  ASSERT_FALSE(er.ok());
  EXPECT_NE(er.status().message().find("eval target: unknown dtype"),
            std::string::npos)
      << er.status();
}

TEST(WireCodec, UpwardStepDoneAndEvalRoundTrip) {
  UpwardMsg u;
  u.step = 3;
  u.mb = 1;
  u.first_entry = 2;
  u.final = false;
  u.grads = {torch::randn({2, 5}), torch::zeros({2, 5})};
  u.nonfinite = {false, true};
  u.reports.push_back({1, 0.5, 3, 4});
  u.timings.push_back({1, Phase::kInputGrad, 0.25});
  v1::UpwardData d;
  Fp32().EncodeUpward(u, &d);
  EXPECT_TRUE(d.partial());
  auto back = Fp32().DecodeUpward(d);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step, 3);
  EXPECT_EQ(back->first_entry, 2);
  EXPECT_FALSE(back->final);
  ASSERT_EQ(back->grads.size(), 2u);
  EXPECT_TRUE(Same(back->grads[0], u.grads[0]));
  EXPECT_EQ(back->nonfinite, u.nonfinite);
  ASSERT_EQ(back->timings.size(), 1u);
  EXPECT_EQ(back->timings[0].phase, Phase::kInputGrad);
  EXPECT_EQ(back->reports[0].correct, 3);

  d.mutable_nonfinite()->RemoveLast();
  EXPECT_FALSE(Fp32().DecodeUpward(d).ok());

  StepDone s{2, 9, {2, Phase::kOptimizer, 0.5}, true, 4};
  v1::StepDone sd;
  Fp32().EncodeStepDone(s, &sd);
  const StepDone s2 = Fp32().DecodeStepDone(sd);
  EXPECT_EQ(s2.block, 2);
  EXPECT_EQ(s2.step, 9);
  EXPECT_EQ(s2.timing.phase, Phase::kOptimizer);
  EXPECT_EQ(s2.timing.seconds, 0.5);
  EXPECT_TRUE(s2.skipped);
  EXPECT_EQ(s2.microbatches, 4);

  v1::EvalResult er;
  Fp32().EncodeEvalResult({5, 1, true, 2.5, 7, 8}, &er);
  const EvalReport r = Fp32().DecodeEvalResult(er);
  EXPECT_EQ(r.batch, 5);
  EXPECT_TRUE(r.has_head);
  EXPECT_EQ(r.loss_sum, 2.5);
  EXPECT_EQ(r.count, 8);
}

TEST(WireCodec, Fp32TransferIsTheIdentity) {
  ForwardMsg m;
  m.input = torch::randn({2, 3});
  const void* data = m.input.data_ptr();
  EXPECT_EQ(Fp32().Transfer(std::move(m)).input.data_ptr(), data);
}

// The limit is what the links' largest message can take: for FP32 image
// runs, the bytes the coordinator computed before the codec existed.
TEST(WireCodec, MaxMessageBytesComesFromTheCodec) {
  auto config = LoadRunConfig(std::string(INTERLOCK_SOURCE_DIR) +
                              "/configs/fmnist_resnet_k4.pbtxt");
  ASSERT_TRUE(config.ok()) << config.status();
  DataShape shape;
  shape.channels = 1;
  shape.height = shape.width = 28;
  shape.classes = 10;
  auto limit = Fp32().MaxMessageBytes(*config, shape);
  ASSERT_TRUE(limit.ok()) << limit.status();

  auto outs = BlockOutputShapes(config->model(), shape);
  ASSERT_TRUE(outs.ok());
  auto elements = [](int64_t b, const std::vector<int64_t>& dims) {
    for (int64_t d : dims) b *= d;
    return b;
  };
  const auto& t = config->training();
  const int64_t b =
      std::max<int64_t>(t.batch_size() / t.microbatches(),
                        std::max(t.eval_batch_size(), t.batch_size()));
  const int k_blocks = static_cast<int>(outs->size());
  int64_t worst = 0;
  for (int k = 0; k < k_blocks; ++k) {
    const auto in = elements(b, k == 0 ? SampleShape(shape) : (*outs)[k - 1]);
    worst = std::max(worst, in * 4 + elements(b, TargetShape(shape)) * 8);
    worst = std::max(worst, elements(b, (*outs)[k]) * 4 * k_blocks);
  }
  EXPECT_EQ(*limit, worst + (1 << 20));
}

}  // namespace
}  // namespace interlock
