// `interlock compare` end to end through the CLI (report table, PNG plots,
// bad --modes) and `interlock simulate` on the profile compare produced, plus
// the simulator's scaling worked out by hand.
#include "coordinator/compare.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "analysis/compare_report.h"
#include "analysis/run_files.h"
#include "analysis/simulate.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

using interlock::testing::ReadFile;
using interlock::testing::RunCommand;

const std::string kCli = INTERLOCK_CLI;
const std::string kSrc = INTERLOCK_SOURCE_DIR;

// The cells of a Markdown table row "| a | b |".
std::vector<std::string> Cells(const std::string& line) {
  std::vector<std::string> out;
  absl::string_view body = line;
  absl::ConsumePrefix(&body, "|");
  absl::ConsumeSuffix(&body, "|");
  for (absl::string_view c : absl::StrSplit(body, '|')) {
    out.emplace_back(absl::StripAsciiWhitespace(c));
  }
  return out;
}

double Number(std::string cell) {
  if (!cell.empty() && cell.back() == '%') cell.pop_back();
  double d = 0;
  EXPECT_TRUE(absl::SimpleAtod(cell, &d)) << "not a number: '" << cell << "'";
  return d;
}

uint32_t BigEndian32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) {
    v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  }
  return v;
}

// A PNG file: the signature, then an IHDR chunk with a non-zero size.
void ExpectPng(const std::string& path) {
  SCOPED_TRACE(path);
  const std::string png = ReadFile(path);
  ASSERT_GE(png.size(), 33u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(BigEndian32(png, 8), 13u);  // IHDR length
  EXPECT_EQ(png.substr(12, 4), "IHDR");
  EXPECT_GT(BigEndian32(png, 16), 0u);  // width
  EXPECT_GT(BigEndian32(png, 20), 0u);  // height
}

class CompareTest : public ::testing::Test {
 protected:
  // One tiny compare for the whole suite: 3 blocks, modes e2e, 1, 2.
  static void SetUpTestSuite() {
    dir_ = (std::filesystem::temp_directory_path() /
            ("interlock_compare_" + std::to_string(getpid())))
               .string();
    std::filesystem::remove_all(dir_);
    run_ = RunCommand(kCli + " compare --config " + kSrc +
                      "/configs/tests/tiny_resnet.pbtxt --modes e2e,1,2 "
                      "--steps 6 --out " +
                      dir_);
  }
  static void TearDownTestSuite() { std::filesystem::remove_all(dir_); }

  static std::string dir_;
  static interlock::testing::CommandResult run_;
};
std::string CompareTest::dir_;
interlock::testing::CommandResult CompareTest::run_;

TEST_F(CompareTest, ReportTableHasARowPerMode) {
  ASSERT_EQ(run_.exit_code, 0) << run_.output;
  // Progress names the mode and its place.
  EXPECT_NE(run_.output.find("[2/3] 1-way furthest"), std::string::npos)
      << run_.output;
  const std::string report = ReadFile(dir_ + "/report.md");
  EXPECT_NE(report.find("--modes e2e,1,2"), std::string::npos);  // command
  EXPECT_NE(report.find("tiny_resnet"), std::string::npos);
  std::istringstream in(report);
  std::string line;
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  while (std::getline(in, line)) {
    if (line.rfind("| mode |", 0) == 0) {
      header = Cells(line);
      std::getline(in, line);  // |---|---:|
      while (std::getline(in, line) && line.rfind("|", 0) == 0) {
        rows.push_back(Cells(line));
      }
      break;
    }
  }
  ASSERT_EQ(header.size(), 11u) << report;  // 8 columns + 3 heads
  EXPECT_EQ(header[1], "steps");
  EXPECT_EQ(header[4], "step wall (s)");
  EXPECT_EQ(header[5], "step virtual (s)");
  EXPECT_EQ(header[6], "utilisation");
  EXPECT_EQ(header[8], "block 0 aux accuracy");
  EXPECT_EQ(header[10], "block 2 final accuracy");
  ASSERT_EQ(rows.size(), 3u) << report;
  const std::vector<std::string> modes = {"e2e", "1-way furthest",
                                          "2-way furthest"};
  for (size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE(modes[i]);
    ASSERT_EQ(rows[i].size(), header.size());
    EXPECT_EQ(rows[i][0], modes[i]);
    EXPECT_EQ(Number(rows[i][1]), 6);
    for (int c : {2, 3}) EXPECT_GE(Number(rows[i][c]), 0) << c;
    for (int c : {4, 5}) EXPECT_GT(Number(rows[i][c]), 0) << c;
    const double util = Number(rows[i][6]);
    EXPECT_GT(util, 0);
    EXPECT_LE(util, 100);
    const double acc = Number(rows[i][10]);
    EXPECT_GE(acc, 0);
    EXPECT_LE(acc, 100);
    if (i == 0) {
      EXPECT_EQ(rows[i][8], "-");  // E2E has no auxiliary heads
    } else {
      Number(rows[i][8]);
    }
  }
}

TEST_F(CompareTest, PlotsAreValidPngsEmbeddedInTheReport) {
  ASSERT_EQ(run_.exit_code, 0) << run_.output;
  const std::string report = ReadFile(dir_ + "/report.md");
  for (const char* png : {"metric_virtual_time.png", "metric_wall_time.png",
                          "metric_steps.png", "loss_steps.png"}) {
    ExpectPng(dir_ + "/" + png);
    EXPECT_NE(report.find(std::string("](") + png + ")"), std::string::npos)
        << png;
  }
  for (const char* mode : {"e2e", "1way", "2way"}) {
    EXPECT_TRUE(std::filesystem::exists(dir_ + "/" + mode + "/metrics.jsonl"))
        << mode;
  }
}

TEST_F(CompareTest, SimulatePredictsEveryModeFromTheProfile) {
  ASSERT_EQ(run_.exit_code, 0) << run_.output;
  // Every mode's profile records the calibrated pass ratios of the blocks
  // whose input gradient some mode needs (not block 0), 1-way's too.
  for (const char* mode : {"e2e", "1way", "2way"}) {
    auto p = LoadProfile(dir_ + "/" + mode);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_EQ(p->shared_extra.size(), 3u);
    EXPECT_EQ(p->shared_extra[0], -1.0) << mode;
    EXPECT_EQ(p->input_share[0], -1.0) << mode;
    for (int k = 1; k < 3; ++k) {
      EXPECT_GE(p->shared_extra[k], 0.0) << mode << " block " << k;
      EXPECT_GT(p->input_share[k], 0.0) << mode << " block " << k;
    }
  }
  auto r = RunCommand(kCli + " simulate --profile " + dir_ +
                      "/2way --blocks 3 --n 2 --sweep");
  // step_of reads `r`, whichever run it holds.
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Rows: "[*] LABEL  step  speed-up  utilisation  idle...".
  auto step_of = [&r](const std::string& label) {
    std::istringstream lines(r.output);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.size() < 2 ||
          line.compare(2, label.size() + 2, label + "  ") != 0) {
        continue;
      }
      std::istringstream in(line.substr(2 + label.size()));
      double step = -1;
      in >> step;
      return step;
    }
    return -1.0;
  };
  for (const char* mode : {"e2e", "1-way furthest", "2-way furthest",
                           "3-way furthest", "3-way sum"}) {
    EXPECT_GT(step_of(mode), 0) << mode << "\n" << r.output;
  }
  EXPECT_NE(r.output.find("* 2-way furthest"), std::string::npos) << r.output;
  // With K = 3, 2-way SUM runs the same passes as FURTHEST: no row of its own.
  EXPECT_EQ(step_of("2-way sum"), -1.0) << r.output;
  EXPECT_NE(r.output.find("Step time (s) of the profiled model cut into K"),
            std::string::npos)
      << r.output;

  // Blocks of equal cost, K as profiled: 1-way's step is shorter than E2E's
  // (the measured tiny model's heads cost as much as its blocks, so its own
  // profile shows no such order).
  const std::string equal = dir_ + "/equal.json";
  std::ofstream(equal) << R"({
    "blocks": 3, "microbatches": 2, "batch_size": 16, "mode": "interlock",
    "n": 2, "rule": "furthest", "input_bytes": 1000,
    "down_bytes": [1000, 1000], "up_bytes": [1000, 1000],
    "link": {"latency_seconds": 1e-4, "bytes_per_second": 1.5e9},
    "per_block": [
      {"forward": 0.01, "head": 0.002, "backward": 0.02, "input_grad": 0,
       "optimizer": 0.001},
      {"forward": 0.01, "head": 0.002, "backward": 0.02, "input_grad": 0.004,
       "optimizer": 0.001},
      {"forward": 0.01, "head": 0.002, "backward": 0.02, "input_grad": 0,
       "optimizer": 0.001}],
    "step_seconds": {"wall": 0.1, "virtual": 0.05}})";
  r = RunCommand(kCli + " simulate --profile " + equal + " --blocks 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_GT(step_of("e2e"), 0) << r.output;
  EXPECT_LT(step_of("1-way furthest"), step_of("e2e")) << r.output;
  EXPECT_LT(step_of("2-way furthest"), step_of("e2e")) << r.output;

  // --n e2e marks the E2E row; a profile from E2E warns about head costs.
  auto e = RunCommand(kCli + " simulate --profile " + dir_ + "/e2e --n e2e");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_NE(e.output.find("* e2e"), std::string::npos) << e.output;
  EXPECT_NE(e.output.find("warning"), std::string::npos) << e.output;
}

