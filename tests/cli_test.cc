// The `interlock train` command: worked examples through the CLI path, the
// run files, and clear one-line errors with a non-zero exit.
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/test_util.h"

namespace interlock {
namespace {

using interlock::testing::DigestOf;
using interlock::testing::ExpectOneLineError;
using interlock::testing::ParseParams;
using interlock::testing::ReadFile;
using interlock::testing::RunCommand;

const std::string kCli = INTERLOCK_CLI;
const std::string kSrc = INTERLOCK_SOURCE_DIR;

std::string TempDir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() /
           ("interlock_cli_" + name + "_" + std::to_string(getpid()));
  std::filesystem::remove_all(p);
  return p.string();
}

std::vector<double> Theta(const std::map<std::string, std::vector<double>>& p,
                          int block) {
  auto it = p.find("block" + std::to_string(block) + ".block.0.theta");
  return it == p.end() ? std::vector<double>{} : it->second;
}

void ExpectNear(const std::vector<double>& got,
                const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6);
}

TEST(Cli, WorkedExamples) {
  struct Case {
    std::string config;
    std::vector<std::vector<double>> theta;
  };
  for (const Case& c : std::vector<Case>{
           {"example_e2e", {{0.8}, {2.2}, {3.4}}},
           {"example_1way", {{1.5, 2.5}, {2.0, 4.0}, {3.4, 3.4}}},
           {"example_2way", {{0.5, 3.5}, {2.2, 2.2}, {3.4, 3.4}}}}) {
    auto r = RunCommand(kCli + " train --quiet --dump-params --config " + kSrc +
                        "/configs/tests/" + c.config + ".pbtxt");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto p = ParseParams(r.output);
    for (int k = 0; k < 3; ++k) {
      SCOPED_TRACE(c.config + " block " + std::to_string(k));
      ExpectNear(Theta(p, k), c.theta[k]);
    }
  }
}

