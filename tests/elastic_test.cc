// Elastic block replicas (ARCHITECTURE: replicas) with real processes on
// loopback: a replica joins through the coordinator's membership service, one
// dies (kill -9), one hangs (SIGSTOP) and one leaves on SIGTERM, mid-run; the
// run ends without a checkpoint restore, every micro-batch applied once per
// block, bitwise where the in-process single chain ends. Bad Register calls are
// refused while the run goes on.
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <iostream>
#include <map>

#include "coordinator/train.h"
#include "proto/report.pb.h"
#include "proto/worker.grpc.pb.h"
#include "services/config.h"
#include "tests/cluster_util.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;
using namespace interlock::testing;  // NOLINT

constexpr const char* kConfig = kElasticConfig;

std::shared_ptr<grpc::Channel> Plain(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

// Register as a raw client would; `token` empty sends none. The answer
// goes to `response` when given.
grpc::Status Register(const std::string& coordinator, const std::string& token,
                      int block, const std::string& address,
                      const std::string& sha = "",
                      v1::RegisterResponse* response = nullptr) {
  auto stub = v1::Coordinator::NewStub(Plain(coordinator));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  v1::RegisterRequest req;
  req.set_block(block);
  req.set_address(address);
  req.set_config_sha256(sha);
  v1::RegisterResponse resp;
  return stub->Register(&ctx, req, response ? response : &resp);
}

// The membership service of a coordinator started with
// --coordinator-port-file `port_file`, once it wrote the file (empty: not
// within two minutes).
std::string MembershipAddress(const std::string& port_file) {
  int port = 0;
  if (!WaitFor([&] { return (std::ifstream(port_file) >> port).good(); },
               120)) {
    return "";
  }
  return "127.0.0.1:" + std::to_string(port);
}

bool LogHas(const std::string& path, const std::string& what) {
  return ReadFile(path).find(what) != std::string::npos;
}

// Waits for the coordinator's fail-over ("surviving replicas continue") and
// for the first step recorded after it. Returns the seconds from `since` to
// that step, or -1 if either did not come within two minutes; `*failed_at`
// is the number of steps recorded when the fail-over was logged.
double SecondsToTheStepAfterFailover(
    const std::string& cli_log, const std::string& metrics,
    std::chrono::steady_clock::time_point since, int* failed_at) {
  if (!WaitFor([&] { return LogHas(cli_log, "surviving replicas continue"); },
               120)) {
    return -1;
  }
  *failed_at = LinesIn(metrics);
  if (!WaitFor([&] { return LinesIn(metrics) > *failed_at; }, 120)) return -1;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

// Five workers, listed as replicas 2,1,1,1 in `workers` (so the test knows
// whom to stop: w[1] is block 0's second replica).
std::vector<WorkerProcess> StartReplicas2111(
    const std::string& dir, const std::vector<std::string>& flags,
    std::string* workers) {
  std::vector<WorkerProcess> w;
  for (int i = 0; i < 5; ++i) {
    w.push_back(StartWorker(INTERLOCK_WORKER, dir, i, flags));
    if (w.back().port <= 0) {
      ADD_FAILURE() << ReadFile(dir + "/w" + std::to_string(i) + ".log");
      return {};
    }
  }
  *workers = w[0].address() + "+" + w[1].address() + "," + w[2].address() +
             "," + w[3].address() + "," + w[4].address();
  return w;
}

v1::RunSummary ReadSummary(const std::string& out) {
  v1::RunSummary summary;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(
                  ReadFile(out + "/summary.json"), &summary)
                  .ok());
  return summary;
}

// One fail-over from the survivors' snapshots, no checkpoint restore, and
// every micro-batch of the 240 steps applied exactly once per block.
void ExpectOneFailoverEachMicroBatchOnce(const v1::RunSummary& summary) {
  const auto& a = summary.accounting();
  EXPECT_EQ(a.recoveries(), 0);
  EXPECT_EQ(a.failovers(), 1);
  EXPECT_EQ(a.steps_not_exactly_once_size(), 0);
  EXPECT_EQ(a.microbatches_applied(), 240 * 4);
}

// Where the in-process single chain ends (after `steps`, 0: the config's).
std::string SingleChainDigest(int steps = 0) {
  auto config = ParseRunConfig(kConfig, "elastic");
  EXPECT_TRUE(config.ok()) << config.status();
  if (!config.ok()) return "";
  if (steps > 0) config->mutable_training()->set_steps(steps);
  TrainOptions o;
  o.output.quiet = true;
  auto single = Train(*config, o);
  EXPECT_TRUE(single.ok()) << single.status();
  return single.ok() ? single->digest : "";
}

TEST(Elastic, JoinFailureAndLeaveMidRunEndBitwiseOnTheSingleChain) {
  const std::string dir = MakeTempDir("elastic");
  const std::string token = "elastic-test-token";
  std::ofstream(dir + "/token") << token << "\n";
  std::ofstream(dir + "/config.pbtxt") << kConfig;
  const std::vector<std::string> auth = {"--token-file=" + dir + "/token"};

  std::string workers;
  std::vector<WorkerProcess> w = StartReplicas2111(dir, auth, &workers);
  ASSERT_EQ(w.size(), 5u);
  const std::string out = dir + "/out";
  const std::string port_file = dir + "/coordinator.port";
  Child cli =
      StartChild(INTERLOCK_CLI,
                 {"train", "--config", dir + "/config.pbtxt", "--engine",
                  "cluster", "--workers", workers, "--token-file",
                  dir + "/token", "--coordinator_port", "0",
                  "--coordinator_host", "127.0.0.1", "--coordinator_port_file",
                  port_file, "--out", out, "--quiet", "--metrics-port=0"},
                 dir + "/cli.log");
  const std::string coordinator = MembershipAddress(port_file);
  ASSERT_FALSE(coordinator.empty()) << ReadFile(cli.log);
  // The coordinator's /metrics, on the free port it picked and logged.
  const int metrics_port = LoggedMetricsPort(cli.log, 30);
  ASSERT_GT(metrics_port, 0) << ReadFile(cli.log);
  const std::string metrics = out + "/metrics.jsonl";
  auto at_step = [&](int n) {
    return WaitFor([&] { return LinesIn(metrics) >= n; }, 300);
  };

  // Bad Register calls: refused with a clear status, the run goes on.
  ASSERT_TRUE(at_step(3)) << ReadFile(cli.log);
  {
    grpc::Status s = Register(coordinator, "", 1, "127.0.0.1:1");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    s = Register(coordinator, "wrong", 1, "127.0.0.1:1");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    s = Register(coordinator, token, 7, "127.0.0.1:1");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(s.error_message().find("block 7 outside [0, 4)"),
              std::string::npos)
        << s.error_message();
    s = Register(coordinator, token, 1, w[2].address());
    EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS);
    EXPECT_NE(s.error_message().find(w[2].address()), std::string::npos);
    s = Register(coordinator, token, 1, "127.0.0.1:1", "0123abcd");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(s.error_message().find("run config"), std::string::npos);
    s = Register(coordinator, token, 1, "no-port");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    // Nothing answers there as a worker: refused at once, never scheduled
    // (it would cost the run a drain at the next boundary).
    s = Register(coordinator, token, 1, "127.0.0.1:1");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE)
        << s.error_message();
    EXPECT_NE(s.error_message().find("nothing answers as a worker"),
              std::string::npos)
        << s.error_message();
    // A worker already in the run, under another name: block 0's replica
    // as localhost, and block 2's worker offered to block 1. The process
    // answers the same identity under any address.
    for (const auto& [block, worker] :
         {std::pair<int, const WorkerProcess*>{0, &w[0]}, {1, &w[3]}}) {
      s = Register(coordinator, token, block,
                   "localhost:" + std::to_string(worker->port));
      EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS)
          << s.error_message();
      EXPECT_NE(s.error_message().find("already in the run"), std::string::npos)
          << s.error_message();
      EXPECT_NE(s.error_message().find(worker->address()), std::string::npos)
          << s.error_message();
    }
  }
  {
    // Every refusal counted by its reason.
    const std::string text = HttpGet(metrics_port, "/metrics");
    const std::string name = "interlock_coordinator_membership_refusals_total";
    const std::map<std::string, double> want = {
        {"token", 2},   {"block", 1}, {"duplicate", 3}, {"config", 1},
        {"address", 1}, {"gone", 1},  {"replicas", 0},  {"unknown", 0}};
    for (const auto& [reason, n] : want) {
      EXPECT_EQ(MetricSum(text, name, "reason=\"" + reason + "\""), n)
          << reason << "\n"
          << text;
    }
  }

  // A second replica of block 1 joins.
  ASSERT_TRUE(at_step(10)) << ReadFile(cli.log);
  std::vector<std::string> join = auth;
  join.insert(join.end(), {"--coordinator=" + coordinator, "--block=1",
                           "--run_config=" + dir + "/config.pbtxt"});
  WorkerProcess joiner = StartWorker(INTERLOCK_WORKER, dir, 5, join);
  ASSERT_GT(joiner.port, 0);
  ASSERT_TRUE(
      WaitFor([&] { return LogHas(dir + "/w5.log", "registered as"); }, 120));
  const auto registered = std::chrono::steady_clock::now();
  ASSERT_TRUE(WaitFor(
      [&] {
        return MetricSum(HttpGet(joiner.metrics_port, "/metrics"),
                         "interlock_worker_configured") == 1;
      },
      120))
      << ReadFile(dir + "/w5.log") << ReadFile(cli.log);
  const int joined_at = LinesIn(metrics);
  // Recorded in docs/BENCHMARKS.md (not a target checked here).
  std::cout << "join: registered to configured in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                             registered)
                   .count()
            << " s\n";

  // A replica of block 0 dies.
  ASSERT_TRUE(at_step(joined_at + 5)) << ReadFile(cli.log);
  const auto killed = std::chrono::steady_clock::now();
  StopWorker(w[1], SIGKILL);
  int failed_at = 0;
  const double failover =
      SecondsToTheStepAfterFailover(cli.log, metrics, killed, &failed_at);
  ASSERT_GE(failover, 0) << ReadFile(cli.log);
  std::cout << "failure: kill to the first step recorded after the "
               "fail-over in "
            << failover << " s\n";

  // The joined replica is scaled down: it leaves at a step boundary.
  ASSERT_TRUE(at_step(failed_at + 5)) << ReadFile(cli.log);
  kill(joiner.pid, SIGTERM);
  EXPECT_EQ(WaitExit(joiner.pid, 120), 0) << ReadFile(dir + "/w5.log");
  EXPECT_TRUE(LogHas(dir + "/w5.log", "left the run"))
      << ReadFile(dir + "/w5.log");

  ASSERT_EQ(WaitExit(cli.pid, 600), 0) << ReadFile(cli.log);
  {
    // Block 0's surviving replica reduced until the fail-over: each time,
    // the wait for the slowest replica is a part of the reduction.
    const std::string text = HttpGet(w[0].metrics_port, "/metrics");
    const std::string phase = "phase=\"reduction\"";
    const double reductions =
        MetricSum(text, "interlock_worker_compute_seconds_count", phase);
    EXPECT_GT(reductions, 0) << text;
    EXPECT_EQ(MetricSum(text, "interlock_worker_reduction_wait_seconds_count"),
              reductions);
    const double wait =
        MetricSum(text, "interlock_worker_reduction_wait_seconds_sum");
    EXPECT_GT(wait, 0);
    EXPECT_LE(wait,
              MetricSum(text, "interlock_worker_compute_seconds_sum", phase));
  }
  for (auto& p : w) StopWorker(p);

  const v1::RunSummary summary = ReadSummary(out);
  ExpectOneFailoverEachMicroBatchOnce(summary);
  const auto& a = summary.accounting();
  EXPECT_EQ(a.block_steps(), 240 * 4);
  ASSERT_EQ(summary.topology_size(), 3);
  const char* kinds[] = {"join", "failure", "leave"};
  for (int i = 0; i < 3; ++i) {
    const auto& t = summary.topology(i);
    EXPECT_EQ(t.generation(), i + 2);
    ASSERT_EQ(t.changes_size(), 1);
    EXPECT_EQ(t.changes(0).kind(), kinds[i]);
  }
  EXPECT_EQ(summary.topology(0).changes(0).block(), 1);
  EXPECT_EQ(summary.topology(1).changes(0).address(), w[1].address());
  EXPECT_EQ(summary.topology(2).changes(0).block(), 1);
  // Only the joiner was sent state; every other replica, and every
  // survivor of the failure, continued from its own snapshot (the digest
  // below shows they continued from the right one).
  EXPECT_GT(summary.topology(0).state_bytes(), 0);
  EXPECT_EQ(summary.topology(1).state_bytes(), 0);
  EXPECT_EQ(summary.topology(2).state_bytes(), 0);
  // The virtual clock followed the topology: the joined replica of block 1
  // has a track with work on it, beside the two of block 0.
  std::map<std::pair<int, int>, double> busy;
  for (const auto& b : summary.replica_busy_ratio()) {
    busy[{b.block(), b.replica()}] = b.ratio();
  }
  EXPECT_EQ(busy.size(), 4u) << summary.DebugString();
  for (auto [k, r] : {std::pair{0, 0}, {0, 1}, {1, 0}, {1, 1}}) {
    const double ratio = busy[{k, r}];
    EXPECT_GT(ratio, 0.0) << "block " << k << " replica " << r;
  }

  EXPECT_EQ(summary.digest(), SingleChainDigest());
  std::filesystem::remove_all(dir);
}

