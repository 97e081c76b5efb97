// Chaos: a 4-worker local-cluster run in which kill -9 hits a random worker
// at a random moment three times, and then the coordinator itself. Every
// time the run must come back (workers restarted and restored, the
// coordinator resumed from its newest checkpoint) and end with parameters
// bitwise equal to an uninterrupted run's, every micro-batch applied
// exactly once.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

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
using interlock::testing::WaitFor;

const std::string kCli = INTERLOCK_CLI;
const std::string kSrc = INTERLOCK_SOURCE_DIR;

bool HasCheckpoint(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().filename().string().rfind("step-", 0) == 0) return true;
  }
  return false;
}

TEST(Chaos, KillNineWorkersAndCoordinatorRunStillExact) {
  std::string tmpl = "/tmp/interlock-chaos-XXXXXX";
  const std::string dir = mkdtemp(tmpl.data());
  const std::string config = kSrc + "/configs/tests/tiny_resnet_k4.pbtxt";
  const int steps = 800;
  const int m = 2;
  const std::string steps_flag = "--steps=" + std::to_string(steps);
  auto ref =
      RunCommand(kCli + " train --quiet --config " + config + " " + steps_flag);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string want = DigestOf(ref.output);
  ASSERT_EQ(want.size(), 64u) << ref.output;

  const unsigned seed = std::random_device()();
  std::mt19937 rng(seed);
  SCOPED_TRACE("chaos seed " + std::to_string(seed));
  std::uniform_int_distribution<int> pause_ms(0, 1500);
  std::uniform_int_distribution<int> which(0, 3);
  const std::string out = dir + "/out";
  const std::vector<std::string> args = {"train",
                                         "--quiet",
                                         "--engine=cluster",
                                         "--config=" + config,
                                         steps_flag,
                                         "--checkpoint-every=20",
                                         "--recover-timeout=90s",
                                         "--out=" + out};
  Child cli = StartChild(kCli, args, dir + "/cli1.log");
  ASSERT_TRUE(
      WaitFor([&] { return LinesIn(out + "/metrics.jsonl") >= 5; }, 120))
      << ReadFile(cli.log);

  for (int kill_no = 1; kill_no <= 3; ++kill_no) {
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms(rng)));
    auto pids = RunCommand("pgrep -P " + std::to_string(cli.pid) +
                           " -f interlock-worker");
    std::vector<int> workers;
    std::istringstream in(pids.output);
    for (int p; in >> p;) workers.push_back(p);
    ASSERT_EQ(workers.size(), 4u) << pids.output << ReadFile(cli.log);
    const int victim = which(rng);
    ASSERT_EQ(kill(workers[victim], SIGKILL), 0);
    ASSERT_TRUE(WaitFor(
        [&] {
          return Count(ReadFile(cli.log), "recovered; replaying") >= kill_no;
        },
        150))
        << "kill " << kill_no << " (worker pid " << workers[victim]
        << "): no recovery\n"
        << ReadFile(cli.log);
    ASSERT_LT(LinesIn(out + "/metrics.jsonl"), steps)
        << "the run finished before the chaos did";
  }
  // The coordinator: wait for a checkpoint after the last recovery's
  // progress, then at a random moment kill -9 it (its workers die with it).
  ASSERT_TRUE(
      WaitFor([&] { return HasCheckpoint(out + "/checkpoints"); }, 120));
  std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms(rng)));
  ASSERT_LT(LinesIn(out + "/metrics.jsonl"), steps)
      << "the run finished before the coordinator was killed";
  kill(cli.pid, SIGKILL);
  ASSERT_EQ(WaitExit(cli.pid, 30), 128 + SIGKILL);

  Child again = StartChild(kCli, args, dir + "/cli2.log");
  const int code = WaitExit(again.pid, 300);
  if (code == -1) kill(again.pid, SIGKILL);
  const std::string log2 = ReadFile(again.log);
  ASSERT_EQ(code, 0) << log2;
  EXPECT_NE(log2.find("resuming from"), std::string::npos) << log2;

  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(SummaryField(summary, "digest"), "\"" + want + "\"") << summary;
  EXPECT_EQ(SummaryField(summary, "microbatches_applied"),
            std::to_string(steps * m))
      << summary;
  EXPECT_EQ(SummaryField(summary, "block_steps"), std::to_string(steps * 4))
      << summary;
  EXPECT_EQ(SummaryField(summary, "steps_not_exactly_once"), "[]") << summary;
  EXPECT_NE(SummaryField(summary, "resumed_from_step"), "-1") << summary;
  // Every step recorded once, in order.
  std::ifstream metrics(out + "/metrics.jsonl");
  std::string line;
  int expect = 0;
  while (std::getline(metrics, line)) {
    ASSERT_EQ(line.rfind("{\"step\":" + std::to_string(expect) + ",", 0), 0u)
        << line;
    ++expect;
  }
  EXPECT_EQ(expect, steps);
  // For the record (docs/RELIABILITY.md).
  const size_t acc = summary.find("\"accounting\"");
  if (acc != std::string::npos) {
    std::cout << summary.substr(acc, summary.find('}', acc) - acc + 1) << "\n";
  }
  if (!HasFailure()) fs::remove_all(dir);
}

}  // namespace
}  // namespace interlock
