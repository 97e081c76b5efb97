// The wire codec: FP32 writes exactly the bytes of the raw tensor encoding,
// every message round-trips, and the message-size limit comes from the
// codec's per-tensor bound. The compressed codecs (BF16, FP16,
// INT8_BLOCKWISE) stay within their error bounds, keep integer tensors
// exact, give in Transfer bitwise what Decode(Encode) gives, and refuse
// every malformed payload.
#include "services/wire_codec.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/train.h"
#include "services/codec_kernels.h"
#include "services/config.h"
#include "services/models.h"
#include "services/trainer.h"

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
  DownFrame f;
  Fp32().EncodeForward(m, 4, &f);
  const v1::ForwardData d = ToProto(f).forward();
  // What the coordinator and the workers wrote before the codec.
  v1::ForwardData want;
  want.set_step(7);
  want.set_microbatch(2);
  want.set_microbatches(4);
  want.set_learning_rate(0.125);
  EncodeTensor(m.input, want.mutable_input());
  EncodeTensor(m.target, want.mutable_target());
  EXPECT_EQ(d.SerializeAsString(), want.SerializeAsString());

  auto back = Fp32().DecodeForward(f, "fwd", {});
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
  DownFrame f;
  Fp32().EncodeForward(m, 1, &f);
  v1::DownMessage d = ToProto(f);
  d.mutable_forward()->mutable_input()->mutable_data()->resize(5);
  auto r = Fp32().DecodeForward(ToFrame(d), "block 1 step 0", {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("block 1 step 0 input"),
            std::string::npos)
      << r.status();

  DownFrame e;
  Fp32().EncodeEval({3, m.input, m.target, true}, &e);
  e.proto.mutable_eval()->mutable_target()->set_dtype(
      static_cast<v1::Tensor::DType>(99));
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
  UpFrame d;
  Fp32().EncodeUpward(u, &d);
  EXPECT_TRUE(d.proto.upward().partial());
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

  d.proto.mutable_upward()->mutable_nonfinite()->RemoveLast();
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

std::shared_ptr<const TensorCodec> Codec(v1::WireSpec::Codec c,
                                         int block_size = 0) {
  auto codec = CodecFor(c, block_size);
  EXPECT_TRUE(codec.ok()) << codec.status();
  return *codec;
}

// Bit patterns, so -0.0 and 0.0 (and any NaN) count as different.
bool Bitwise(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) {
    return false;
  }
  const torch::Tensor x = a.contiguous(), y = b.contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

torch::Tensor RoundTrip(const TensorCodec& codec, const torch::Tensor& t) {
  v1::Tensor w;
  codec.Encode(t, &w);
  auto back = codec.Decode(w, "t", {});
  EXPECT_TRUE(back.ok()) << back.status();
  return back.ok() ? *back : torch::Tensor();
}

// Values over many magnitudes, with zeros, and shapes whose element counts
// are not multiples of the int8 block size.
std::vector<torch::Tensor> Samples() {
  torch::manual_seed(7);
  std::vector<torch::Tensor> out;
  out.push_back(torch::randn({4, 300}));
  out.push_back(torch::randn({3, 5, 7}) * 1e-3);
  out.push_back(torch::randn({1000}) * torch::exp(torch::randn({1000}) * 4));
  out.push_back(torch::zeros({2, 257}));
  torch::Tensor mixed = torch::randn({513});
  mixed.slice(0, 0, 256).zero_();  // a block of zeros: scale 0
  out.push_back(mixed);
  out.push_back(torch::tensor(3.5f));                  // rank 0
  out.push_back(torch::empty({0, 4}, torch::kFloat));  // no values
  out.push_back(torch::randn({6, 8}).t());             // not contiguous
  return out;
}

TEST(WireCodecs, HalfWidthRoundTripsWithinTheirRelativeBound) {
  struct Case {
    v1::WireSpec::Codec codec;
    double relative;  // half a unit in the last place
  } cases[] = {{v1::WireSpec::BF16, std::ldexp(1.0, -8)},
               {v1::WireSpec::FP16, std::ldexp(1.0, -11)}};
  for (const Case& c : cases) {
    auto codec = Codec(c.codec);
    SCOPED_TRACE(std::string(codec->name()));
    for (torch::Tensor x : Samples()) {
      // Within the range the trainer lets through (FP16: below 65520).
      x = x.clamp(-60000, 60000);
      torch::Tensor y = RoundTrip(*codec, x);
      ASSERT_TRUE(y.defined());
      EXPECT_EQ(y.scalar_type(), torch::kFloat32);
      EXPECT_EQ(y.sizes(), x.sizes());
      // FP16 is relative only in its normal range (from 2^-14); below, its
      // spacing is 2^-24.
      const torch::Tensor bound =
          x.abs() * c.relative +
          (c.codec == v1::WireSpec::FP16 ? std::ldexp(1.0, -25) : 0.0);
      EXPECT_TRUE(((y - x).abs() <= bound).all().item<bool>());
      EXPECT_TRUE(Bitwise(codec->Transfer(x), y));
    }
  }
}

TEST(WireCodecs, Int8RoundTripsWithinHalfAScalePerBlock) {
  for (int block : {256, 64, 1, 1000}) {
    auto codec = Codec(v1::WireSpec::INT8_BLOCKWISE, block);
    SCOPED_TRACE(block);
    for (const torch::Tensor& x : Samples()) {
      torch::Tensor y = RoundTrip(*codec, x);
      ASSERT_TRUE(y.defined());
      EXPECT_EQ(y.sizes(), x.sizes());
      EXPECT_TRUE(Bitwise(codec->Transfer(x), y));
      const torch::Tensor fx = x.contiguous().reshape({-1});
      const torch::Tensor fy = y.reshape({-1});
      for (int64_t i = 0; i < fx.numel(); i += block) {
        const int64_t end = std::min<int64_t>(i + block, fx.numel());
        const float absmax = fx.slice(0, i, end).abs().max().item<float>();
        const double err = (fy.slice(0, i, end) - fx.slice(0, i, end))
                               .abs()
                               .max()
                               .item<float>();
        // Round to nearest: half the scale absmax / 127, plus float rounding.
        EXPECT_LE(err, absmax / 127.0 * (0.5 + 1e-5)) << "block at " << i;
        // The largest value of a block is carried exactly up to rounding.
        EXPECT_LE(err, absmax / 127.0);
      }
    }
  }
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// The vectorised kernels compute exactly the scalar definition: scale =
// absmax / 127, code = nearbyint(x / scale) clamped to [-127, 127], value =
// code x scale; NaN scale and zero codes for a non-finite block. Bitwise, so
// runs (and their digests) do not depend on the CPU's vector units.
TEST(WireCodecs, Int8KernelsAreTheScalarDefinitionBitwise) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int trial = 0; trial < 3000; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 300);
    std::vector<float> x(n);
    for (float& v : x) {
      switch (trial % 5) {
        case 0: {  // any bits: NaN, Inf, subnormals, -0
          const uint32_t u = rng();
          std::memcpy(&v, &u, sizeof(v));
          break;
        }
        case 1:
          v = normal(rng);
          break;
        case 2:  // subnormal scales
          v = normal(rng) * 1e-40f;
          break;
        case 3:  // exact ties at .5 after scaling
          v = static_cast<float>(static_cast<int>(rng() % 509) - 254) * 0.5f;
          break;
        default:
          v = std::ldexp(normal(rng), static_cast<int>(rng() % 250) - 125);
      }
    }
    float absmax = 0.0f;
    bool finite = true;
    for (float v : x) {
      finite = finite && std::isfinite(v);
      absmax = std::max(absmax, std::fabs(v));
    }
    std::vector<int8_t> want(n, 0);
    float want_scale = std::numeric_limits<float>::quiet_NaN();
    if (finite) {
      want_scale = absmax / 127.0f;
      for (int i = 0; i < n && want_scale > 0.0f; ++i) {
        want[i] = static_cast<int8_t>(
            std::clamp(std::nearbyint(x[i] / want_scale), -127.0f, 127.0f));
      }
    }
    std::vector<int8_t> got(n, 1);
    const float scale = QuantizeInt8Block(x.data(), n, got.data());
    ASSERT_EQ(Bits(scale), Bits(want_scale)) << "trial " << trial;
    ASSERT_EQ(got, want) << "trial " << trial;
    std::vector<float> values(n);
    ASSERT_TRUE(DequantizeInt8Block(got.data(), n, scale, values.data()));
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(Bits(values[i]), Bits(static_cast<float>(want[i]) * scale))
          << "trial " << trial << " value " << i;
    }
  }
  std::vector<int8_t> codes(40, 5);
  codes[33] = -128;  // never sent; refused from a peer
  std::vector<float> values(40);
  EXPECT_FALSE(DequantizeInt8Block(codes.data(), 40, 1.0f, values.data()));
}

