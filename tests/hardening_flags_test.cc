// A careless operator starting interlock-worker: bad flags, an occupied
// port, an unauthenticated metrics port (docs/RELIABILITY.md, "Attacks and
// mistakes").
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "tests/cluster_util.h"
#include "tests/worker_test_util.h"

namespace interlock::worker_test {
namespace {

using interlock::testing::HealthStatus;
using interlock::testing::HttpGet;
using interlock::testing::MetricSum;

class HardeningFlags : public WorkerFixture {
 protected:
  // The worker with `flags` only (no standard flags), which must not start.
  ExitResult Refused(const std::vector<std::string>& flags) {
    return RunToExit(kWorker, flags,
                     dir_ + "/refused" + std::to_string(runs_++) + ".log");
  }
  // A clean refusal: exited by itself, non-zero, no signal (no core dump).
  static void ExpectCleanRefusal(const ExitResult& r,
                                 const std::vector<std::string>& wanted) {
    EXPECT_FALSE(r.timed_out) << "still running: it started\n" << r.output;
    EXPECT_TRUE(r.exited) << "signal " << r.signal << "\n" << r.output;
    EXPECT_NE(r.code, 0) << r.output;
    for (const auto& w : wanted) {
      EXPECT_NE(r.output.find(w), std::string::npos) << "no '" << w << "' in:\n"
                                                     << r.output;
    }
  }
  int runs_ = 0;
};

// gRPC's default SO_REUSEPORT let a second worker (without a token) bind the
// port of a token worker and take a share of its connections.
TEST_F(HardeningFlags, SecondWorkerOnOccupiedPortRefusedFirstServesAll) {
  WriteFile(dir_ + "/token", "first-worker-secret\n");
  WorkerProcess first = Start({"--token_file=" + dir_ + "/token"});
  ASSERT_GT(first.port, 0);
  const std::string port = std::to_string(first.port);

  const ExitResult second =
      Refused({"--host=127.0.0.1", "--port=" + port, "--metrics_port=-1"});
  ExpectCleanRefusal(second, {"127.0.0.1:" + port});
  // One line of ours, not gRPC's error blob before it (--verbosity 1 shows
  // gRPC's own lines).
  EXPECT_EQ(second.output.find("chttp2"), std::string::npos) << second.output;
  EXPECT_EQ(std::count(second.output.begin(), second.output.end(), '\n'), 1)
      << second.output;

  // Every new connection reaches the first worker: it demands the token.
  int unauthenticated = 0;
  for (int i = 0; i < 20; ++i) {
    auto stub = v1::Worker::NewStub(FreshPlaintext(first.address()));
    const grpc::Status st = Configure(stub.get(), "occupied");
    if (st.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      ++unauthenticated;
    } else {
      ADD_FAILURE() << "connection " << i
                    << " answered by another server: " << st.error_code() << " "
                    << st.error_message();
    }
  }
  EXPECT_EQ(unauthenticated, 20);
  auto stub = v1::Worker::NewStub(Plaintext(first));
  EXPECT_TRUE(
      Configure(stub.get(), "occupied", "Bearer first-worker-secret").ok());
}

TEST_F(HardeningFlags, OccupiedMetricsPortRefused) {
  WorkerProcess first = Start({});
  ASSERT_GT(first.metrics_port, 0);
  const std::string mport = std::to_string(first.metrics_port);
  ExpectCleanRefusal(
      Refused({"--host=127.0.0.1", "--port=0", "--metrics_port=" + mport}),
      {"127.0.0.1:" + mport});
  EXPECT_NE(HttpGet(first.metrics_port, "/metrics")
                .find("interlock_worker_unauthenticated_requests_total"),
            std::string::npos);
  EXPECT_EQ(HealthStatus(Plaintext(first)), 2);  // serving, not configured
}

TEST_F(HardeningFlags, BadFlagsExitCleanlyNamingTheFlag) {
  struct Case {
    std::vector<std::string> flags;
    std::vector<std::string> wanted;  // in the message
  };
  const std::vector<Case> cases = {
      {{"--port=-5"}, {"--port", "-5"}},
      {{"--port=99999"}, {"--port", "99999"}},
      {{"--metrics_port=70000"}, {"--metrics_port", "70000"}},
      {{"--metrics_port=-2"}, {"--metrics_port", "-2"}},
      {{"--host=999.1.1.1"}, {"--host", "999.1.1.1"}},
      {{"--host=no-such-host.invalid"}, {"--host", "no-such-host.invalid"}},
      {{"--metrics_host=999.1.1.1"}, {"--metrics_host", "999.1.1.1"}},
      {{"--metrics_token_file=" + dir_ + "/missing"},
       {"--metrics_token_file", dir_ + "/missing"}},
      {{"--metrics_token_file=" + dir_ + "/blank"},
       {"--metrics_token_file", dir_ + "/blank", "white space"}},
  };
  WriteFile(dir_ + "/blank", " \n\t\n");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags[0]);
    // The case's flag comes last: a flag given twice takes its last value.
    std::vector<std::string> flags = {"--host=127.0.0.1", "--port=0",
                                      "--metrics_port=0"};
    flags.insert(flags.end(), c.flags.begin(), c.flags.end());
    ExpectCleanRefusal(Refused(flags), c.wanted);
  }
}

