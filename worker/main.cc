// interlock-worker: hosts one block of a model (chosen by the coordinator at
// Configure time) behind a gRPC service.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "rpc/channel.h"
#include "rpc/coordinator_client.h"
#include "rpc/grpc_logging.h"
#include "rpc/security.h"
#include "services/config.h"
#include "services/device.h"
#include "services/logging.h"
#include "services/runtime.h"
#include "worker/server.h"

ABSL_FLAG(int, verbosity, 0,
          "log detail: 0 what an operator needs (INFO and above), 1 every "
          "Configure and every stream opened or ended");
ABSL_FLAG(std::string, host, "127.0.0.1",
          "address to listen on: an IP address of this machine or a name "
          "that resolves to one (0.0.0.0: every IPv4 interface); beyond "
          "loopback it needs --token_file or mutual TLS, or --insecure");
ABSL_FLAG(int, port, 7070,
          "gRPC port, 0..65535 (0: any free port); a port in use is an error");
ABSL_FLAG(int, metrics_port, 9090,
          "Prometheus /metrics port, -1..65535 (0: any free port, -1: off)");
ABSL_FLAG(std::string, metrics_host, "",
          "address of /metrics, e.g. 127.0.0.1 or a pod-internal interface "
          "(empty: the same as --host); beyond loopback it needs "
          "--metrics_token_file, --token_file or mutual TLS, or --insecure");
ABSL_FLAG(std::string, metrics_token_file, "",
          "file holding a bearer token /metrics requires (Authorization: "
          "Bearer <token>; 401 without it); empty: no authentication");
ABSL_FLAG(std::string, port_file, "",
          "write 'GRPC_PORT METRICS_PORT' here once listening (local "
          "launchers use it with --port 0)");
ABSL_FLAG(int64_t, max_message_bytes, 256 << 20,
          "largest message accepted on any RPC (compressed messages count "
          "inflated)");
ABSL_FLAG(int64_t, max_model_bytes, int64_t{1} << 30,
          "a scripted model's files this worker keeps, in all (sent by the "
          "coordinator in chunks before Configure)");
ABSL_FLAG(int, max_concurrent_streams, 8,
          "Stream calls open at once; more are refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(std::string, token_file, "",
          "file holding the shared bearer token every Worker call must carry "
          "(the health service needs none)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve TLS, and present it to the next block");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA: require client certificates signed by it (mutual TLS) and "
          "verify the next block against it");
ABSL_FLAG(bool, insecure, false,
          "allow --host or --metrics_host beyond loopback without a token or "
          "mutual TLS: anyone who reaches the port can drive the worker (or "
          "read /metrics); only on a network you trust");
ABSL_FLAG(std::string, device, "cpu",
          "where the block runs: cpu, cuda (= cuda:0) or cuda:N; CUDA needs "
          "a LibTorch built with it and that GPU visible");
ABSL_FLAG(std::string, coordinator, "",
          "HOST:PORT of a running coordinator's membership service: join "
          "the replicas of --block there (Register) and leave on SIGTERM");
ABSL_FLAG(int, block, -1, "With --coordinator: the block to host");
ABSL_FLAG(std::string, advertise, "",
          "With --coordinator: HOST:PORT the coordinator and the upstream "
          "block reach this worker at (default: --host, or this machine's "
          "host name when --host is 0.0.0.0 or ::, and the port served)");
ABSL_FLAG(std::string, run_config, "",
          "With --coordinator: the run config this worker is meant for; a "
          "run of another model refuses it");
ABSL_FLAG(int, drain_timeout, 120,
          "Seconds a registered worker waits, on SIGTERM, for the "
          "coordinator to take it out at a step boundary before it exits");
ABSL_FLAG(std::string, collective_host, "",
          "address of this machine the reduction with the other replicas of "
          "its block listens on, e.g. the pod IP (empty: the host name)");