// The receivers' widening kernels against LibTorch's own conversion, for
// every one of the 65,536 bit patterns, at every alignment the slices of a
// message can give: finite values bitwise equal, Inf and NaN kept so.
TEST(WireCodecs, WideningIsLibTorchsConversionForEveryPattern) {
  std::vector<uint16_t> patterns(1 << 16);
  for (size_t i = 0; i < patterns.size(); ++i) {
    patterns[i] = static_cast<uint16_t>(i);
  }
  const int64_t n = static_cast<int64_t>(patterns.size());
  for (auto half : {torch::kBFloat16, torch::kHalf}) {
    SCOPED_TRACE(half == torch::kHalf ? "fp16" : "bf16");
    const torch::Tensor want =
        torch::from_blob(patterns.data(), {n}, torch::dtype(half))
            .to(torch::kFloat32);
    for (int offset : {0, 1, 3}) {
      std::vector<char> bytes(2 * patterns.size() + offset);
      std::memcpy(bytes.data() + offset, patterns.data(), 2 * patterns.size());
      std::vector<float> got(patterns.size());
      (half == torch::kHalf ? WidenFp16 : WidenBf16)(bytes.data() + offset, n,
                                                     got.data());
      const float* expected = want.data_ptr<float>();
      int mismatches = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float w = expected[i];
        if (std::isfinite(w)) {
          mismatches += std::memcmp(&w, &got[i], sizeof(w)) != 0;
        } else {
          mismatches += std::isnan(w) != std::isnan(got[i]) ||
                        std::isinf(w) != std::isinf(got[i]) ||
                        std::signbit(w) != std::signbit(got[i]);
        }
      }
      EXPECT_EQ(mismatches, 0) << "offset " << offset;
    }
  }
}

