// A careless operator running `interlock train`: bad values, a full or
// shared --out, overflowing schedules, altered checkpoints, stale folders
// (docs/RELIABILITY.md, "Attacks and mistakes"). Every case runs the real
// CLI on real files and checks the clear refusal and that runs go on.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "coordinator/checkpoint.h"
#include "coordinator/local_cluster.h"
#include "coordinator/train.h"
#include "services/config.h"
#include "services/digest.h"
#include "tests/cluster_util.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

namespace fs = std::filesystem;
namespace v1 = interlock::v1;

using interlock::testing::Child;
using interlock::testing::Contains;
using interlock::testing::LinesIn;
using interlock::testing::MakeTempDir;
using interlock::testing::ReadFile;
using interlock::testing::RunCommand;
using interlock::testing::StartChild;
using interlock::testing::WaitExit;
using interlock::testing::WaitFor;

const std::string kCli = INTERLOCK_CLI;
const std::string kSrc = INTERLOCK_SOURCE_DIR;
const std::string kTiny = kSrc + "/configs/tests/tiny_resnet.pbtxt";

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::trunc) << text;
}

// tiny_resnet with its schedule replaced by `schedule` (text format).
std::string ConfigWithSchedule(const std::string& dir,
                               const std::string& schedule) {
  std::string text = ReadFile(kTiny);
  const std::string old = "schedule { kind: CONSTANT lr: 0.05 }";
  const size_t at = text.find(old);
  EXPECT_NE(at, std::string::npos) << "tiny_resnet.pbtxt changed";
  text.replace(at, old.size(), "schedule { " + schedule + " }");
  const std::string path = dir + "/config.pbtxt";
  WriteText(path, text);
  return path;
}

// ---- 1. Every run file is checked: a full disk fails the run.

// /dev/full: every write fails with ENOSPC, a real "disk full" without root.
TEST(HardeningRun, FullDiskForEvalOrMetricsFailsTheRunNamingTheFile) {
  for (const std::string file : {"eval.jsonl", "metrics.jsonl"}) {
    SCOPED_TRACE(file);
    const std::string out = MakeTempDir("full");
    fs::create_symlink("/dev/full", out + "/" + file);
    auto r = RunCommand(kCli + " train --quiet --config " + kTiny +
                        " --steps 3 --out " + out);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_TRUE(Contains(r.output, out + "/" + file)) << r.output;
    EXPECT_TRUE(Contains(r.output, "No space left on device")) << r.output;
    // The same folder with a real file works: nothing else was wrong.
    fs::remove(out + "/" + file);
    r = RunCommand(kCli + " train --quiet --config " + kTiny +
                   " --steps 3 --out " + out);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(LinesIn(out + "/metrics.jsonl"), 3);
    EXPECT_GT(LinesIn(out + "/eval.jsonl"), 0);
    fs::remove_all(out);
  }
}

TEST(HardeningRun, FullDiskForSummaryFailsTheRun) {
  const std::string out = MakeTempDir("full_summary");
  fs::create_symlink("/dev/full", out + "/summary.json.tmp");
  auto r = RunCommand(kCli + " train --quiet --config " + kTiny +
                      " --steps 2 --out " + out);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, out + "/summary.json.tmp")) << r.output;
  EXPECT_TRUE(Contains(r.output, "No space left on device")) << r.output;
  EXPECT_FALSE(fs::exists(out + "/summary.json"));
  // And leaves no temporary file behind.
  EXPECT_FALSE(fs::exists(fs::symlink_status(out + "/summary.json.tmp")));
  fs::remove_all(out);
}

// ---- 2. Schedules are checked over their whole range at config time.

TEST(HardeningRun, OverflowingMultistepIsRefusedAtConfigTime) {
  const std::string dir = MakeTempDir("multistep");
  const std::string config =
      ConfigWithSchedule(dir,
                         "kind: MULTISTEP lr: 10 gamma: 1e38 "
                         "milestones: [2]");
  auto r = RunCommand(kCli + " train --quiet --config " + config +
                      " --steps 6 --out " + dir + "/out");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "schedule.gamma")) << r.output;
  EXPECT_TRUE(Contains(r.output, "from step 2")) << r.output;
  // Refused before training: no step was recorded.
  EXPECT_EQ(LinesIn(dir + "/out/metrics.jsonl"), 0);
  EXPECT_FALSE(Contains(r.output, "Test metrics")) << r.output;
  fs::remove_all(dir);
}

