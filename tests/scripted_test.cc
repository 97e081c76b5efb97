// The scripted family: a model exported from plain PyTorch by the Python
// package (python/examples/export_small_cnn.py) trains like a built-in
// family, and a bad model folder or file is refused with a message naming
// it. The exported folder is made once per test binary with Debian's
// python3-torch.
#include "services/scripted.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "absl/strings/str_replace.h"
#include "coordinator/train.h"
#include "services/config.h"
#include "services/models.h"
#include "services/sha256.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

namespace fs = std::filesystem;
using interlock::testing::Contains;
using interlock::testing::ReadFile;
using interlock::v1::RunConfig;

// The small CNN's folder: 1x28x28 -> 5 units -> 10 classes, a user head
// after unit 1.
const std::string& ExportedCnn() {
  static const std::string* dir = [] {
    const std::string d = (fs::temp_directory_path() /
                           ("interlock_scripted_" + std::to_string(getpid())))
                              .string();
    fs::remove_all(d);
    const std::string cmd =
        std::string("/usr/bin/python3 ") + INTERLOCK_SOURCE_DIR +
        "/python/examples/export_small_cnn.py " + d + " >/dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0) return new std::string();
    return new std::string(d);
  }();
  return *dir;
}

std::string CopyOf(const std::string& dir, const std::string& name) {
  const std::string d = dir + "-" + name;
  fs::remove_all(d);
  fs::copy(dir, d, fs::copy_options::recursive);
  return d;
}

// The scripted model at `dir`, trained as `training` says (fields of
// TrainingSpec), on synthetic images of its input shape.
RunConfig Config(const std::string& dir, const std::string& training) {
  constexpr char kTemplate[] = R"pb(
    model {
      scripted { path: "DIR" }
      partition: "2,2,rest"
      head: "gbpl_fc"
    }
    data {
      kind: SYNTHETIC_IMAGES
      synthetic_train: 64
      synthetic_test: 32
      synthetic_shape: [ 1, 28, 28 ]
      synthetic_classes: 10
    }
    optimizer { kind: SGD momentum: 0.9 }
    schedule { lr: 0.05 }
    training { batch_size: 16 microbatches: 2 steps: 3 seed: 3 }
  )pb";
  std::string text = absl::StrReplaceAll(
      kTemplate, {{"DIR", dir}, {"seed: 3 }", "seed: 3 " + training + " }"}});
  auto c = ParseRunConfig(text, "scripted.pbtxt");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

absl::StatusOr<TrainResult> TrainIt(const RunConfig& c) {
  TrainOptions o;
  o.output.quiet = true;
  return Train(c, o);
}

class Scripted : public ::testing::Test {
 protected:
  void SetUp() override {
    if (ExportedCnn().empty()) {
      GTEST_FAIL() << "python/examples/export_small_cnn.py failed (is "
                      "python3-torch installed? scripts/setup.sh)";
    }
  }
  // Rewrites a line of the copy's model.pbtxt.
  static void EditManifest(const std::string& dir, const std::string& from,
                           const std::string& to) {
    std::string text = ReadFile(dir + "/model.pbtxt");
    text = std::regex_replace(text, std::regex(from), to,
                              std::regex_constants::format_first_only);
    std::ofstream(dir + "/model.pbtxt") << text;
  }
};

TEST_F(Scripted, TrainsInEveryModeAndStartsFromTheExportedWeights) {
  std::map<std::string, std::string> digests;
  for (const std::string mode :
       {"mode: E2E", "n: 1", "n: 2", "n: 2 rule: SUM", "n: 3"}) {
    auto r = TrainIt(Config(ExportedCnn(), mode));
    ASSERT_TRUE(r.ok()) << mode << ": " << r.status();
    EXPECT_EQ(r->steps, 3);
    ASSERT_EQ(r->block_digests.size(), 3u);
    for (double loss : r->final_losses) {
      if (!std::isnan(loss)) {
        EXPECT_TRUE(std::isfinite(loss)) << mode;
      }
    }
    digests[mode] = r->digest;
  }
  // E2E and 3-way (n = K) give the blocks the same gradient.
  EXPECT_NE(digests["n: 1"], digests["n: 2"]);
  EXPECT_NE(digests["n: 2"], digests["n: 2 rule: SUM"]);
  // Same config, same bits.
  auto again = TrainIt(Config(ExportedCnn(), "n: 2"));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->digest, digests["n: 2"]);
}

TEST_F(Scripted, UsesTheUserHeadAndTheHeadStringElsewhere) {
  RunConfig c = Config(ExportedCnn(), "n: 2");
  c.mutable_model()->set_partition("2,1,rest");  // cuts after units 1 and 2
  ASSERT_TRUE(ResolveModelSpec(c.mutable_model()).ok());
  DataShape shape;
  shape.channels = 1;
  shape.height = shape.width = 28;
  shape.classes = 10;
  auto blocks = BuildModel(c.model(), shape, /*with_heads=*/true, 0);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  // Block 0 ends at unit 1: the exported head (pool, LayerNorm, linear:
  // 16*2 + 16*10 + 10 parameters); block 1 ends at unit 2: gbpl_fc
  // (32*10 + 10).
  auto count = [](const torch::nn::Sequential& m) {
    int64_t n = 0;
    for (const auto& p : m->parameters()) n += p.numel();
    return n;
  };
  EXPECT_EQ(count((*blocks)[0].head), 16 * 2 + 16 * 10 + 10);
  EXPECT_EQ(count((*blocks)[1].head), 32 * 10 + 10);
  // The loaded unit holds the file's weights: equal to a second load.
  auto again = BuildModel(c.model(), shape, true, 99);
  ASSERT_TRUE(again.ok());
  auto a = (*blocks)[0].block->named_parameters();
  auto b = (*again)[0].block->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].value(), b[i].value())) << a[i].key();
  }
}

