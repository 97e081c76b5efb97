// The chaos soak (docs/RELIABILITY.md): one run with block replicas on
// workers started by hand on loopback, where seeded random faults hit the
// workers and the coordinator: kill -9 of a replica, SIGSTOP long enough to
// be dropped, SIGTERM (a leave), kill -9 of the coordinator (a new one
// adopts the live workers). A supervisor plays the orchestrator: a worker
// that exits is started again on its port after a random delay and joins
// through the membership service; one left unconfigured for long (its
// registration died with a coordinator) is restarted. Faults land at random
// moments, joins and state transfers included. The run must end bitwise
// equal to the uninterrupted run, every micro-batch applied exactly once;
// the report lists faults by kind and the time each cost.
//
// `make test` runs a short version (INTERLOCK_SOAK_FAULTS, default 12);
// tests/bench/chaos_soak.sh runs the long one and keeps the report.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <random>

#include "tests/cluster_util.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

namespace fs = std::filesystem;
using namespace interlock::testing;  // NOLINT
using Clock = std::chrono::steady_clock;

// Four blocks; blocks 0 and 1 get a second replica that joins.
constexpr const char* kConfig = kElasticConfig;
constexpr int kMicrobatches = 4;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

// A free loopback port (bound and released: the coordinator's membership
// service keeps it across restarts, so joiners can always find it).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// One worker slot: a block and a fixed port; the process comes and goes.
struct Slot {
  int block = 0;
  int port = 0;
  bool joiner = false;  // started with --coordinator (every restart is)
  pid_t pid = -1;
  int metrics_port = -1;
  bool stopped = false;
  // Struck by a fault at this time: not a member to count on until it is
  // configured again and some seconds have passed (a stopped replica's
  // gauge still reads configured until the run releases it).
  std::optional<Clock::time_point> struck;
  Clock::time_point restart_at{};          // when exited: when to start again
  Clock::time_point unconfigured_since{};  // alive and not configured since
  int starts = 0;
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

class Soak {
 public:
  Soak(std::string dir, unsigned seed) : dir_(std::move(dir)), rng_(seed) {}

  std::string dir_;
  std::mt19937 rng_;
  std::vector<Slot> slots_;
  int membership_port_ = 0;
  std::vector<std::string> coordinator_args_;
  Child coordinator_;
  int coordinator_starts_ = 0;
  int restarts_ = 0;
  int liveness_kills_ = 0;
  std::string metrics_;

  double Uniform(double a, double b) {
    return std::uniform_real_distribution<double>(a, b)(rng_);
  }

  void StartSlot(Slot& s) {
    const std::string port_file =
        dir_ + "/slot" + std::to_string(&s - slots_.data()) + ".port";
    fs::remove(port_file);
    std::vector<std::string> args = {INTERLOCK_WORKER,
                                     "--host=127.0.0.1",
                                     "--port=" + std::to_string(s.port),
                                     "--metrics_port=0",
                                     "--port_file=" + port_file,
                                     "--token_file=" + dir_ + "/token"};
    if (s.joiner) {
      args.push_back("--coordinator=127.0.0.1:" +
                     std::to_string(membership_port_));
      args.push_back("--block=" + std::to_string(s.block));
    }
    const std::string log = dir_ + "/slot" +
                            std::to_string(&s - slots_.data()) + "." +
                            std::to_string(s.starts++) + ".log";
    s.pid = SpawnLogged(std::move(args), log);
    s.stopped = false;
    s.metrics_port = -1;
    s.unconfigured_since = Clock::now();
    WaitFor(
        [&] {
          int port = 0;
          std::ifstream in(port_file);
          return static_cast<bool>(in >> port >> s.metrics_port);
        },
        30);
  }

  void StartCoordinator() {
    coordinator_ =
        StartChild(INTERLOCK_CLI, coordinator_args_,
                   dir_ + "/coordinator." +
                       std::to_string(coordinator_starts_++) + ".log");
  }

  bool Configured(const Slot& s) const {
    if (s.pid <= 0 || s.stopped || s.metrics_port <= 0) return false;
    return MetricSum(HttpGet(s.metrics_port, "/metrics"),
                     "interlock_worker_configured") == 1;
  }

