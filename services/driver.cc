#include "services/driver.h"

#include "absl/strings/str_cat.h"
#include "services/status_macros.h"

namespace interlock {

BlockDriver::BlockDriver(std::unique_ptr<BlockTrainer> trainer,
                         Callbacks callbacks, int64_t first_step)
    : trainer_(std::move(trainer)),
      cb_(std::move(callbacks)),
      m_(trainer_->options().microbatches),
      step_(first_step) {}

absl::Status BlockDriver::OnForward(ForwardMsg msg) {
  const int k = trainer_->options().block;
  if (msg.mb < 0 || msg.mb >= m_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", k, ": micro-batch index ", msg.mb, " outside [0, ", m_, ")"));
  }
  const auto key = std::make_pair(msg.step, msg.mb);
  if (msg.step < step_ || (msg.step == step_ && msg.mb < forwarded_) ||
      forward_queue_.count(key)) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", k, ": step ", msg.step, " micro-batch ", msg.mb,
                     " is stale or repeated (block is at step ", step_, ")"));
  }
  forward_queue_.emplace(key, std::move(msg));
  return Drain();
}

absl::Status BlockDriver::OnUpward(UpwardMsg msg) {
  const int k = trainer_->options().block;
  const auto key = std::make_pair(msg.step, msg.mb);
  auto it = states_.find(key);
  if (trainer_->is_last() || it == states_.end() || it->second.below_seen ||
      upward_queue_.count(key)) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", k, ": unexpected upward message for step ",
                     msg.step, " micro-batch ", msg.mb));
  }
  if (trainer_->NeedsDownstream()) {
    if (static_cast<int>(msg.grads.size()) != trainer_->DownstreamListSize()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", k, ": expected ", trainer_->DownstreamListSize(),
          " gradients from below, got ", msg.grads.size()));
    }
    upward_queue_.emplace(key, std::move(msg));
    return Drain();
  }
  // 1-way: this block's backward is long done; only pass the reports on.
  MbState& st = it->second;
  st.below_seen = true;
  for (auto& r : msg.reports) st.reports.push_back(r);
  for (auto& t : msg.timings) st.timings.push_back(t);
  return MaybeSendUp(key.second, key.first);
}

absl::Status BlockDriver::Drain() {
  bool progress = true;
  while (progress) {
    progress = false;
    if (forwarded_ < m_) {
      auto it = forward_queue_.find({step_, forwarded_});
      if (it != forward_queue_.end()) {
        ForwardMsg msg = std::move(it->second);
        forward_queue_.erase(it);
        RETURN_IF_ERROR(RunForward(std::move(msg)));
        progress = true;
      }
    }
    // Backward passes run in micro-batch order whatever order the gradients
    // arrive in, so accumulated gradients are bitwise reproducible.
    if (backwarded_ < forwarded_) {
      auto it = upward_queue_.find({step_, backwarded_});
      if (it != upward_queue_.end()) {
        UpwardMsg msg = std::move(it->second);
        upward_queue_.erase(it);
        MbState& st = states_[{msg.step, msg.mb}];
        st.below_seen = true;
        for (auto& r : msg.reports) st.reports.push_back(r);
        for (auto& t : msg.timings) st.timings.push_back(t);
        RETURN_IF_ERROR(RunBackward(msg.mb, std::move(msg.grads)));
        progress = true;
      }
    }
    if (backwarded_ == m_) {
      ASSIGN_OR_RETURN(OpTiming t, trainer_->Step(lr_));
      const int64_t done = step_;
      ++step_;
      forwarded_ = backwarded_ = 0;
      if (cb_.step_done) cb_.step_done({trainer_->options().block, done, t});
      progress = true;
    }
  }
  return absl::OkStatus();
}

absl::Status BlockDriver::RunForward(ForwardMsg msg) {
  lr_ = msg.lr;
  ASSIGN_OR_RETURN(ForwardResult r,
                   trainer_->Forward(msg.mb, msg.input, msg.target));
  MbState& st = states_[{msg.step, msg.mb}];
  st.reports = std::move(r.reports);
  st.timings = std::move(r.timings);
  ++forwarded_;
  if (!trainer_->is_last()) {
    ForwardMsg down;
    down.step = msg.step;
    down.mb = msg.mb;
    down.lr = msg.lr;
    down.input = std::move(r.output);
    down.target = std::move(msg.target);
    cb_.send_down(std::move(down));
  }
  if (!trainer_->NeedsDownstream()) {
    RETURN_IF_ERROR(RunBackward(msg.mb, {}));
  }
  return absl::OkStatus();
}

absl::Status BlockDriver::RunBackward(int mb,
                                      std::vector<torch::Tensor> grads) {
  ASSIGN_OR_RETURN(BackwardResult r, trainer_->Backward(mb, std::move(grads)));
  MbState& st = states_[{step_, mb}];
  st.backward_done = true;
  st.upstream = std::move(r.upstream);
  for (auto& t : r.timings) st.timings.push_back(t);
  ++backwarded_;
  return MaybeSendUp(mb, step_);
}

absl::Status BlockDriver::MaybeSendUp(int mb, int64_t step) {
  auto it = states_.find({step, mb});
  if (it == states_.end()) return absl::OkStatus();
  MbState& st = it->second;
  if (!st.backward_done || (!st.below_seen && !trainer_->is_last())) {
    return absl::OkStatus();
  }
  UpwardMsg up;
  up.step = step;
  up.mb = mb;
  up.grads = std::move(st.upstream);
  up.reports = std::move(st.reports);
  up.timings = std::move(st.timings);
  states_.erase(it);
  cb_.send_up(std::move(up));
  return absl::OkStatus();
}

}  // namespace interlock
