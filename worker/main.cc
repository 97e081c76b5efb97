// interlock-worker: hosts one block of a model (chosen by the coordinator at
// Configure time) behind a gRPC service.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "services/runtime.h"
#include "worker/server.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on");
ABSL_FLAG(int, port, 7070, "gRPC port (0: any free port)");
ABSL_FLAG(int, metrics_port, 9090,
          "Prometheus /metrics port (0: any free port, -1: off)");
ABSL_FLAG(std::string, port_file, "",
          "write 'GRPC_PORT METRICS_PORT' here once listening (local "
          "launchers use it with --port 0)");
ABSL_FLAG(int64_t, max_message_bytes, 256 << 20,
          "largest message accepted on any RPC");

int main(int argc, char** argv) {
  interlock::TuneAllocator();
  absl::SetProgramUsageMessage(
      "interlock-worker [--host H] [--port P] [--metrics_port M] "
      "[--port_file F] [--max_message_bytes B]");
  absl::ParseCommandLine(argc, argv);
  // Signals are taken synchronously by this thread only; block them before
  // any other thread starts so none of those receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  interlock::WorkerServerOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (options.max_message_bytes < (1 << 20)) {
    std::cerr << "interlock-worker: error: --max_message_bytes must be at "
                 "least 1 MiB\n";
    return 2;
  }
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
  std::cerr << "interlock-worker: serving on " << options.host << ":"
            << (*server)->port() << ", metrics on port "
            << (*server)->metrics_port() << "\n";
  int sig = 0;
  sigwait(&signals, &sig);
  std::cerr << "interlock-worker: signal " << sig << ", shutting down\n";
  (*server)->Shutdown();
  server->reset();
  return 0;
}