// --device is checked before anything listens: a name that is no device,
// or CUDA with this CPU-only LibTorch, exits 2 naming the flag.
TEST_F(HardeningFlags, BadDeviceExitsTwoNamingTheFlag) {
  std::vector<std::pair<std::string, std::string>> cases = {
      {"gpu", "--device: 'gpu' is not cpu, cuda or cuda:N"},
      {"cuda:x", "--device: 'cuda:x' is not cpu, cuda or cuda:N"},
      {"", "--device: '' is not cpu, cuda or cuda:N"},
  };
  if (!torch::cuda::is_available()) {
    cases.push_back({"cuda", "--device: 'cuda:0' needs CUDA"});
    cases.push_back({"cuda:1", "--device: 'cuda:1' needs CUDA"});
  }
  for (const auto& [device, wanted] : cases) {
    SCOPED_TRACE(device);
    const ExitResult r = Refused({"--host=127.0.0.1", "--port=0",
                                  "--metrics_port=0", "--device=" + device});
    ExpectCleanRefusal(r, {wanted});
    EXPECT_EQ(r.code, 2) << r.output;
  }
}

// gRPC only noticed the mismatch in BuildAndStart, and the worker then
// dereferenced its null server while cleaning up (SIGSEGV).
TEST_F(HardeningFlags, MismatchedTlsKeyRefused) {
  MakeCertificates(dir_, "a");
  MakeCertificates(dir_, "b");
  const std::string a = dir_ + "/a", b = dir_ + "/b";
  ExpectCleanRefusal(
      Refused({"--host=127.0.0.1", "--port=0", "--metrics_port=0",
               "--tls_cert=" + a + ".pem", "--tls_key=" + b + ".key"}),
      {"--tls-key", b + ".key", a + ".pem"});
  // A CA file that says CERTIFICATE but holds none.
  WriteFile(dir_ + "/bad-ca.pem",
            "-----BEGIN CERTIFICATE-----\nZ2FyYmFnZQ==\n"
            "-----END CERTIFICATE-----\n");
  ExpectCleanRefusal(
      Refused({"--host=127.0.0.1", "--port=0", "--metrics_port=0",
               "--tls_cert=" + a + ".pem", "--tls_key=" + a + ".key",
               "--tls_ca=" + dir_ + "/bad-ca.pem"}),
      {"--tls-ca", "bad-ca.pem"});
  // The probe loads the same files.
  const ExitResult probe =
      Refused({"--health_check=127.0.0.1:1", "--tls_cert=" + a + ".pem",
               "--tls_key=" + b + ".key", "--tls_ca=" + a + "-ca.pem"});
  ExpectCleanRefusal(probe, {"--tls-key"});
  EXPECT_EQ(probe.code, 2);
  // The matching pair still serves TLS.
  WorkerProcess w =
      Start({"--tls_cert=" + a + ".pem", "--tls_key=" + a + ".key"});
  EXPECT_GT(w.port, 0);
}

