// Helpers for integration tests with real worker processes on loopback.
#ifndef INTERLOCK_TESTS_CLUSTER_UTIL_H_
#define INTERLOCK_TESTS_CLUSTER_UTIL_H_

#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_util.h"

namespace interlock::testing {

// A two-block ResNet on 3x8x8 synthetic images with 4 classes, 2-way.
inline constexpr char kTwoBlocks[] = R"pb(
  model {
    resnet { architecture: "8,1/16,1" }
    partition: "2,rest"
    head: "gbpl_fc"
  }
  data {
    kind: SYNTHETIC_IMAGES
    synthetic_shape: [ 3, 8, 8 ]
    synthetic_classes: 4
  }
  training { mode: INTERLOCK n: 2 batch_size: 2 }
)pb";

// Four ResNet blocks on synthetic 3x16x16 images, 4 micro-batches, 240
// steps: the elastic and chaos tests' run (replicas up to 4 per block).
inline constexpr char kElasticConfig[] = R"pb(
  name: "elastic"
  model {
    resnet { architecture: "8,1/16,1/16,1" }
    head: "gbpl_fc"
    partition: "2,1,1,rest"
  }
  data {
    kind: SYNTHETIC_IMAGES
    synthetic_shape: [ 3, 16, 16 ]
    synthetic_classes: 4
    synthetic_train: 512
    synthetic_test: 32
  }
  optimizer { kind: SGD momentum: 0.9 }
  schedule { kind: CONSTANT lr: 0.02 }
  training { batch_size: 16 microbatches: 4 steps: 240 seed: 5 }
)pb";

inline std::string MakeTempDir(const std::string& tag) {
  std::string tmpl = "/tmp/interlock-test-" + tag + "-XXXXXX";
  return mkdtemp(tmpl.data());
}

// A unary call by method name with a raw (serialized) request; the reply's
// bytes go to `reply`. Blocks until the call ends.
inline grpc::Status RawUnaryCall(const std::shared_ptr<grpc::Channel>& channel,
                                 const std::string& method,
                                 const std::string& request,
                                 std::string* reply = nullptr) {
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1), response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status result;
  generic.UnaryCall(&ctx, method, grpc::StubOptions(), &request_buffer,
                    &response, [&](grpc::Status s) {
                      std::lock_guard<std::mutex> l(mu);
                      result = s;
                      done = true;
                      cv.notify_all();
                    });
  std::unique_lock<std::mutex> l(mu);
  cv.wait(l, [&] { return done; });
  std::vector<grpc::Slice> slices;
  if (reply && result.ok() && response.Dump(&slices).ok()) {
    for (auto& s : slices) {
      reply->append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  return result;
}

// grpc.health.v1.Health/Check of the whole server, with no token: 1 SERVING,
// 2 NOT_SERVING, -1 when the call failed. The wire format:
// HealthCheckResponse{status = 1}, field 1 as a varint.
inline int HealthStatus(const std::shared_ptr<grpc::Channel>& channel) {
  std::string bytes;
  if (!RawUnaryCall(channel, "/grpc.health.v1.Health/Check", "", &bytes).ok()) {
    return -1;
  }
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : -1;
}

// One interlock-worker process started by a test.
struct WorkerProcess {
  pid_t pid = -1;
  int port = 0;
  int metrics_port = -1;
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

// Forks `args[0] args[1...]` with stdout and stderr in `log`, one intra-op
// thread, dying with the test; returns the child's pid.
inline pid_t SpawnLogged(std::vector<std::string> args,
                         const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    // Die with the test, and keep the test's stdout free: ctest waits for
    // every holder of that pipe.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    freopen(log.c_str(), "w", stderr);
    dup2(fileno(stderr), fileno(stdout));
    setenv("OMP_NUM_THREADS", "1", 1);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// `extra` flags go to the worker after the standard ones.
inline WorkerProcess StartWorker(const std::string& binary,
                                 const std::string& dir, int index,
                                 const std::vector<std::string>& extra = {}) {
  WorkerProcess w;
  const std::string port_file = dir + "/w" + std::to_string(index) + ".port";
  const std::string log = dir + "/w" + std::to_string(index) + ".log";
  std::filesystem::remove(port_file);
  std::vector<std::string> args = {binary, "--host=127.0.0.1", "--port=0",
                                   "--metrics_port=0",
                                   "--port_file=" + port_file};
  args.insert(args.end(), extra.begin(), extra.end());
  w.pid = SpawnLogged(std::move(args), log);
  for (int i = 0; i < 1500; ++i) {
    std::ifstream in(port_file);
    if (in >> w.port >> w.metrics_port) return w;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return w;
}

inline void StopWorker(WorkerProcess& w, int sig = SIGTERM) {
  if (w.pid <= 0) return;
  kill(w.pid, sig);
  int status;
  waitpid(w.pid, &status, 0);
  w.pid = -1;
}

// GET http://127.0.0.1:port/path; returns the body ("" on failure).
inline std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req =
        "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[8192];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
    }
  }
  close(fd);
  const auto body = out.find("\r\n\r\n");
  return body == std::string::npos ? "" : out.substr(body + 4);
}

// Sum of every sample of a metric family in a Prometheus text exposition
// whose labels contain `label_filter` (e.g. "phase=\"forward\"").
inline double MetricSum(const std::string& text, const std::string& name,
                        const std::string& label_filter = "") {
  double sum = 0;
  bool found = false;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line.compare(0, name.size(), name) != 0) continue;
    const char next = line.size() > name.size() ? line[name.size()] : ' ';
    if (next != '{' && next != ' ') continue;
    if (!label_filter.empty() && line.find(label_filter) == std::string::npos) {
      continue;
    }
    sum += std::stod(line.substr(line.rfind(' ') + 1));
    found = true;
  }
  return found ? sum : -1;
}

// A child process (e.g. the CLI) with its output in a log file.
struct Child {
  pid_t pid = -1;
  std::string log;
};

inline Child StartChild(const std::string& binary,
                        const std::vector<std::string>& args,
                        const std::string& log) {
  std::vector<std::string> all = {binary};
  all.insert(all.end(), args.begin(), args.end());
  return Child{SpawnLogged(std::move(all), log), log};
}

inline int LinesIn(const std::string& path) {
  std::ifstream in(path);
  int n = 0;
  std::string line;
  while (std::getline(in, line)) ++n;
  return n;
}

// Waits (up to `seconds`) until `done` holds.
template <typename F>
bool WaitFor(F done, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(int(seconds * 1000));
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// The port a coordinator started with --metrics-port 0 logged for its
// /metrics ("coordinator metrics on HOST:PORT/metrics"), waiting up to
// `seconds` for the line; 0 if it did not come.
inline int LoggedMetricsPort(const std::string& log, double seconds) {
  const std::string serving = "coordinator metrics on ";
  int port = 0;
  WaitFor(
      [&] {
        const std::string text = ReadFile(log);
        const size_t at = text.find(serving);
        if (at == std::string::npos) return false;
        const size_t colon = text.find(':', at + serving.size());
        const size_t slash = text.find('/', colon);
        if (colon == std::string::npos || slash == std::string::npos) {
          return false;
        }
        port = std::atoi(text.substr(colon + 1, slash - colon - 1).c_str());
        return port > 0;
      },
      seconds);
  return port;
}

// Waits up to `seconds` for the child; returns its exit code or -1.
inline int WaitExit(pid_t pid, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(int(seconds * 1000));
  while (std::chrono::steady_clock::now() < deadline) {
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

}  // namespace interlock::testing

#endif  // INTERLOCK_TESTS_CLUSTER_UTIL_H_