TEST(WireCodecs, Fp32AndIntegerTensorsTravelExactly) {
  const torch::Tensor ids = torch::randint(0, 256, {4, 12}, torch::kInt64);
  const torch::Tensor x = torch::randn({3, 9});
  for (auto c : {v1::WireSpec::FP32, v1::WireSpec::BF16, v1::WireSpec::FP16,
                 v1::WireSpec::INT8_BLOCKWISE}) {
    auto codec = Codec(c);
    SCOPED_TRACE(std::string(codec->name()));
    v1::Tensor w;
    codec->Encode(ids, &w);
    EXPECT_EQ(w.encoding(), v1::Tensor::RAW);
    EXPECT_TRUE(Bitwise(RoundTrip(*codec, ids), ids));
    EXPECT_TRUE(Bitwise(codec->Transfer(ids), ids));
    EXPECT_EQ(codec->MaxEncodedBytes(torch::kInt64, 48), 48 * 8);
  }
  EXPECT_TRUE(Bitwise(RoundTrip(*Fp32Codec(), x), x));
}

TEST(WireCodecs, EncodedSizesAreMaxEncodedBytes) {
  const torch::Tensor x = torch::randn({5, 103});  // 515 values
  struct Case {
    v1::WireSpec::Codec codec;
    int64_t bytes;
  } cases[] = {{v1::WireSpec::FP32, 515 * 4},
               {v1::WireSpec::BF16, 515 * 2},
               {v1::WireSpec::FP16, 515 * 2},
               {v1::WireSpec::INT8_BLOCKWISE, 515 + 3 * 4}};
  for (const Case& c : cases) {
    auto codec = Codec(c.codec);
    v1::Tensor w;
    codec->Encode(x, &w);
    EXPECT_EQ(static_cast<int64_t>(w.data().size() + w.scales().size()),
              c.bytes)
        << codec->name();
    EXPECT_EQ(codec->MaxEncodedBytes(torch::kFloat32, 515), c.bytes);
  }
}

