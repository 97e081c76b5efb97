// Helpers for tests that drive one real interlock-worker process over gRPC:
// requests for a one-block run, the Worker calls with an optional bearer
// token, certificates, and a fixture that starts and stops workers.
#ifndef INTERLOCK_TESTS_WORKER_TEST_UTIL_H_
#define INTERLOCK_TESTS_WORKER_TEST_UTIL_H_

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "proto/worker.grpc.pb.h"
#include "services/config.h"
#include "services/wire.h"
#include "tests/cluster_util.h"
#include "tests/test_util.h"

namespace interlock::worker_test {

namespace v1 = interlock::v1;
using interlock::testing::MakeTempDir;
using interlock::testing::ReadFile;
using interlock::testing::RunCommand;
using interlock::testing::StartWorker;
using interlock::testing::StopWorker;
using interlock::testing::WorkerProcess;

inline const std::string kWorker = INTERLOCK_WORKER;
inline const std::string kCli = INTERLOCK_CLI;
inline const std::string kSrc = INTERLOCK_SOURCE_DIR;

inline void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::trunc) << text;
}

// A CA and a certificate it signs for 127.0.0.1 (server and client use),
// made with the openssl CLI: DIR/NAME-ca.pem, DIR/NAME.pem, DIR/NAME.key.
inline void MakeCertificates(const std::string& dir, const std::string& name) {
  const std::string p = dir + "/" + name;
  WriteFile(p + ".ext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
            "basicConstraints=CA:FALSE\n");
  const std::string ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 ";
  const std::string script =
      "set -e; openssl req -x509 -nodes" + ec + "-keyout " + p +
      "-ca.key -out " + p + "-ca.pem -days 2 -subj /CN=" + name +
      "-ca; openssl req -nodes" + ec + "-keyout " + p + ".key -out " + p +
      ".csr -subj /CN=" + name + "; openssl x509 -req -in " + p + ".csr -CA " +
      p + "-ca.pem -CAkey " + p + "-ca.key -CAcreateserial -out " + p +
      ".pem -days 2 -extfile " + p + ".ext";
  auto r = RunCommand("bash -c '" + script + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

inline constexpr char kOneBlock[] = R"pb(
  model {
    resnet { architecture: "8,1" }
    partition: "rest"
  }
  data {
    kind: SYNTHETIC_IMAGES
    synthetic_shape: [ 3, 8, 8 ]
    synthetic_classes: 4
  }
  training { mode: INTERLOCK n: 1 batch_size: 2 microbatches: 1 }
)pb";

inline v1::ConfigureRequest OneBlockRequest(const std::string& run_id) {
  v1::ConfigureRequest req;
  req.set_run_id(run_id);
  req.set_generation(1);
  auto config = ParseRunConfig(kOneBlock, "test");
  EXPECT_TRUE(config.ok()) << config.status();
  *req.mutable_config() = *config;
  req.set_block(0);
  req.set_num_blocks(1);
  auto* s = req.mutable_shape();
  s->set_channels(3);
  s->set_height(8);
  s->set_width(8);
  s->set_classes(4);
  req.set_max_message_bytes(1 << 20);
  return req;
}

inline v1::DownMessage Forward(const std::string& run_id, int64_t step) {
  v1::DownMessage m;
  m.mutable_header()->set_run_id(run_id);
  m.mutable_header()->set_generation(1);
  auto* f = m.mutable_forward();
  f->set_step(step);
  f->set_microbatches(1);
  f->set_learning_rate(0.1);
  EncodeTensor(torch::rand({2, 3, 8, 8}), f->mutable_input());
  EncodeTensor(torch::tensor({1, 3}, torch::kInt64), f->mutable_target());
  return m;
}

inline void Deadline(grpc::ClientContext* ctx, int seconds = 20) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::seconds(seconds));
}

inline grpc::Status Configure(v1::Worker::Stub* stub, const std::string& run_id,
                              const std::string& authorization = "") {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
  v1::ConfigureResponse resp;
  return stub->Configure(&ctx, OneBlockRequest(run_id), &resp);
}

inline grpc::Status GetState(v1::Worker::Stub* stub,
                             const std::string& authorization = "") {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
  v1::GetStateResponse resp;
  return stub->GetState(&ctx, v1::GetStateRequest(), &resp);
}

// SaveState of run `run_id` generation 1; the chunks it sent go to `chunks`.
inline grpc::Status SaveState(v1::Worker::Stub* stub, const std::string& run_id,
                              const std::string& authorization,
                              std::vector<v1::StateChunk>* chunks) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
  v1::SaveStateRequest req;
  req.set_run_id(run_id);
  req.set_generation(1);
  auto reader = stub->SaveState(&ctx, req);
  v1::StateChunk c;
  while (reader->Read(&c)) chunks->push_back(c);
  return reader->Finish();
}

