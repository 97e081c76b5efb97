#include "coordinator/local_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "rpc/security.h"

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

// Whether something accepts TCP connections on 127.0.0.1:port.
bool Accepts(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok =
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// Folders of local clusters: kClusterPrefix<owner pid>-XXXXXX, so that a
// later start can tell whose they are.
constexpr char kClusterPrefix[] = "interlock-cluster-";

// Whether process `pid` exists (EPERM: it does, owned by someone else).
bool Alive(pid_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

// Creates `path` (it must not exist, nor be a link) readable and writable
// by this user only, whatever the umask, holding `text`.
absl::Status WritePrivateFile(const std::string& path,
                              const std::string& text) {
  const int fd = open(
      path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    return absl::InternalError(
        absl::StrCat("cannot create ", path, ": ", std::strerror(err)));
  }
  int err = fchmod(fd, 0600) == 0 ? 0 : errno;
  for (size_t done = 0; err == 0 && done < text.size();) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n == 0) {
      err = EIO;
    } else if (errno != EINTR) {
      err = errno;
    }
  }
  if (close(fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    return absl::InternalError(
        absl::StrCat("cannot write ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> RemoveStaleClusterFolders(const std::string& parent) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(parent, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kClusterPrefix, 0) != 0) continue;
    // "<pid>-XXXXXX"; older folders without a pid are left alone: their
    // owner is unknown.
    const std::vector<std::string> parts = absl::StrSplit(
        name.substr(sizeof(kClusterPrefix) - 1), absl::MaxSplits('-', 1));
    int64_t pid = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &pid) || pid <= 0 ||
        pid > std::numeric_limits<pid_t>::max()) {
      continue;
    }
    // Only our own real folders (not a link planted in /tmp), of processes
    // that are gone. A reused pid keeps its folder: safe, if untidy.
    struct stat st;
    if (lstat(e.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
        st.st_uid != getuid() || Alive(static_cast<pid_t>(pid))) {
      continue;
    }
    std::error_code rm;
    std::filesystem::remove_all(e.path(), rm);
    if (!rm) removed.push_back(e.path().string());
  }
  return removed;
}

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
    const std::vector<std::string>& extra_args,
    const std::vector<std::vector<std::string>>& worker_args,
    bool generate_token) {
  if (access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("worker binary not found or not executable: ", binary));
  }
  std::unique_ptr<LocalCluster> c(new LocalCluster());
  c->binary_ = binary;
  c->extra_args_ = extra_args;
  c->worker_args_ = worker_args;
  // Folders a killed coordinator left behind (its workers died with it).
  RemoveStaleClusterFolders("/tmp");
  std::string tmpl = absl::StrCat("/tmp/", kClusterPrefix, getpid(), "-XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) {
    const int err = errno;
    return absl::InternalError(absl::StrCat("cannot create a folder ", tmpl,
                                            ": ", std::strerror(err)));
  }
  c->dir_ = tmpl;
  if (generate_token) {
    // In the cluster's own folder (0700, removed by Stop), read by the
    // workers (the same user) and by restarted ones.
    auto token = RandomToken();
    if (!token.ok()) return token.status();
    c->token_ = *std::move(token);
    c->token_file_ = c->dir_ + "/token";
    if (absl::Status s = WritePrivateFile(c->token_file_, c->token_ + "\n");
        !s.ok()) {
      return s;
    }
    c->extra_args_.push_back("--token_file=" + c->token_file_);
  }
  c->workers_.resize(count);
  const absl::Time deadline = absl::Now() + timeout;
  for (int k = 0; k < count; ++k) {
    if (absl::Status s = c->Spawn(k, 0, deadline); !s.ok()) return s;
  }
  return c;
}

absl::Status LocalCluster::Spawn(int k, int port, absl::Time deadline) {
  Worker& w = workers_[k];
  // A fresh port file per start: an old one must not be mistaken for it.
  const std::string port_file =
      absl::StrCat(dir_, "/worker", k, "-", restarts_++, ".port");
  w.log_path = absl::StrCat(dir_, "/worker", k, ".log");
  std::vector<std::string> args = {
      binary_, "--host=127.0.0.1", absl::StrCat("--port=", port),
      "--metrics_port=0", "--port_file=" + port_file};
  args.insert(args.end(), extra_args_.begin(), extra_args_.end());
  if (k < static_cast<int>(worker_args_.size())) {
    args.insert(args.end(), worker_args_[k].begin(), worker_args_[k].end());
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    // Child: die with the parent, log to a file, one BLAS thread. Its own
    // process group: a terminal's Ctrl-C reaches the coordinator only, which
    // checkpoints before it stops the workers.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    setpgid(0, 0);
    if (getppid() != parent) _exit(1);
    const int fd =
        open(w.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
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
    execv(binary_.c_str(), argv.data());
    _exit(127);
  }
  w.pid = pid;
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
          absl::StrCat("worker ", k, " did not start in time"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  w.address = absl::StrCat("127.0.0.1:", w.port);
  return absl::OkStatus();
}

absl::StatusOr<int> LocalCluster::ReviveDead(absl::Duration timeout) {
  std::lock_guard<std::mutex> l(mu_);
  if (stopped_) return absl::CancelledError("the local cluster was stopped");
  const absl::Time deadline = absl::Now() + timeout;
  int revived = 0;
  for (size_t k = 0; k < workers_.size(); ++k) {
    Worker& w = workers_[k];
    int status;
    if (w.pid > 0 && waitpid(w.pid, &status, WNOHANG) == 0) {
      if (Accepts(w.port)) continue;
      // Not listening: dying (a killed process closes its sockets before
      // it can be reaped) or broken. Make sure it is gone.
      kill(w.pid, SIGKILL);
      waitpid(w.pid, &status, 0);
    }
    w.pid = -1;
    // The same port: the coordinator and the neighbours reconnect to the
    // address they know. Binding may fail briefly while the old sockets
    // close; retry until the deadline.
    absl::Status s;
    do {
      s = Spawn(static_cast<int>(k), workers_[k].port, deadline);
      if (!s.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    } while (!s.ok() && absl::Now() < deadline);
    if (!s.ok()) return s;
    ++revived;
  }
  return revived;
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