TEST(Compare, BadModesGiveAClearError) {
  struct Case {
    std::string modes;
    std::string fragment;
  };
  for (const Case& c : std::vector<Case>{
           {"e2e,x", "'x' is not a mode"},
           {"e2e,4", "'4' needs 1 <= n <= K, and the model has K = 3"},
           {"0", "'0' needs 1 <= n <= K"},
           {"2,2way", "'2way' (2-way furthest) is listed twice"},
           {"e2e,,1", "empty entry"},
           {"2max", "'2max' is not a mode"},
           {"-1", "'-1' is not a mode"},
       }) {
    SCOPED_TRACE(c.modes);
    auto m = ParseModes(c.modes, 3);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find("--modes: " + c.fragment),
              std::string::npos)
        << m.status();
  }
  // Through the CLI: the message and exit code 2, before any training.
  const std::string out = std::filesystem::temp_directory_path().string() +
                          "/interlock_compare_bad";
  auto r = RunCommand(kCli + " compare --config " + kSrc +
                      "/configs/tests/tiny_resnet.pbtxt --steps 1 --out " +
                      out + " --modes e2e,5");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("interlock: error: --modes: '5' needs 1 <= n <= K"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(std::filesystem::exists(out));
}

// A fresh folder for one test's comparison.
std::string FreshOut(const std::string& name) {
  const std::string out = std::filesystem::temp_directory_path().string() +
                          "/interlock_compare_" + name + "_" +
                          std::to_string(getpid());
  std::filesystem::remove_all(out);
  return out;
}