TEST(Cli, WritesRunFiles) {
  const std::string out = TempDir("files");
  auto r =
      RunCommand(kCli + " train --config " + kSrc +
                 "/configs/tests/tiny_resnet.pbtxt --steps 4 --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("final head: accuracy"), std::string::npos)
      << r.output;
  std::ifstream metrics(out + "/metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) {
    ++lines;
    EXPECT_NE(line.find("\"wall_seconds\":"), std::string::npos);
    EXPECT_NE(line.find("\"lr\":"), std::string::npos);
    EXPECT_NE(line.find("\"loss\":["), std::string::npos);
  }
  EXPECT_EQ(lines, 4);
  std::stringstream summary;
  summary << std::ifstream(out + "/summary.json").rdbuf();
  EXPECT_NE(summary.str().find("\"digests\""), std::string::npos);
  EXPECT_NE(summary.str().find("\"digest\""), std::string::npos);
  std::stringstream eval;
  eval << std::ifstream(out + "/eval.jsonl").rdbuf();
  EXPECT_NE(eval.str().find("\"head\":\"final\""), std::string::npos);
  EXPECT_NE(eval.str().find("\"head\":\"aux\""), std::string::npos);
  std::filesystem::remove_all(out);
}

// A machine without gnuplot (a slim container) still trains and writes the
// run's files: the timeline picture is left to its script, with a warning.
// (The image's smoke test once failed every run with --out this way.)
TEST(Cli, RunsWithoutGnuplot) {
  const std::string out = TempDir("nognuplot");
  auto r =
      RunCommand("env PATH=/nonexistent " + kCli + " train --config " + kSrc +
                 "/configs/tests/tiny_resnet.pbtxt --steps 3 --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("timeline not drawn"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(out + "/summary.json"));
  EXPECT_TRUE(std::filesystem::exists(out + "/timeline.gp"));
  EXPECT_FALSE(std::filesystem::exists(out + "/timeline.png"));
  std::filesystem::remove_all(out);
}

// `train --reduction` sets training.reduction (it was once read by
// `simulate` only, and `train` ran ORDERED whatever it said).
TEST(Cli, ReductionFlagSetsTheRunsReduction) {
  for (const std::string reduction : {"ring", "ordered"}) {
    const std::string out = TempDir("reduction_" + reduction);
    auto r = RunCommand(kCli + " train --quiet --config " + kSrc +
                        "/configs/tests/tiny_resnet.pbtxt --steps 1 " +
                        "--reduction " + reduction + " --out " + out);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::stringstream summary;
    summary << std::ifstream(out + "/summary.json").rdbuf();
    EXPECT_NE(summary.str().find("\"reduction\": \"" + reduction + "\""),
              std::string::npos)
        << summary.str();
    std::filesystem::remove_all(out);
  }
}

TEST(Cli, SameSeedSameDigestAcrossSchedules) {
  const std::string base = kCli + " train --quiet --config " + kSrc +
                           "/configs/tests/tiny_resnet.pbtxt --steps 3";
  auto a = RunCommand(base + " --schedule sequential");
  auto b = RunCommand(base + " --schedule threaded");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  auto digest = [](const std::string& s) {
    auto at = s.find("digest ");
    return at == std::string::npos ? std::string() : s.substr(at, 71);
  };
  EXPECT_FALSE(digest(a.output).empty());
  EXPECT_EQ(digest(a.output), digest(b.output));
}

// Blocks placed on the CPU explicitly, all at once or one by one, train
// exactly as by default.
TEST(Cli, ExplicitCpuDevicesKeepTheDigest) {
  const std::string base = kCli + " train --quiet --config " + kSrc +
                           "/configs/tests/tiny_resnet.pbtxt --steps 3";
  auto plain = RunCommand(base);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_FALSE(DigestOf(plain.output).empty());
  for (const char* devices : {"cpu", "cpu,cpu,cpu"}) {
    auto r = RunCommand(base + " --device " + devices);
    ASSERT_EQ(r.exit_code, 0) << devices << ": " << r.output;
    EXPECT_EQ(DigestOf(r.output), DigestOf(plain.output)) << devices;
  }
}

// Every bad input: a one-line error naming the problem, a non-zero exit.
TEST(Cli, BadInputsGiveOneLineErrors) {
  const std::string dir = TempDir("bad");
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  const std::string tiny = kSrc + "/configs/tests/tiny_resnet.pbtxt";
  struct Case {
    std::string args;
    std::string fragment;
  };
  const std::string bad_gz = write("train-images-idx3-ubyte.gz", "not gzip");
  for (const char* f :
       {"train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz"}) {
    write(f, "x");
  }
  const std::string fmnist_cfg =
      write("fmnist.pbtxt",
            "model { mlp { hidden: 8 } blocks: 2 head: \"fc\" }\n"
            "data { kind: FASHION_MNIST path: \"" +
                dir + "\" }\n");
  for (const Case& c : std::vector<Case>{
           {"--config /nonexistent.pbtxt", "/nonexistent.pbtxt"},
           {"--config " + write("u.pbtxt", "nonsense_field: 1\n"),
            "nonsense_field"},
           {"--config " + tiny + " --n 9", "training.n"},
           {"--config " + tiny + " --mode sideways", "--mode"},
           {"--config " + tiny + " --rule biggest", "--rule"},
           {"--config " + tiny + " --reduction fastest",
            "--reduction: 'fastest', expected ordered or ring"},
           {"--config " + tiny + " --schedule random", "--schedule"},
           {"--config " + tiny + " --schedule threaded --profile-ops x.md",
            "--profile-ops needs --engine inprocess and --schedule "
            "sequential"},
           {"--config " + tiny + " --profile-ops /nonexistent/ops.md",
            "--profile-ops: cannot write /nonexistent/ops.md"},
           {"--config " + fmnist_cfg, "train-images-idx3-ubyte.gz"},
           {"--config " + tiny + " --device gpu",
            "--device: 'gpu' is not cpu, cuda or cuda:N"},
           {"--config " + tiny + " --device cpu,cpu",
            "--device: 2 devices for a model of 3 blocks"},
           {"--config " + tiny + " --engine cluster --device cpu,cpu",
            "--device: 2 devices for a model of 3 blocks"},
           {"--config " + tiny +
                " --engine cluster --workers a:1,b:2,c:3 --device cpu",
            "--device: remote workers"},
       }) {
    ExpectOneLineError(RunCommand(kCli + " train --quiet " + c.args), c.args,
                       c.fragment);
  }
  auto r = RunCommand(kCli + " frobnicate");
  EXPECT_EQ(r.exit_code, 2);
  std::filesystem::remove_all(dir);
}

// --profile-ops: the time per LibTorch operation of the steps after the
// first, in a Markdown table; profiling changes no parameter.
TEST(Cli, ProfileOpsTimesEachOperationAndKeepsTheDigest) {
  const std::string dir = TempDir("profile_ops");
  std::filesystem::create_directories(dir);
  const std::string base = kCli + " train --quiet --config " + kSrc +
                           "/configs/tests/tiny_resnet.pbtxt --steps 4";
  auto plain = RunCommand(base);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  auto profiled = RunCommand(base + " --profile-ops " + dir + "/ops.md");
  ASSERT_EQ(profiled.exit_code, 0) << profiled.output;
  EXPECT_FALSE(DigestOf(plain.output).empty());
  EXPECT_EQ(DigestOf(profiled.output), DigestOf(plain.output));
  const std::string ops = ReadFile(dir + "/ops.md");
  // Steps 2-4: the first one warms up and is left out; four steps are too
  // few to leave out calibration too, and the report says so.
  EXPECT_NE(ops.find(", steps 2-4 (in process"), std::string::npos) << ops;
  EXPECT_NE(ops.find("\n3 steps; "), std::string::npos) << ops;
  EXPECT_NE(ops.find("these steps include them"), std::string::npos) << ops;
  // The convolutions forward and backward (autograd's work is seen too),
  // with one call per step of each of the model's convolutions at least.
  for (const std::string op :
       {"| aten::convolution | ", "| aten::convolution_backward | "}) {
    const auto at = ops.find(op);
    ASSERT_NE(at, std::string::npos) << op << "\n" << ops;
    const double calls = std::stod(ops.substr(at + op.size()));
    EXPECT_GE(calls, 3.0) << op;
  }
  // The self shares of the rows add up to the whole.
  double percent = 0;
  std::istringstream rows(ops);
  for (std::string line; std::getline(rows, line);) {
    if (line.rfind("| ", 0) != 0 || line.find("---") != std::string::npos ||
        line.find("| operation |") == 0) {
      continue;
    }
    std::vector<std::string> cells;
    for (size_t a = 1, b; (b = line.find(" |", a)) != std::string::npos;
         a = b + 2) {
      cells.push_back(line.substr(a + 1, b - a - 1));
    }
    ASSERT_GE(cells.size(), 4u) << line;
    percent += std::stod(cells[3]);
  }
  EXPECT_NEAR(percent, 100.0, 1.0) << ops;

  // A longer run leaves out the micro-batches whose blocks calibrate (three
  // extra backward passes each): in E2E every convolution then has exactly
  // one backward call per step.
  auto e2e = RunCommand(kCli + " train --quiet --config " + kSrc +
                        "/configs/tests/tiny_resnet.pbtxt --mode e2e --steps "
                        "40 --profile-ops " +
                        dir + "/e2e.md");
  ASSERT_EQ(e2e.exit_code, 0) << e2e.output;
  const std::string e2e_ops = ReadFile(dir + "/e2e.md");
  EXPECT_EQ(e2e_ops.find("calibrate"), std::string::npos) << e2e_ops;
  EXPECT_NE(e2e_ops.find("\n10 steps; "), std::string::npos) << e2e_ops;
  auto calls_of = [&](const std::string& op) {
    const auto at = e2e_ops.find("| " + op + " | ");
    return at == std::string::npos
               ? -1.0
               : std::stod(e2e_ops.substr(at + op.size() + 5));
  };
  EXPECT_GT(calls_of("aten::convolution"), 0) << e2e_ops;
  EXPECT_EQ(calls_of("aten::convolution_backward"),
            calls_of("aten::convolution"))
      << e2e_ops;
  std::filesystem::remove_all(dir);
}

// Debian's LibTorch has no CUDA: asking for it is refused before anything
// starts, in process and for a local cluster's workers alike.
TEST(Cli, CudaWithoutCudaIsAClearError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "this machine has CUDA";
  const std::string tiny = kSrc + "/configs/tests/tiny_resnet.pbtxt";
  for (const std::string args : {"--device cuda", "--device cpu,cpu,cuda:1",
                                 "--engine cluster --device cuda:0"}) {
    auto r = RunCommand(kCli + " train --quiet --config " + tiny + " " + args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find("interlock: error: --device: 'cuda:"),
              std::string::npos)
        << args << ": " << r.output;
    EXPECT_NE(r.output.find("needs CUDA"), std::string::npos)
        << args << ": " << r.output;
  }
}

// --help describes every flag of the CLI (absl's default found none).
TEST(Cli, HelpListsEveryFlagWithItsDescription) {
  auto r = RunCommand(kCli + " train --help");
  for (const char* flag : {"--config", "--steps", "--seed", "--out",
                           "--workers", "--device", "--budget", "--token_file",
                           "--checkpoint_every", "--recover_timeout"}) {
    EXPECT_NE(r.output.find(std::string(flag) + " ("), std::string::npos)
        << flag << " missing from --help:\n"
        << r.output;
  }
  EXPECT_NE(r.output.find("optimizer steps to run"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("No flags matched"), std::string::npos) << r.output;
}

// `simulate --replicas`: a bad count is refused with exit 2 naming the flag;
// a good one prints what the replicas buy and the reduction per step.
TEST(Cli, SimulateReplicas) {
  const std::string dir = TempDir("simulate_replicas");
  std::filesystem::create_directories(dir);
  const std::string profile = dir + "/profile.json";
  // Block 0 costs 3x block 1; M = 2; 1000 and 10 parameters.
  std::ofstream(profile) << R"({
    "blocks": 2, "microbatches": 2, "batch_size": 16, "mode": "interlock",
    "n": 1, "rule": "furthest", "input_bytes": 1000,
    "down_bytes": [1000], "up_bytes": [0],
    "link": {"latency_seconds": 1e-4, "bytes_per_second": 4.4e8},
    "per_block": [
      {"forward": 0.01, "head": 0, "backward": 0.02, "input_grad": 0,
       "optimizer": 0.001, "parameters": 1000},
      {"forward": 0.004, "head": 0, "backward": 0.006, "input_grad": 0,
       "optimizer": 0.001, "parameters": 10}],
    "step_seconds": {"wall": 0.1, "virtual": 0.05}})";
  const std::string base = kCli + " simulate --profile " + profile;
  struct Case {
    std::string args;
    std::string fragment;
  };
  for (const Case& c : std::vector<Case>{
           {"--replicas 2", "--replicas: 1 blocks given for a model of 2"},
           {"--replicas 2,1,1", "--replicas: 3 blocks given"},
           {"--replicas 0,1", "--replicas: '0' is not a replica count"},
           {"--replicas 2,x", "--replicas: 'x' is not a replica count"},
           {"--replicas=", "--replicas: '' is not a replica count"},
           {"--replicas 3,1",
            "--replicas: block 0 has 3 replicas but a step has only 2"},
           {"--replicas 2,1 --microbatches 1",
            "--replicas: block 0 has 2 replicas but a step has only 1"},
           {"--replicas 2,1 --reduction fast", "--reduction: 'fast'"},
       }) {
    auto r = RunCommand(base + " " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << ": " << r.output;
    EXPECT_NE(r.output.find("interlock: error: " + c.fragment),
              std::string::npos)
        << c.args << ": " << r.output;
  }
  auto r = RunCommand(base + " --replicas 2,1 --sweep");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* text :
       {"Replicas 2,1, reduction ordered", "block 0: 2 replicas, P = 1000",
        "vs 1 rep.", "samples/s", "against block 0's replicas"}) {
    EXPECT_NE(r.output.find(text), std::string::npos) << text << r.output;
  }
  std::filesystem::remove_all(dir);
}

// In process, --replicas only informs the virtual clock: the run is the
// single chain (its digest does not change) and the run files describe the
// replicas the clock replayed.
TEST(Cli, InProcessReplicasInformTheClock) {
  const std::string out = TempDir("inprocess_replicas");
  const std::string base = kCli + " train --quiet --config " + kSrc +
                           "/configs/tests/tiny_resnet.pbtxt --steps 2";
  auto plain = RunCommand(base);
  auto replicated = RunCommand(base + " --replicas 2,1,1 --out " + out);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_EQ(replicated.exit_code, 0) << replicated.output;
  EXPECT_EQ(DigestOf(replicated.output), DigestOf(plain.output));
  std::stringstream profile, summary;
  profile << std::ifstream(out + "/profile.json").rdbuf();
  summary << std::ifstream(out + "/summary.json").rdbuf();
  EXPECT_NE(profile.str().find("\"replicas\""), std::string::npos)
      << profile.str();
  EXPECT_NE(profile.str().find("\"parameters\""), std::string::npos)
      << profile.str();
  EXPECT_NE(summary.str().find("\"replica_busy_ratio\""), std::string::npos)
      << summary.str();
  auto bad = RunCommand(base + " --replicas 2,1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--replicas: 2 blocks given for a model of 3"),
            std::string::npos)
      << bad.output;
  std::filesystem::remove_all(out);
}

}  // namespace
}  // namespace interlock