// A local cluster's membership service asks for the token its workers have
// (the run's id and generation went to any local caller before); the token
// file it logs lets a joiner in. Registrations are rate-limited, and one
// for an address where no worker answers is refused at once.
TEST(Elastic, ALocalClustersMembershipServiceNeedsItsToken) {
  const std::string dir = MakeTempDir("elastic-local");
  std::ofstream(dir + "/config.pbtxt") << kConfig;
  const std::string port_file = dir + "/coordinator.port";
  Child cli = StartChild(
      INTERLOCK_CLI,
      {"train", "--config", dir + "/config.pbtxt", "--engine", "cluster",
       "--coordinator-port", "0", "--coordinator-port-file", port_file,
       "--steps", "100000", "--quiet"},
      dir + "/cli.log");
  const std::string coordinator = MembershipAddress(port_file);
  ASSERT_FALSE(coordinator.empty()) << ReadFile(cli.log);
  grpc::Status s = Register(coordinator, "", 1, "127.0.0.1:1");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.error_message();
  // The token file the coordinator logged for joiners.
  const std::string log = ReadFile(cli.log);
  const std::string marker = "require the token in ";
  const size_t at = log.find(marker);
  ASSERT_NE(at, std::string::npos) << log;
  const size_t from = at + marker.size();
  const std::string token_file = log.substr(from, log.find(';', from) - from);
  std::string token;
  std::ifstream(token_file) >> token;
  ASSERT_FALSE(token.empty()) << token_file;
  s = Register(coordinator, token, 1, "no-port");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << s.error_message();
  // A flood of registrations for an address where nothing answers: none
  // accepted, most refused by the rate limit before anything is asked, and
  // the run never drains for them.
  int accepted = 0, limited = 0, gone = 0;
  for (int i = 0; i < 200; ++i) {
    s = Register(coordinator, token, 1, "127.0.0.1:1");
    accepted += s.ok();
    limited += s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
    gone += s.error_code() == grpc::StatusCode::UNAVAILABLE;
  }
  EXPECT_EQ(accepted, 0);
  EXPECT_GE(limited, 150);
  EXPECT_EQ(accepted + limited + gone, 200);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_FALSE(LogHas(cli.log, "membership change")) << ReadFile(cli.log);
  EXPECT_FALSE(LogHas(cli.log, "topology changed")) << ReadFile(cli.log);
  // Its workers die with it.
  kill(cli.pid, SIGKILL);
  int status = 0;
  waitpid(cli.pid, &status, 0);
  std::filesystem::remove_all(dir);
}

