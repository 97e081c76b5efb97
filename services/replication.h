// What a BlockTrainer keeps during a step when its block has replicas
// (ARCHITECTURE: replicas), and the reduction that lets every replica apply the
// same optimizer step. Each replica runs only the micro-batches routed to it.
//
// ORDERED keeps every micro-batch's gradient contribution apart (a row of an
// M x P buffer), sums the rows over the replicas as integers (each row is
// non-zero on one replica only, so the sum is a copy) and then adds them up
// in micro-batch order exactly as autograd would have: the gradients are
// bitwise those of one trainer that ran all M micro-batches.
// RING sums the replicas' accumulated gradients as floats.
// In both modes each BatchNorm layer's per-micro-batch statistics are kept
// apart and replayed into the running statistics in micro-batch order with
// the update ATen's CPU kernel makes, so the buffers are bitwise a single
// trainer's (docs/ARCHITECTURE.md, "Block replicas").
#ifndef INTERLOCK_SERVICES_REPLICATION_H_
#define INTERLOCK_SERVICES_REPLICATION_H_

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/config.pb.h"
#include "services/collective.h"

namespace interlock {

class Replication {
 public:
  // `params`: the trained parameters (block, then head) in a fixed order;
  // `block` and `head` (head may be empty): where the BatchNorm layers are.
  Replication(std::shared_ptr<Collective> group,
              interlock::v1::TrainingSpec::Reduction mode, int block_index,
              int microbatches, std::vector<torch::Tensor> params,
              const torch::nn::Sequential& block,
              const torch::nn::Sequential& head);
  ~Replication();

  // While alive, every BatchNorm layer writes into zeroed stand-ins for its
  // running statistics with momentum 1: a train-mode forward then leaves
  // exactly the micro-batch's mean and unbiased variance there, and the real
  // statistics untouched. The destructor puts the real ones back.
  class StatsCapture {
   public:
    StatsCapture(Replication& r, int mb);
    ~StatsCapture();
    StatsCapture(const StatsCapture&) = delete;
    StatsCapture& operator=(const StatsCapture&) = delete;
    // Keeps the captured statistics as micro-batch mb's.
    absl::Status Keep();

   private:
    struct Saved {
      torch::Tensor mean, var, count;
      c10::optional<double> momentum;
    };
    Replication& r_;
    const int mb_;
    std::vector<Saved> saved_;
  };

  // Errors name the block. Whether micro-batch `mb` may be forwarded now (in
  // range, not yet this step, and the block holds nothing the replicas cannot
  // keep equal).
  absl::Status CheckForward(int mb) const;
  // ORDERED: moves the gradients the parameters now hold (micro-batch mb's
  // contribution) into its row and leaves them undefined. RING: nothing.
  void TakeGradients(int mb);

  struct Totals {
    bool skip = false;    // some replica met a non-finite value
    int accumulated = 0;  // micro-batch gradients over every replica
    // The first, small exchange (flags and counts): it ends only when the
    // last replica has arrived, so it is the wait for the slowest one;
    // the rest of the reduction is the gradients' own exchange.
    double wait_seconds = 0.0;
  };
  // Reduces with the group. On success the parameters hold the step's
  // gradients and the BatchNorm layers their running statistics after all
  // the step's micro-batches; the captures are cleared either way.
  absl::StatusOr<Totals> Reduce(bool skip, int accumulated);
  // Drops everything captured this step.
  void Reset();

  const Collective& group() const { return *group_; }

 private:
  struct Norm;
  absl::StatusOr<Totals> ReduceImpl(bool skip, int accumulated);
  absl::Status ReplayStatistics();
  int32_t* Row(int mb) { return meta_.data_ptr<int32_t>() + mb * row_width_; }

  std::shared_ptr<Collective> group_;
  const bool ordered_;
  const int block_;  // for messages
  const int m_;
  std::vector<torch::Tensor> params_;
  std::vector<int64_t> offsets_;  // of each parameter in a gradient row
  int64_t numel_ = 0;             // P
  std::vector<Norm> norms_;
  // A buffer no replica can keep equal (not a BatchNorm statistic), if any.
  std::string unsupported_;
  // Int32 words: M rows of [per-parameter "has a gradient" flags (ORDERED
  // only) | per-norm: calls, mean bits, variance bits], then per-parameter
  // flags (RING only), the skip flag and the accumulated count.
  int64_t row_width_ = 0;
  int64_t stats_offset_ = 0;  // of the statistics within a row
  int64_t tail_ = 0;          // offset of the words after the rows
  torch::Tensor meta_;
  torch::Tensor grads_;  // ORDERED: [M, P] float32 contributions
  std::vector<bool> forwarded_;
};

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_REPLICATION_H_