TEST_F(HardeningFlags, HealthCheckBadTargetsExitTwo) {
  struct Case {
    std::string target;
    std::string wanted;
  };
  const std::vector<Case> cases = {
      {"127.0.0.1:99999", "--health_check"},
      {"127.0.0.1:-5", "--health_check"},
      {"999.1.1.1:5", "999.1.1.1"},
      {"no-such-host.invalid:7070", "no-such-host.invalid"},
      {"not a target", "not a target"},
      {"unix:" + dir_ + "/no-socket", "no-socket"},
      {"127.0.0.1:1", "127.0.0.1:1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.target);
    const ExitResult r = Refused({"--health_check=" + c.target});
    ExpectCleanRefusal(r, {c.wanted});
    EXPECT_EQ(r.code, 2) << r.output;
  }
}

TEST_F(HardeningFlags, MetricsTokenRequired) {
  WriteFile(dir_ + "/metrics-token", "  scrape-secret \n");
  WorkerProcess w = Start({"--metrics_token_file=" + dir_ + "/metrics-token"});
  ASSERT_GT(w.metrics_port, 0);
  const std::string ip = "127.0.0.1";
  EXPECT_EQ(HttpGetFrom(ip, w.metrics_port, "/metrics").status, 401);
  EXPECT_EQ(HttpGetFrom(ip, w.metrics_port, "/metrics",
                        "Authorization: Bearer scrape-wrong\r\n")
                .status,
            401);
  EXPECT_EQ(HttpGetFrom(ip, w.metrics_port, "/metrics",
                        "Authorization: Bearer scrape-secret-and-more\r\n")
                .status,
            401);
  EXPECT_EQ(HttpGetFrom(ip, w.metrics_port, "/metrics",
                        "Authorization: Basic scrape-secret\r\n")
                .status,
            401);
  const HttpResponse refused = HttpGetFrom(ip, w.metrics_port, "/metrics");
  EXPECT_EQ(refused.body.find("interlock_worker"), std::string::npos);

  // What Prometheus sends (header names are case-insensitive).
  const HttpResponse ok =
      HttpGetFrom(ip, w.metrics_port, "/metrics",
                  "authorization: Bearer scrape-secret\r\n");
  EXPECT_EQ(ok.status, 200);
  EXPECT_NE(ok.body.find("interlock_worker_unauthenticated_requests_total"),
            std::string::npos);
  EXPECT_EQ(MetricSum(ok.body, "interlock_metrics_refused_scrapes_total"), 5);
  // The gRPC side is untouched: health needs no token.
  EXPECT_EQ(HealthStatus(Plaintext(w)), 2);

  // Without the flag, /metrics stays open (the dashboards' Prometheus).
  WorkerProcess plain = Start({});
  const HttpResponse open = HttpGetFrom(ip, plain.metrics_port, "/metrics");
  EXPECT_EQ(open.status, 200);
  EXPECT_EQ(MetricSum(open.body, "interlock_metrics_refused_scrapes_total"),
            -1);
}

TEST_F(HardeningFlags, MetricsHostBindsThere) {
  // gRPC on every interface, /metrics on loopback 127.0.0.1 only; 127.0.0.2
  // is another loopback address that reaches only the wildcard listener.
  // (Without a token, gRPC beyond loopback needs --insecure.)
  WorkerProcess w =
      Start({"--host=0.0.0.0", "--metrics_host=127.0.0.1", "--insecure"});
  ASSERT_GT(w.port, 0);
  EXPECT_EQ(HttpGetFrom("127.0.0.1", w.metrics_port, "/metrics").status, 200);
  EXPECT_EQ(HttpGetFrom("127.0.0.2", w.metrics_port, "/metrics").status, -1);
  EXPECT_EQ(HealthStatus(Plaintext(w)), 2);
  EXPECT_EQ(
      HealthStatus(grpc::CreateChannel("127.0.0.2:" + std::to_string(w.port),
                                       grpc::InsecureChannelCredentials())),
      2);

  // And the other way round: /metrics on 127.0.0.2 only.
  WorkerProcess v = Start({"--metrics_host=127.0.0.2"});
  ASSERT_GT(v.metrics_port, 0);
  EXPECT_EQ(HttpGetFrom("127.0.0.2", v.metrics_port, "/metrics").status, 200);
  EXPECT_EQ(HttpGetFrom("127.0.0.1", v.metrics_port, "/metrics").status, -1);
}

}  // namespace
}  // namespace interlock::worker_test