// A replica that stops answering (SIGSTOP: its sockets stay open, so only
// keepalive notices) is dropped like one that died: its peer's reduction,
// held by the hung replica, is abandoned when the coordinator reconfigures
// the block, the run continues from the survivors' snapshots without a
// checkpoint restore, and ends bitwise where the single chain ends.
TEST(Elastic, HungReplicaIsDroppedAndTheRunEndsBitwise) {
  const std::string dir = MakeTempDir("elastic-hung");
  std::ofstream(dir + "/config.pbtxt") << kConfig;
  std::string workers;
  std::vector<WorkerProcess> w = StartReplicas2111(dir, {}, &workers);
  ASSERT_EQ(w.size(), 5u);
  const std::string out = dir + "/out";
  Child cli =
      StartChild(INTERLOCK_CLI,
                 {"train", "--config", dir + "/config.pbtxt", "--engine",
                  "cluster", "--workers", workers, "--out", out, "--quiet"},
                 dir + "/cli.log");
  const std::string metrics = out + "/metrics.jsonl";
  ASSERT_TRUE(WaitFor([&] { return LinesIn(metrics) >= 10; }, 300))
      << ReadFile(cli.log);
  const auto stopped = std::chrono::steady_clock::now();
  kill(w[1].pid, SIGSTOP);
  int failed_at = 0;
  const double failover =
      SecondsToTheStepAfterFailover(cli.log, metrics, stopped, &failed_at);
  ASSERT_GE(failover, 0) << ReadFile(cli.log);
  // Recorded in docs/BENCHMARKS.md (not a target checked here).
  std::cout << "hung: stop to the first step recorded after the fail-over in "
            << failover << " s\n";
  // It wakes to a run without it: told so by the coordinator, it has no
  // membership service to register with again, and exits with a message.
  kill(w[1].pid, SIGCONT);
  EXPECT_EQ(WaitExit(w[1].pid, 60), 1) << ReadFile(dir + "/w1.log");
  EXPECT_TRUE(LogHas(dir + "/w1.log", "no --coordinator to register with"))
      << ReadFile(dir + "/w1.log");
  ASSERT_EQ(WaitExit(cli.pid, 600), 0) << ReadFile(cli.log);
  EXPECT_TRUE(LogHas(cli.log, w[1].address())) << ReadFile(cli.log);
  for (auto& p : w) StopWorker(p);

  const v1::RunSummary summary = ReadSummary(out);
  ExpectOneFailoverEachMicroBatchOnce(summary);
  ASSERT_EQ(summary.topology_size(), 1);
  ASSERT_EQ(summary.topology(0).changes_size(), 1);
  EXPECT_EQ(summary.topology(0).changes(0).kind(), "failure");
  EXPECT_EQ(summary.topology(0).changes(0).address(), w[1].address());
  EXPECT_EQ(summary.topology(0).state_bytes(), 0);

  EXPECT_EQ(summary.digest(), SingleChainDigest());
  std::filesystem::remove_all(dir);
}

