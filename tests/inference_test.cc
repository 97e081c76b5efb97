// Using a trained run through the CLI: `interlock eval` reports what the
// run's own final evaluation reported, `predict` labels test samples
// through any exit, `generate` samples text reproducibly, and bad requests
// get one-line errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

using testing::Contains;
using testing::Count;
using testing::ExpectOneLineError;
using testing::RunCommand;

const std::string kCli = INTERLOCK_CLI;
const std::string kSrc = INTERLOCK_SOURCE_DIR;

// Trains `config` for `steps` with its last step checkpointed into a fresh
// folder; returns the folder and the run's output.
std::pair<std::string, std::string> TrainRun(const std::string& config,
                                             int steps) {
  std::string dir = "/tmp/interlock-inference-XXXXXX";
  dir = mkdtemp(dir.data());
  const std::string out = dir + "/run";
  auto r = RunCommand(kCli + " train --config " + kSrc + "/" + config +
                      " --steps " + std::to_string(steps) +
                      " --checkpoint-every 100 --out " + out);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return {out, r.output};
}

// The "  block ..." lines of a metrics report.
std::string HeadLines(const std::string& output) {
  std::string lines;
  for (const auto& line : absl::StrSplit(output, '\n')) {
    if (absl::StartsWith(line, "  block ")) {
      absl::StrAppend(&lines, line, "\n");
    }
  }
  return lines;
}

TEST(Inference, EvalReportsTheRunsOwnFinalEvaluation) {
  // 5 steps, checkpointed only at the last (every 100).
  const auto [out, trained] = TrainRun("configs/tests/tiny_resnet.pbtxt", 5);
  ASSERT_FALSE(HeadLines(trained).empty()) << trained;
  EXPECT_TRUE(std::filesystem::exists(out + "/checkpoints/step-0000000005"));
  auto r = RunCommand(kCli + " eval --run " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "Test metrics of step 5")) << r.output;
  EXPECT_EQ(HeadLines(r.output), HeadLines(trained));

  auto p = RunCommand(kCli + " predict --run " + out +
                      " --exit 0 --first 3 --count 4");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_EQ(Count(p.output, "sample "), 4) << p.output;
  EXPECT_TRUE(Contains(p.output, "sample 3: class ")) << p.output;

  ExpectOneLineError(RunCommand(kCli + " predict --run " + out + " --exit 7"),
                     "exit 7", "--exit 7: outside [0, 3)");
  ExpectOneLineError(RunCommand(kCli + " eval --run " + out + "/nothing"),
                     "no run", "no checkpoints");
  ExpectOneLineError(
      RunCommand(kCli + " generate --run " + out + " --prompt x"),
      "a classifier", "generate samples a language model");
  std::filesystem::remove_all(std::filesystem::path(out).parent_path());
}

TEST(Inference, GenerateSamplesReproduciblyThroughAnyExit) {
  const auto [out, trained] =
      TrainRun("configs/tests/tiny_transformer.pbtxt", 4);
  const std::string base = kCli + " generate --run " + out +
                           " --prompt 'In the' --tokens 24 --seed 3";
  auto a = RunCommand(base);
  auto b = RunCommand(base);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_EQ(a.output, b.output);
  ASSERT_TRUE(absl::StartsWith(a.output, "In the")) << a.output;
  EXPECT_EQ(a.output.size(), std::string("In the").size() + 24 + 1);
  auto greedy = RunCommand(base + " --temperature 0 --exit 0");
  ASSERT_EQ(greedy.exit_code, 0) << greedy.output;
  EXPECT_EQ(greedy.output, RunCommand(base + " --temperature 0 --exit 0 "
                                             "--seed 9")
                               .output);
  auto top = RunCommand(base + " --top-k 5 --exit 1");
  EXPECT_EQ(top.exit_code, 0) << top.output;
  ExpectOneLineError(
      RunCommand(kCli + " generate --run " + out + " --prompt ''"),
      "empty prompt", "generate needs one of --prompt (text) and --prompt-ids");
  // The same prompt as token ids gives the same tokens, as ids.
  const std::string in = kCli + " generate --run " + out +
                         " --tokens 24 --seed 3 --temperature 0";
  auto text = RunCommand(in + " --prompt In");
  auto ids = RunCommand(in + " --prompt-ids '73 110'");
  ASSERT_EQ(ids.exit_code, 0) << ids.output;
  std::string bytes;
  for (absl::string_view id :
       absl::StrSplit(absl::StripAsciiWhitespace(ids.output), ' ')) {
    int v = 0;
    ASSERT_TRUE(absl::SimpleAtoi(id, &v)) << ids.output;
    bytes.push_back(static_cast<char>(v));
  }
  EXPECT_EQ(bytes + "\n", text.output);
  ExpectOneLineError(RunCommand(kCli + " generate --run " + out +
                                " --prompt-ids '1 300'"),
                     "id outside the vocabulary",
                     "--prompt-ids: 300 is not a token id of this model");
  ExpectOneLineError(
      RunCommand(kCli + " generate --run " + out + " --prompt-ids 'a'"),
      "not a number", "--prompt-ids: 'a' is not a number");
  std::filesystem::remove_all(std::filesystem::path(out).parent_path());
}

}  // namespace
}  // namespace interlock