  // The orchestrator's round: reap and restart exited workers, restart
  // one left unconfigured for `patience` seconds (its registration died
  // with a coordinator).
  void Supervise(double patience) {
    const auto now = Clock::now();
    for (Slot& s : slots_) {
      if (s.pid > 0) {
        int status;
        if (waitpid(s.pid, &status, WNOHANG) == s.pid) {
          s.pid = -1;
          s.joiner = true;
          s.restart_at = now + std::chrono::milliseconds(
                                   static_cast<int>(Uniform(0, 2000)));
          continue;
        }
        if (s.stopped) continue;
        if (Configured(s)) {
          s.unconfigured_since = now;
        } else if (now - s.unconfigured_since >
                   std::chrono::milliseconds(int(patience * 1000))) {
          kill(s.pid, SIGKILL);
          ++liveness_kills_;
        }
      } else if (now >= s.restart_at) {
        s.joiner = true;
        StartSlot(s);
        ++restarts_;
      }
    }
  }

  // Supervises until `done` holds (true) or `seconds` pass (false).
  template <typename F>
  bool SuperviseUntil(F done, double seconds) {
    const auto deadline =
        Clock::now() + std::chrono::milliseconds(int(seconds * 1000));
    while (Clock::now() < deadline) {
      if (done()) return true;
      Supervise(/*patience=*/20);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  bool CoordinatorExited(int* code) {
    int status;
    if (waitpid(coordinator_.pid, &status, WNOHANG) != coordinator_.pid) {
      return false;
    }
    *code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return true;
  }

  // Workers of `block` that are configured now and not struck lately.
  std::vector<Slot*> Members(int block) {
    std::vector<Slot*> out;
    for (Slot& s : slots_) {
      if (s.block != block || !Configured(s)) continue;
      if (s.struck && Clock::now() - *s.struck < std::chrono::seconds(8)) {
        continue;
      }
      s.struck.reset();
      out.push_back(&s);
    }
    return out;
  }
};

TEST(ChaosSoak, RandomFaultsOnReplicasAndTheCoordinatorEndBitwise) {
  const int faults = EnvInt("INTERLOCK_SOAK_FAULTS", 12);
  // About 100 steps a fault take on this machine; room for twice as many.
  const int steps = EnvInt("INTERLOCK_SOAK_STEPS", 150 * faults + 500);
  const unsigned seed = static_cast<unsigned>(
      EnvInt("INTERLOCK_SOAK_SEED", static_cast<int>(std::random_device()())));
  SCOPED_TRACE("soak seed " + std::to_string(seed));
  std::cout << "soak: seed " << seed << ", " << faults << " faults, " << steps
            << " steps\n";
  const std::string dir = MakeTempDir("soak");
  std::ofstream(dir + "/token") << "soak-token\n";
  std::ofstream(dir + "/config.pbtxt") << kConfig;

  // The uninterrupted run: the single chain in process.
  auto ref =
      RunCommand(std::string(INTERLOCK_CLI) + " train --quiet --config " + dir +
                 "/config.pbtxt --steps " + std::to_string(steps));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string want = DigestOf(ref.output);
  ASSERT_EQ(want.size(), 64u) << ref.output;

  Soak soak(dir, seed);
  soak.membership_port_ = FreePort();
  ASSERT_GT(soak.membership_port_, 0);
  // Four primaries named by --workers, then a second replica of blocks 0
  // and 1 joining through the membership service.
  for (int b : {0, 1, 2, 3, 0, 1}) {
    Slot s;
    s.block = b;
    s.port = FreePort();
    soak.slots_.push_back(s);
  }
  for (int i = 0; i < 4; ++i) {
    soak.StartSlot(soak.slots_[i]);
    ASSERT_GT(soak.slots_[i].metrics_port, 0);
  }
  std::string workers;
  for (int i = 0; i < 4; ++i) {
    workers += (i ? "," : "") + soak.slots_[i].address();
  }
  const std::string out = dir + "/out";
  soak.metrics_ = out + "/metrics.jsonl";
  soak.coordinator_args_ = {
      "train",
      "--config=" + dir + "/config.pbtxt",
      "--engine=cluster",
      "--workers=" + workers,
      "--token-file=" + dir + "/token",
      "--steps=" + std::to_string(steps),
      "--coordinator_port=" + std::to_string(soak.membership_port_),
      "--coordinator_host=127.0.0.1",
      "--checkpoint-every=500",
      "--recover-timeout=120s",
      "--out=" + out,
      "--quiet"};
  soak.StartCoordinator();
  ASSERT_TRUE(WaitFor([&] { return LinesIn(soak.metrics_) >= 5; }, 120))
      << ReadFile(soak.coordinator_.log);
  for (int i = 4; i < 6; ++i) {
    soak.slots_[i].joiner = true;
    soak.StartSlot(soak.slots_[i]);
  }
  ASSERT_TRUE(soak.SuperviseUntil(
      [&] {
        return soak.Members(0).size() == 2 && soak.Members(1).size() == 2;
      },
      120))
      << ReadFile(soak.coordinator_.log);

  // Faults, one after another; each waits for progress past where the run
  // was when it struck (the recovery), then a random pause.
  // Seconds from each fault until kSpan steps past the one the run had
  // reached were recorded; less kSpan steps at the undisturbed pace, the
  // time it lost.
  constexpr int kSpan = 20;
  std::map<std::string, std::vector<double>> recovery;
  int during_join = 0;
  std::vector<double> gaps;  // seconds per step between faults
  int code = -1;
  bool ended = false;
  const int stop_injecting = steps * 9 / 10;
  for (int f = 0; f < faults && !ended; ++f) {
    // A pause, and the run's pace meanwhile.
    const int before = LinesIn(soak.metrics_);
    const auto p0 = Clock::now();
    soak.SuperviseUntil([&] { return soak.CoordinatorExited(&code); },
                        soak.Uniform(0.2, 1.5));
    if (code >= 0) break;
    const int after = LinesIn(soak.metrics_);
    if (after > before + 5) {
      gaps.push_back(std::chrono::duration<double>(Clock::now() - p0).count() /
                     (after - before));
    }
    if (after >= stop_injecting) break;
    // What can strike now: a replica of a block that has two, or the
    // coordinator.
    // (both of its workers configured: a block never loses its last one).
    std::vector<Slot*> spare;
    for (int b : {0, 1}) {
      auto m = soak.Members(b);
      if (m.size() >= 2) spare.insert(spare.end(), m.begin(), m.end());
    }
    std::vector<std::string> kinds = {"kill -9 coordinator"};
    if (!spare.empty()) {
      kinds.insert(kinds.end(),
                   {"kill -9 replica", "SIGSTOP replica", "SIGTERM replica"});
    }
    const std::string kind = kinds[std::uniform_int_distribution<size_t>(
        0, kinds.size() - 1)(soak.rng_)];
    Slot* victim = spare.empty() ? nullptr
                                 : spare[std::uniform_int_distribution<size_t>(
                                       0, spare.size() - 1)(soak.rng_)];
    // A joiner started but not configured yet: the fault strikes during
    // its join (registration, the drain, the state transfer).
    bool joining = false;
    for (const Slot& s : soak.slots_) {
      joining |= s.pid > 0 && s.joiner && !s.stopped && !soak.Configured(s);
    }
    during_join += joining;
    if (victim != nullptr && kind != "kill -9 coordinator") {
      victim->struck = Clock::now();
    }
    const int at = LinesIn(soak.metrics_);
    auto recovered = [&] {
      return soak.CoordinatorExited(&code) ||
             LinesIn(soak.metrics_) >= at + kSpan;
    };
    const auto t0 = Clock::now();
    std::optional<Clock::time_point> done_at;
    if (kind == "kill -9 coordinator") {
      kill(soak.coordinator_.pid, SIGKILL);
      WaitExit(soak.coordinator_.pid, 30);
      soak.StartCoordinator();
    } else if (kind == "kill -9 replica") {
      kill(victim->pid, SIGKILL);
    } else if (kind == "SIGTERM replica") {
      kill(victim->pid, SIGTERM);
    } else {
      kill(victim->pid, SIGSTOP);
      victim->stopped = true;
      // Stopped past the hang timeout (3.5 s): the run drops it and goes
      // on meanwhile.
      const auto until =
          Clock::now() +
          std::chrono::milliseconds(static_cast<int>(soak.Uniform(4000, 5000)));
      if (soak.SuperviseUntil(recovered, 6)) done_at = Clock::now();
      soak.SuperviseUntil([&] { return Clock::now() >= until; }, 6);
      kill(victim->pid, SIGCONT);
      victim->stopped = false;
      victim->unconfigured_since = Clock::now();
    }
    // Recovered: kSpan steps recorded past the one it had reached (a
    // replacement coordinator's replay first re-records what it undid).
    if (!done_at) {
      const bool progressed = soak.SuperviseUntil(recovered, 300);
      if (code >= 0) {
        ended = true;
        break;
      }
      ASSERT_TRUE(progressed) << kind << ": no progress within 300 s\n"
                              << ReadFile(soak.coordinator_.log);
      done_at = Clock::now();
    }
    recovery[kind].push_back(
        std::chrono::duration<double>(*done_at - t0).count());
  }
  // The run ends; the supervisor keeps workers coming back meanwhile.
  if (code < 0) {
    ASSERT_TRUE(soak.SuperviseUntil(
        [&] { return soak.CoordinatorExited(&code); }, 1800))
        << ReadFile(soak.coordinator_.log);
  }
  ASSERT_EQ(code, 0) << ReadFile(soak.coordinator_.log);
  for (Slot& s : soak.slots_) {
    if (s.pid > 0) {
      kill(s.pid, SIGKILL);
      waitpid(s.pid, nullptr, 0);
    }
  }

  const std::string summary = ReadFile(out + "/summary.json");
  const double step_seconds = Median(gaps);
  int injected = 0;
  std::ostringstream report;
  report << "chaos soak: seed " << seed << ", " << steps << " steps, "
         << "median step " << step_seconds * 1000 << " ms between faults\n";
  report << "| fault | count | to " << kSpan
         << " steps past it: median (s) | max (s) | time lost: median (s) "
            "| max (s) |\n|---|---|---|---|---|---|\n";
  for (const auto& [kind, v] : recovery) {
    injected += static_cast<int>(v.size());
    const double pace = kSpan * step_seconds;
    report << "| " << kind << " | " << v.size() << " | " << Median(v) << " | "
           << *std::max_element(v.begin(), v.end()) << " | "
           << std::max(0.0, Median(v) - pace) << " | "
           << std::max(0.0, *std::max_element(v.begin(), v.end()) - pace)
           << " |\n";
  }
  report << "faults " << injected << " (" << during_join
         << " while a replica was joining), worker restarts " << soak.restarts_
         << " (" << soak.liveness_kills_ << " after 20 s unconfigured), "
         << "coordinator starts " << soak.coordinator_starts_ << "\n"
         << "accounting: recoveries " << SummaryField(summary, "recoveries")
         << ", failovers " << SummaryField(summary, "failovers")
         << ", adoptions " << SummaryField(summary, "adoptions")
         << ", microbatches applied "
         << SummaryField(summary, "microbatches_applied") << " of "
         << steps * kMicrobatches << "\n"
         << "digest "
         << (SummaryField(summary, "digest") == "\"" + want + "\""
                 ? "equal to the uninterrupted run's"
                 : "DIFFERS from the uninterrupted run's")
         << "\n";
  std::cout << report.str();
  if (const char* path = std::getenv("INTERLOCK_SOAK_REPORT")) {
    std::ofstream(path) << report.str();
  }
  EXPECT_GE(injected, faults) << "the run ended before every fault";
  EXPECT_EQ(SummaryField(summary, "digest"), "\"" + want + "\"") << summary;
  EXPECT_EQ(SummaryField(summary, "steps_not_exactly_once"), "[]") << summary;
  EXPECT_EQ(std::atof(SummaryField(summary, "microbatches_applied").c_str()),
            static_cast<double>(steps) * kMicrobatches)
      << summary;
  EXPECT_EQ(LinesIn(soak.metrics_), steps);
  if (!HasFailure()) fs::remove_all(dir);
}

}  // namespace
}  // namespace interlock