// A replica that joined through the membership service, hangs and is
// dropped, then wakes: the coordinator tells it the run went on without
// it, it registers again as a new replica, is admitted, and later leaves;
// the run ends bitwise on the single chain.
TEST(Elastic, ADroppedReplicaThatWakesRegistersAgain) {
  const std::string dir = MakeTempDir("elastic-wakes");
  std::ofstream(dir + "/token") << "wakes-token\n";
  std::ofstream(dir + "/config.pbtxt") << kConfig;
  const std::vector<std::string> auth = {"--token-file=" + dir + "/token"};
  std::vector<WorkerProcess> w;
  std::string workers;
  for (int i = 0; i < 4; ++i) {
    w.push_back(StartWorker(INTERLOCK_WORKER, dir, i, auth));
    ASSERT_GT(w.back().port, 0);
    workers += (i ? "," : "") + w.back().address();
  }
  const int steps = 600;
  const std::string out = dir + "/out";
  const std::string port_file = dir + "/coordinator.port";
  Child cli = StartChild(
      INTERLOCK_CLI,
      {"train", "--config", dir + "/config.pbtxt", "--engine", "cluster",
       "--workers", workers, "--token-file", dir + "/token", "--steps",
       std::to_string(steps), "--coordinator_port", "0",
       "--coordinator_port_file", port_file, "--out", out, "--quiet"},
      dir + "/cli.log");
  const std::string coordinator = MembershipAddress(port_file);
  ASSERT_FALSE(coordinator.empty()) << ReadFile(cli.log);
  const std::string metrics = out + "/metrics.jsonl";
  std::vector<std::string> join = auth;
  join.insert(join.end(), {"--coordinator=" + coordinator, "--block=0"});
  WorkerProcess joiner = StartWorker(INTERLOCK_WORKER, dir, 4, join);
  ASSERT_GT(joiner.port, 0);
  const std::string log = dir + "/w4.log";
  auto configured = [&] {
    return WaitFor(
        [&] {
          return MetricSum(HttpGet(joiner.metrics_port, "/metrics"),
                           "interlock_worker_configured") == 1;
        },
        120);
  };
  ASSERT_TRUE(configured()) << ReadFile(log) << ReadFile(cli.log);
  const int first_join = LinesIn(metrics);
  ASSERT_TRUE(WaitFor([&] { return LinesIn(metrics) >= first_join + 5; }, 300))
      << ReadFile(cli.log);

  kill(joiner.pid, SIGSTOP);
  int failed_at = 0;
  ASSERT_GE(SecondsToTheStepAfterFailover(
                cli.log, metrics, std::chrono::steady_clock::now(), &failed_at),
            0)
      << ReadFile(cli.log);
  kill(joiner.pid, SIGCONT);
  ASSERT_TRUE(WaitFor(
      [&] { return LogHas(log, "registering again as a new replica"); }, 60))
      << ReadFile(log) << ReadFile(cli.log);
  ASSERT_TRUE(configured()) << ReadFile(log) << ReadFile(cli.log);
  // Admitted again (the join completes at a step boundary): it can leave
  // like any replica.
  const int joined_at = LinesIn(metrics);
  ASSERT_TRUE(WaitFor([&] { return LinesIn(metrics) >= joined_at + 5; }, 300))
      << ReadFile(cli.log);
  kill(joiner.pid, SIGTERM);
  EXPECT_EQ(WaitExit(joiner.pid, 120), 0) << ReadFile(log);
  EXPECT_TRUE(LogHas(log, "left the run")) << ReadFile(log);
  ASSERT_EQ(WaitExit(cli.pid, 600), 0) << ReadFile(cli.log);
  for (auto& p : w) StopWorker(p);

  const v1::RunSummary summary = ReadSummary(out);
  const auto& a = summary.accounting();
  EXPECT_EQ(a.recoveries(), 0);
  EXPECT_EQ(a.failovers(), 1);
  EXPECT_EQ(a.steps_not_exactly_once_size(), 0);
  EXPECT_EQ(a.microbatches_applied(), steps * 4);
  std::vector<std::string> kinds;
  for (const auto& t : summary.topology()) {
    for (const auto& c : t.changes()) kinds.push_back(c.kind());
  }
  EXPECT_EQ(kinds,
            (std::vector<std::string>{"join", "failure", "join", "leave"}))
      << ReadFile(cli.log);
  EXPECT_EQ(summary.digest(), SingleChainDigest(steps));
  std::filesystem::remove_all(dir);
}