// `interlock compare` of the tiny ResNet with `args` into `out`.
interlock::testing::CommandResult CompareTiny(const std::string& args,
                                              const std::string& out) {
  return RunCommand(kCli + " compare --config " + kSrc +
                    "/configs/tests/tiny_resnet.pbtxt " + args + " --out " +
                    out);
}

// --wire runs every mode with each codec, rows named mode/codec, folders
// mode-codec; the profiles count the encoded bytes.
TEST(Compare, WireCodecsAreVariantsOfEveryMode) {
  const std::string out = FreshOut("wire");
  auto r = CompareTiny("--modes 1,2 --wire fp32,bf16,int8 --steps 3", out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[5/6] 2-way furthest/bf16"), std::string::npos)
      << r.output;
  const std::string report = ReadFile(out + "/report.md");
  EXPECT_NE(report.find("* Wire codecs: fp32, bf16, int8 (--wire"),
            std::string::npos)
      << report;
  for (const char* row : {"| 1-way furthest/fp32 |", "| 1-way furthest/int8 |",
                          "| 2-way furthest/fp32 |", "| 2-way furthest/bf16 |",
                          "| 2-way furthest/int8 |"}) {
    EXPECT_NE(report.find(row), std::string::npos) << row << "\n" << report;
  }
  auto up_bytes = [&](const std::string& dir) {
    auto p = LoadProfile(out + "/" + dir);
    EXPECT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->up_bytes.size(), 2u);
    return p.ok() && !p->up_bytes.empty() ? p->up_bytes[0] : 0;
  };
  const int64_t fp32 = up_bytes("2way-fp32");
  EXPECT_GT(fp32, 0);
  EXPECT_EQ(up_bytes("2way-bf16") * 2, fp32);
  EXPECT_LT(up_bytes("2way-int8") * 3.9, fp32);
  auto summary = ReadSummary(out + "/2way-int8/summary.json");
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->wire(), "int8");

  auto bad = CompareTiny("--modes 2 --wire fp32,int4 --steps 1", out + "-bad");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--wire: wire codec \"int4\""), std::string::npos)
      << bad.output;
  std::filesystem::remove_all(out);
}