TEST_F(Scripted, AWorkerBuildsItsBlockFromTheFilesItWasSent) {
  RunConfig c = Config(ExportedCnn(), "n: 2");
  ASSERT_TRUE(ResolveModelSpec(c.mutable_model()).ok());
  auto files = ScriptedFilesOfBlock(c.model(), 1);
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(files->size(), 2u);  // units 2 and 3; no user head after unit 3
  // Without the folder, from what it holds alone.
  RunConfig remote = c;
  remote.mutable_model()->mutable_scripted()->set_path("/nonexistent");
  ASSERT_TRUE(HoldScriptedFiles(*files, 1 << 30).ok());
  DataShape shape;
  shape.channels = 1;
  shape.height = shape.width = 28;
  shape.classes = 10;
  auto blocks = BuildModel(remote.model(), shape, true, 0, /*keep_block=*/1);
  ASSERT_TRUE(blocks.ok()) << blocks.status();
  torch::Tensor out =
      (*blocks)[1].block->forward(torch::zeros({2, 16, 14, 14}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 32, 7, 7}));
  // Another block's units were not sent: a stand-in that refuses to run.
  EXPECT_THROW((*blocks)[0].block->forward(torch::zeros({2, 1, 28, 28})),
               std::exception);
  auto shapes = BlockOutputShapes(remote.model(), shape);
  ASSERT_TRUE(shapes.ok()) << shapes.status();
  EXPECT_EQ((*shapes)[2], (std::vector<int64_t>{10}));
  // Bytes that do not match their hash are refused, and so is too much.
  auto bad = *files;
  bad[0].bytes[100] ^= 1;
  absl::Status s = HoldScriptedFiles(bad, 1 << 30);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(std::string(s.message()), bad[0].name)) << s;
  s = HoldScriptedFiles(*files, 100);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ASSERT_TRUE(HoldScriptedFiles({}, 1 << 30).ok());
}

TEST_F(Scripted, BadFoldersAndFilesAreRefusedNamingThem) {
  auto expect = [](const RunConfig& c, const std::string& fragment) {
    auto r = TrainIt(c);
    ASSERT_FALSE(r.ok()) << fragment;
    EXPECT_TRUE(Contains(std::string(r.status().message()), fragment))
        << r.status();
  };
  // A newer PyTorch: both versions in one line.
  std::string d = CopyOf(ExportedCnn(), "version");
  EditManifest(d, "torch_version: \"[^\"]*\"", "torch_version: \"2.1.0\"");
  expect(Config(d, "n: 2"),
         "exported with PyTorch 2.1.0 but this LibTorch is 1.13");
  // A unit file changed after export.
  d = CopyOf(ExportedCnn(), "changed");
  { std::ofstream(d + "/unit_002.pt", std::ios::app) << "x"; }
  expect(Config(d, "n: 2"), "unit_002.pt does not match the SHA-256");
  // Not TorchScript, with a matching hash.
  d = CopyOf(ExportedCnn(), "notscript");
  {
    std::ofstream(d + "/unit_001.pt") << "not a zip";
    const std::string sha = Sha256Hex("not a zip", 9);
    std::string text = ReadFile(d + "/model.pbtxt");
    text = std::regex_replace(
        text, std::regex("(file: \"unit_001.pt\"[^}]*sha256: \")[0-9a-f]{64}"),
        "$1" + sha);
    std::ofstream(d + "/model.pbtxt") << text;
  }
  expect(Config(d, "n: 2"), "unit 1 (");
  expect(Config(d, "n: 2"), "is not TorchScript");
  // A declared shape that the unit does not produce.
  d = CopyOf(ExportedCnn(), "shape");
  EditManifest(d, "output_shape: 32 output_shape: 7 output_shape: 7",
               "output_shape: 32 output_shape: 6 output_shape: 6");
  expect(Config(d, "n: 2"), "declares [32, 6, 6]");
  // Data of another shape.
  RunConfig c = Config(ExportedCnn(), "n: 2");
  c.mutable_data()->clear_synthetic_shape();
  for (int v : {3, 28, 28}) c.mutable_data()->add_synthetic_shape(v);
  expect(c, "takes samples of [1, 28, 28] but the data gives [3, 28, 28]");
  // No folder.
  expect(Config("/nonexistent/model", "n: 2"),
         "/nonexistent/model/model.pbtxt");
  // A file outside the folder.
  d = CopyOf(ExportedCnn(), "escape");
  EditManifest(d, "file: \"unit_000.pt\"", "file: \"../unit_000.pt\"");
  expect(Config(d, "n: 2"), "must be a plain name");
}

}  // namespace
}  // namespace interlock
