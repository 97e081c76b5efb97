// Invalid configurations get a clear error that points at the field.
#include "services/config.h"

#include <gtest/gtest.h>

#include "coordinator/train.h"

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

}  // namespace
}  // namespace interlock