// With a budget, each mode runs the steps its budget buys, with its
// schedule spanning them (--fit-schedule, the default): the steps are
// predicted once from a calibration run, the report says them, and each
// mode stops exactly there, not at the budget or the config's steps.
TEST(Compare, BudgetFittedSchedulesRunThePredictedSteps) {
  const std::string out = FreshOut("fit");
  auto r = CompareTiny("--modes e2e,1 --budget-virtual 0.4s", out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("within the budget (--fit-schedule)"),
            std::string::npos)
      << r.output;
  const std::string report = ReadFile(out + "/report.md");
  EXPECT_NE(report.find("buys each mode"), std::string::npos) << report;
  int64_t e2e_steps = 0;
  for (const std::string dir : {"e2e", "1way"}) {
    const std::string mode = dir == "e2e" ? "e2e" : "1-way furthest";
    const size_t at = r.output.find(" " + mode + " -> ");
    ASSERT_NE(at, std::string::npos) << r.output;
    const size_t fitted = r.output.find(" steps fitted to the budget", at);
    ASSERT_NE(fitted, std::string::npos) << r.output;
    const size_t begin = r.output.rfind(' ', fitted - 1) + 1;
    const int64_t steps = std::stoll(r.output.substr(begin, fitted - begin));
    EXPECT_GT(steps, 6) << r.output;
    EXPECT_NE(report.find(mode + " " + std::to_string(steps)),
              std::string::npos)
        << report;
    auto summary = ReadSummary(out + "/" + dir + "/summary.json");
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_EQ(summary->steps(), steps) << dir;
    if (dir == "e2e") e2e_steps = steps;
  }
  // The same command again resumes the comparison: the steps fitted when
  // it started, finished modes read, an unfinished one run to them.
  std::filesystem::remove(out + "/e2e/summary.json");
  auto again = CompareTiny("--modes e2e,1 --budget-virtual 0.4s", out);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(again.output.find("calibrating"), std::string::npos)
      << again.output;
  EXPECT_NE(again.output.find("the steps fitted when this comparison started"),
            std::string::npos)
      << again.output;
  EXPECT_NE(again.output.find("1-way furthest: done before"), std::string::npos)
      << again.output;
  EXPECT_EQ(again.output.find("e2e: done before"), std::string::npos)
      << again.output;
  auto rerun = ReadSummary(out + "/e2e/summary.json");
  ASSERT_TRUE(rerun.ok()) << rerun.status();
  EXPECT_EQ(rerun->steps(), e2e_steps);
  EXPECT_NE(ReadFile(out + "/report.md").find("buys each mode"),
            std::string::npos);
  // Without it: the config's 20 steps, cut at the budget.
  auto plain = CompareTiny(
      "--modes e2e --budget-virtual 0.4s --fit-schedule=false", out + "-plain");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_EQ(plain.output.find("fitted to the budget"), std::string::npos)
      << plain.output;
  std::filesystem::remove_all(out);
  std::filesystem::remove_all(out + "-plain");
}

// `train --fit-schedule`: one run's steps fitted to its budget; the same
// command on the same --out resumes with the steps it was fitted to (no
// second calibration that could choose others).
TEST(Compare, TrainFitsItsScheduleToTheBudgetAndKeepsItOnResume) {
  const std::string out = FreshOut("train_fit");
  const std::string cmd = kCli + " train --config " + kSrc +
                          "/configs/tests/tiny_resnet.pbtxt --budget-virtual "
                          "0.3s --fit-schedule --checkpoint-every 1000 --out " +
                          out;
  auto r = RunCommand(cmd);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const size_t at = r.output.find("the budget buys ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const int64_t steps = std::stoll(r.output.substr(at + 16));
  EXPECT_GT(steps, 6);
  auto summary = ReadSummary(out + "/summary.json");
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->steps(), steps);
  EXPECT_FALSE(std::filesystem::exists(out + "/calibration"));
  auto again = RunCommand(cmd);
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("--fit-schedule: " + std::to_string(steps) +
                              " steps, as fitted when the run started"),
            std::string::npos)
      << again.output;
  EXPECT_EQ(again.output.find("calibrating"), std::string::npos)
      << again.output;
  EXPECT_EQ(interlock::testing::DigestOf(again.output),
            interlock::testing::DigestOf(r.output));
  auto none = RunCommand(kCli + " train --config " + kSrc +
                         "/configs/tests/tiny_resnet.pbtxt --fit-schedule");
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("--fit-schedule needs --budget or "
                             "--budget-virtual"),
            std::string::npos)
      << none.output;
  std::filesystem::remove_all(out);
}

