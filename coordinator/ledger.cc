#include "coordinator/ledger.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace interlock {

Ledger::Ledger(int64_t steps, int blocks, int microbatches)
    : k_(blocks),
      m_(microbatches),
      completions_(steps, 0),
      block_steps_(steps, 0),
      block_grads_(steps, 0),
      steps_done_(blocks, 0) {}

void Ledger::Restored(int64_t steps) {
  for (int64_t s = 0; s < steps; ++s) {
    completions_[s] = m_;
    block_steps_[s] = k_;
    block_grads_[s] = int64_t{k_} * m_;
  }
  acc_.resumed_from_step = steps;
}

void Ledger::ResetFrom(int64_t from) {
  for (int64_t s = from; s < static_cast<int64_t>(completions_.size()); ++s) {
    acc_.microbatches_replayed += completions_[s];
    completions_[s] = 0;
    block_steps_[s] = 0;
    block_grads_[s] = 0;
  }
  steps_done_.assign(k_, from);
}

bool Ledger::OnBlockStep(int block, int64_t step, int microbatches,
                         bool skipped) {
  ++steps_done_[block];
  ++block_steps_[step];
  block_grads_[step] += microbatches;
  return skipped && skipped_.insert({step, block}).second;
}

bool Ledger::AppliedOnce(int64_t s) const {
  return completions_[s] == m_ && block_steps_[s] == k_ &&
         block_grads_[s] == int64_t{k_} * m_;
}

absl::Status Ledger::CheckThrough(int64_t steps) const {
  for (int64_t s = 0; s < steps; ++s) {
    if (!AppliedOnce(s)) {
      return absl::InternalError(absl::StrCat("checkpoint at step ", steps,
                                              ": step ", s,
                                              " was not applied exactly once"));
    }
  }
  return absl::OkStatus();
}

absl::Status Ledger::Close(int64_t steps) {
  acc_.microbatches_per_step = m_;
  acc_.microbatches_applied = 0;
  acc_.block_steps = 0;
  acc_.steps_not_exactly_once.clear();
  for (int64_t s = 0; s < steps; ++s) {
    acc_.microbatches_applied += completions_[s];
    acc_.block_steps += block_steps_[s];
    if (!AppliedOnce(s)) acc_.steps_not_exactly_once.push_back(s);
  }
  if (!acc_.steps_not_exactly_once.empty()) {
    return absl::InternalError(
        absl::StrCat(acc_.steps_not_exactly_once.size(),
                     " steps were not applied exactly once, the first ",
                     acc_.steps_not_exactly_once.front()));
  }
  return absl::OkStatus();
}

int64_t Ledger::MinStepsDone() const {
  int64_t m = std::numeric_limits<int64_t>::max();
  for (int64_t v : steps_done_) m = std::min(m, v);
  return m;
}

std::vector<int64_t> Ledger::SkippedPerBlock() const {
  std::vector<int64_t> out(k_, 0);
  for (const auto& [step, block] : skipped_) ++out[block];
  return out;
}

}  // namespace interlock
