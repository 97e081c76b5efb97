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
  m->desired_family_ =
      &prometheus::BuildGauge()
           .Name("interlock_coordinator_desired_replicas")
           .Help(
               "Replicas a block should have: those configured, plus joins, "
               "minus leaves (a failure leaves it below)")
           .Register(r);
  m->changes_family_ =
      &prometheus::BuildCounter()
           .Name("interlock_coordinator_membership_changes_total")
           .Help("Replicas that joined, left or failed, by kind")
           .Register(r);
  m->refusals_family_ =
      &prometheus::BuildCounter()
           .Name("interlock_coordinator_membership_refusals_total")
           .Help("Register and Leave calls refused, by reason")
           .Register(r);
  for (const char* kind : {"join", "leave", "failure"}) {
    m->changes_family_->Add({{"kind", kind}, {"mode", mode}});
  }
  for (const std::string& reason : Membership::RefusalReasons()) {
    m->refusals_family_->Add({{"reason", reason}, {"mode", mode}});
  }
  m->generation_ = &prometheus::BuildGauge()
                        .Name("interlock_coordinator_topology_generation")
                        .Help("Generation of the topology in force")
                        .Register(r)
                        .Add(labels);
  m->generation_->Set(1);
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
  int desired = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    desired = desired_count_.emplace(block, replicas).first->second;
  }
  PerBlock(desired_family_, desired_, block).Set(desired);
}

void CoordinatorMetrics::OnTopology(const TopologyEvent& e) {
  for (size_t b = 0; b < e.replicas.size(); ++b) {
    SetReplicas(static_cast<int>(b), e.replicas[b]);
  }
  for (const auto& c : e.changes) {
    changes_family_->Add({{"kind", MemberChangeName(c.kind)}, {"mode", mode_}})
        .Increment();
    if (c.kind == MemberChangeKind::kFailure) continue;
    int desired = 0;
    {
      std::lock_guard<std::mutex> l(mu_);
      desired = desired_count_[c.block] +=
          c.kind == MemberChangeKind::kJoin ? 1 : -1;
    }
    PerBlock(desired_family_, desired_, c.block).Set(desired);
  }
  generation_->Set(static_cast<double>(e.generation));
}

void CoordinatorMetrics::OnRefused(const std::string& reason) {
  refusals_family_->Add({{"reason", reason}, {"mode", mode_}}).Increment();
}

void CoordinatorMetrics::OnEval(int block, double accuracy, double loss) {
  PerBlock(accuracy_family_, accuracy_, block).Set(accuracy);
  PerBlock(eval_loss_family_, eval_loss_, block).Set(loss);
}

}  // namespace interlock