TEST(Simulate, BadProfilesNameWhatIsWrong) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("interlock_profile_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string missing = (dir / "nothing").string();
  auto r = RunCommand(kCli + " simulate --profile " + missing);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("cannot read " + missing), std::string::npos)
      << r.output;

  const std::string file = (dir / "profile.json").string();
  std::ofstream(file) << "{\"blocks\": 2, \"microbatches\": 1";
  auto p = LoadProfile(dir.string());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("not a JSON object"), std::string::npos)
      << p.status();

  std::ofstream(file, std::ios::trunc)
      << "{\"blocks\": 2, \"microbatches\": 1, \"batch_size\": 8, "
         "\"mode\": \"e2e\", \"input_bytes\": 10, \"down_bytes\": [4], "
         "\"up_bytes\": [4], \"link\": {\"latency_seconds\": 0, "
         "\"bytes_per_second\": 0}, \"per_block\": [{\"forward\": 1, "
         "\"head\": 0, \"backward\": 1, \"optimizer\": 0}], "
         "\"step_seconds\": {\"wall\": 1, \"virtual\": 1}}";
  p = LoadProfile(file);
  EXPECT_NE(p.status().message().find(
                "field 'per_block' must be an array of 2 objects"),
            std::string::npos)
      << p.status();

  r = RunCommand(kCli + " simulate --profile " + file + " --microbatches -1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  std::filesystem::remove_all(dir);
}

// A profile with hand-picked costs and free links.
Profile HandProfile(int blocks, ModeSpec mode, double forward, double head,
                    double backward) {
  Profile p;
  p.blocks = blocks;
  p.microbatches = 1;
  p.mode = mode;
  p.link.latency_seconds = 0;
  p.link.bytes_per_second = 0;  // no transfer time
  p.down_bytes.assign(blocks - 1, 1000);
  p.up_bytes.assign(blocks - 1, 1000);
  for (int k = 0; k < blocks; ++k) {
    p.per_block.push_back(BlockProfile{forward, head, backward, 0.0});
  }
  return p;
}

TEST(Simulate, StepTimesWorkedOutByHand) {
  ModeSpec e2e;
  e2e.e2e = true;
  ModeSpec one;
  one.n = 1;
  // E2E, K = 2, forward 1, final loss 0.5, backward 2, no optimizer cost:
  // the chain is f + f + h + b + b = 6.5 s.
  Profile p = HandProfile(2, e2e, 1.0, 0.5, 2.0);
  p.per_block[0].head = 0.0;  // E2E: only the last block has a loss
  EXPECT_NEAR(PredictMode(p, 2, 1, p.link, e2e).step_seconds, 6.5, 1e-9);
  // 1-way: every block runs alone. Block 1's E2E backward also gave block 0
  // its input gradient, which 1-way does not need: its parameter pass is
  // b / (1 + kSharedInputShare). Block 1 takes f + h + that, block 0 f + b
  // = 3 (the E2E profile has no auxiliary head cost).
  const double s = kSharedInputShare;
  EXPECT_NEAR(PredictMode(p, 2, 1, p.link, one).step_seconds,
              std::max(3.0, 1.5 + 2.0 / (1 + s)), 1e-9);
  // The same model cut into 4 equal blocks: forward 0.5 each, parameter
  // passes b4 = (2 + 2 / (1 + s)) / 4, which blocks 1-3 also yield their
  // input gradient from: 4 * 0.5 + 0.5 + b4 + 3 * b4 * (1 + s).
  const double b4 = (2.0 + 2.0 / (1 + s)) / 4;
  EXPECT_NEAR(PredictMode(p, 4, 1, p.link, e2e).step_seconds,
              2.5 + b4 + 3 * b4 * (1 + s), 1e-9);
  const ScaledPipeline four = ScaleProfile(p, 4, 1, p.link, e2e);
  ASSERT_EQ(four.costs.size(), 4u);
  EXPECT_NEAR(four.costs[1].forward, 0.5, 1e-12);
  EXPECT_NEAR(four.costs[0].backward, b4, 1e-12);
  EXPECT_NEAR(four.costs[1].backward, b4 * (1 + s), 1e-12);
  EXPECT_NEAR(four.costs[3].head, 0.5, 1e-12);
  EXPECT_EQ(four.shape.down_bytes, std::vector<int64_t>(3, 1000));
}