// Messages follow: a BF16 run's largest message is about half an FP32 run's.
TEST(WireCodecs, MessageLimitFollowsTheCodecs) {
  auto config = LoadRunConfig(std::string(INTERLOCK_SOURCE_DIR) +
                              "/configs/fmnist_resnet_k4.pbtxt");
  ASSERT_TRUE(config.ok()) << config.status();
  ApplyDefaults(*config);
  DataShape shape;
  shape.channels = 1;
  shape.height = shape.width = 28;
  shape.classes = 10;
  auto fp32 = WireCodec::ForRun(*config);
  ASSERT_TRUE(fp32.ok());
  config->mutable_wire()->set_activations(v1::WireSpec::BF16);
  config->mutable_wire()->set_gradients(v1::WireSpec::BF16);
  auto bf16 = WireCodec::ForRun(*config);
  ASSERT_TRUE(bf16.ok());
  EXPECT_EQ(bf16->activations().name(), "bf16");
  const int64_t a = *fp32->MaxMessageBytes(*config, shape) - (1 << 20);
  const int64_t b = *bf16->MaxMessageBytes(*config, shape) - (1 << 20);
  EXPECT_LT(b, a * 0.6);
  EXPECT_GT(b, a * 0.4);
}

// Everything a hostile peer can get wrong in an encoded tensor is refused
// with INVALID_ARGUMENT naming it.
TEST(WireCodecs, MalformedPayloadsAreRefused) {
  const torch::Tensor x = torch::randn({3, 100});  // 300 values
  auto int8 = Codec(v1::WireSpec::INT8_BLOCKWISE, 128);
  auto bf16 = Codec(v1::WireSpec::BF16);
  auto fp16 = Codec(v1::WireSpec::FP16);
  v1::Tensor q, h;
  int8->Encode(x, &q);
  bf16->Encode(x, &h);
  ASSERT_EQ(q.scales().size(), 3 * sizeof(float));
  auto set_scale = [](v1::Tensor& t, int i, float v) {
    std::memcpy(t.mutable_scales()->data() + i * sizeof(float), &v,
                sizeof(float));
  };
  struct Case {
    const char* what;
    std::shared_ptr<const TensorCodec> codec;
    v1::Tensor tensor;
    const char* expect;
  };
  std::vector<Case> cases;
  auto add = [&](const char* what, std::shared_ptr<const TensorCodec> codec,
                 const v1::Tensor& base, auto change, const char* expect) {
    v1::Tensor t = base;
    change(t);
    cases.push_back({what, codec, t, expect});
  };
  add(
      "short data", int8, q,
      [](v1::Tensor& t) { t.mutable_data()->pop_back(); },
      "299 data bytes, expected 300");
  add(
      "extra scale", int8, q,
      [](v1::Tensor& t) { t.mutable_scales()->append(4, '\0'); },
      "16 scale bytes, expected 12");
  add(
      "missing scales", int8, q, [](v1::Tensor& t) { t.clear_scales(); },
      "0 scale bytes");
  add(
      "block size", int8, q, [](v1::Tensor& t) { t.set_block_size(64); },
      "int8 block size 64, the run's wire.int8_block_size is 128");
  add(
      "NaN scale", int8, q,
      [&](v1::Tensor& t) {
        set_scale(t, 1, std::numeric_limits<float>::quiet_NaN());
      },
      "scale 1 is nan");
  add(
      "infinite scale", int8, q,
      [&](v1::Tensor& t) {
        set_scale(t, 2, std::numeric_limits<float>::infinity());
      },
      "scale 2 is inf");
  add(
      "negative scale", int8, q, [&](v1::Tensor& t) { set_scale(t, 0, -1); },
      "scale 0 is -1");
  add(
      "huge scale", int8, q, [&](v1::Tensor& t) { set_scale(t, 0, 1e38f); },
      "scale 0 is 1e+38");
  add(
      "code -128", int8, q,
      [](v1::Tensor& t) { (*t.mutable_data())[7] = static_cast<char>(-128); },
      "value 7 is -128");
  add(
      "raw in an int8 run", int8, q,
      [&](v1::Tensor& t) { EncodeTensor(x, &t); },
      "encoding RAW, the run's codec is INT8_BLOCKWISE");
  add(
      "bf16 in an int8 run", int8, h, [](v1::Tensor&) {},
      "encoding BF16, the run's codec is INT8_BLOCKWISE");
  add(
      "int8 in a bf16 run", bf16, q, [](v1::Tensor&) {},
      "encoding INT8_BLOCKWISE, the run's codec is BF16");
  add(
      "bf16 in an fp16 run", fp16, h, [](v1::Tensor&) {},
      "encoding BF16, the run's codec is FP16");
  add(
      "bf16 in an fp32 run", Fp32Codec(), h, [](v1::Tensor&) {},
      "encoding BF16, expected RAW");
  add(
      "unknown encoding", bf16, h,
      [](v1::Tensor& t) {
        t.set_encoding(static_cast<v1::Tensor::Encoding>(42));
      },
      "encoding 42 (unknown)");
  add(
      "int64 claiming int8", int8, q,
      [](v1::Tensor& t) { t.set_dtype(v1::Tensor::INT64); },
      "encoding INT8_BLOCKWISE, expected RAW");
  add(
      "odd bf16 bytes", bf16, h,
      [](v1::Tensor& t) { t.mutable_data()->push_back('x'); },
      "601 data bytes, expected 600");
  add(
      "bf16 with scales", bf16, h, [](v1::Tensor& t) { t.set_scales("abcd"); },
      "int8 block size or scales");
  add(
      "raw with scales", Fp32Codec(), q,
      [&](v1::Tensor& t) {
        EncodeTensor(x, &t);
        t.set_block_size(128);
      },
      "a RAW tensor with a block size or scales");
  add(
      "rank 9", int8, q,
      [](v1::Tensor& t) {
        t.clear_shape();
        for (int i = 0; i < 9; ++i) t.add_shape(1);
      },
      "rank 9 exceeds the limit 8");
  add(
      "negative dimension", int8, q, [](v1::Tensor& t) { t.set_shape(0, -3); },
      "dimension 0 is negative");
  add(
      "absurd shape", bf16, h,
      [](v1::Tensor& t) {
        t.clear_shape();
        t.add_shape(int64_t{1} << 40);
        t.add_shape(int64_t{1} << 40);
      },
      "element count overflows");
  add(
      "shape larger than the data", int8, q,
      [](v1::Tensor& t) { t.set_shape(1, 1000); },
      "300 data bytes, expected 3000");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto r = c.codec->Decode(c.tensor, "gradients[0]", {});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("gradients[0]: "), std::string::npos)
        << r.status();
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos)
        << r.status();
  }
  // The untouched payloads decode.
  EXPECT_TRUE(int8->Decode(q, "q", {}).ok());
  EXPECT_TRUE(bf16->Decode(h, "h", {}).ok());
}