inline grpc::Status LoadState(v1::Worker::Stub* stub,
                              const std::string& authorization,
                              const std::vector<v1::StateChunk>& chunks) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
  v1::LoadStateResponse resp;
  auto writer = stub->LoadState(&ctx, &resp);
  for (const auto& c : chunks) {
    if (!writer->Write(c)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

// Sends `m` on a new stream; the stream's status, and whether an upward
// completion came back.
inline grpc::Status StreamOnce(v1::Worker::Stub* stub, const v1::DownMessage& m,
                               bool* completed = nullptr,
                               const std::string& authorization = "") {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
  auto stream = stub->Stream(&ctx);
  stream->Write(m);
  v1::UpMessage up;
  bool got = false;
  while (!got && stream->Read(&up)) got = up.has_upward();
  stream->WritesDone();
  while (stream->Read(&up)) {
  }
  if (completed) *completed = got;
  return stream->Finish();
}

inline std::shared_ptr<grpc::Channel> Plaintext(const WorkerProcess& w) {
  return grpc::CreateChannel(w.address(), grpc::InsecureChannelCredentials());
}

class WorkerFixture : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = MakeTempDir("w"); }
  void TearDown() override {
    for (auto& w : workers_) {
      if (HasFailure()) {
        std::cerr << "worker log:\n" << ReadFile(log_of_[w.pid]) << "\n";
      }
      StopWorker(w);
    }
    std::filesystem::remove_all(dir_);
  }
  WorkerProcess Start(const std::vector<std::string>& flags) {
    const int index = static_cast<int>(workers_.size());
    WorkerProcess w = StartWorker(kWorker, dir_, index, flags);
    EXPECT_GT(w.port, 0) << ReadFile(dir_ + "/w" + std::to_string(index) +
                                     ".log");
    log_of_[w.pid] = dir_ + "/w" + std::to_string(index) + ".log";
    workers_.push_back(w);
    return w;
  }
  std::string dir_;
  std::vector<WorkerProcess> workers_;
  std::map<pid_t, std::string> log_of_;
};

// A field of /proc/PID/status in KiB ("VmRSS", "VmSize", "VmPeak"); -1 when
// absent.
inline int64_t ProcStatusKiB(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, field.size() + 1, field + ":") == 0) {
      return std::stoll(line.substr(field.size() + 1));
    }
  }
  return -1;
}

// A Stream the test holds open: messages go down when the test says, and it
// waits for what comes back.
class OpenStream {
 public:
  explicit OpenStream(v1::Worker::Stub* stub, int seconds = 120,
                      const std::string& authorization = "") {
    Deadline(&ctx_, seconds);
    if (!authorization.empty()) {
      ctx_.AddMetadata("authorization", authorization);
    }
    stream_ = stub->Stream(&ctx_);
  }
  bool Write(const v1::DownMessage& m) { return stream_->Write(m); }
  // Reads until an upward completion comes; false if the stream ended.
  bool AwaitCompletion() {
    v1::UpMessage up;
    while (stream_->Read(&up)) {
      if (up.has_upward() && !up.upward().partial()) return true;
    }
    return false;
  }
  // Waits for the worker to end the stream (without half-closing it) and
  // returns its status.
  grpc::Status AwaitEnd() {
    v1::UpMessage up;
    while (stream_->Read(&up)) {
    }
    return stream_->Finish();
  }
  // Half-closes, reads what is left and returns the stream's status.
  grpc::Status Finish() {
    stream_->WritesDone();
    v1::UpMessage up;
    while (stream_->Read(&up)) {
    }
    return stream_->Finish();
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DownMessage, v1::UpMessage>>
      stream_;
};

// --- Bearer token. ---------------------------------------------------------

// --- Start-up failures and raw HTTP (tests/hardening_flags_test.cc). -------

// How a process that should refuse to start ended.
struct ExitResult {
  bool exited = false;  // exited by itself, not by a signal or our kill
  int code = -1;        // exit status when `exited`
  int signal = 0;       // the signal that ended it, if one did
  bool timed_out = false;
  std::string output;  // stdout and stderr
};

// Runs `binary flags...` (no standard flags added) and waits up to `seconds`
// for it to end by itself; a process still running then is killed and
// reported as timed out (e.g. a worker that started when it should not).
inline ExitResult RunToExit(const std::string& binary,
                            const std::vector<std::string>& flags,
                            const std::string& log, double seconds = 30) {
  std::vector<std::string> args = {binary};
  args.insert(args.end(), flags.begin(), flags.end());
  const pid_t pid = interlock::testing::SpawnLogged(std::move(args), log);
  ExitResult r;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(int(seconds * 1000));
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!r.timed_out) {
    r.exited = WIFEXITED(status);
    r.code = r.exited ? WEXITSTATUS(status) : -1;
    r.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  }
  r.output = ReadFile(log);
  return r;
}

struct HttpResponse {
  int status = -1;  // -1: no connection or no HTTP answer
  std::string body;
};

// GET http://ip:port/path with extra header lines ("Name: value\r\n" each).
inline HttpResponse HttpGetFrom(const std::string& ip, int port,
                                const std::string& path,
                                const std::string& headers = "") {
  HttpResponse r;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return r;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, ip.c_str(), &addr.sin_addr);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req =
        "GET " + path + " HTTP/1.0\r\nHost: " + ip + "\r\n" + headers + "\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[8192];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
    }
  }
  close(fd);
  // "HTTP/1.1 401 Unauthorized\r\n..."
  if (out.rfind("HTTP/1.", 0) == 0 && out.size() > 12) {
    r.status = std::atoi(out.substr(9, 3).c_str());
  }
  const auto body = out.find("\r\n\r\n");
  if (body != std::string::npos) r.body = out.substr(body + 4);
  return r;
}

// A channel of its own (own subchannel, so its own TCP connection).
inline std::shared_ptr<grpc::Channel> FreshPlaintext(
    const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   args);
}

}  // namespace interlock::worker_test

#endif  // INTERLOCK_TESTS_WORKER_TEST_UTIL_H_