// Calibrated pass ratios replace the defaults, block by block.
TEST(Simulate, CalibratedPassRatios) {
  ModeSpec e2e;
  e2e.e2e = true;
  ModeSpec one;
  one.n = 1;
  ModeSpec two_sum;
  two_sum.n = 2;
  two_sum.sum = true;
  // A 1-way profile (parameter passes alone: 2.0) with block 1 calibrated
  // and block 2 not.
  Profile p = HandProfile(3, one, 1.0, 0.25, 2.0);
  p.shared_extra = {-1.0, 0.1, -1.0};
  p.input_share = {-1.0, 0.8, -1.0};
  const ScaledPipeline e = ScaleProfile(p, 3, 1, p.link, e2e);
  EXPECT_NEAR(e.costs[0].backward, 2.0, 1e-12);
  EXPECT_NEAR(e.costs[1].backward, 2.0 * 1.1, 1e-12);
  EXPECT_NEAR(e.costs[2].backward, 2.0 * (1 + kSharedInputShare), 1e-12);
  // 2-way SUM: blocks 1 and 2 send their own entry up in an input-only pass.
  const ScaledPipeline s = ScaleProfile(p, 3, 1, p.link, two_sum);
  EXPECT_NEAR(s.costs[1].input_grad, 0.8 * 2.0, 1e-12);
  // Block 2, the last, yields its entry from the parameter pass.
  EXPECT_NEAR(s.costs[2].backward, 2.0 * (1 + kSharedInputShare), 1e-12);
  // Read back from an E2E profile, the parameter pass is the shared one
  // less the calibrated extra.
  Profile q = HandProfile(3, e2e, 1.0, 0.25, 2.2);
  q.shared_extra = {-1.0, 0.1, 0.1};
  EXPECT_NEAR(ScaleProfile(q, 3, 1, q.link, one).costs[1].backward, 2.0, 1e-12);
}

TEST(Simulate, InputGradientPassesPerMode) {
  ModeSpec one;
  one.n = 1;
  ModeSpec two;
  two.n = 2;
  ModeSpec three;
  three.n = 3;
  ModeSpec three_sum = three;
  three_sum.sum = true;
  // Measured in 2-way FURTHEST with K = 3: block 1 ran one early pass
  // (sending its own head's gradient up) that took 0.8 s; blocks 0 and 2
  // ran none.
  Profile p = HandProfile(3, two, 1.0, 0.25, 3.0);
  p.per_block[1].input_grad = 0.8;
  auto input_grad = [&](const ModeSpec& m, int k) {
    return ScaleProfile(p, 3, 1, p.link, m).costs[k].input_grad;
  };
  EXPECT_NEAR(input_grad(one, 1), 0.0, 1e-12);
  EXPECT_NEAR(input_grad(two, 1), 0.8, 1e-12);
  // 3-way FURTHEST: block 1 trains on, and sends up, the entry of L[2]; its
  // own entry (L[1]) would be an early pass, but it trains no block (block 0
  // trains on L[2]), so it is skipped. 3-way SUM sends both entries early.
  EXPECT_NEAR(input_grad(three, 1), 0.0, 1e-12);
  EXPECT_NEAR(input_grad(three_sum, 1), 1.6, 1e-12);
  // Block 0 sends nothing up; the parameter pass is the measured one.
  EXPECT_NEAR(input_grad(three_sum, 0), 0.0, 1e-12);
  EXPECT_NEAR(ScaleProfile(p, 3, 1, p.link, three_sum).costs[1].backward, 3.0,
              1e-12);
  // Where the profile's mode ran no early pass, one counts kInputOnlyShare of
  // the parameter pass: a 1-way profile predicting 3-way SUM.
  Profile local = HandProfile(3, one, 1.0, 0.25, 3.0);
  EXPECT_NEAR(
      ScaleProfile(local, 3, 1, local.link, three_sum).costs[1].input_grad,
      2 * kInputOnlyShare * 3.0, 1e-12);
  // Gradient bytes: the profile sent one entry of 1000 bytes per link, so
  // 3-way's two entries from block 1 weigh 2000.
  const ScaledPipeline three_lists = ScaleProfile(p, 3, 1, p.link, three);
  EXPECT_EQ(three_lists.shape.up_bytes, (std::vector<int64_t>{2000, 1000}));
  // Two micro-batches per step: per-micro-batch costs and bytes halve.
  const ScaledPipeline m2 = ScaleProfile(p, 3, 2, p.link, two);
  EXPECT_NEAR(m2.costs[2].forward, 0.5, 1e-12);
  EXPECT_NEAR(m2.costs[1].input_grad, 0.4, 1e-12);
  EXPECT_EQ(m2.shape.down_bytes[0], 500);
  EXPECT_EQ(m2.shape.window, 12);  // 2 K M, as the runner keeps in flight
}

TEST(Simulate, ParseModes) {
  auto m = ParseModes("e2e, 1,2sum,3way", 3);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->size(), 4u);
  EXPECT_TRUE((*m)[0].e2e);
  EXPECT_EQ((*m)[2].n, 2);
  EXPECT_TRUE((*m)[2].sum);
  EXPECT_EQ((*m)[2].Dir(), "2sum");
  EXPECT_EQ((*m)[3].Label(), "3-way furthest");
  EXPECT_EQ(ModesFor(2).size(), 3u);  // e2e, 1-way, 2-way (SUM costs the same)
}