// A value the codec cannot carry never reaches it: an int8 block with an
// infinity gets a NaN scale that every decoder refuses, not a scale of inf.
TEST(WireCodecs, NonFiniteInputNeverMakesAnInfiniteScale) {
  torch::Tensor x = torch::ones({300});
  x[5] = std::numeric_limits<float>::infinity();
  auto int8 = Codec(v1::WireSpec::INT8_BLOCKWISE);
  v1::Tensor w;
  int8->Encode(x, &w);
  float s0, s1;
  std::memcpy(&s0, w.scales().data(), 4);
  std::memcpy(&s1, w.scales().data() + 4, 4);
  EXPECT_TRUE(std::isnan(s0));
  EXPECT_EQ(s1, 1.0f / 127);
  EXPECT_FALSE(int8->Decode(w, "x", {}).ok());
  const torch::Tensor t = int8->Transfer(x);
  EXPECT_TRUE(torch::isnan(t.slice(0, 0, 256)).all().item<bool>());
  EXPECT_TRUE(torch::allclose(t.slice(0, 256), x.slice(0, 256)));
}

TEST(WireCodecs, RangesAreWhereTheCodecsOverflow) {
  for (auto c : {v1::WireSpec::BF16, v1::WireSpec::FP16}) {
    auto codec = Codec(c);
    const float r = codec->range();
    EXPECT_EQ(r, WireRange(c));
    const float below = std::nextafter(r, 0.0f);
    EXPECT_TRUE(
        std::isfinite(codec->Transfer(torch::tensor(below)).item<float>()))
        << codec->name();
    EXPECT_TRUE(std::isinf(codec->Transfer(torch::tensor(r)).item<float>()))
        << codec->name();
  }
  auto int8 = Codec(v1::WireSpec::INT8_BLOCKWISE);
  const float big = std::nextafter(int8->range(), 0.0f);
  torch::Tensor x = torch::tensor({big, -big, 1.0f});
  EXPECT_TRUE(torch::isfinite(RoundTrip(*int8, x)).all().item<bool>());
  EXPECT_TRUE(std::isinf(WireRange(v1::WireSpec::FP32)));
}