TEST(HardeningRun, ScheduleRangeIsValidated) {
  auto loaded = LoadRunConfig(kTiny);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  struct Case {
    std::string schedule;
    std::string field;  // "" : accepted
  };
  for (const Case& c : std::vector<Case>{
           {"kind: CONSTANT lr: nan", "schedule.lr"},
           {"kind: CONSTANT lr: inf", "schedule.lr"},
           {"kind: CONSTANT lr: -0.5", "schedule.lr"},
           {"kind: MULTISTEP lr: 10 gamma: 1e38 milestones: [5]",
            "schedule.gamma"},
           // Two milestones: the second (in step order) overflows.
           {"kind: MULTISTEP lr: 1e10 gamma: 1e15 milestones: [9, 3]",
            "from step 9"},
           {"kind: MULTISTEP lr: 0.1 gamma: -2 milestones: [5]",
            "schedule.gamma"},
           {"kind: MULTISTEP lr: 0.1 gamma: nan milestones: [5]",
            "schedule.gamma"},
           {"kind: COSINE lr: 0.1 min_lr: nan", "schedule.min_lr"},
           {"kind: COSINE lr: 0.1 min_lr: -1", "schedule.min_lr"},
           {"kind: COSINE lr: 0.1 warmup_steps: -3", "schedule.warmup_steps"},
           {"kind: MULTISTEP lr: 0.1 gamma: 0.1 milestones: [5, 10]", ""},
           {"kind: MULTISTEP lr: 1e30 gamma: 100 milestones: [5]", ""},
           {"kind: COSINE lr: 0.1 min_lr: 0.001 warmup_steps: 2", ""},
       }) {
    SCOPED_TRACE(c.schedule);
    v1::RunConfig config = *loaded;
    auto parsed = ParseRunConfig("schedule { " + c.schedule + " }", "test");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    *config.mutable_schedule() = parsed->schedule();
    ApplyDefaults(config);
    const absl::Status s = ValidateRunConfig(config);
    if (c.field.empty()) {
      EXPECT_TRUE(s.ok()) << s;
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_TRUE(Contains(std::string(s.message()), c.field)) << s;
    }
  }
}

TEST(HardeningRun, NanLearningRateIsRefused) {
  const std::string dir = MakeTempDir("nan_lr");
  const std::string config = ConfigWithSchedule(dir, "kind: CONSTANT lr: nan");
  auto r =
      RunCommand(kCli + " train --quiet --config " + config + " --steps 2");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "schedule.lr")) << r.output;
  EXPECT_TRUE(Contains(r.output, "nan")) << r.output;
  EXPECT_FALSE(Contains(r.output, "Test metrics")) << r.output;
  fs::remove_all(dir);
}

// ---- 4. Flags whose "unset" value is typed, or nonsense, are refused.