// The step the coordinator's log says it adopted the live workers at, or
// -1 when it did not.
int64_t AdoptedAt(const std::string& log) {
  const std::string text = ReadFile(log);
  const std::string mark = "adopted the live workers of run ";
  const size_t at = text.find(mark);
  if (at == std::string::npos) return -1;
  const size_t step = text.find(" at step ", at);
  return step == std::string::npos ? -1 : std::stoll(text.substr(step + 9));
}

// Workers started by hand outlive their coordinator: one killed with -9
// mid-run is started again on the same --out and adopts the live workers,
// every block continuing from its own snapshot of the last step boundary
// the journal names (no checkpoint exists yet, so none is read). Killed
// again after a checkpoint, with a worker restarted meanwhile (it has no
// snapshot), the third falls back to the checkpoint. The run ends bitwise
// on the single chain, every micro-batch applied once, every step recorded
// once.
TEST(Elastic, ANewCoordinatorAdoptsTheLiveWorkers) {
  const std::string dir = MakeTempDir("elastic-adopt");
  std::ofstream(dir + "/token") << "adopt-token\n";
  std::ofstream(dir + "/config.pbtxt") << kConfig;
  const std::vector<std::string> auth = {"--token-file=" + dir + "/token"};
  std::string workers;
  std::vector<WorkerProcess> w = StartReplicas2111(dir, auth, &workers);
  ASSERT_EQ(w.size(), 5u);
  const int steps = 400;
  const std::string out = dir + "/out";
  const std::string metrics = out + "/metrics.jsonl";
  const std::vector<std::string> args = {"train",
                                         "--config",
                                         dir + "/config.pbtxt",
                                         "--engine",
                                         "cluster",
                                         "--workers",
                                         workers,
                                         "--token-file",
                                         dir + "/token",
                                         "--steps",
                                         std::to_string(steps),
                                         "--checkpoint-every=100",
                                         "--out",
                                         out,
                                         "--quiet"};
  Child first = StartChild(INTERLOCK_CLI, args, dir + "/cli1.log");
  ASSERT_TRUE(WaitFor([&] { return LinesIn(metrics) >= 30; }, 300))
      << ReadFile(first.log);
  const int recorded = LinesIn(metrics);
  kill(first.pid, SIGKILL);
  WaitExit(first.pid, 30);
  ASSERT_FALSE(std::filesystem::exists(out + "/checkpoints/step-0000000100"));

  Child second = StartChild(INTERLOCK_CLI, args, dir + "/cli2.log");
  ASSERT_TRUE(WaitFor([&] { return AdoptedAt(second.log) >= 0; }, 120))
      << ReadFile(second.log);
  // At most the steps in flight run again.
  const int64_t adopted = AdoptedAt(second.log);
  EXPECT_GE(adopted + 3, recorded) << ReadFile(second.log);
  std::cout << "adopted at step " << adopted << " with " << recorded
            << " steps recorded when the coordinator was killed\n";
  EXPECT_FALSE(LogHas(second.log, "resuming from")) << ReadFile(second.log);
  ASSERT_TRUE(WaitFor([&] { return LinesIn(metrics) >= 130; }, 300))
      << ReadFile(second.log);
  kill(second.pid, SIGKILL);
  WaitExit(second.pid, 30);
  // Block 2's worker restarted on its port: it holds no snapshot.
  const int port = w[3].port;
  StopWorker(w[3], SIGKILL);
  std::vector<std::string> same_port = auth;
  same_port.push_back("--port=" + std::to_string(port));
  w[3] = StartWorker(INTERLOCK_WORKER, dir, 3, same_port);
  ASSERT_EQ(w[3].port, port) << ReadFile(dir + "/w3.log");

  Child third = StartChild(INTERLOCK_CLI, args, dir + "/cli3.log");
  ASSERT_EQ(WaitExit(third.pid, 600), 0) << ReadFile(third.log);
  EXPECT_TRUE(LogHas(third.log, "could not adopt the live workers"))
      << ReadFile(third.log);
  EXPECT_TRUE(LogHas(third.log, "resuming from")) << ReadFile(third.log);
  for (auto& p : w) StopWorker(p);

  const v1::RunSummary summary = ReadSummary(out);
  const auto& a = summary.accounting();
  EXPECT_EQ(a.adoptions(), 1);
  EXPECT_EQ(a.recoveries(), 0);
  EXPECT_GE(a.resumed_from_step(), 100);
  EXPECT_EQ(a.steps_not_exactly_once_size(), 0);
  EXPECT_EQ(a.microbatches_applied(), steps * 4);
  EXPECT_EQ(LinesIn(metrics), steps);
  EXPECT_FALSE(std::filesystem::exists(out + "/journal.pbtxt"));
  EXPECT_EQ(summary.digest(), SingleChainDigest(steps));
  std::filesystem::remove_all(dir);
}