ABSL_FLAG(std::string, health_check, "",
          "ask the gRPC health service at this address (host:port) and exit: "
          "0 SERVING, 1 NOT_SERVING, 2 unreachable or error");
ABSL_FLAG(std::string, health_service, "",
          "service name for --health_check (empty: the whole server; "
          "'liveness' answers SERVING whenever the process serves)");

namespace {

absl::Status CheckPort(const char* flag, int port, int lowest) {
  if (port < lowest || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, ": ", port, " is not a port (", lowest, "..65535)"));
  }
  return absl::OkStatus();
}

// An IP literal (IPv6 with or without brackets) or a name that resolves.
absl::Status CheckHost(const char* flag, const std::string& host) {
  if (host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, ": empty (0.0.0.0 listens on every IPv4 interface)"));
  }
  std::string bare = host;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  in_addr v4;
  in6_addr v6;
  if (inet_pton(AF_INET, bare.c_str(), &v4) == 1 ||
      inet_pton(AF_INET6, bare.c_str(), &v6) == 1) {
    return absl::OkStatus();
  }
  // Digits and dots but no IPv4 address (999.1.1.1, 10.1): a typo, not a
  // name; the resolver would accept some of them in legacy forms.
  if (host.find_first_not_of("0123456789.") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": '", host, "' is not an IPv4 address"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (res != nullptr) freeaddrinfo(res);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": '", host,
                     "' is neither an IP address nor a name that resolves (",
                     gai_strerror(rc), ")"));
  }
  return absl::OkStatus();
}

// A health-check target of the form host:port or [v6]:port must have a port
// gRPC will not wrap (99999 would probe 34463, maybe another process).
// Targets with a scheme (dns:///, unix:) are left to gRPC.
absl::Status CheckTargetPort(const std::string& flag,
                             const std::string& target) {
  const size_t colon = target.rfind(':');
  if (colon == std::string::npos) return absl::OkStatus();
  const bool bracketed = colon > 0 && target[colon - 1] == ']';
  if (!bracketed && target.find(':') != colon) return absl::OkStatus();
  const std::string port = target.substr(colon + 1);
  int value = 0;
  if (port.empty() ||
      port.find_first_not_of("-0123456789") != std::string::npos) {
    return absl::OkStatus();
  }
  if (!absl::SimpleAtoi(port, &value) || value < 1 || value > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, ": '", target, "': port ", port, " is not in 1..65535"));
  }
  return absl::OkStatus();
}

// Prints the server's serving status; 0 when SERVING.
int HealthCheck(const std::string& target, const std::string& service,
                const interlock::TransportSecurity& security) {
  // With this worker's certificates, so a probe can check a worker that
  // requires mutual TLS.
  absl::StatusOr<int> code =
      interlock::CheckHealth(interlock::MakeChannel(target, 4 << 20, security),
                             service, absl::Now() + absl::Seconds(5));
  if (!code.ok()) {
    std::cerr << "interlock-worker: health check of " << target
              << " failed: " << code.status().message() << "\n";
    return 2;
  }
  static const char* kNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING",
                                 "SERVICE_UNKNOWN"};
  std::cout << (*code >= 0 && *code < 4 ? kNames[*code] : "UNKNOWN") << "\n";
  return *code == 1 ? 0 : 1;
}

// Whether this process hosts a configured block (WorkerServerOptions::
// on_configured).
std::atomic<bool> g_configured{false};
bool configured() { return g_configured.load(); }