TEST(HardeningRun, NonsenseNumericFlagsAreRefused) {
  struct Case {
    std::string flags;
    std::string named;
  };
  for (const Case& c : std::vector<Case>{
           {"--steps -1", "--steps"},
           {"--steps=-1", "--steps"},
           {"--steps 0", "--steps"},
           {"--seed -1", "--seed"},
           {"--seed=-7", "--seed"},
           {"--epochs -1", "--epochs"},
           {"--epochs 0", "--epochs"},
           {"--n 0", "--n"},
           {"--threads-per-block 0", "--threads-per-block"},
           {"--threads-per-block 1000", "--threads-per-block"},
           {"--window -3", "--window"},
           {"--metrics-port -2", "--metrics-port"},
           {"--metrics-port 70000", "--metrics-port"},
           {"--link-bandwidth nan", "--link-bandwidth"},
           {"--link-bandwidth inf", "--link-bandwidth"},
           {"--link-bandwidth 0", "--link-bandwidth"},
           {"--link-latency -1s", "--link-latency"},
           {"--link-latency inf", "--link-latency"},
           {"--keep-checkpoints 0", "--keep-checkpoints"},
           {"--checkpoint-every -5", "--checkpoint-every"},
           {"--connect-timeout 0s", "--connect-timeout"},
       }) {
    SCOPED_TRACE(c.flags);
    auto r =
        RunCommand(kCli + " train --quiet --config " + kTiny + " " + c.flags);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(Contains(r.output, c.named)) << r.output;
    EXPECT_FALSE(Contains(r.output, "Test metrics")) << r.output;
  }
  // compare shares them.
  auto r = RunCommand(kCli + " compare --config " + kTiny +
                      " --modes e2e --out /tmp/never --steps -1");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(Contains(r.output, "--steps")) << r.output;
  EXPECT_FALSE(fs::exists("/tmp/never"));
  // Good values still run.
  r = RunCommand(kCli + " train --quiet --config " + kTiny +
                 " --steps 2 --seed 0 --n 1 --threads-per-block 1 --window 0");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// ---- 3. One run per --out.

TEST(HardeningRun, SecondRunOnALockedOutIsRefusedAndTheFirstCompletes) {
  const std::string out = MakeTempDir("locked");
  const std::string log = out + ".first.log";
  Child first = StartChild(
      kCli,
      {"train", "--quiet", "--config=" + kTiny, "--steps=1500", "--out=" + out},
      log);
  ASSERT_GT(first.pid, 0);
  ASSERT_TRUE(WaitFor([&] { return LinesIn(out + "/metrics.jsonl") > 0; }, 60))
      << ReadFile(log);
  const auto t0 = std::chrono::steady_clock::now();
  auto second = RunCommand(kCli + " train --quiet --config " + kTiny +
                           " --steps 3 --out " + out);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  EXPECT_NE(second.exit_code, 0) << second.output;
  EXPECT_TRUE(Contains(second.output, out + " is in use by another run"))
      << second.output;
  EXPECT_TRUE(
      Contains(second.output, "(pid " + std::to_string(first.pid) + ")"))
      << second.output;
  EXPECT_LT(took, 20.0);
  // The first was not disturbed: still running, then complete.
  int status;
  EXPECT_EQ(waitpid(first.pid, &status, WNOHANG), 0)
      << "the first run ended before the second was refused";
  EXPECT_EQ(WaitExit(first.pid, 240), 0) << ReadFile(log);
  EXPECT_EQ(LinesIn(out + "/metrics.jsonl"), 1500);
  EXPECT_TRUE(fs::exists(out + "/summary.json"));
  // Free again once the first is done, but it holds a finished run and no
  // checkpoint: not written over unless asked.
  const std::string summary = ReadFile(out + "/summary.json");
  auto third = RunCommand(kCli + " train --quiet --config " + kTiny +
                          " --steps 3 --out " + out);
  EXPECT_NE(third.exit_code, 0) << third.output;
  EXPECT_TRUE(Contains(third.output, "holds a finished run")) << third.output;
  EXPECT_TRUE(Contains(third.output, "--replace")) << third.output;
  EXPECT_EQ(ReadFile(out + "/summary.json"), summary);
  EXPECT_EQ(LinesIn(out + "/metrics.jsonl"), 1500);
  third = RunCommand(kCli + " train --quiet --config " + kTiny +
                     " --steps 3 --replace --out " + out);
  EXPECT_EQ(third.exit_code, 0) << third.output;
  EXPECT_EQ(LinesIn(out + "/metrics.jsonl"), 3);
  fs::remove_all(out);
  fs::remove(log);
}

// A run's checkpoint folder inside its --out is locked too: another run
// given it as --checkpoint-dir is refused instead of resuming from the live
// checkpoints and writing beside them.
TEST(HardeningRun, AnotherRunCannotUseALiveRunsCheckpointFolder) {
  const std::string a = MakeTempDir("ckpt_a");
  const std::string b = MakeTempDir("ckpt_b");
  const std::string log = a + ".first.log";
  Child first =
      StartChild(kCli,
                 {"train", "--quiet", "--config=" + kTiny, "--steps=1500",
                  "--checkpoint-every=200", "--out=" + a},
                 log);
  ASSERT_GT(first.pid, 0);
  ASSERT_TRUE(WaitFor(
      [&] { return fs::exists(a + "/checkpoints/step-0000000200"); }, 120))
      << ReadFile(log);
  auto second = RunCommand(kCli + " train --quiet --config " + kTiny +
                           " --steps 3 --out " + b + " --checkpoint-dir " + a +
                           "/checkpoints");
  EXPECT_NE(second.exit_code, 0) << second.output;
  EXPECT_TRUE(Contains(second.output, a + "/checkpoints is in use by another "
                                          "run"))
      << second.output;
  EXPECT_FALSE(fs::exists(b + "/summary.json"));
  EXPECT_EQ(WaitExit(first.pid, 240), 0) << ReadFile(log);
  EXPECT_EQ(LinesIn(a + "/metrics.jsonl"), 1500);
  fs::remove_all(a);
  fs::remove_all(b);
  fs::remove(log);
}

TEST(HardeningRun, CompareAndTrainRefuseAFolderLockedInProcess) {
  const std::string out = MakeTempDir("locked_compare");
  auto lock = FolderLock::Acquire(out, "--out");
  ASSERT_TRUE(lock.ok()) << lock.status();
  const std::string pid = "(pid " + std::to_string(getpid()) + ")";
  auto r = RunCommand(kCli + " compare --config " + kTiny +
                      " --modes e2e --steps 2 --out " + out);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Contains(r.output, out + " is in use")) << r.output;
  EXPECT_TRUE(Contains(r.output, pid)) << r.output;
  EXPECT_FALSE(fs::exists(out + "/e2e"));
  // A second lock in this process is refused as well (flock is per open).
  auto again = FolderLock::Acquire(out, "--out");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  lock->reset();
  r = RunCommand(kCli + " compare --config " + kTiny +
                 " --modes e2e --steps 2 --out " + out);
  EXPECT_TRUE(fs::exists(out + "/e2e/summary.json")) << r.output;
  fs::remove_all(out);
}

