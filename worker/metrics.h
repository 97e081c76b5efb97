// The worker's Prometheus metrics. Families are built once; the children of
// a block are created on first use and cached.
#ifndef INTERLOCK_WORKER_METRICS_H_
#define INTERLOCK_WORKER_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

namespace interlock {

struct StepDone;
struct UpwardMsg;

struct BlockMetrics {
  prometheus::Counter* microbatches = nullptr;
  prometheus::Histogram* forward_seconds = nullptr;
  prometheus::Histogram* head_seconds = nullptr;
  prometheus::Histogram* backward_seconds = nullptr;
  prometheus::Histogram* optimizer_seconds = nullptr;
  prometheus::Histogram* input_grad_seconds = nullptr;
  // The reduction with the block's other replicas (part of the optimizer
  // phase); observed only when the block has replicas.
  prometheus::Histogram* reduction_seconds = nullptr;
  // Its part spent waiting for the slowest replica to arrive (the rest is
  // the gradients' own exchange).
  prometheus::Histogram* reduction_wait_seconds = nullptr;
  prometheus::Counter* idle_seconds = nullptr;
  prometheus::Counter* sent_down_bytes = nullptr;
  prometheus::Counter* sent_up_bytes = nullptr;
  prometheus::Counter* sent_control_bytes = nullptr;
  prometheus::Counter* received_down_bytes = nullptr;
  prometheus::Counter* received_up_bytes = nullptr;
  prometheus::Counter* rejected = nullptr;
  prometheus::Counter* nonfinite = nullptr;
  prometheus::Gauge* step = nullptr;
  prometheus::Gauge* head_loss = nullptr;
  prometheus::Gauge* configured = nullptr;
};

// What block `block`'s driver reports, observed: its own phases' times and
// head loss from an upward message, the step and its optimizer and
// reduction times (`reduction`, `reduction_wait`: the trainer's last, when
// the block has replicas; negative: none) from a finished step.
void ObserveUpward(const UpwardMsg& m, int block, BlockMetrics* metrics);
void ObserveStepDone(const StepDone& d, double reduction, double reduction_wait,
                     BlockMetrics* metrics);

class WorkerMetrics {
 public:
  WorkerMetrics();
  std::shared_ptr<prometheus::Registry> registry() { return registry_; }
  // Children for one block (replica 0 until replicas exist) whose links
  // carry activations (`down`) and gradients (`up`) in the named codecs:
  // the byte counters' `codec` label ("none" on the control stream).
  BlockMetrics& ForBlock(int block, int replica, const std::string& down_codec,
                         const std::string& up_codec);
  // Calls refused for a missing or wrong bearer token (no block yet).
  prometheus::Counter* unauthenticated() { return unauthenticated_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* microbatches_;
  prometheus::Family<prometheus::Histogram>* compute_;
  prometheus::Family<prometheus::Histogram>* reduction_wait_;
  prometheus::Family<prometheus::Counter>* idle_;
  prometheus::Family<prometheus::Counter>* sent_;
  prometheus::Family<prometheus::Counter>* received_;
  prometheus::Family<prometheus::Counter>* rejected_;
  prometheus::Family<prometheus::Counter>* nonfinite_;
  prometheus::Counter* unauthenticated_;
  prometheus::Family<prometheus::Gauge>* step_;
  prometheus::Family<prometheus::Gauge>* head_loss_;
  prometheus::Family<prometheus::Gauge>* configured_;
  std::mutex mu_;
  std::map<std::tuple<int, int, std::string, std::string>, BlockMetrics>
      blocks_;
};

}  // namespace interlock

#endif  // INTERLOCK_WORKER_METRICS_H_
