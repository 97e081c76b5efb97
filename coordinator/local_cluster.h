// Starts K interlock-worker processes on free loopback ports for
// `interlock train --engine cluster` without --workers, and stops them: on
// Stop(), on destruction, and (through PR_SET_PDEATHSIG) when this process
// dies, so no worker is left behind.
#ifndef INTERLOCK_COORDINATOR_LOCAL_CLUSTER_H_
#define INTERLOCK_COORDINATOR_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace interlock {

class LocalCluster {
 public:
  struct Worker {
    pid_t pid = -1;
    int port = 0;
    int metrics_port = -1;
    std::string address;
    std::string log_path;
  };

  // `extra_args` go to every worker (e.g. the token and TLS flags),
  // `worker_args[k]` (when given) to worker k only (e.g. its --device).
  // `generate_token`: the workers require a random token (32 bytes, hex)
  // that Launch writes to a file only this user can read (0600) in the
  // cluster's folder and passes them as --token_file; token() gives it to
  // the coordinator's own calls.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Launch(
      int workers, const std::string& worker_binary,
      absl::Duration timeout = absl::Seconds(120),
      const std::vector<std::string>& extra_args = {},
      const std::vector<std::vector<std::string>>& worker_args = {},
      bool generate_token = false);
  ~LocalCluster();

  const std::vector<Worker>& workers() const { return workers_; }
  std::vector<std::string> addresses() const;
  // The generated token and its file (empty without `generate_token`).
  const std::string& token() const { return token_; }
  const std::string& token_file() const { return token_file_; }
  // SIGTERM, then SIGKILL after `grace`; safe to call from several threads.
  void Stop(absl::Duration grace = absl::Seconds(5));
  // Restarts every worker process that has died, on its old port (what a
  // Kubernetes restartPolicy does for a pod). Returns how many it restarted.
  absl::StatusOr<int> ReviveDead(absl::Duration timeout = absl::Seconds(30));

 private:
  LocalCluster() = default;
  // Starts worker k on `port` (0: any free port) and waits for its port file.
  absl::Status Spawn(int k, int port, absl::Time deadline);
  std::string binary_;
  std::vector<std::string> extra_args_;
  std::vector<std::vector<std::string>> worker_args_;
  std::string dir_;
  std::string token_;
  std::string token_file_;
  int restarts_ = 0;
  std::vector<Worker> workers_;
  std::mutex mu_;
  bool stopped_ = false;
};

// Removes the local-cluster folders in `parent` whose owning process is gone
// (a SIGKILLed coordinator cannot remove its own); folders of live processes,
// of other users, and without an owner pid in their name stay. Returns the
// removed paths. Launch calls it on /tmp.
std::vector<std::string> RemoveStaleClusterFolders(const std::string& parent);

// The interlock-worker binary next to this executable (or in the build
// tree's worker/ folder).
std::string DefaultWorkerBinary();

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_LOCAL_CLUSTER_H_
