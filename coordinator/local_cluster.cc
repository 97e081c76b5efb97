#include "coordinator/local_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"

namespace interlock {
namespace {

std::string Tail(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  if (s.size() > 600) s = s.substr(s.size() - 600);
  return s;
}

}  // namespace

std::string DefaultWorkerBinary() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "interlock-worker";
  const auto dir = self.parent_path();
  for (const auto& candidate :
       {dir / "interlock-worker", dir / ".." / "worker" / "interlock-worker"}) {
    if (std::filesystem::exists(candidate, ec)) return candidate.string();
  }
  return "interlock-worker";
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Launch(
    int count, const std::string& binary, absl::Duration timeout,
    const std::vector<std::string>& extra_args) {
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("worker binary not found or not executable: ", binary));
  }
  std::unique_ptr<LocalCluster> c(new LocalCluster());
  char tmpl[] = "/tmp/interlock-cluster-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    return absl::InternalError("cannot create a temporary folder");
  }
  c->dir_ = tmpl;
  const pid_t parent = getpid();
  for (int k = 0; k < count; ++k) {
    Worker w;
    const std::string port_file = absl::StrCat(c->dir_, "/worker", k, ".port");
    w.log_path = absl::StrCat(c->dir_, "/worker", k, ".log");
    std::vector<std::string> args = {binary, "--host=127.0.0.1", "--port=0",
                                     "--metrics_port=0",
                                     "--port_file=" + port_file};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      // Child: die with the parent, log to a file, one BLAS thread.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      const int fd =
          open(w.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
        close(fd);
      }
      setenv("OMP_NUM_THREADS", "1", 1);
      setenv("OPENBLAS_NUM_THREADS", "1", 1);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(binary.c_str(), argv.data());
      _exit(127);
    }
    w.pid = pid;
    c->workers_.push_back(w);
  }
  const absl::Time deadline = absl::Now() + timeout;
  for (int k = 0; k < count; ++k) {
    Worker& w = c->workers_[k];
    const std::string port_file = absl::StrCat(c->dir_, "/worker", k, ".port");
    for (;;) {
      std::ifstream in(port_file);
      if (in >> w.port >> w.metrics_port) break;
      int status;
      if (waitpid(w.pid, &status, WNOHANG) == w.pid) {
        w.pid = -1;
        return absl::UnavailableError(absl::StrCat(
            "worker ", k, " exited at start-up: ", Tail(w.log_path)));
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("worker ", k, " did not start within ",
                         absl::FormatDuration(timeout)));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    w.address = absl::StrCat("127.0.0.1:", w.port);
  }
  return c;
}

std::vector<std::string> LocalCluster::addresses() const {
  std::vector<std::string> out;
  for (const auto& w : workers_) out.push_back(w.address);
  return out;
}

void LocalCluster::Stop(absl::Duration grace) {
  std::lock_guard<std::mutex> l(mu_);
  if (stopped_) return;
  stopped_ = true;
  for (auto& w : workers_) {
    if (w.pid > 0) kill(w.pid, SIGTERM);
  }
  const absl::Time deadline = absl::Now() + grace;
  for (auto& w : workers_) {
    if (w.pid <= 0) continue;
    int status;
    while (waitpid(w.pid, &status, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(w.pid, SIGKILL);
        waitpid(w.pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    w.pid = -1;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

LocalCluster::~LocalCluster() { Stop(); }

}  // namespace interlock
