// What a run returns and reports: evaluations, the virtual clock's figures,
// digests and the exactly-once accounting.
#ifndef INTERLOCK_COORDINATOR_RUN_RESULT_H_
#define INTERLOCK_COORDINATOR_RUN_RESULT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/ledger.h"
#include "coordinator/membership.h"

namespace interlock {

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
  // per block (the mean over its replicas) and overall, and per replica.
  double virtual_seconds = 0.0;
  double mean_step_wall = 0.0;
  double mean_step_virtual = 0.0;
  double utilisation = 0.0;
  std::vector<double> busy_ratio;
  std::vector<std::vector<double>> replica_busy_ratio;
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
  std::vector<int> replicas;  // worker replicas per block (1 in process)
  std::vector<TopologyEvent> topology;  // changes during the run
  // Started with --insecure (listeners beyond loopback without a token or
  // mutual TLS allowed).
  bool insecure = false;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RUN_RESULT_H_
