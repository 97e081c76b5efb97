#include "coordinator/metrics.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace interlock {

absl::StatusOr<std::unique_ptr<CoordinatorMetrics>> CoordinatorMetrics::Serve(
    const std::string& host, int port, const std::string& mode) {
  std::unique_ptr<CoordinatorMetrics> m(new CoordinatorMetrics());
  m->mode_ = mode;
  m->registry_ = std::make_shared<prometheus::Registry>();
  auto& r = *m->registry_;
  const std::map<std::string, std::string> labels = {{"mode", mode}};
  m->step_ = &prometheus::BuildGauge()
                  .Name("interlock_coordinator_step")
                  .Help("Optimizer steps completed by the whole chain")
                  .Register(r)
                  .Add(labels);
  m->samples_per_second_ =
      &prometheus::BuildGauge()
           .Name("interlock_coordinator_samples_per_second")
           .Help("Training throughput since the run began")
           .Register(r)
           .Add(labels);
  m->microbatches_ = &prometheus::BuildCounter()
                          .Name("interlock_coordinator_microbatches_total")
                          .Help("Micro-batches finished by every block")
                          .Register(r)
                          .Add(labels);
  m->step_seconds_ =
      &prometheus::BuildHistogram()
           .Name("interlock_coordinator_step_seconds")
           .Help("Wall time of each optimizer step of the whole chain")
           .Register(r)
           .Add(labels,
                prometheus::Histogram::BucketBoundaries{
                    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30});
  m->virtual_seconds_ =
      &prometheus::BuildGauge()
           .Name("interlock_coordinator_virtual_seconds")
           .Help(
               "Virtual model-parallel clock: training time with one "
               "accelerator per block")
           .Register(r)
           .Add(labels);
  m->virtual_step_seconds_ =
      &prometheus::BuildGauge()
           .Name("interlock_coordinator_virtual_step_seconds")
           .Help("Virtual duration of the last step")
           .Register(r)
           .Add(labels);
  m->busy_family_ =
      &prometheus::BuildGauge()
           .Name("interlock_coordinator_virtual_busy_ratio")
           .Help(
               "Busy time over elapsed time of each block on the virtual "
               "clock")
           .Register(r);
  m->loss_family_ = &prometheus::BuildGauge()
                         .Name("interlock_coordinator_head_loss")
                         .Help("Training loss of each head, mean of last step")
                         .Register(r);
  m->accuracy_family_ = &prometheus::BuildGauge()
                             .Name("interlock_coordinator_eval_accuracy_ratio")
                             .Help("Test accuracy of each head at evaluation")
                             .Register(r);
  m->eval_loss_family_ = &prometheus::BuildGauge()
                              .Name("interlock_coordinator_eval_loss")
                              .Help("Test loss of each head at evaluation")
                              .Register(r);
  m->skipped_family_ =
      &prometheus::BuildCounter()
           .Name("interlock_coordinator_skipped_steps_total")
           .Help("Steps whose update a block skipped for non-finite values")
           .Register(r);
  m->checkpoints_ = &prometheus::BuildCounter()
                         .Name("interlock_coordinator_checkpoints_total")
                         .Help("Checkpoints written")
                         .Register(r)
                         .Add(labels);
  m->checkpoint_seconds_ =
      &prometheus::BuildHistogram()
           .Name("interlock_coordinator_checkpoint_seconds")
           .Help(
               "Time to take a checkpoint: drain, fetch every block's "
               "state, write and sync")
           .Register(r)
           .Add(labels,
                prometheus::Histogram::BucketBoundaries{
                    0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120});
  m->last_checkpoint_step_ =
      &prometheus::BuildGauge()
           .Name("interlock_coordinator_last_checkpoint_step")
           .Help("Steps covered by the newest complete checkpoint")
           .Register(r)
           .Add(labels);
  m->recoveries_ = &prometheus::BuildCounter()
                        .Name("interlock_coordinator_recoveries_total")
                        .Help(
                            "Recoveries from a failed worker (restore from "
                            "the last checkpoint and replay)")
                        .Register(r)
                        .Add(labels);
  m->workers_up_family_ =
      &prometheus::BuildGauge()
           .Name("interlock_coordinator_workers_up")
           .Help(
               "1 while the worker of a block is reachable, 0 once it "
               "failed")
           .Register(r);
  m->replicas_family_ = &prometheus::BuildGauge()
                             .Name("interlock_coordinator_replicas")
                             .Help("Worker replicas the run gives each block")
                             .Register(r);
  auto exposer = HttpExposer::Start(host, port, m->registry_);
  if (!exposer.ok()) return exposer.status();
  m->exposer_ = std::move(*exposer);
  m->port_ = m->exposer_->port();
  return m;
}

prometheus::Gauge& CoordinatorMetrics::PerBlock(
    prometheus::Family<prometheus::Gauge>* family,
    std::map<int, prometheus::Gauge*>& cache, int block) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = cache.find(block);
  if (it != cache.end()) return *it->second;
  auto& g = family->Add({{"block", std::to_string(block)}, {"mode", mode_}});
  cache[block] = &g;
  return g;
}

void CoordinatorMetrics::OnStep(int64_t step, const std::vector<double>& losses,
                                double sps, int microbatches) {
  step_->Set(static_cast<double>(step + 1));
  samples_per_second_->Set(sps);
  microbatches_->Increment(microbatches);
  for (size_t k = 0; k < losses.size(); ++k) {
    if (std::isfinite(losses[k])) {
      PerBlock(loss_family_, loss_, static_cast<int>(k)).Set(losses[k]);
    }
  }
}

void CoordinatorMetrics::OnStepTimes(double wall_step_seconds,
                                     double virtual_seconds,
                                     double virtual_step_seconds,
                                     const std::vector<double>& busy_ratio) {
  step_seconds_->Observe(wall_step_seconds);
  virtual_seconds_->Set(virtual_seconds);
  virtual_step_seconds_->Set(virtual_step_seconds);
  for (size_t k = 0; k < busy_ratio.size(); ++k) {
    PerBlock(busy_family_, busy_, static_cast<int>(k)).Set(busy_ratio[k]);
  }
}

void CoordinatorMetrics::OnSkippedSteps(int block, int steps) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = skipped_.find(block);
  if (it == skipped_.end()) {
    it = skipped_
             .emplace(block,
                      &skipped_family_->Add(
                          {{"block", std::to_string(block)}, {"mode", mode_}}))
             .first;
  }
  it->second->Increment(steps);
}

void CoordinatorMetrics::OnCheckpoint(int64_t step, double seconds) {
  checkpoints_->Increment();
  checkpoint_seconds_->Observe(seconds);
  last_checkpoint_step_->Set(static_cast<double>(step));
}

void CoordinatorMetrics::OnRecovery() { recoveries_->Increment(); }

void CoordinatorMetrics::SetWorkerUp(int block, bool up) {
  PerBlock(workers_up_family_, workers_up_, block).Set(up ? 1.0 : 0.0);
}

void CoordinatorMetrics::SetReplicas(int block, int replicas) {
  PerBlock(replicas_family_, replicas_, block).Set(replicas);
}

void CoordinatorMetrics::OnEval(int block, double accuracy, double loss) {
  PerBlock(accuracy_family_, accuracy_, block).Set(accuracy);
  PerBlock(eval_loss_family_, eval_loss_, block).Set(loss);
}

}  // namespace interlock