// The trainer's checks of what it sends and receives: the one-pass kernel
// on dense fp32 tensors (row-major, channels-last, a view with an offset)
// says what LibTorch's expressions say, for NaN, both infinities, values
// at and just below the range, and whatever the value's position.
TEST(WireCodecs, TrainerRangeChecksAgreeWithLibTorch) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float bf16 = WireRange(v1::WireSpec::BF16);
  auto expected = [](const torch::Tensor& t, float range) {
    return std::isinf(range) ? torch::isfinite(t).all().item<bool>()
                             : (t.abs() < range).all().item<bool>();
  };
  const torch::Tensor base = torch::randn({2, 3, 5, 7}) * 100;
  for (const float range : {inf, bf16, 65504.0f, 1.0f}) {
    for (const float bad : {nan, -nan, inf, -inf, range, -range,
                            std::nextafter(range, 0.0f), 0.5f, -0.0f}) {
      for (const int64_t at : {int64_t{0}, int64_t{17}, base.numel() - 1}) {
        torch::Tensor t = base.clone();
        if (range == 1.0f) t = t / 1000;  // inside the range but for `bad`
        t.view({-1})[at] = bad;
        const torch::Tensor cl =
            t.contiguous(torch::MemoryFormat::ChannelsLast);
        const torch::Tensor offset = t.view({-1}).slice(0, 1);
        const torch::Tensor strided = t.view({-1}).slice(0, 0, -1, 2);
        SCOPED_TRACE(absl::StrCat("range ", range, " value ", bad, " at ", at));
        ASSERT_FALSE(cl.is_contiguous());
        ASSERT_TRUE(cl.is_non_overlapping_and_dense());
        EXPECT_EQ(AllWithin(t, range), expected(t, range));
        EXPECT_EQ(AllWithin(cl, range), expected(cl, range));
        EXPECT_EQ(AllWithin(offset, range), expected(offset, range));
        EXPECT_EQ(AllWithin(strided, range), expected(strided, range));
        EXPECT_EQ(AllFinite(t), expected(t, inf));
        EXPECT_EQ(AllWithin(t.to(torch::kDouble), range),
                  expected(t.to(torch::kDouble), range));
      }
    }
  }
  // Nothing to check: empty, integer and undefined tensors pass.
  EXPECT_TRUE(AllWithin(torch::empty({0}), 1.0f));
  EXPECT_TRUE(AllWithin(torch::full({3}, 7, torch::kLong), 1.0f));
  EXPECT_TRUE(AllWithin(torch::Tensor(), 1.0f));
}