// --coordinator: registers this worker (serving on `port`) for --block.
// Returns the address it registered and the client-side security its Leave
// uses.
absl::StatusOr<std::pair<std::string, interlock::TransportSecurity>> Join(
    const std::string& coordinator, const interlock::SecurityFiles& files,
    int port, const std::string& host) {
  if (auto st = CheckTargetPort("coordinator", coordinator); !st.ok())
    return st;
  const int block = absl::GetFlag(FLAGS_block);
  if (block < 0) {
    return absl::InvalidArgumentError(
        "--coordinator needs --block (the block to host, from 0)");
  }
  std::string address = absl::GetFlag(FLAGS_advertise);
  if (address.empty()) {
    std::string h = host;
    if (h == "0.0.0.0" || h == "::" || h == "[::]") {
      char name[256] = {0};
      if (gethostname(name, sizeof(name) - 1) != 0) {
        return absl::InternalError("--advertise: no host name; give one");
      }
      h = name;
    }
    address = interlock::GrpcAddress(h, port);
  } else if (auto st = CheckTargetPort("advertise", address); !st.ok()) {
    return st;
  }
  interlock::v1::RegisterRequest req;
  req.set_block(block);
  req.set_address(address);
  if (const std::string path = absl::GetFlag(FLAGS_run_config); !path.empty()) {
    auto config = interlock::LoadRunConfig(path);
    if (!config.ok()) return config.status();
    req.set_config_sha256(interlock::ModelFingerprint(*config));
  }
  auto security = interlock::LoadTransportSecurity(files, /*server=*/false);
  if (!security.ok()) return security.status();
  const absl::Time deadline = absl::Now() + absl::Minutes(5);
  auto r =
      interlock::RegisterWithCoordinator(coordinator, *security, req, deadline);
  // This address still listed (a process that had it died and the run has
  // not dropped it yet, or a registration of it is pending): the run
  // either drops the old one, and this one is taken, or configures this
  // one at that address. Asked again until one of them happens.
  while (absl::IsAlreadyExists(r.status()) && absl::Now() < deadline) {
    if (configured()) {
      LOG(INFO) << address << " is in the run already (configured)";
      return std::make_pair(address, *std::move(security));
    }
    LOG(INFO) << "register: " << r.status().message()
              << "; asking again in 2 s";
    absl::SleepFor(absl::Seconds(2));
    if (configured()) continue;
    r = interlock::RegisterWithCoordinator(coordinator, *security, req,
                                           deadline);
  }
  if (!r.ok()) {
    return absl::Status(r.status().code(),
                        absl::StrCat("register with ", coordinator, ": ",
                                     r.status().message()));
  }
  // A membership service without authentication does not tell the run.
  LOG(INFO) << "registered as " << address << " for block " << block
            << (r->run_id().empty()
                    ? std::string()
                    : absl::StrCat(" of run ", r->run_id(), " (generation ",
                                   r->generation(), ")"));
  return std::make_pair(address, *std::move(security));
}

}  // namespace

