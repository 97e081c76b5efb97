// The coordinator's Prometheus metrics: run progress, loss per head,
// throughput and evaluation accuracy per head.
#ifndef INTERLOCK_COORDINATOR_METRICS_H_
#define INTERLOCK_COORDINATOR_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/membership.h"
#include "metrics/http_exposer.h"

namespace interlock {

class CoordinatorMetrics {
 public:
  // Serves /metrics on host:port (port 0: any free port).
  static absl::StatusOr<std::unique_ptr<CoordinatorMetrics>> Serve(
      const std::string& host, int port, const std::string& mode);
  int port() const { return port_; }

  void OnStep(int64_t step, const std::vector<double>& losses,
              double samples_per_second, int microbatches);
  void OnEval(int block, double accuracy, double loss);
  // A step's wall duration and the virtual clock after it (ARCHITECTURE: the
  // virtual clock).
  void OnStepTimes(double wall_step_seconds, double virtual_seconds,
                   double virtual_step_seconds,
                   const std::vector<double>& busy_ratio);
  // A block skipped `steps` steps' updates (training.nonfinite_policy
  // SKIP_STEP); 0 creates the block's series, so alerts see it at zero.
  void OnSkippedSteps(int block, int steps);
  // A checkpoint of `step` steps was written in `seconds` (drain, fetch of
  // every block's state, write and sync).
  void OnCheckpoint(int64_t step, double seconds);
  void OnRecovery();
  // Thread-safe: the cluster engine reports from its RPC threads.
  void SetWorkerUp(int block, bool up);
  // The block runs on `replicas` worker replicas (ARCHITECTURE: replicas); the
  // first call also makes them the block's desired replicas.
  void SetReplicas(int block, int replicas);
  // A topology change: replicas per block, a change counted by kind, the
  // generation. Joins and leaves move the desired replicas; failures do
  // not (the alert fires while a block runs below them).
  void OnTopology(const TopologyEvent& e);
  // A Register or Leave refused, by reason (Membership::set_on_refused).
  void OnRefused(const std::string& reason);

 private:
  CoordinatorMetrics() = default;
  prometheus::Gauge& PerBlock(prometheus::Family<prometheus::Gauge>* family,
                              std::map<int, prometheus::Gauge*>& cache,
                              int block);

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<HttpExposer> exposer_;
  int port_ = 0;
  std::string mode_;
  prometheus::Gauge* step_ = nullptr;
  prometheus::Gauge* samples_per_second_ = nullptr;
  prometheus::Counter* microbatches_ = nullptr;
  prometheus::Histogram* step_seconds_ = nullptr;
  prometheus::Gauge* virtual_seconds_ = nullptr;
  prometheus::Gauge* virtual_step_seconds_ = nullptr;
  prometheus::Family<prometheus::Gauge>* busy_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* loss_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* accuracy_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* eval_loss_family_ = nullptr;
  prometheus::Counter* checkpoints_ = nullptr;
  prometheus::Histogram* checkpoint_seconds_ = nullptr;
  prometheus::Gauge* last_checkpoint_step_ = nullptr;
  prometheus::Counter* recoveries_ = nullptr;
  prometheus::Family<prometheus::Gauge>* workers_up_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* replicas_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* desired_family_ = nullptr;
  prometheus::Family<prometheus::Counter>* changes_family_ = nullptr;
  prometheus::Family<prometheus::Counter>* refusals_family_ = nullptr;
  prometheus::Gauge* generation_ = nullptr;
  std::map<int, int> desired_count_;  // guarded by mu_
  prometheus::Family<prometheus::Counter>* skipped_family_ = nullptr;
  std::mutex mu_;  // guards the per-block caches
  std::map<int, prometheus::Gauge*> loss_, accuracy_, eval_loss_, workers_up_,
      busy_, replicas_, desired_;
  std::map<int, prometheus::Counter*> skipped_;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_METRICS_H_