TEST(CompareSeeds, MeanAndSampleDeviation) {
  // 2,4,4,4,5,5,7,9: mean 5, squared deviations 32, sample sd sqrt(32/7).
  MeanSd m = MeanAndSd({2, 4, 4, 4, 5, 5, 7, 9});
  EXPECT_EQ(m.n, 8);
  EXPECT_DOUBLE_EQ(m.mean, 5.0);
  EXPECT_DOUBLE_EQ(m.sd, std::sqrt(32.0 / 7.0));
  // Non-finite values (a metric a run lacks) are left out.
  m = MeanAndSd({1, std::nan(""), 3});
  EXPECT_EQ(m.n, 2);
  EXPECT_DOUBLE_EQ(m.mean, 2.0);
  EXPECT_DOUBLE_EQ(m.sd, std::sqrt(2.0));
  m = MeanAndSd({7});
  EXPECT_EQ(m.n, 1);
  EXPECT_TRUE(std::isnan(m.sd));
  EXPECT_EQ(FormatMeanSd(m, false, 2), "7.00 ± -");
  EXPECT_EQ(FormatMeanSd(MeanAndSd({}), false, 2), "-");
  EXPECT_EQ(FormatMeanSd(MeanAndSd({80, 85, 90}), true, 2), "85.00% ± 5.00");
}

// A finished run of `mode` with `seed`: final accuracy, aux accuracy (not
// for E2E) and virtual step time as given.
ModeReport FinishedRun(const std::string& mode, int64_t seed, double accuracy,
                       double aux, double step_virtual) {
  ModeReport r;
  r.mode = (*ParseModes(mode, 2))[0];
  r.seed = seed;
  r.status = absl::OkStatus();
  r.summary.set_steps(10);
  r.summary.mutable_mean_step_seconds()->set_wall(2 * step_virtual);
  r.summary.mutable_mean_step_seconds()->set_virtual_(step_virtual);
  r.summary.set_utilisation(0.5);
  if (!r.mode.e2e) {
    auto* h = r.summary.add_eval();
    h->set_block(0);
    h->set_head("aux");
    h->set_accuracy(aux);
  }
  auto* h = r.summary.add_eval();
  h->set_block(1);
  h->set_head("final");
  h->set_accuracy(accuracy);
  for (auto& head : *r.summary.mutable_eval()) {
    head.set_perplexity(std::nan(""));  // an image model
  }
  return r;
}

TEST(CompareSeeds, AggregatesEachModeOverItsSeeds) {
  std::vector<ModeReport> runs = {FinishedRun("e2e", 1, 0.80, 0, 1.0),
                                  FinishedRun("e2e", 2, 0.85, 0, 2.0),
                                  FinishedRun("e2e", 3, 0.90, 0, 3.0),
                                  FinishedRun("2", 1, 0.70, 0.60, 0.5),
                                  FinishedRun("2", 2, 0.74, 0.64, 0.5),
                                  FinishedRun("2", 3, 0.0, 0.0, 9.0)};
  runs.back().status = absl::InternalError("failed");  // left out
  EXPECT_EQ(runs[1].Label(), "e2e seed 2");
  EXPECT_EQ(runs[1].GroupLabel(), "e2e");
  EXPECT_EQ(runs[4].Dir(), "2way-seed2");
  const std::vector<SeedAggregate> a = AggregateSeeds(runs, 2, false);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].label, "e2e");
  EXPECT_EQ(a[0].runs, 3);
  EXPECT_DOUBLE_EQ(a[0].metric[1].mean, 85.0);
  EXPECT_NEAR(a[0].metric[1].sd, 5.0, 1e-12);
  EXPECT_EQ(a[0].metric[0].n, 0);  // E2E has no auxiliary head
  EXPECT_DOUBLE_EQ(a[0].step_virtual.mean, 2.0);
  EXPECT_DOUBLE_EQ(a[0].step_virtual.sd, 1.0);
  EXPECT_DOUBLE_EQ(a[0].step_wall.mean, 4.0);
  EXPECT_EQ(a[1].label, "2-way furthest");
  EXPECT_EQ(a[1].runs, 2);
  EXPECT_DOUBLE_EQ(a[1].metric[1].mean, 72.0);
  EXPECT_NEAR(a[1].metric[1].sd, std::sqrt(8.0), 1e-12);
  EXPECT_DOUBLE_EQ(a[1].metric[0].mean, 62.0);
  EXPECT_DOUBLE_EQ(a[1].step_virtual.sd, 0.0);
  EXPECT_DOUBLE_EQ(a[1].utilisation.mean, 50.0);

  // The report's table: one row per mode, as aggregated.
  const std::string dir = FreshOut("seeds_report");
  std::filesystem::create_directories(dir);
  ReportHeader header;
  header.blocks = 2;
  header.seeds = {1, 2, 3};
  ASSERT_TRUE(WriteReport(dir, header, runs, absl::OkStatus()).ok());
  const std::string report = ReadFile(dir + "/report.md");
  EXPECT_NE(report.find("seeds 1, 2, 3"), std::string::npos) << report;
  EXPECT_NE(report.find("| e2e | 3 | 10.0 ± 0.0 | 4.0000 ± 2.0000 | "
                        "2.0000 ± 1.0000 | 50.0% ± 0.0 | - | 85.00% ± 5.00 |"),
            std::string::npos)
      << report;
  EXPECT_NE(report.find("| 2-way furthest | 2 |"), std::string::npos) << report;
  EXPECT_NE(report.find("| 62.00% ± 2.83 | 72.00% ± 2.83 |"), std::string::npos)
      << report;
  std::filesystem::remove_all(dir);

  EXPECT_EQ(*ParseSeeds("1,2,30"), (std::vector<int64_t>{1, 2, 30}));
  for (const char* bad : {"1,,2", "x", "-1", "1,1", ""}) {
    EXPECT_FALSE(ParseSeeds(bad).ok()) << bad;
  }
  EXPECT_NE(ParseSeeds("1,1").status().message().find("1 is listed twice"),
            std::string::npos);
}

