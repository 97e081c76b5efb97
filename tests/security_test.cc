// Hostile clients against real interlock-worker processes on loopback: the
// bearer token, TLS and mutual TLS (certificates made here with the openssl
// CLI), message and stream limits, compressed frames that inflate past the
// limit, and the non-finite policy on both engines.
#include "rpc/security.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "coordinator/local_cluster.h"
#include "coordinator/train.h"
#include "proto/worker.grpc.pb.h"
#include "rpc/channel.h"
#include "services/config.h"
#include "services/wire.h"
#include "tests/cluster_util.h"
#include "tests/test_util.h"
#include "tests/worker_test_util.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;
using interlock::testing::HealthStatus;
using interlock::testing::HttpGet;
using interlock::testing::MakeTempDir;
using interlock::testing::MetricSum;
using interlock::testing::RawUnaryCall;
using interlock::testing::ReadFile;
using interlock::testing::RunCommand;
using interlock::testing::SpawnLogged;
using interlock::testing::StartWorker;
using interlock::testing::StopWorker;
using interlock::testing::WorkerProcess;

using interlock::worker_test::Configure;
using interlock::worker_test::Deadline;
using interlock::worker_test::ExitResult;
using interlock::worker_test::Forward;
using interlock::worker_test::GetState;
using interlock::worker_test::kCli;
using interlock::worker_test::kOneBlock;
using interlock::worker_test::kSrc;
using interlock::worker_test::kWorker;
using interlock::worker_test::LoadState;
using interlock::worker_test::MakeCertificates;
using interlock::worker_test::OneBlockRequest;
using interlock::worker_test::Plaintext;
using interlock::worker_test::RunToExit;
using interlock::worker_test::SaveState;
using interlock::worker_test::StreamOnce;
using interlock::worker_test::WorkerFixture;
using interlock::worker_test::WriteFile;

using TokenTest = WorkerFixture;