TEST(WireConfig, CodecsAreReadValidatedAndCanonical) {
  constexpr char kConfig[] = R"pb(
    model {
      mlp { hidden: [ 4 ] }
      blocks: 2
      head: "fc"
    }
    data { kind: SYNTHETIC_VECTORS synthetic_shape: 3 }
    wire { activations: BF16 gradients: INT8_BLOCKWISE }
  )pb";
  auto c = ParseRunConfig(kConfig, "test");
  ASSERT_TRUE(c.ok()) << c.status();
  ApplyDefaults(*c);
  EXPECT_EQ(c->wire().int8_block_size(), 256);
  ASSERT_TRUE(ValidateRunConfig(*c).ok()) << ValidateRunConfig(*c);
  auto codec = WireCodec::ForRun(*c);
  ASSERT_TRUE(codec.ok());
  EXPECT_EQ(codec->activations().name(), "bf16");
  EXPECT_EQ(codec->gradients().name(), "int8");
  EXPECT_EQ(WireName(c->wire()), "bf16:int8");

  // FP32 written out is the same run as no wire at all.
  v1::RunConfig fp32 = *c;
  fp32.mutable_wire()->set_activations(v1::WireSpec::FP32);
  fp32.mutable_wire()->set_gradients(v1::WireSpec::FP32);
  ApplyDefaults(fp32);
  EXPECT_FALSE(fp32.has_wire());
  EXPECT_EQ(WireName(fp32.wire()), "fp32");

  c->mutable_wire()->set_int8_block_size(-4);
  auto bad = ValidateRunConfig(*c);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("wire.int8_block_size: -4"), std::string::npos)
      << bad;
  c->mutable_wire()->set_int8_block_size(0);
  c->mutable_wire()->set_activations(static_cast<v1::WireSpec::Codec>(9));
  bad = ValidateRunConfig(*c);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("wire.activations: unknown codec 9"),
            std::string::npos)
      << bad;

  v1::WireSpec w;
  ASSERT_TRUE(ParseWireName("fp16:int8", &w).ok());
  EXPECT_EQ(w.activations(), v1::WireSpec::FP16);
  EXPECT_EQ(w.gradients(), v1::WireSpec::INT8_BLOCKWISE);
  ASSERT_TRUE(ParseWireName("bf16", &w).ok());
  EXPECT_EQ(w.gradients(), v1::WireSpec::BF16);
  EXPECT_FALSE(ParseWireName("int4", &w).ok());
  EXPECT_FALSE(ParseWireName("bf16:", &w).ok());
}

// Block 0 of the design's scale model multiplies by 1000: its output of
// 1e5 is finite in fp32 but beyond fp16. The trainer treats it as
// non-finite before it is sent, under training.nonfinite_policy.
TEST(WireConfig, OutputsBeyondTheCodecFollowTheNonFinitePolicy) {
  auto c = LoadRunConfig(std::string(INTERLOCK_SOURCE_DIR) +
                         "/configs/tests/example_2way.pbtxt");
  ASSERT_TRUE(c.ok());
  c->mutable_model()->mutable_scale()->mutable_block_init(0)->set_value(0,
                                                                        1000);
  c->mutable_data()->set_inline_inputs(0, 100);
  TrainOptions quiet;
  quiet.output.quiet = true;
  ASSERT_TRUE(Train(*c, quiet).ok());  // FP32 carries 1e5

  c->mutable_wire()->set_activations(v1::WireSpec::FP16);
  auto stop = Train(*c, quiet);
  ASSERT_FALSE(stop.ok());
  EXPECT_NE(stop.status().message().find(
                "output is not finite or reaches 65520 in magnitude, beyond "
                "the range of wire.activations"),
            std::string::npos)
      << stop.status();

  c->mutable_training()->set_nonfinite_policy(v1::TrainingSpec::SKIP_STEP);
  auto skip = Train(*c, quiet);
  ASSERT_TRUE(skip.ok()) << skip.status();
  EXPECT_EQ(skip->skipped_steps[0], 1);

  // BF16 has fp32's range: the same run trains.
  c->mutable_wire()->set_activations(v1::WireSpec::BF16);
  auto bf16 = Train(*c, quiet);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->skipped_steps[0], 0);
}

// The in-process engine applies the codecs at every block boundary: the
// parameters change with the codec, and the sequential and threaded
// schedules still agree bitwise.
TEST(WireConfig, InProcessRunsApplyTheCodecs) {
  auto c = LoadRunConfig(std::string(INTERLOCK_SOURCE_DIR) +
                         "/configs/tests/tiny_resnet.pbtxt");
  ASSERT_TRUE(c.ok());
  c->mutable_training()->set_steps(3);
  TrainOptions quiet;
  quiet.output.quiet = true;
  std::vector<std::string> digests;
  for (const char* wire : {"fp32", "bf16", "fp16", "int8", "bf16:int8"}) {
    SCOPED_TRACE(wire);
    ASSERT_TRUE(ParseWireName(wire, c->mutable_wire()).ok());
    auto a = Train(*c, quiet);
    ASSERT_TRUE(a.ok()) << a.status();
    TrainOptions threaded = quiet;
    threaded.engine.schedule = Schedule::kThreaded;
    auto b = Train(*c, threaded);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->digest, b->digest);
    EXPECT_EQ(std::count(digests.begin(), digests.end(), a->digest), 0);
    digests.push_back(a->digest);
  }
}

}  // namespace
}  // namespace interlock
