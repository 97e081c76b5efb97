// Invalid configurations (and device names) get a clear error that points
// at the field or flag.
#include "services/config.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "coordinator/train.h"
#include "services/device.h"

namespace interlock {
namespace {

using interlock::v1::RunConfig;

constexpr char kBase[] = R"pb(
  model {
    resnet { architecture: "8,1/16,1" }
    partition: "1,1,rest"
    head: "conv8_bn_gbpl_fc"
  }
  data {
    kind: SYNTHETIC_IMAGES
    synthetic_shape: [ 3, 8, 8 ]
  }
  training { n: 2 batch_size: 8 steps: 1 }
)pb";

absl::Status Check(const std::string& text) {
  auto c = ParseRunConfig(text, "bad.pbtxt");
  if (!c.ok()) return c.status();
  ApplyDefaults(*c);
  return ValidateRunConfig(*c);
}

void ExpectError(const std::string& text, const std::string& fragment) {
  absl::Status s = Check(text);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(fragment), std::string::npos)
      << "message '" << s.message() << "' lacks '" << fragment << "'";
}

TEST(Config, BaseIsValid) { EXPECT_TRUE(Check(kBase).ok()) << Check(kBase); }

TEST(Config, UnknownFieldNamesFileLineAndField) {
  ExpectError(std::string(kBase) + "\nbogus_field: 3\n", "bad.pbtxt:");
  ExpectError(std::string(kBase) + "\nbogus_field: 3\n", "bogus_field");
}

TEST(Config, NLargerThanBlocks) {
  std::string t = kBase;
  t.replace(t.find("n: 2"), 4, "n: 4");
  ExpectError(t, "training.n");
}

TEST(Config, PartitionMustCoverModel) {
  std::string t = kBase;
  t.replace(t.find("1,1,rest"), 8, "1,1,1,1,1");
  ExpectError(t, "model.partition");
  t = kBase;
  t.replace(t.find("1,1,rest"), 8, "1,x,rest");
  ExpectError(t, "model.partition");
}

TEST(Config, UnknownHeadLayer) {
  std::string t = kBase;
  t.replace(t.find("conv8_bn_gbpl_fc"), 16, "conv8_pool_fc");
  ExpectError(t, "'pool'");
}

TEST(Config, HeadMustEndInClassifier) {
  std::string t = kBase;
  t.replace(t.find("conv8_bn_gbpl_fc"), 16, "conv8_bn");
  ExpectError(t, "model.head");
}

TEST(Config, MicrobatchesMustDivideBatch) {
  std::string t = kBase;
  t.replace(t.find("batch_size: 8"), 13, "batch_size: 8 microbatches: 3");
  ExpectError(t, "training.microbatches");
}

TEST(Config, BadArchitecture) {
  std::string t = kBase;
  t.replace(t.find("8,1/16,1"), 8, "8,1/16");
  ExpectError(t, "model.resnet.architecture");
}

TEST(Config, MissingDataFileIsReported) {
  auto c = ParseRunConfig(
      R"pb(
        model {
          mlp { hidden: 8 }
          blocks: 2
          head: "fc"
        }
        data { kind: FASHION_MNIST path: "/nonexistent/fmnist" }
        training { steps: 1 }
      )pb",
      "t");
  ASSERT_TRUE(c.ok());
  TrainOptions o;
  o.output.quiet = true;
  auto r = Train(*c, o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_NE(r.status().message().find("/nonexistent/fmnist"), std::string::npos)
      << r.status();
}

// --device names: cpu, cuda, cuda:N; anything else names the flag and value.
TEST(Device, NamesParseAndBadOnesNameTheFlag) {
  EXPECT_EQ(*ParseDeviceName("--device", "cpu"), c10::Device(c10::kCPU));
  EXPECT_EQ(*ParseDeviceName("--device", "CPU"), c10::Device(c10::kCPU));
  EXPECT_EQ(*ParseDeviceName("--device", "cuda"), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(*ParseDeviceName("--device", "cuda:3"), c10::Device(c10::kCUDA, 3));
  for (const std::string bad : {"gpu", "", "cuda:", "cuda:-1", "cuda:x",
                                "cuda:1:2", "cuda:128", " cpu", "mps"}) {
    SCOPED_TRACE(bad);
    auto d = ParseDeviceName("--device", bad);
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find("--device: '" + bad +
                                        "' is not cpu, cuda or cuda:N"),
              std::string::npos)
        << d.status();
  }
}

TEST(Device, CudaNeedsACudaLibTorchAndAVisibleGpu) {
  EXPECT_EQ(*ParseDevice("--device", "cpu"), c10::Device(c10::kCPU));
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has CUDA";
  for (const char* name : {"cuda", "cuda:1"}) {
    auto d = ParseDevice("--device", name);
    ASSERT_FALSE(d.ok()) << name;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(d.status().message().find("--device: 'cuda:"), std::string::npos)
        << d.status();
    EXPECT_NE(d.status().message().find("CUDA"), std::string::npos)
        << d.status();
  }
}

TEST(Device, OneDeviceForAllBlocksOrOnePerBlock) {
  const c10::Device cpu(c10::kCPU);
  EXPECT_TRUE(ParseDeviceList("--device", "")->empty());
  EXPECT_EQ(*ParseDeviceList("--device", "cpu,CPU,cpu"),
            std::vector<c10::Device>(3, cpu));
  auto empty_entry = ParseDeviceList("--device", "cpu,,cpu");
  EXPECT_NE(empty_entry.status().message().find("empty entry (device 2)"),
            std::string::npos)
      << empty_entry.status();
  auto bad = ParseDeviceList("--device", "cpu,gpu");
  EXPECT_NE(bad.status().message().find("'gpu'"), std::string::npos)
      << bad.status();

  const std::vector<c10::Device> four(4, cpu);
  EXPECT_EQ(*BlockDevices("--device", {}, 4), four);
  EXPECT_EQ(*BlockDevices("--device", {cpu}, 4), four);
  EXPECT_EQ(*BlockDevices("--device", four, 4), four);
  auto mismatch = BlockDevices("--device", {cpu, cpu, cpu}, 4);
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.status().message().find(
                "--device: 3 devices for a model of 4 blocks"),
            std::string::npos)
      << mismatch.status();
}

}  // namespace
}  // namespace interlock