TEST_F(TokenTest, EveryWorkerCallNeedsTheTokenAndTheHandlerNeverRunsWithout) {
  WriteFile(dir_ + "/token", "s3cret-token-0123456789\n");
  WorkerProcess w = Start({"--token-file=" + dir_ + "/token"});
  auto stub = v1::Worker::NewStub(Plaintext(w));
  const std::string right = "Bearer s3cret-token-0123456789";

  grpc::Status s = Configure(stub.get(), "run-a");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(s.error_message().find("missing bearer token"), std::string::npos)
      << s.error_message();
  s = Configure(stub.get(), "run-a", "Bearer s3cret-token-0123456788");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(s.error_message().find("wrong bearer token"), std::string::npos);
  EXPECT_EQ(s.error_message().find("s3cret"), std::string::npos)
      << "never echoes a token";
  s = Configure(stub.get(), "run-a", "s3cret-token-0123456789");  // no scheme
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(GetState(stub.get(), "Bearer nope").error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  bool completed = true;
  s = StreamOnce(stub.get(), Forward("run-a", 0), &completed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_FALSE(completed);
  std::vector<v1::StateChunk> chunks;
  EXPECT_EQ(SaveState(stub.get(), "run-a", "", &chunks).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(chunks.empty());
  v1::StateChunk forged;
  forged.set_run_id("run-a");
  forged.set_generation(1);
  forged.set_total_bytes(3);
  forged.set_data("abc");
  EXPECT_EQ(LoadState(stub.get(), "Bearer nope", {forged}).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);

  // None of it reached the core: still unconfigured, nothing counted but
  // the refusals. The health service answers without a token.
  EXPECT_EQ(HealthStatus(Plaintext(w)), 2);
  std::string metrics = HttpGet(w.metrics_port, "/metrics");
  EXPECT_EQ(
      MetricSum(metrics, "interlock_worker_unauthenticated_requests_total"), 7)
      << metrics;
  EXPECT_EQ(MetricSum(metrics, "interlock_worker_configured"), -1) << metrics;
  EXPECT_EQ(MetricSum(metrics, "interlock_worker_rejected_messages_total"), -1);
  EXPECT_EQ(MetricSum(metrics, "interlock_worker_microbatches_total"), -1);

  // With the token everything works, through the channel interceptor the
  // services use too.
  TransportSecurity sec;
  sec.token = "s3cret-token-0123456789";
  auto good = v1::Worker::NewStub(MakeChannel(w.address(), 4 << 20, sec));
  s = Configure(good.get(), "run-a");
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(HealthStatus(Plaintext(w)), 1);
  s = StreamOnce(good.get(), Forward("run-a", 0), &completed);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(completed);
  EXPECT_TRUE(GetState(stub.get(), right).ok());
  // The checkpoint calls: the block's state out and back in.
  s = SaveState(stub.get(), "run-a", right, &chunks);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_FALSE(chunks.empty());
  s = LoadState(stub.get(), right, chunks);
  EXPECT_TRUE(s.ok()) << s.error_message();
  metrics = HttpGet(w.metrics_port, "/metrics");
  EXPECT_EQ(
      MetricSum(metrics, "interlock_worker_unauthenticated_requests_total"), 7);
  EXPECT_EQ(MetricSum(metrics, "interlock_worker_microbatches_total"), 1);

  // No reflection service, token or not.
  grpc::Status reflection = RawUnaryCall(
      MakeChannel(w.address(), 4 << 20, sec),
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "");
  EXPECT_EQ(reflection.error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST(TokenFlags, BadTokenAndTlsFilesStopTheWorkerAtStartUp) {
  const std::string dir = MakeTempDir("flags");
  WriteFile(dir + "/blank", " \n");
  WriteFile(dir + "/spaced", "two words\n");
  WriteFile(dir + "/notpem", "hello\n");
  struct Case {
    std::string flags, fragment;
  };
  const std::vector<Case> cases = {
      {"--token-file=" + dir + "/missing", "--token-file: cannot read"},
      {"--token-file=" + dir + "/blank", "only white space"},
      {"--token-file=" + dir + "/spaced", "printable ASCII"},
      {"--tls-cert=" + dir + "/notpem", "go together"},
      {"--tls-ca=" + dir + "/notpem", "--tls-ca on a server needs"},
      {"--tls-cert=" + dir + "/notpem --tls-key=" + dir + "/notpem",
       "is not a PEM file"},
  };
  for (const auto& c : cases) {
    auto r = RunCommand(kWorker + " --port=0 --metrics_port=-1 " + c.flags);
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.fragment), std::string::npos) << c.flags << "\n"
                                                            << r.output;
  }
  auto r = RunCommand(kCli + " train --config " + kSrc +
                      "/configs/tests/tiny_resnet.pbtxt --token-file " + dir +
                      "/blank");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("need --engine cluster"), std::string::npos);
  std::filesystem::remove_all(dir);
}

// --- TLS and mutual TLS. ---------------------------------------------------

class TlsTest : public WorkerFixture {
 protected:
  void SetUp() override {
    WorkerFixture::SetUp();
    MakeCertificates(dir_, "good");
    MakeCertificates(dir_, "other");
  }
  TransportSecurity Client(const std::string& name, bool with_cert,
                           bool with_ca) {
    TransportSecurity s;
    if (with_cert) {
      s.cert_pem = ReadFile(dir_ + "/" + name + ".pem");
      s.key_pem = ReadFile(dir_ + "/" + name + ".key");
    }
    if (with_ca) s.ca_pem = ReadFile(dir_ + "/good-ca.pem");
    return s;
  }
  std::vector<std::string> ServerFlags(bool mutual) {
    std::vector<std::string> f = {"--tls-cert=" + dir_ + "/good.pem",
                                  "--tls-key=" + dir_ + "/good.key"};
    if (mutual) f.push_back("--tls-ca=" + dir_ + "/good-ca.pem");
    return f;
  }
};

TEST_F(TlsTest, TlsServesVerifyingClientsAndRefusesPlaintext) {
  WorkerProcess w = Start(ServerFlags(/*mutual=*/false));
  auto plain = v1::Worker::NewStub(Plaintext(w));
  EXPECT_EQ(Configure(plain.get(), "run-t").error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // A client that does not trust the server's CA refuses it.
  TransportSecurity untrusting;
  untrusting.ca_pem = ReadFile(dir_ + "/other-ca.pem");
  auto wary =
      v1::Worker::NewStub(MakeChannel(w.address(), 4 << 20, untrusting));
  EXPECT_EQ(Configure(wary.get(), "run-t").error_code(),
            grpc::StatusCode::UNAVAILABLE);
  auto tls = v1::Worker::NewStub(
      MakeChannel(w.address(), 4 << 20, Client("good", false, true)));
  grpc::Status s = Configure(tls.get(), "run-t");
  ASSERT_TRUE(s.ok()) << s.error_message();
  bool completed = false;
  s = StreamOnce(tls.get(), Forward("run-t", 0), &completed);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(completed);
}

TEST_F(TlsTest, MutualTlsRefusesNoCertificateAForeignCaAndPlaintext) {
  WorkerProcess w = Start(ServerFlags(/*mutual=*/true));
  struct Refused {
    const char* what;
    std::shared_ptr<grpc::Channel> channel;
  };
  const std::vector<Refused> refused = {
      {"plaintext", Plaintext(w)},
      {"no client certificate",
       MakeChannel(w.address(), 4 << 20, Client("good", false, true))},
      {"certificate from another CA",
       MakeChannel(w.address(), 4 << 20, Client("other", true, true))},
  };
  for (const auto& r : refused) {
    auto stub = v1::Worker::NewStub(r.channel);
    grpc::Status s = Configure(stub.get(), "run-m");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE)
        << r.what << ": " << s.error_message();
  }
  auto good = v1::Worker::NewStub(
      MakeChannel(w.address(), 4 << 20, Client("good", true, true)));
  // Nothing of the refused attempts reached the core.
  grpc::Status s = GetState(good.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << s.error_message();
  s = Configure(good.get(), "run-m");
  ASSERT_TRUE(s.ok()) << s.error_message();
  bool completed = false;
  s = StreamOnce(good.get(), Forward("run-m", 0), &completed);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(completed);
}

std::string DigestLine(const std::string& out) {
  auto at = out.find("digest ");
  return at == std::string::npos ? std::string() : out.substr(at, 71);
}

// A local cluster whose workers (and the links between them) require the
// token and mutual TLS trains to the same parameters as one process; a
// coordinator with the wrong token is refused, naming the worker.
TEST_F(TlsTest, ClusterWithTokenAndMutualTlsMatchesInProcess) {
  WriteFile(dir_ + "/token", "cluster-token-42\n");
  const std::string flags = " --token-file " + dir_ + "/token --tls-cert " +
                            dir_ + "/good.pem --tls-key " + dir_ +
                            "/good.key --tls-ca " + dir_ + "/good-ca.pem";
  const std::string config =
      " --config " + kSrc + "/configs/tests/tiny_resnet.pbtxt --steps 6";
  auto secured = RunCommand(kCli + " train --quiet --engine cluster" + config +
                            flags + " --out " + dir_ + "/out");
  ASSERT_EQ(secured.exit_code, 0) << secured.output;
  auto local = RunCommand(kCli + " train --quiet" + config);
  ASSERT_EQ(local.exit_code, 0) << local.output;
  EXPECT_FALSE(DigestLine(secured.output).empty());
  EXPECT_EQ(DigestLine(secured.output), DigestLine(local.output));

  // Workers started elsewhere with the same files; the coordinator has the
  // wrong token.
  std::vector<std::string> wflags = ServerFlags(/*mutual=*/true);
  wflags.push_back("--token-file=" + dir_ + "/token");
  std::vector<WorkerProcess> w;
  for (int k = 0; k < 3; ++k) w.push_back(Start(wflags));
  WriteFile(dir_ + "/wrong", "cluster-token-43\n");
  const std::string addrs =
      w[0].address() + "," + w[1].address() + "," + w[2].address();
  auto wrong = RunCommand(kCli + " train --quiet --engine cluster" + config +
                          " --workers " + addrs + " --token-file " + dir_ +
                          "/wrong --tls-cert " + dir_ + "/good.pem --tls-key " +
                          dir_ + "/good.key --tls-ca " + dir_ + "/good-ca.pem");
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.output.find("worker 2 (" + w[2].address() +
                              "): configure failed: wrong bearer token"),
            std::string::npos)
      << wrong.output;
  auto right = RunCommand(kCli + " train --quiet --engine cluster" + config +
                          " --workers " + addrs + flags);
  ASSERT_EQ(right.exit_code, 0) << right.output;
  EXPECT_EQ(DigestLine(right.output), DigestLine(local.output));
}

// --- Secure by default. ----------------------------------------------------

using SecureByDefault = WorkerFixture;

int Lines(const std::string& text) {
  return static_cast<int>(std::count(text.begin(), text.end(), '\n'));
}

// A worker listens on loopback unless told otherwise; beyond it only with a
// token or mutual TLS, or when --insecure says so (and its log says so).
TEST_F(SecureByDefault, WorkerBeyondLoopbackNeedsATokenOrInsecure) {
  // The default host: 127.0.0.1.
  {
    const std::string port_file = dir_ + "/default.port";
    const pid_t pid = SpawnLogged(
        {kWorker, "--port=0", "--metrics_port=0", "--port_file=" + port_file},
        dir_ + "/default.log");
    int port = 0;
    EXPECT_TRUE(interlock::testing::WaitFor(
        [&] { return (std::ifstream(port_file) >> port).good(); }, 30));
    kill(pid, SIGTERM);
    int status;
    waitpid(pid, &status, 0);
    const std::string log = ReadFile(dir_ + "/default.log");
    EXPECT_NE(log.find("serving on 127.0.0.1:" + std::to_string(port) +
                       " (plaintext, no token), metrics on 127.0.0.1:"),
              std::string::npos)
        << log;
  }
  struct Case {
    std::vector<std::string> flags;
    std::string fragment;
  };
  const std::vector<Case> refused = {
      {{"--host=0.0.0.0"},
       "--host 0.0.0.0 is not a loopback address and this worker has no "
       "--token_file or mutual TLS"},
      {{"--host", "::"}, "--host :: is not a loopback address"},
      {{"--host=127.0.0.1", "--metrics_host=0.0.0.0"},
       "--metrics_host 0.0.0.0 is not a loopback address and /metrics would "
       "be open to anyone"},
      // TLS without a CA authenticates only the worker: anyone may call.
      {{"--host=0.0.0.0", "--tls_cert=" + dir_ + "/good.pem",
        "--tls_key=" + dir_ + "/good.key"},
       "--host 0.0.0.0 is not a loopback address"},
  };
  interlock::worker_test::MakeCertificates(dir_, "good");
  int n = 0;
  for (const Case& c : refused) {
    std::vector<std::string> flags = {"--port=0", "--metrics_port=0"};
    flags.insert(flags.end(), c.flags.begin(), c.flags.end());
    const ExitResult r =
        RunToExit(kWorker, flags, dir_ + "/refused" + std::to_string(n++));
    SCOPED_TRACE(c.flags[0]);
    EXPECT_FALSE(r.timed_out) << "it started:\n" << r.output;
    EXPECT_TRUE(r.exited) << r.output;
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("interlock-worker: error: " + c.fragment),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("or pass --insecure on a network you trust"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(Lines(r.output), 1) << r.output;
  }

  // --insecure: it starts, says so, and answers on loopback and beyond.
  WorkerProcess open = Start({"--host=0.0.0.0", "--insecure"});
  ASSERT_GT(open.port, 0);
  const std::string log = ReadFile(log_of_[open.pid]);
  EXPECT_NE(log.find("serving on 0.0.0.0:" + std::to_string(open.port) +
                     " (plaintext, no token, --insecure)"),
            std::string::npos)
      << log;
  EXPECT_EQ(HealthStatus(Plaintext(open)), 2);
  EXPECT_EQ(HttpGet(open.metrics_port, "/metrics").empty(), false);

  // A token, or mutual TLS, is enough for gRPC and for /metrics (which
  // follows --host); --metrics_token_file for /metrics alone.
  WriteFile(dir_ + "/token", "secure-default-token\n");
  WorkerProcess token =
      Start({"--host=0.0.0.0", "--token_file=" + dir_ + "/token"});
  EXPECT_GT(token.port, 0);
  EXPECT_EQ(ReadFile(log_of_[token.pid]).find("--insecure"), std::string::npos);
  WorkerProcess mtls = Start(
      {"--host=0.0.0.0", "--tls_cert=" + dir_ + "/good.pem",
       "--tls_key=" + dir_ + "/good.key", "--tls_ca=" + dir_ + "/good-ca.pem"});
  EXPECT_GT(mtls.port, 0);
  WorkerProcess scraped = Start(
      {"--metrics_host=0.0.0.0", "--metrics_token_file=" + dir_ + "/token"});
  EXPECT_GT(scraped.port, 0);
}

// The coordinator's listeners: the membership service (--coordinator-host)
// and /metrics (--metrics-host) default to loopback; beyond it they need a
// token or mutual TLS, or --insecure, which summary.json records.
TEST(SecureByDefaultCli,
     CoordinatorListenersBeyondLoopbackNeedATokenOrInsecure) {
  const std::string dir = MakeTempDir("secure-cli");
  const std::string train = kCli + " train --config " + kSrc +
                            "/configs/tests/tiny_resnet.pbtxt " + "--steps 2 ";
  const std::string cluster = train + "--engine cluster --coordinator-port 0 ";
  struct Refusal {
    std::string flags, fragment;
  };
  for (const Refusal& c : std::vector<Refusal>{
           {cluster + "--coordinator-host 0.0.0.0",
            "--coordinator-host 0.0.0.0 is not a loopback address and the "
            "run has no --token-file or mutual TLS: anyone who reaches the "
            "membership service could join the run"},
           {cluster + "--coordinator_host=0.0.0.0 --insecure=false",
            "--coordinator-host 0.0.0.0 is not a loopback address"},
           {train + "--metrics-port 0 --metrics-host 0.0.0.0",
            "--metrics-host 0.0.0.0 is not a loopback address"}}) {
    auto r = RunCommand(c.flags);
    SCOPED_TRACE(c.flags);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    interlock::testing::ExpectOneLineError(r, c.flags, c.fragment);
    EXPECT_NE(r.output.find("or pass --insecure"), std::string::npos);
  }

  // The defaults: both on 127.0.0.1.
  auto plain = RunCommand(cluster + "--metrics-port 0 --quiet --out " + dir +
                          "/default");
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_NE(plain.output.find("membership service on 127.0.0.1:"),
            std::string::npos)
      << plain.output;
  EXPECT_NE(plain.output.find("coordinator metrics on 127.0.0.1:"),
            std::string::npos)
      << plain.output;
  EXPECT_EQ(interlock::testing::SummaryField(
                ReadFile(dir + "/default/summary.json"), "insecure"),
            "false");

  // --insecure (either spelling): they listen on every interface, the log
  // says so, and summary.json records it.
  for (const std::string flag : {"--insecure", "--insecure=true"}) {
    const std::string out = dir + "/insecure" + std::to_string(flag.size());
    auto r = RunCommand(cluster +
                        "--coordinator-host 0.0.0.0 --metrics-port 0 "
                        "--metrics-host 0.0.0.0 --quiet --out " +
                        out + " " + flag);
    ASSERT_EQ(r.exit_code, 0) << flag << "\n" << r.output;
    EXPECT_NE(r.output.find("membership service on 0.0.0.0:"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("(--insecure)"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("coordinator metrics on 0.0.0.0:"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(interlock::testing::SummaryField(ReadFile(out + "/summary.json"),
                                               "insecure"),
              "true");
  }

  // A token is enough; no --insecure recorded.
  WriteFile(dir + "/token", "coordinator-token\n");
  auto token = RunCommand(cluster +
                          "--coordinator-host 0.0.0.0 --metrics-port 0 "
                          "--metrics-host 0.0.0.0 --quiet --token-file " +
                          dir + "/token --out " + dir + "/token-run");
  ASSERT_EQ(token.exit_code, 0) << token.output;
  EXPECT_EQ(token.output.find("--insecure"), std::string::npos) << token.output;
  EXPECT_EQ(interlock::testing::SummaryField(
                ReadFile(dir + "/token-run/summary.json"), "insecure"),
            "false");
  std::filesystem::remove_all(dir);
}

// A local cluster started without the user's token or TLS still requires a
// token: one generated per start, 0600 in the cluster's folder. A client
// without it is refused; the run trains to the in-process digest; its
// checkpoints are not sealed with it, so another local cluster (another
// token) resumes them.
TEST(SecureByDefaultLocalCluster, WorkersRequireTheGeneratedToken) {
  const std::string dir = MakeTempDir("secure-local");
  auto config = LoadRunConfig(kSrc + "/configs/tests/tiny_resnet.pbtxt");
  ASSERT_TRUE(config.ok()) << config.status();
  config->mutable_training()->set_steps(4);

  struct Seen {
    std::vector<std::string> addresses;
    std::string token, token_file;
    int mode = -1;
    grpc::Status missing, wrong, right;
  };
  std::vector<Seen> seen;
  TrainOptions o;
  o.output.quiet = true;
  o.engine.kind = EngineKind::kCluster;
  o.engine.worker_binary = kWorker;
  o.checkpoints.dir = dir + "/checkpoints";
  o.checkpoints.every = 2;
  o.engine.on_cluster = [&](LocalCluster* c) {
    if (c == nullptr) return;
    Seen s;
    s.addresses = c->addresses();
    s.token = c->token();
    s.token_file = c->token_file();
    struct stat st;
    if (stat(s.token_file.c_str(), &st) == 0) s.mode = st.st_mode & 07777;
    // Every worker, called as any other local user could: by address.
    for (const std::string& address : s.addresses) {
      auto stub = v1::Worker::NewStub(
          grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
      s.missing = GetState(stub.get());
      s.wrong = GetState(stub.get(), "Bearer " + std::string(64, '0'));
      s.right = GetState(stub.get(), BearerValue(s.token));
      if (s.missing.error_code() != grpc::StatusCode::UNAUTHENTICATED) break;
    }
    seen.push_back(std::move(s));
  };
  auto first = Train(*config, o);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(seen.size(), 1u);
  const Seen& s = seen[0];
  ASSERT_EQ(s.addresses.size(), 3u);
  EXPECT_EQ(s.token.size(), 64u);
  EXPECT_EQ(s.token.find_first_not_of("0123456789abcdef"), std::string::npos)
      << s.token;
  EXPECT_EQ(s.token_file.rfind("/tmp/interlock-cluster-", 0), 0u)
      << s.token_file;
  EXPECT_EQ(s.mode, 0600);
  EXPECT_FALSE(std::filesystem::exists(s.token_file))
      << "removed with the cluster's folder";
  EXPECT_EQ(s.missing.error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << s.missing.error_message();
  EXPECT_NE(s.missing.error_message().find("missing bearer token"),
            std::string::npos);
  EXPECT_EQ(s.wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  // With the token the call reaches the (not yet configured) worker.
  EXPECT_EQ(s.right.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << s.right.error_message();

  TrainOptions local;
  local.output.quiet = true;
  auto inprocess = Train(*config, local);
  ASSERT_TRUE(inprocess.ok()) << inprocess.status();
  EXPECT_EQ(first->digest, inprocess->digest);

  // Not sealed with the generated token ...
  int manifests = 0;
  for (const auto& e :
       std::filesystem::recursive_directory_iterator(dir + "/checkpoints")) {
    if (e.path().filename() != "manifest.pbtxt") continue;
    ++manifests;
    EXPECT_EQ(ReadFile(e.path()).find("hmac-sha256"), std::string::npos)
        << e.path();
  }
  EXPECT_GT(manifests, 0);
  // ... so a new local cluster, with a token of its own, resumes them.
  o.checkpoints.resume = dir + "/checkpoints/step-0000000002";
  o.checkpoints.dir = dir + "/resumed";
  auto resumed = Train(*config, o);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_NE(seen[1].token, s.token);
  EXPECT_EQ(resumed->accounting.resumed_from_step, 2);
  EXPECT_EQ(resumed->digest, inprocess->digest);
  std::filesystem::remove_all(dir);
}

// --- Limits. ---------------------------------------------------------------

using LimitTest = WorkerFixture;

// A DownMessage with `bytes` of zeros as the input tensor's data.
v1::DownMessage Padded(const std::string& run_id, size_t bytes) {
  v1::DownMessage m = Forward(run_id, 0);
  m.mutable_forward()->mutable_input()->mutable_data()->assign(bytes, '\0');
  return m;
}

TEST_F(LimitTest, OversizedAndInflatingMessagesAreRefusedAndWorkerServes) {
  WorkerProcess w = Start({"--max_message_bytes=4194304"});
  auto stub = v1::Worker::NewStub(Plaintext(w));
  ASSERT_TRUE(Configure(stub.get(), "run-l").ok());
  grpc::Status s = StreamOnce(stub.get(), Padded("run-l", 5 << 20));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_message();

  // 64 MiB of zeros gzip to about 64 KiB on the wire: the limit holds for
  // the inflated message.
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  args.SetCompressionAlgorithm(GRPC_COMPRESS_GZIP);
  auto gz = v1::Worker::NewStub(grpc::CreateCustomChannel(
      w.address(), grpc::InsecureChannelCredentials(), args));
  s = StreamOnce(gz.get(), Padded("run-l", 64 << 20));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_message();
  // Compressed messages under the limit are fine.
  bool completed = false;
  s = StreamOnce(gz.get(), Forward("run-l", 0), &completed);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(completed);
  EXPECT_EQ(HealthStatus(Plaintext(w)), 1);
}

TEST_F(LimitTest, StreamsBeyondTheLimitAreRefusedWithoutDisturbingOpenOnes) {
  WorkerProcess w = Start({"--max_concurrent_streams=1"});
  auto stub = v1::Worker::NewStub(Plaintext(w));
  ASSERT_TRUE(Configure(stub.get(), "run-s").ok());
  // Stream A is open and attached once its first completion came back.
  grpc::ClientContext a_ctx;
  Deadline(&a_ctx);
  auto a = stub->Stream(&a_ctx);
  ASSERT_TRUE(a->Write(Forward("run-s", 0)));
  v1::UpMessage up;
  bool completed = false;
  while (!completed && a->Read(&up)) completed = up.has_upward();
  ASSERT_TRUE(completed);
  // B is refused before it can replace A.
  bool b_completed = true;
  grpc::Status s = StreamOnce(stub.get(), Forward("run-s", 1), &b_completed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_message();
  EXPECT_NE(s.error_message().find("max_concurrent_streams"),
            std::string::npos);
  EXPECT_FALSE(b_completed);
  // A still works.
  ASSERT_TRUE(a->Write(Forward("run-s", 1)));
  completed = false;
  while (!completed && a->Read(&up)) completed = up.has_upward();
  EXPECT_TRUE(completed);
  a->WritesDone();
  while (a->Read(&up)) {
  }
  EXPECT_TRUE(a->Finish().ok());
  // Once A is done, a new stream is accepted (the slot frees when the
  // server has finished A, just after the client saw its status).
  for (int i = 0; i < 50; ++i) {
    s = StreamOnce(stub.get(), Forward("run-s", 2), &completed);
    if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(completed);
}

// --- Non-finite losses. ----------------------------------------------------

// An MLP whose first step's enormous learning rate overflows every later
// forward pass: losses become NaN from step 1 on.
constexpr char kDiverging[] = R"pb(
  name: "diverging"
  model {
    mlp { hidden: [ 16, 16 ] }
    partition: "1,1,rest"
    head: "fc"
  }
  data {
    kind: SYNTHETIC_VECTORS
    synthetic_shape: [ 8 ]
    synthetic_classes: 4
    synthetic_train: 64
    synthetic_test: 16
  }
  optimizer { kind: SGD }
  schedule { kind: CONSTANT lr: 1e30 }
  training { mode: INTERLOCK n: 2 batch_size: 8 microbatches: 2 steps: 6 }
)pb";

class NonFiniteTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(MakeTempDir("nonfinite"));
    workers_ = new std::vector<WorkerProcess>();
    for (int k = 0; k < 3; ++k) {
      workers_->push_back(StartWorker(kWorker, *dir_, k));
    }
  }
  static void TearDownTestSuite() {
    for (auto& w : *workers_) StopWorker(w);
    std::filesystem::remove_all(*dir_);
    delete workers_;
    delete dir_;
  }
  static TrainOptions Cluster() {
    TrainOptions o;
    o.output.quiet = true;
    o.engine.kind = EngineKind::kCluster;
    for (const auto& w : *workers_) o.engine.workers.push_back({w.address()});
    return o;
  }
  static std::string* dir_;
  static std::vector<WorkerProcess>* workers_;
};
std::string* NonFiniteTest::dir_ = nullptr;
std::vector<WorkerProcess>* NonFiniteTest::workers_ = nullptr;

TEST_F(NonFiniteTest, SkipStepIsIdenticalInProcessAndOnTheCluster) {
  auto config = ParseRunConfig(kDiverging, "test");
  ASSERT_TRUE(config.ok()) << config.status();
  config->mutable_training()->set_nonfinite_policy(v1::TrainingSpec::SKIP_STEP);
  for (int n : {1, 2, 3}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    config->mutable_training()->set_n(n);
    TrainOptions local;
    local.output.quiet = true;
    auto a = Train(*config, local);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = Train(*config, Cluster());
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->block_digests, b->block_digests);
    EXPECT_EQ(a->head_digests, b->head_digests);
    EXPECT_EQ(a->skipped_steps, b->skipped_steps);
    int64_t skipped = 0;
    for (int64_t s : a->skipped_steps) skipped += s;
    EXPECT_GT(skipped, 0);
  }
  double counted = 0;
  for (const auto& w : *workers_) {
    counted += std::max(0.0, MetricSum(HttpGet(w.metrics_port, "/metrics"),
                                       "interlock_worker_nonfinite_total"));
  }
  EXPECT_GT(counted, 0);
}

TEST_F(NonFiniteTest, StopEndsTheRunNamingTheBlockOnBothEngines) {
  auto config = ParseRunConfig(kDiverging, "test");
  ASSERT_TRUE(config.ok()) << config.status();
  TrainOptions local;
  local.output.quiet = true;
  auto a = Train(*config, local);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("training.nonfinite_policy is STOP"),
            std::string::npos)
      << a.status();
  auto b = Train(*config, Cluster());
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("training.nonfinite_policy is STOP"),
            std::string::npos)
      << b.status();
  // Block 0's output leaves before its head computes the loss, so block 1
  // may meet the values that made it diverge (its output) first.
  const std::string message(b.status().message());
  EXPECT_TRUE(message.find("block 0: micro-batch") != std::string::npos ||
              message.find("block 1: micro-batch") != std::string::npos)
      << b.status();
  EXPECT_TRUE(message.find("loss is") != std::string::npos ||
              message.find("output is not finite") != std::string::npos)
      << b.status();
}

}  // namespace
}  // namespace interlock