// A real compare over two seeds: every mode once per seed, a mean ± sd row
// per mode whose mean is the mean of its seeds' rows, one line per seed in
// the plots.
TEST(CompareSeeds, RunsEveryModePerSeed) {
  const std::string out = FreshOut("seeds");
  auto r = CompareTiny("--modes e2e,2 --seeds 1,2 --steps 3", out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Seed by seed: a drifting machine does not favour one mode.
  EXPECT_NE(r.output.find("[2/4] 2-way furthest seed 1"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[4/4] 2-way furthest seed 2"), std::string::npos)
      << r.output;
  const std::string report = ReadFile(out + "/report.md");
  std::istringstream in(report);
  std::string line;
  std::vector<std::vector<std::string>> runs, means;
  while (std::getline(in, line)) {
    if (line.rfind("| mode |", 0) != 0) continue;
    auto& rows = runs.empty() ? runs : means;
    std::getline(in, line);
    while (std::getline(in, line) && line.rfind("|", 0) == 0) {
      rows.push_back(Cells(line));
    }
  }
  ASSERT_EQ(runs.size(), 4u) << report;
  EXPECT_EQ(runs[0][0], "e2e seed 1");
  EXPECT_EQ(runs[3][0], "2-way furthest seed 2");
  ASSERT_EQ(means.size(), 2u) << report;
  for (size_t m = 0; m < 2; ++m) {
    SCOPED_TRACE(means[m][0]);
    EXPECT_EQ(means[m][0], m == 0 ? "e2e" : "2-way furthest");
    EXPECT_EQ(means[m][1], "2");
    // The final head's accuracy: "a% ± s" against the two runs' cells.
    const std::string cell = means[m].back();
    const size_t pm = cell.find(" ± ");
    ASSERT_NE(pm, std::string::npos) << cell;
    const double a = Number(runs[2 * m].back()),
                 b = Number(runs[2 * m + 1].back());
    EXPECT_NEAR(Number(cell.substr(0, pm)), (a + b) / 2, 0.006);
    EXPECT_NEAR(Number(cell.substr(pm + 4)), std::abs(a - b) / std::sqrt(2.0),
                0.006);
  }
  // Different seeds start from different parameters.
  auto s1 = ReadSummary(out + "/e2e-seed1/summary.json");
  auto s2 = ReadSummary(out + "/e2e-seed2/summary.json");
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_NE(s1->digest(), s2->digest());
  EXPECT_EQ(s2->seed(), 2);
  const std::string gp = ReadFile(out + "/plots.gp");
  EXPECT_NE(gp.find("lt 2 dt 2 notitle"), std::string::npos) << gp;
  EXPECT_NE(gp.find("2-way furthest (seeds)"), std::string::npos);
  ExpectPng(out + "/metric_steps.png");
  auto both =
      CompareTiny("--modes e2e --seed 3 --seeds 1,2 --steps 1", out + "-both");
  EXPECT_EQ(both.exit_code, 2) << both.output;
  EXPECT_NE(both.output.find("give --seed or --seeds"), std::string::npos);
  std::filesystem::remove_all(out);
}

}  // namespace
}  // namespace interlock
