// The run driver: owns data order, learning-rate schedule, the bounded window
// of micro-batches in flight, step records, evaluation and the run's files.
// It drives an Engine (in-process or cluster) and has no LibTorch in its API.
#ifndef INTERLOCK_COORDINATOR_TRAIN_H_
#define INTERLOCK_COORDINATOR_TRAIN_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "analysis/virtual_clock.h"
#include "proto/config.pb.h"
#include "rpc/security.h"

namespace interlock {

enum class Schedule { kSequential, kThreaded };
enum class EngineKind { kInProcess, kCluster };

class LocalCluster;

struct TrainOptions {
  // Folder for metrics.jsonl, eval.jsonl and summary.json; empty: none.
  std::string out_dir;
  Schedule schedule = Schedule::kSequential;
  // Progress: a redrawn bar on a terminal, plain log lines otherwise.
  bool progress_bar = false;
  bool quiet = false;
  bool dump_params = false;
  std::ostream* log = &std::cerr;

  EngineKind engine = EngineKind::kInProcess;
  // Cluster: one worker address per block; empty starts a local cluster of
  // interlock-worker processes on loopback.
  std::vector<std::string> workers;
  std::string worker_binary;  // empty: next to this executable
  // Coordinator /metrics: -1 off, 0 any free port.
  int metrics_port = -1;
  // Cluster: how long to wait for a worker to be reachable.
  absl::Duration connect_timeout = absl::Seconds(30);
  // Cluster: bearer token and TLS files for the coordinator's calls; a local
  // cluster's workers get the same files.
  SecurityFiles security;
  std::string metrics_host = "0.0.0.0";
  // Micro-batches in flight between the coordinator and the chain; 0: 2KM.
  int window = 0;
  // Time budgets (zero: none). The run stops submitting steps once training
  // time (wall, evaluation excluded) or the virtual clock reaches the
  // budget, finishes the steps in flight, then evaluates.
  absl::Duration budget_wall = absl::ZeroDuration();
  absl::Duration budget_virtual = absl::ZeroDuration();
  // Link model of the virtual clock.
  LinkModel link;
  // Shown before the run's name in progress output (e.g. "[2/4]").
  std::string progress_label;
  // Receives the local cluster while it runs (nullptr once stopped), so a
  // signal handler can stop it.
  std::function<void(LocalCluster*)> on_cluster;

  // Checkpoints (docs/RELIABILITY.md): every this many steps (0: none but
  // the one a stop request takes), in `checkpoint_dir` (empty:
  // OUT/checkpoints; no checkpoints without either), keeping the newest
  // `keep_checkpoints`.
  int64_t checkpoint_every = 0;
  std::string checkpoint_dir;
  int keep_checkpoints = 3;
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

// Exactly-once accounting of the run, written to summary.json: every step
// of the surviving history applied M micro-batch gradients on every block.
struct Accounting {
  int64_t microbatches_per_step = 0;  // M
  // Completions (micro-batches finished by every block) and optimizer steps
  // of the run's final history, over all steps (restored ones included).
  int64_t microbatches_applied = 0;
  int64_t block_steps = 0;
  // Steps whose completions or block gradients were not exactly M (each
  // is an error; listed for the report).
  std::vector<int64_t> steps_not_exactly_once;
  int64_t recoveries = 0;
  // Micro-batches run again after a restore (their first run was undone).
  int64_t microbatches_replayed = 0;
  // Repeats a worker acknowledged without applying them.
  int64_t duplicates_acknowledged = 0;
  int64_t resumed_from_step = -1;  // -1: not resumed
  int64_t checkpoints = 0;
};

struct HeadResult {
  int block = 0;
  bool final = false;
  double loss = 0.0;        // mean per sample (token for text)
  double accuracy = 0.0;    // argmax hits / count
  double perplexity = 0.0;  // text only
};

// Test metrics of every head at one point of the run.
struct EvalPoint {
  int64_t step = 0;              // steps done
  double wall_seconds = 0.0;     // training time (evaluation excluded)
  double virtual_seconds = 0.0;  // virtual clock at that step
  std::vector<HeadResult> heads;
};

struct TrainResult {
  int64_t steps = 0;          // steps done (fewer than asked on a budget)
  double wall_seconds = 0.0;  // training time, evaluation excluded
  // The virtual model-parallel clock (analysis/virtual_clock.h): end of
  // the last step, mean step times after the first step, and busy / elapsed
  // per block and overall.
  double virtual_seconds = 0.0;
  double mean_step_wall = 0.0;
  double mean_step_virtual = 0.0;
  double utilisation = 0.0;
  std::vector<double> busy_ratio;
  std::vector<EvalPoint> evals;  // every evaluation, the final one last
  std::vector<HeadResult> eval;
  std::vector<std::string> block_digests;
  std::vector<std::string> head_digests;  // "" where a block has no head
  std::string digest;                     // over all of them
  std::string params_json;                // one JSON line per tensor
  std::vector<double> final_losses;       // last step, per block (NaN: none)
  // Per block: steps whose update it skipped (training.nonfinite_policy).
  std::vector<int64_t> skipped_steps;
  Accounting accounting;
};

// An exclusive lock on a run's folder (--out, --checkpoint-dir): two runs
// sharing one would write over each other's files and resume from each
// other's live checkpoints. An advisory flock on DIR/.interlock.lock, which
// names the holder's pid; the kernel drops it when the holder dies, so a
// killed run's folder can be used again at once.
class FolderLock {
 public:
  // Creates `dir` if needed and locks it, or fails at once with
  // FAILED_PRECONDITION naming the folder and the holder (`flag` names the
  // option the folder came from, for the message).
  static absl::StatusOr<std::unique_ptr<FolderLock>> Acquire(
      const std::string& dir, const std::string& flag);
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;

 private:
  explicit FolderLock(int fd) : fd_(fd) {}
  int fd_;
};

// Loads the data, builds the in-process engine and trains. Locks
// `options.out_dir` (and a separate checkpoint folder) for the whole run.
absl::StatusOr<TrainResult> Train(const interlock::v1::RunConfig& config,
                                  const TrainOptions& options);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_TRAIN_H_
