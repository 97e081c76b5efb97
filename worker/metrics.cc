#include "worker/metrics.h"

#include "services/messages.h"

namespace interlock {
namespace {

// Operation durations span ~50 us (a small head) to tens of seconds.
prometheus::Histogram::BucketBoundaries Buckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
}

}  // namespace

WorkerMetrics::WorkerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()) {
  microbatches_ = &prometheus::BuildCounter()
                       .Name("interlock_worker_microbatches_total")
                       .Help("Micro-batches whose backward pass finished")
                       .Register(*registry_);
  compute_ = &prometheus::BuildHistogram()
                  .Name("interlock_worker_compute_seconds")
                  .Help("Duration of block operations by phase")
                  .Register(*registry_);
  reduction_wait_ =
      &prometheus::BuildHistogram()
           .Name("interlock_worker_reduction_wait_seconds")
           .Help(
               "Part of a replica reduction spent waiting for the slowest "
               "replica of the block")
           .Register(*registry_);
  idle_ = &prometheus::BuildCounter()
               .Name("interlock_worker_idle_seconds_total")
               .Help("Time spent idle while waiting for gradients from below")
               .Register(*registry_);
  sent_ = &prometheus::BuildCounter()
               .Name("interlock_worker_sent_bytes_total")
               .Help("Bytes sent on the stream links by direction and codec")
               .Register(*registry_);
  received_ =
      &prometheus::BuildCounter()
           .Name("interlock_worker_received_bytes_total")
           .Help("Bytes received on the stream links by direction and codec")
           .Register(*registry_);
  rejected_ = &prometheus::BuildCounter()
                   .Name("interlock_worker_rejected_messages_total")
                   .Help("Received messages refused as invalid or stale")
                   .Register(*registry_);
  nonfinite_ = &prometheus::BuildCounter()
                    .Name("interlock_worker_nonfinite_total")
                    .Help(
                        "Tensors received or losses computed with NaN or "
                        "infinite values")
                    .Register(*registry_);
  unauthenticated_ =
      &prometheus::BuildCounter()
           .Name("interlock_worker_unauthenticated_requests_total")
           .Help(
               "Calls refused for a missing or wrong bearer "
               "token")
           .Register(*registry_)
           .Add({});
  step_ = &prometheus::BuildGauge()
               .Name("interlock_worker_step")
               .Help("Optimizer steps this block has completed")
               .Register(*registry_);
  head_loss_ = &prometheus::BuildGauge()
                    .Name("interlock_worker_head_loss")
                    .Help("Loss of this block's head on the latest micro-batch")
                    .Register(*registry_);
  configured_ = &prometheus::BuildGauge()
                     .Name("interlock_worker_configured")
                     .Help("1 while a block is configured and serving")
                     .Register(*registry_);
}

BlockMetrics& WorkerMetrics::ForBlock(int block, int replica,
                                      const std::string& down_codec,
                                      const std::string& up_codec) {
  std::lock_guard<std::mutex> l(mu_);
  const auto key = std::make_tuple(block, replica, down_codec, up_codec);
  auto it = blocks_.find(key);
  if (it != blocks_.end()) return it->second;
  const std::map<std::string, std::string> base = {
      {"block", std::to_string(block)}, {"replica", std::to_string(replica)}};
  auto with = [&](const char* key, const char* value) {
    auto l = base;
    l[key] = value;
    return l;
  };
  auto link = [&](const char* direction, const std::string& codec) {
    auto l = base;
    l["direction"] = direction;
    l["codec"] = codec;
    return l;
  };
  BlockMetrics m;
  m.microbatches = &microbatches_->Add(base);
  m.forward_seconds = &compute_->Add(with("phase", "forward"), Buckets());
  m.head_seconds = &compute_->Add(with("phase", "head"), Buckets());
  m.backward_seconds = &compute_->Add(with("phase", "backward"), Buckets());
  m.optimizer_seconds = &compute_->Add(with("phase", "optimizer"), Buckets());
  m.input_grad_seconds = &compute_->Add(with("phase", "input_grad"), Buckets());
  m.reduction_seconds = &compute_->Add(with("phase", "reduction"), Buckets());
  m.reduction_wait_seconds = &reduction_wait_->Add(base, Buckets());
  m.idle_seconds = &idle_->Add(base);
  // Families return the existing child for known labels: a block
  // reconfigured with other codecs shares every other series.
  m.sent_down_bytes = &sent_->Add(link("down", down_codec));
  m.sent_up_bytes = &sent_->Add(link("up", up_codec));
  m.sent_control_bytes = &sent_->Add(link("control", "none"));
  m.received_down_bytes = &received_->Add(link("down", down_codec));
  m.received_up_bytes = &received_->Add(link("up", up_codec));
  m.rejected = &rejected_->Add(base);
  m.nonfinite = &nonfinite_->Add(base);
  m.step = &step_->Add(base);
  m.head_loss = &head_loss_->Add(base);
  m.configured = &configured_->Add(base);
  return blocks_.emplace(key, m).first->second;
}

void ObserveUpward(const UpwardMsg& m, int block, BlockMetrics* metrics) {
  if (m.final) metrics->microbatches->Increment();
  for (const auto& t : m.timings) {
    if (t.block != block) continue;
    switch (t.phase) {
      case Phase::kForward:
        metrics->forward_seconds->Observe(t.seconds);
        break;
      case Phase::kHead:
        metrics->head_seconds->Observe(t.seconds);
        break;
      case Phase::kBackward:
        metrics->backward_seconds->Observe(t.seconds);
        break;
      case Phase::kOptimizer:
        metrics->optimizer_seconds->Observe(t.seconds);
        break;
      case Phase::kInputGrad:
        metrics->input_grad_seconds->Observe(t.seconds);
        break;
      case Phase::kParamPass:  // calibration, not training work
      case Phase::kSharedPass:
      case Phase::kInputPass:
        break;
    }
  }
  for (const auto& rep : m.reports) {
    if (rep.block == block) metrics->head_loss->Set(rep.loss);
  }
}

void ObserveStepDone(const StepDone& d, double reduction, double reduction_wait,
                     BlockMetrics* metrics) {
  metrics->step->Set(static_cast<double>(d.step + 1));
  metrics->optimizer_seconds->Observe(d.timing.seconds);
  if (reduction >= 0) metrics->reduction_seconds->Observe(reduction);
  if (reduction_wait >= 0) {
    metrics->reduction_wait_seconds->Observe(reduction_wait);
  }
}

}  // namespace interlock