// The virtual clock splits a step without routes of its own as the engine
// does, by the run's step number: a replicated run resumed at an odd step
// places every step (it once stalled, "step N did not finish in the
// replay") and ends bitwise where the uninterrupted run does.
TEST(Elastic, AReplicatedRunResumedAtAnOddStepPlacesEveryStep) {
  const std::string dir = MakeTempDir("elastic-odd");
  std::ofstream(dir + "/config.pbtxt") << kConfig;
  const std::string out = dir + "/out";
  const std::string common =
      std::string(INTERLOCK_CLI) + " train --quiet --config " + dir +
      "/config.pbtxt --engine cluster --replicas 2,1,1,1 --steps 120 "
      "--checkpoint-every 41 --out " +
      out;
  auto whole = RunCommand(common);
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  ASSERT_TRUE(std::filesystem::exists(out + "/checkpoints/step-0000000041"));
  auto resumed =
      RunCommand(common + " --resume " + out + "/checkpoints/step-0000000041");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(DigestOf(resumed.output), DigestOf(whole.output));
  EXPECT_EQ(LinesIn(out + "/metrics.jsonl"), 120);
  std::filesystem::remove_all(dir);
}

// A run without a token (workers on loopback) tells no caller its id or
// generation: a Register that succeeds is answered without them.
TEST(Elastic, ATokenlessMembershipServiceTellsNoRunId) {
  const std::string dir = MakeTempDir("elastic-tokenless");
  std::ofstream(dir + "/config.pbtxt") << kConfig;
  std::vector<WorkerProcess> w;
  std::string workers;
  for (int i = 0; i < 5; ++i) {
    w.push_back(StartWorker(INTERLOCK_WORKER, dir, i, {}));
    ASSERT_GT(w.back().port, 0);
    if (i < 4) workers += (i ? "," : "") + w.back().address();
  }
  const std::string out = dir + "/out";
  const std::string port_file = dir + "/coordinator.port";
  Child cli = StartChild(
      INTERLOCK_CLI,
      {"train", "--config", dir + "/config.pbtxt", "--engine", "cluster",
       "--workers", workers, "--coordinator_port", "0",
       "--coordinator_port_file", port_file, "--out", out, "--quiet"},
      dir + "/cli.log");
  const std::string coordinator = MembershipAddress(port_file);
  ASSERT_FALSE(coordinator.empty()) << ReadFile(cli.log);
  ASSERT_TRUE(
      WaitFor([&] { return LinesIn(out + "/metrics.jsonl") >= 3; }, 300))
      << ReadFile(cli.log);
  v1::RegisterResponse response;
  grpc::Status s = Register(coordinator, "", 1, w[4].address(), "", &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.run_id(), "");
  EXPECT_EQ(response.generation(), 0);
  ASSERT_EQ(WaitExit(cli.pid, 600), 0) << ReadFile(cli.log);
  for (auto& p : w) StopWorker(p);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace interlock