TEST(HardeningRun, SigkilledRunsOutCanBeReusedAtOnce) {
  const std::string out = MakeTempDir("killed");
  const std::string log = out + ".first.log";
  Child first = StartChild(
      kCli,
      {"train", "--quiet", "--config=" + kTiny, "--steps=5000", "--out=" + out},
      log);
  ASSERT_GT(first.pid, 0);
  ASSERT_TRUE(WaitFor([&] { return LinesIn(out + "/metrics.jsonl") > 0; }, 60))
      << ReadFile(log);
  ASSERT_EQ(kill(first.pid, SIGKILL), 0);
  EXPECT_EQ(WaitExit(first.pid, 30), 128 + SIGKILL);
  // The lock file is still there, naming the dead holder; it does not block.
  EXPECT_TRUE(
      Contains(ReadFile(out + "/.interlock.lock"), std::to_string(first.pid)));
  auto r = RunCommand(kCli + " train --quiet --config " + kTiny +
                      " --steps 3 --out " + out);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(LinesIn(out + "/metrics.jsonl"), 3);
  fs::remove_all(out);
  fs::remove(log);
}

// ---- 5. With a token, checkpoints are signed and the signature checked.

// The manifest split into its checked text and its signature line.
struct SignedManifest {
  v1::CheckpointManifest manifest;
  std::string signature_line;  // "# hmac-sha256 ...\n" or ""
};

SignedManifest ReadManifest(const std::string& path) {
  const std::string bytes = ReadFile(path);
  SignedManifest out;
  const size_t at = bytes.find("# hmac-sha256 ");
  if (at != std::string::npos) out.signature_line = bytes.substr(at);
  auto m = ParseManifest(bytes.substr(0, at), path);  // checksum only
  EXPECT_TRUE(m.ok()) << m.status();
  if (m.ok()) out.manifest = *m;
  return out;
}

