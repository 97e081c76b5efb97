// Checkpoints, resume and recovery of whole runs through the CLI, with real
// interlock-worker processes on loopback: resume equals an uninterrupted run
// bitwise, SIGTERM checkpoints before stopping, a killed worker is restarted
// and the run completes exactly once.
#include <gtest/gtest.h>

#include <filesystem>

#include "tests/cluster_util.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

namespace fs = std::filesystem;
using interlock::testing::Child;
using interlock::testing::Count;
using interlock::testing::DigestOf;
using interlock::testing::LinesIn;
using interlock::testing::ReadFile;
using interlock::testing::RunCommand;
using interlock::testing::StartChild;
using interlock::testing::SummaryField;
using interlock::testing::WaitExit;

const std::string kCli = INTERLOCK_CLI;
const std::string kSrc = INTERLOCK_SOURCE_DIR;

std::string MakeTempDir(const std::string& tag) {
  std::string tmpl = "/tmp/interlock-test-" + tag + "-XXXXXX";
  return mkdtemp(tmpl.data());
}

// The digest of the uninterrupted run, from the in-process engine (bitwise
// equal to the cluster's).
std::string Reference(const std::string& config, int steps) {
  auto r = RunCommand(kCli + " train --quiet --config " + config + " --steps " +
                      std::to_string(steps));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return DigestOf(r.output);
}

// A field of summary.json ("name": value).
TEST(ClusterResume, ResumeEqualsUninterruptedRun) {
  const std::string dir = MakeTempDir("resume");
  const std::string config = kSrc + "/configs/tests/tiny_resnet.pbtxt";
  const std::string want = Reference(config, 20);
  const std::string cmd = kCli + " train --quiet --engine cluster --config " +
                          config + " --steps 20 --checkpoint-every 5 --out " +
                          dir + "/out";
  auto full = RunCommand(cmd);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  EXPECT_EQ(DigestOf(full.output), want);
  fs::remove_all(dir + "/out/checkpoints/step-0000000020");
  fs::remove_all(dir + "/out/checkpoints/step-0000000015");
  auto resumed = RunCommand(cmd);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from"), std::string::npos)
      << resumed.output;
  EXPECT_EQ(DigestOf(resumed.output), want);
  const std::string summary = ReadFile(dir + "/out/summary.json");
  EXPECT_EQ(SummaryField(summary, "resumed_from_step"), "10") << summary;
  EXPECT_EQ(SummaryField(summary, "microbatches_applied"), "40") << summary;
  EXPECT_EQ(LinesIn(dir + "/out/metrics.jsonl"), 20);

  // --resume names a checkpoint explicitly (here, of the same run).
  auto explicit_resume = RunCommand(
      kCli + " train --quiet --engine cluster --config " + config +
      " --steps 20 --resume " + dir + "/out/checkpoints/step-0000000010");
  ASSERT_EQ(explicit_resume.exit_code, 0) << explicit_resume.output;
  EXPECT_EQ(DigestOf(explicit_resume.output), want);
  fs::remove_all(dir);
}

// SIGTERM: the coordinator checkpoints at the next step boundary, stops its
// workers and exits; the same command then continues the run to the same
// parameters as an uninterrupted run.
TEST(ClusterResume, SigtermCheckpointsAndTheSameCommandResumes) {
  const std::string dir = MakeTempDir("sigterm");
  const std::string config = kSrc + "/configs/tests/tiny_resnet.pbtxt";
  const int steps = 300;
  const std::string want = Reference(config, steps);
  const std::vector<std::string> args = {"train",
                                         "--quiet",
                                         "--engine=cluster",
                                         "--config=" + config,
                                         "--steps=" + std::to_string(steps),
                                         "--out=" + dir + "/out"};
  Child cli = StartChild(kCli, args, dir + "/cli1.log");
  for (int i = 0; i < 1200 && LinesIn(dir + "/out/metrics.jsonl") < 20; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(LinesIn(dir + "/out/metrics.jsonl"), 20) << ReadFile(cli.log);
  kill(cli.pid, SIGTERM);
  const int code = WaitExit(cli.pid, 60);
  const std::string log1 = ReadFile(cli.log);
  ASSERT_EQ(code, 130) << log1;
  EXPECT_NE(log1.find("checkpoint"), std::string::npos) << log1;
  const int done = LinesIn(dir + "/out/metrics.jsonl");
  ASSERT_LT(done, steps) << "the run ended before the signal";

  Child again = StartChild(kCli, args, dir + "/cli2.log");
  ASSERT_EQ(WaitExit(again.pid, 240), 0) << ReadFile(again.log);
  const std::string log2 = ReadFile(again.log);
  EXPECT_NE(log2.find("resuming from"), std::string::npos) << log2;
  EXPECT_EQ(DigestOf(log2), want) << log2;
  EXPECT_EQ(LinesIn(dir + "/out/metrics.jsonl"), steps);
  fs::remove_all(dir);
}

// A local cluster's worker killed mid-run is restarted on its port; every
// block is restored and the run replays from the last checkpoint.
TEST(ClusterRecovery, KilledWorkerIsRestartedAndTheRunCompletes) {
  const std::string dir = MakeTempDir("recover");
  const std::string config = kSrc + "/configs/tests/tiny_resnet.pbtxt";
  const int steps = 200;
  const std::string want = Reference(config, steps);
  Child cli =
      StartChild(kCli,
                 {"train", "--quiet", "--engine=cluster", "--config=" + config,
                  "--steps=" + std::to_string(steps), "--checkpoint-every=10",
                  "--recover-timeout=60s", "--out=" + dir + "/out"},
                 dir + "/cli.log");
  for (int i = 0; i < 1200 && LinesIn(dir + "/out/metrics.jsonl") < 25; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(LinesIn(dir + "/out/metrics.jsonl"), 25) << ReadFile(cli.log);
  auto pids = RunCommand("pgrep -P " + std::to_string(cli.pid) +
                         " -f interlock-worker");
  std::vector<int> workers;
  std::istringstream in(pids.output);
  for (int p; in >> p;) workers.push_back(p);
  ASSERT_EQ(workers.size(), 3u) << pids.output;
  kill(workers[1], SIGKILL);
  ASSERT_EQ(WaitExit(cli.pid, 240), 0) << ReadFile(cli.log);
  const std::string log = ReadFile(cli.log);
  EXPECT_EQ(DigestOf(log), want) << log;
  EXPECT_NE(log.find("restarted 1 worker"), std::string::npos) << log;
  EXPECT_NE(log.find("recovered; replaying from step"), std::string::npos);
  const std::string summary = ReadFile(dir + "/out/summary.json");
  EXPECT_EQ(SummaryField(summary, "recoveries"), "1") << summary;
  EXPECT_EQ(SummaryField(summary, "microbatches_applied"),
            std::to_string(steps * 2))
      << summary;
  EXPECT_EQ(SummaryField(summary, "steps_not_exactly_once"), "[]") << summary;
  EXPECT_EQ(LinesIn(dir + "/out/metrics.jsonl"), steps);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace interlock
