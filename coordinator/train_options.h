// What a run is told besides its RunConfig, one struct per concern: where
// it reports, which engine runs the blocks, checkpoints and recovery, time
// budgets. The CLI fills them from flags; compare and tests set them
// directly.
#ifndef INTERLOCK_COORDINATOR_TRAIN_OPTIONS_H_
#define INTERLOCK_COORDINATOR_TRAIN_OPTIONS_H_

#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "analysis/virtual_clock.h"
#include "coordinator/live_run.h"
#include "rpc/security.h"

namespace interlock {

enum class Schedule { kSequential, kThreaded };
enum class EngineKind { kInProcess, kCluster };

class LocalCluster;

// The run's files, progress output and coordinator metrics.
struct OutputOptions {
  // Folder for metrics.jsonl, eval.jsonl and summary.json; empty: none.
  std::string out_dir;
  // Write over a finished run's files in out_dir (otherwise a run there
  // resumes from its checkpoint or refuses).
  bool replace = false;
  // Progress: a redrawn bar on a terminal, plain log lines otherwise.
  bool progress_bar = false;
  bool quiet = false;
  // Every parameter's values into TrainResult::params_json.
  bool dump_params = false;
  // Progress lines and a command's own report lines (compare's). What an
  // operator needs to know goes to the log (services/logging.h).
  std::ostream* console = &std::cerr;
  // Shown before the run's name in progress output (e.g. "[2/4]").
  std::string progress_label;
  // Coordinator /metrics: -1 off, 0 any free port; on metrics_host
  // (--metrics-host; loopback unless the CLI allows more, see
  // EngineOptions::insecure).
  int metrics_port = -1;
  std::string metrics_host = "127.0.0.1";
  // Time per LibTorch operation of kProfiledSteps steps into this file
  // (services/op_profile.h); in process, sequential schedule only.
  std::string profile_ops;
};

// Which engine runs the blocks and how it is reached.
struct EngineOptions {
  EngineKind kind = EngineKind::kInProcess;
  // In-process: blocks one after the other, or one thread each.
  Schedule schedule = Schedule::kSequential;
  // Cluster: worker addresses by block, then replica (--workers,
  // plan/topology.h); empty starts a local cluster of
  // interlock-worker processes on loopback, `replicas[k]` for block k
  // (empty: one each).
  std::vector<std::vector<std::string>> workers;
  std::vector<int> replicas;
  // With replicas: the address of this process the workers reach the
  // reduction groups' rendezvous store at (empty: 127.0.0.1 for a local
  // cluster, this machine's host name for remote workers).
  std::string collective_host;
  int collective_port = 0;    // the store's port; 0: any free one
  std::string worker_binary;  // empty: next to this executable
  // Where the blocks run (--device, services/device.h): none (all on the
  // CPU), one for every block, or one per block. In process they are the
  // blocks' devices; a local cluster passes each worker its block's. Remote
  // workers choose their own (their --device), so they take none here.
  std::vector<c10::Device> devices;
  // Cluster: the membership service workers join and leave through
  // (ARCHITECTURE: replicas) listens on coordinator_host:coordinator_port (-1:
  // off, 0: any free port; coordinator_port_file, if set, receives the port).
  int coordinator_port = -1;
  std::string coordinator_host = "127.0.0.1";
  std::string coordinator_port_file;
  // Cluster: how long to wait for a worker to be reachable.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Cluster: bearer token and TLS files for the coordinator's calls and the
  // membership service; a local cluster's workers get the same files, or,
  // when there are none, a token the coordinator generates for them
  // (engine_factory.cc; never the checkpoints' seal key).
  SecurityFiles security;
  // --insecure: the CLI let the membership service or /metrics listen beyond
  // loopback without a token or mutual TLS. Recorded in summary.json.
  bool insecure = false;
  // Cluster on workers that live on their own, with an --out (set by
  // Train): every worker keeps step-boundary snapshots and `on_generation`
  // hears of each generation before it is configured, so the run's journal
  // always names one no Configure used yet. `adopt`: the live workers of
  // the journal, continued from their snapshots instead of started afresh
  // (when that fails, the run starts them afresh and resumes from its
  // checkpoint).
  bool keep_snapshots = false;
  std::function<void(const std::string& run_id, int64_t generation)>
      on_generation;
  std::optional<LiveRun> adopt;
  // Receives the local cluster while it runs (nullptr once stopped), so a
  // signal handler can stop it.
  std::function<void(LocalCluster*)> on_cluster;
};

// Checkpoints and recovery (docs/RELIABILITY.md).
struct CheckpointOptions {
  // Every this many steps (0: none but the one a stop request takes), in
  // `dir` (empty: OUT/checkpoints; no checkpoints without either), keeping
  // the newest `keep`.
  int64_t every = 0;
  std::string dir;
  int keep = 3;
  // Resume from this checkpoint (or folder of checkpoints). Without it a run
  // resumes from the newest checkpoint in its checkpoint folder, if any.
  std::string resume;
  // Cluster: how long a failed run waits for its workers to be reachable
  // again before it restores the last checkpoint and replays (zero: a
  // failure ends the run).
  absl::Duration recover_timeout = absl::Seconds(120);
  // When set (a signal handler), the run takes a checkpoint at the next
  // step boundary and stops with CANCELLED.
  const std::atomic<bool>* stop_requested = nullptr;
};

// Time budgets (zero: none). The run stops submitting steps once training
// time (wall, evaluation excluded) or the virtual clock reaches the budget,
// finishes the steps in flight, then evaluates.
struct BudgetOptions {
  absl::Duration wall = absl::ZeroDuration();
  absl::Duration virtual_time = absl::ZeroDuration();
};

struct TrainOptions {
  OutputOptions output;
  EngineOptions engine;
  CheckpointOptions checkpoints;
  BudgetOptions budget;
  // Micro-batches in flight between the coordinator and the chain; 0: 2KM.
  int window = 0;
  // Link model of the virtual clock.
  LinkModel link;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_TRAIN_OPTIONS_H_