TEST(HardeningRun, TokenSignsCheckpointsAndAlteredWeightsAreRefused) {
  const std::string dir = MakeTempDir("signed");
  const std::string token = dir + "/token";
  WriteText(token, "s3cret-token-of-this-run\n");
  const std::string run = kCli + " train --quiet --engine cluster --config " +
                          kTiny +
                          " --steps 4 --checkpoint-every 2 "
                          "--keep-checkpoints 2 --recover-timeout 0s";
  const std::string a = dir + "/a";
  auto r = RunCommand(run + " --token-file " + token + " --out " + a);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string step4 = a + "/checkpoints/step-0000000004";
  SignedManifest signed4 = ReadManifest(step4 + "/manifest.pbtxt");
  ASSERT_FALSE(signed4.signature_line.empty()) << "the manifest is not signed";

  // An untouched signed checkpoint loads with the token.
  r = RunCommand(run + " --token-file " + token + " --out " + a);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "resuming from " + step4)) << r.output;

  // The attacker: block 0's weights replaced by other weights of the same
  // step (a valid archive: another seed's run), the manifest's size and
  // SHA-256 entries and its checksum line recomputed; the signature cannot
  // be, so it is kept (or dropped).
  const std::string c = dir + "/c";
  r = RunCommand(run + " --seed 2 --out " + c);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string weights =
      ReadFile(c + "/checkpoints/step-0000000004/block-0.pt");
  ASSERT_NE(weights, ReadFile(step4 + "/block-0.pt"));
  v1::CheckpointManifest altered = signed4.manifest;
  for (auto& f : *altered.mutable_files()) {
    if (f.block() != 0) continue;
    f.set_bytes(static_cast<int64_t>(weights.size()));
    f.set_sha256(Sha256Hex(weights.data(), weights.size()));
  }
  struct Tamper {
    std::string name;
    std::string signature;  // appended after the recomputed checksum
    std::string refusal;
  };
  for (const Tamper& t : std::vector<Tamper>{
           {"kept", signed4.signature_line, "signature does not match"},
           {"dropped", "", "not signed"}}) {
    SCOPED_TRACE(t.name);
    const std::string b = dir + "/b-" + t.name;
    fs::create_directories(b + "/checkpoints");
    fs::copy(step4, b + "/checkpoints/step-0000000004",
             fs::copy_options::recursive);
    const std::string bstep = b + "/checkpoints/step-0000000004";
    WriteText(bstep + "/block-0.pt", weights);
    WriteText(bstep + "/manifest.pbtxt",
              SerializeManifest(altered) + t.signature);
    // With the token: refused, naming the manifest; nothing trained.
    r = RunCommand(run + " --token-file " + token + " --out " + b);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_TRUE(Contains(r.output, bstep + "/manifest.pbtxt")) << r.output;
    EXPECT_TRUE(Contains(r.output, t.refusal)) << r.output;
    EXPECT_FALSE(fs::exists(b + "/summary.json"));
    // The alteration is consistent: a run without a token (checksums only)
    // loads it, which is exactly what the signature is for.
    r = RunCommand(run + " --out " + b);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(Contains(r.output, "resuming from " + bstep)) << r.output;
  }
  // A token file with another token: refused as well.
  WriteText(token, "another-token\n");
  r = RunCommand(run + " --token-file " + token + " --out " + a);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "signature does not match")) << r.output;
  fs::remove_all(dir);
}

TEST(HardeningRun, UnsignedCheckpointsStillLoadWithoutAToken) {
  // Today's checkpoints (no token) keep the checksum-only behaviour, and a
  // signed manifest is still read by a reader without a key.
  v1::CheckpointManifest m;
  m.set_format(1);
  m.set_num_blocks(1);
  m.set_step(1);
  m.set_total_steps(2);
  auto* f = m.add_files();
  f->set_name("block-0.pt");
  f->set_block(0);
  f->set_bytes(3);
  f->set_sha256(Sha256Hex("abc", 3));
  const std::string plain = SerializeManifest(m);
  const std::string sealed = SerializeManifest(m, "key");
  EXPECT_TRUE(ParseManifest(plain, "plain").ok());
  EXPECT_TRUE(ParseManifest(sealed, "sealed").ok());
  EXPECT_TRUE(ParseManifest(sealed, "sealed", "key").ok());
  EXPECT_EQ(ParseManifest(plain, "plain", "key").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ParseManifest(sealed, "sealed", "other").status().code(),
            absl::StatusCode::kPermissionDenied);
  // A flipped signature digit and a cut signature line.
  std::string flipped = sealed;
  flipped[flipped.size() - 2] = flipped[flipped.size() - 2] == '0' ? '1' : '0';
  EXPECT_EQ(ParseManifest(flipped, "flipped", "key").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ParseManifest(sealed.substr(0, sealed.size() - 5), "cut", "key")
                .status()
                .code(),
            absl::StatusCode::kDataLoss);
}

// ---- 6. Stale local-cluster folders of dead coordinators are removed.

TEST(HardeningRun, StaleClusterFolderOfADeadPidIsRemovedAtTheNextStart) {
  // A pid that is surely gone: a child that exited and was reaped.
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  ASSERT_GT(dead, 0);
  int status;
  ASSERT_EQ(waitpid(dead, &status, 0), dead);
  const std::string stale =
      "/tmp/interlock-cluster-" + std::to_string(dead) + "-h3test";
  const std::string live =
      "/tmp/interlock-cluster-" + std::to_string(getpid()) + "-h3test";
  for (const auto& d : {stale, live}) {
    fs::create_directories(d);
    WriteText(d + "/worker0.log", "left behind\n");
  }
  auto r = RunCommand(kCli + " train --quiet --engine cluster --config " +
                      kTiny + " --steps 1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(stale)) << "the dead coordinator's folder stayed";
  EXPECT_TRUE(fs::exists(live + "/worker0.log"))
      << "a live process's folder was removed";
  fs::remove_all(live);
}

}  // namespace
}  // namespace interlock