int main(int argc, char** argv) {
  interlock::TuneAllocator();
  // --help lists the flags of this binary's main.cc (absl's default looks
  // for a file named after the program and found none).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "interlock-worker [--host H] [--port P] [--metrics_port M] "
      "[--metrics_host H] [--metrics_token_file F] [--port_file F] "
      "[--max_message_bytes B] [--max_model_bytes B] "
      "[--max_concurrent_streams N] "
      "[--token_file F] [--tls_cert F --tls_key F] [--tls_ca F] "
      "[--insecure] [--device cpu|cuda[:N]] [--collective_host H]\n"
      "interlock-worker --health_check HOST:PORT [--health_service S] "
      "[--tls_cert F --tls_key F] [--tls_ca F]");
  std::vector<std::string> storage(argv, argv + argc);
  std::vector<char*> args = interlock::UnderscoreFlagNames(storage);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  interlock::InitLogging("interlock-worker", absl::GetFlag(FLAGS_verbosity));
  interlock::RouteGrpcLogs();
  interlock::SecurityFiles files;
  files.token_file = absl::GetFlag(FLAGS_token_file);
  files.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  files.tls_key = absl::GetFlag(FLAGS_tls_key);
  files.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  if (!absl::GetFlag(FLAGS_health_check).empty()) {
    if (auto st =
            CheckTargetPort("health_check", absl::GetFlag(FLAGS_health_check));
        !st.ok()) {
      std::cerr << "interlock-worker: error: " << st.message() << "\n";
      return 2;
    }
    auto security = interlock::LoadTransportSecurity(files, /*server=*/false);
    if (!security.ok()) {
      std::cerr << "interlock-worker: error: " << security.status().message()
                << "\n";
      return 2;
    }
    return HealthCheck(absl::GetFlag(FLAGS_health_check),
                       absl::GetFlag(FLAGS_health_service), *security);
  }
  // Signals are taken synchronously by this thread only; block them before
  // any other thread starts so none of those receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  // Raised by this process when the coordinator dropped its block (below).
  sigaddset(&signals, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  interlock::WorkerServerOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  options.collective_host = absl::GetFlag(FLAGS_collective_host);
  for (const absl::Status& st :
       {CheckPort("port", options.port, 0),
        CheckPort("metrics_port", options.metrics_port, -1),
        CheckHost("host", options.host),
        options.metrics_host.empty()
            ? absl::OkStatus()
            : CheckHost("metrics_host", options.metrics_host),
        absl::GetFlag(FLAGS_collective_host).empty()
            ? absl::OkStatus()
            : CheckHost("collective_host",
                        absl::GetFlag(FLAGS_collective_host))}) {
    if (!st.ok()) {
      std::cerr << "interlock-worker: error: " << st.message() << "\n";
      return 2;
    }
  }
  // Secure by default: nothing beyond loopback without a token or mutual TLS
  // (or --insecure). /metrics is read-only: its own token, or a worker whose
  // gRPC port is protected (Prometheus scrapes pods at their address), will
  // do.
  const bool insecure = absl::GetFlag(FLAGS_insecure);
  const bool authenticated = interlock::AuthenticatesCallers(files);
  for (const absl::Status& st :
       {interlock::CheckListener(
            "host", options.host, authenticated, insecure,
            "this worker has no --token_file or mutual TLS: anyone who "
            "reaches it could configure and drive it",
            "give it --token_file (or --tls_cert, --tls_key and --tls_ca)"),
        options.metrics_port < 0 || options.metrics_host.empty()
            ? absl::OkStatus()
            : interlock::CheckListener(
                  "metrics_host", options.metrics_host,
                  authenticated ||
                      !absl::GetFlag(FLAGS_metrics_token_file).empty(),
                  insecure,
                  "/metrics would be open to anyone (no "
                  "--metrics_token_file, --token_file or mutual TLS)",
                  "give it --metrics_token_file")}) {
    if (!st.ok()) {
      std::cerr << "interlock-worker: error: " << st.message() << "\n";
      return 2;
    }
  }
  if (const std::string path = absl::GetFlag(FLAGS_metrics_token_file);
      !path.empty()) {
    // Prometheus's credentials_file is read the same way: trimmed.
    auto token = interlock::LoadBearerToken("metrics_token_file", path);
    if (!token.ok()) {
      std::cerr << "interlock-worker: error: " << token.status().message()
                << "\n";
      return 2;
    }
    options.metrics_token = *std::move(token);
  }
  auto device = interlock::ParseDevice("--device", absl::GetFlag(FLAGS_device));
  if (!device.ok()) {
    std::cerr << "interlock-worker: error: " << device.status().message()
              << "\n";
    return 2;
  }
  options.device = *device;
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (options.max_message_bytes < (1 << 20)) {
    std::cerr << "interlock-worker: error: --max_message_bytes must be at "
                 "least 1 MiB\n";
    return 2;
  }
  options.max_model_bytes = absl::GetFlag(FLAGS_max_model_bytes);
  if (options.max_model_bytes < 0) {
    std::cerr << "interlock-worker: error: --max_model_bytes must be >= 0\n";
    return 2;
  }
  options.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  if (options.max_concurrent_streams < 1) {
    std::cerr << "interlock-worker: error: --max_concurrent_streams must be "
                 "at least 1\n";
    return 2;
  }
  auto security = interlock::LoadTransportSecurity(files, /*server=*/true);
  if (!security.ok()) {
    std::cerr << "interlock-worker: error: " << security.status().message()
              << "\n";
    return 2;
  }
  options.security = *std::move(security);
  // A replica the run left out (it stopped answering and came back) is
  // told so by the coordinator; this thread then registers it again or
  // exits, never leaving an idle process behind.
  static std::mutex dropped_mu;
  static std::string dropped_from;
  options.on_released = [](const std::string& run_id, int64_t generation) {
    {
      std::lock_guard<std::mutex> l(dropped_mu);
      dropped_from = absl::StrCat(run_id, " (generation ", generation, ")");
    }
    kill(getpid(), SIGUSR1);
  };
  options.on_configured = [](bool on) { g_configured.store(on); };
  auto server = interlock::WorkerServer::Start(options);
  if (!server.ok()) {
    std::cerr << "interlock-worker: error: " << server.status().message()
              << "\n";
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    {
      std::ofstream out(tmp);
      out << (*server)->port() << " " << (*server)->metrics_port() << "\n";
    }
    std::rename(tmp.c_str(), port_file.c_str());
  }
  LOG(INFO) << "serving on " << options.host << ":" << (*server)->port() << " ("
            << (options.security.cert_pem.empty() ? "plaintext"
                : options.security.ca_pem.empty() ? "TLS"
                                                  : "mutual TLS")
            << (options.security.token.empty() ? ", no token" : ", token")
            << (insecure ? ", --insecure" : "") << "), metrics "
            << ((*server)->metrics_port() < 0
                    ? std::string("off")
                    : absl::StrCat(
                          "on ",
                          options.metrics_host.empty() ? options.host
                                                       : options.metrics_host,
                          ":", (*server)->metrics_port(),
                          options.metrics_token.empty() ? "" : " (token)"))
            << ", blocks on " << options.device.str();
  // Elastic membership: join a running run's block, leave on SIGTERM.
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  std::string advertised;
  interlock::TransportSecurity client_security;
  if (!coordinator.empty()) {
    auto joined = Join(coordinator, files, (*server)->port(), options.host);
    if (!joined.ok()) {
      std::cerr << "interlock-worker: error: " << joined.status().message()
                << "\n";
      (*server)->Shutdown();
      return 1;
    }
    std::tie(advertised, client_security) = *std::move(joined);
  }
  int sig = 0;
  for (;;) {
    sigwait(&signals, &sig);
    if (sig != SIGUSR1) break;
    std::string from;
    {
      std::lock_guard<std::mutex> l(dropped_mu);
      from = dropped_from;
    }
    if (coordinator.empty()) {
      LOG(ERROR) << "dropped from run " << from
                 << "; no --coordinator to register with again: exiting";
      (*server)->Shutdown();
      return 1;
    }
    LOG(WARNING) << "dropped from run " << from
                 << "; registering again as a new replica";
    auto joined = Join(coordinator, files, (*server)->port(), options.host);
    if (!joined.ok()) {
      LOG(ERROR) << joined.status().message() << ": exiting";
      (*server)->Shutdown();
      return 1;
    }
  }
  LOG(INFO) << "signal " << sig << ", shutting down";
  if (!advertised.empty()) {
    // Scale-down: finish what this replica holds and leave at a step
    // boundary before the server goes.
    auto left = interlock::LeaveCoordinator(
        coordinator, client_security, advertised,
        absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_drain_timeout)));
    if (left.ok()) {
      LOG(INFO) << "left the run (generation " << *left << ")";
    } else {
      LOG(WARNING) << "leave: " << left.status().message();
    }
  }
  (*server)->Shutdown();
  server->reset();
  return 0;
}
