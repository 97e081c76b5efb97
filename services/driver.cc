#include "services/driver.h"

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"

namespace interlock {
namespace {

// Trainer errors name the block and micro-batch; the driver adds the step.
absl::Status AtStep(int64_t step, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("step ", step, ": ", s.message()));
}

}  // namespace

BlockDriver::BlockDriver(std::unique_ptr<BlockTrainer> trainer,
                         Callbacks callbacks, int64_t first_step, int replica)
    : trainer_(std::move(trainer)),
      cb_(std::move(callbacks)),
      m_(trainer_->options().microbatches),
      step_(first_step),
      replica_(replica) {}

std::vector<int> BlockDriver::OwnMicrobatches(
    const std::vector<int32_t>& routes) const {
  std::vector<int> own;
  const int k = trainer_->options().block;
  const int blocks = trainer_->options().num_blocks;
  for (int mb = 0; mb < m_; ++mb) {
    if (routes.empty() || routes[mb * blocks + k] == replica_) {
      own.push_back(mb);
    }
  }
  return own;
}

int BlockDriver::OwnIndex(int mb) const {
  for (size_t i = 0; i < own_.size(); ++i) {
    if (own_[i] == mb) return static_cast<int>(i);
  }
  return -1;
}

bool BlockDriver::KnowOwn() {
  if (own_known_) return true;
  auto it = forward_queue_.lower_bound({step_, 0});
  if (it == forward_queue_.end() || it->first.first != step_) return false;
  routes_ = it->second.routes;
  own_ = OwnMicrobatches(routes_);
  own_known_ = true;
  return true;
}

bool BlockDriver::RunsNext(int64_t step, int mb,
                           const std::vector<int32_t>& routes) const {
  if (step != step_) return false;
  if (own_known_) {
    return forwarded_ < static_cast<int>(own_.size()) && own_[forwarded_] == mb;
  }
  const std::vector<int> own = OwnMicrobatches(routes);
  return !own.empty() && own[0] == mb;
}

absl::Status BlockDriver::OnForward(ForwardMsg msg) {
  const int k = trainer_->options().block;
  if (msg.mb < 0 || msg.mb >= m_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", k, ": micro-batch index ", msg.mb, " outside [0, ", m_, ")"));
  }
  const int blocks = trainer_->options().num_blocks;
  if (!msg.routes.empty() &&
      (static_cast<int64_t>(msg.routes.size()) != int64_t{m_} * blocks ||
       msg.routes[msg.mb * blocks + k] != replica_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", k, " replica ", replica_, ": step ", msg.step,
        " micro-batch ", msg.mb, " is not routed here (", msg.routes.size(),
        " route entries for ", m_, " micro-batches of ", blocks, " blocks)"));
  }
  if (msg.routes.empty() && replica_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", k, " replica ", replica_, ": step ", msg.step,
                     " micro-batch ", msg.mb, " carries no routes"));
  }
  // Every message of a step carries the step's routes: they must agree.
  const std::vector<int32_t>* step_routes = nullptr;
  if (msg.step == step_ && own_known_) {
    step_routes = &routes_;
  } else {
    auto it = forward_queue_.lower_bound({msg.step, 0});
    if (it != forward_queue_.end() && it->first.first == msg.step) {
      step_routes = &it->second.routes;
    }
  }
  if (step_routes && *step_routes != msg.routes) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", k, ": step ", msg.step, " micro-batch ", msg.mb,
                     " carries routes that differ from the step's others"));
  }
  const auto key = std::make_pair(msg.step, msg.mb);
  if (Seen(msg.step, msg.mb)) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", k, ": step ", msg.step, " micro-batch ", msg.mb,
                     " is stale or repeated (block is at step ", step_, ")"));
  }
  forward_queue_.emplace(key, std::move(msg));
  return Drain();
}

bool BlockDriver::Seen(int64_t step, int mb) const {
  if (step < step_ || forward_queue_.count({step, mb}) > 0) return true;
  if (step != step_ || !own_known_) return false;
  const int i = OwnIndex(mb);
  return i >= 0 && i < forwarded_;
}

bool BlockDriver::Idle() const {
  return forwarded_ == 0 && backwarded_ == 0 && forward_queue_.empty() &&
         states_.empty();
}

absl::StatusOr<std::string> BlockDriver::SaveState() const {
  if (!Idle()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", trainer_->options().block,
        ": cannot save state with micro-batches in flight (step ", step_, ")"));
  }
  return trainer_->SaveState(step_);
}

absl::Status BlockDriver::CheckIdleForLoad() const {
  if (Idle()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("block ", trainer_->options().block,
                   ": cannot load state with micro-batches in flight"));
}

absl::Status BlockDriver::LoadState(const std::string& archive, int64_t step) {
  RETURN_IF_ERROR(CheckIdleForLoad());
  ASSIGN_OR_RETURN(step_, trainer_->LoadState(archive, step));
  return absl::OkStatus();
}

absl::Status BlockDriver::LoadRecord(const BlockStateRecord& record,
                                     int64_t step) {
  RETURN_IF_ERROR(CheckIdleForLoad());
  ASSIGN_OR_RETURN(step_, trainer_->LoadRecord(record, step));
  return absl::OkStatus();
}

absl::Status BlockDriver::OnUpward(UpwardMsg msg) {
  const int k = trainer_->options().block;
  const auto key = std::make_pair(msg.step, msg.mb);
  auto it = states_.find(key);
  if (trainer_->is_last() || it == states_.end() || it->second.below_seen) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", k, ": unexpected upward message for step ",
                     msg.step, " micro-batch ", msg.mb));
  }
  MbState& st = it->second;
  const int d = trainer_->DownstreamListSize();
  // Check the whole message before anything changes.
  if (st.backward_done && !msg.grads.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", k, ": step ", msg.step, " micro-batch ", msg.mb,
                     ": gradient entries from below after its backward pass"));
  }
  if (!msg.nonfinite.empty() && msg.nonfinite.size() != msg.grads.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", k, ": step ", msg.step, " micro-batch ", msg.mb,
                     ": ", msg.nonfinite.size(), " non-finite marks for ",
                     msg.grads.size(), " gradients from below"));
  }
  const int unused = trainer_->UnusedDownstream();
  for (size_t i = 0; i < msg.grads.size(); ++i) {
    const int j = msg.first_entry + static_cast<int>(i);
    if (j < unused || j >= d || st.down[j].defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("block ", k, ": step ", msg.step, " micro-batch ",
                       msg.mb, ": gradient entry ", j, " from below is ",
                       (j < 0 || j >= d) ? absl::StrCat("outside [0, ", d, ")")
                       : j < unused ? std::string("one that trains no block")
                                    : std::string("repeated")));
    }
  }
  if (msg.final && st.down_count + static_cast<int>(msg.grads.size()) < d) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", k, ": step ", msg.step, " micro-batch ", msg.mb,
                     ": the final message from below came before all ", d,
                     " gradient entries"));
  }
  for (size_t i = 0; i < msg.grads.size(); ++i) {
    const int j = msg.first_entry + static_cast<int>(i);
    st.down[j] = std::move(msg.grads[i]);
    st.down_nonfinite[j] = !msg.nonfinite.empty() && msg.nonfinite[i];
    ++st.down_count;
    // Downstream entry j is list entry j + 1: its upstream entry can go now.
    if (trainer_->IsEarlyEntry(j + 1)) {
      RETURN_IF_ERROR(SendEntry(msg.step, msg.mb, j + 1, st, st.down[j],
                                st.down_nonfinite[j]));
    }
  }
  if (msg.final) {
    st.below_seen = true;
    for (auto& r : msg.reports) st.reports.push_back(r);
    for (auto& t : msg.timings) st.timings.push_back(t);
  }
  RETURN_IF_ERROR(Drain());
  // 1-way, or a backward long done: only the reports travel on.
  if (msg.final) MaybeSendUp(msg.mb, msg.step);
  return absl::OkStatus();
}

absl::Status BlockDriver::Drain() {
  const int d = trainer_->DownstreamListSize();
  bool progress = true;
  while (progress && KnowOwn()) {
    progress = false;
    const int own = static_cast<int>(own_.size());
    if (forwarded_ < own) {
      auto it = forward_queue_.find({step_, own_[forwarded_]});
      if (it != forward_queue_.end()) {
        ForwardMsg msg = std::move(it->second);
        forward_queue_.erase(it);
        RETURN_IF_ERROR(RunForward(std::move(msg)));
        progress = true;
      }
    }
    // Parameter backward passes run in micro-batch order whatever order the
    // gradients arrive in, so accumulated gradients are bitwise
    // reproducible.
    if (d > 0 && backwarded_ < forwarded_) {
      auto it = states_.find({step_, own_[backwarded_]});
      if (it != states_.end() && it->second.down_count == d) {
        RETURN_IF_ERROR(RunBackward(own_[backwarded_]));
        progress = true;
      }
    }
    if (backwarded_ == own) {
      auto stepped = trainer_->Step(lr_);
      if (!stepped.ok()) return AtStep(step_, stepped.status());
      const OpTiming t = *stepped;
      const int64_t done = step_;
      ++step_;
      forwarded_ = backwarded_ = 0;
      own_known_ = false;
      if (cb_.step_done) {
        cb_.step_done({trainer_->options().block, done, t,
                       trainer_->last_step_skipped(),
                       trainer_->last_applied()});
      }
      progress = true;
    }
  }
  return absl::OkStatus();
}

absl::Status BlockDriver::RunForward(ForwardMsg msg) {
  lr_ = msg.lr;
  // The output goes down before the head runs, so the next block starts
  // while this one trains its head.
  auto forwarded =
      trainer_->ForwardBlock(msg.mb, msg.input, msg.target, msg.nonfinite);
  if (!forwarded.ok()) return AtStep(msg.step, forwarded.status());
  ForwardResult r = *std::move(forwarded);
  MbState& st = states_[{msg.step, msg.mb}];
  st.down.resize(trainer_->DownstreamListSize());
  st.down_nonfinite.assign(trainer_->DownstreamListSize(), false);
  // Entries that train no block never come.
  st.down_count = trainer_->UnusedDownstream();
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
    down.nonfinite = r.output_nonfinite;
    down.routes = std::move(msg.routes);
    cb_.send_down(std::move(down));
  }
  auto head = trainer_->ForwardHead(msg.mb);
  if (!head.ok()) return AtStep(msg.step, head.status());
  for (auto& rep : head->reports) st.reports.push_back(rep);
  for (auto& t : head->timings) st.timings.push_back(t);
  // The block's own gradient is entry 0: upstream may have it at once.
  if (trainer_->IsEarlyEntry(0)) {
    RETURN_IF_ERROR(SendEntry(msg.step, msg.mb, 0, st, torch::Tensor()));
  }
  if (!trainer_->NeedsDownstream()) RETURN_IF_ERROR(RunBackward(msg.mb));
  return absl::OkStatus();
}

absl::Status BlockDriver::SendEntry(int64_t step, int mb, int i, MbState& st,
                                    const torch::Tensor& entry,
                                    bool entry_nonfinite) {
  auto entry_result = trainer_->Entry(mb, i, entry, entry_nonfinite);
  if (!entry_result.ok()) return AtStep(step, entry_result.status());
  st.timings.push_back(entry_result->timing);
  SendGradient(step, mb, i, std::move(entry_result->grad),
               entry_result->nonfinite);
  return absl::OkStatus();
}

void BlockDriver::SendGradient(int64_t step, int mb, int i, torch::Tensor grad,
                               bool nonfinite) {
  UpwardMsg up;
  up.step = step;
  up.mb = mb;
  up.first_entry = i;
  up.final = false;
  up.grads.push_back(std::move(grad));
  // Marks travel only when set, so the usual message is unchanged.
  if (nonfinite) up.nonfinite.push_back(true);
  cb_.send_up(std::move(up));
}

absl::Status BlockDriver::RunBackward(int mb) {
  MbState& st = states_[{step_, mb}];
  auto backward = trainer_->Backward(mb, std::move(st.down), st.down_nonfinite);
  if (!backward.ok()) return AtStep(step_, backward.status());
  BackwardResult r = *std::move(backward);
  st.down.clear();
  st.down_nonfinite.clear();
  st.backward_done = true;
  for (auto& t : r.timings) st.timings.push_back(t);
  if (r.shared.defined()) {
    SendGradient(step_, mb, trainer_->SharedEntry(), std::move(r.shared),
                 r.shared_nonfinite);
  }
  ++backwarded_;
  MaybeSendUp(mb, step_);
  return absl::OkStatus();
}

void BlockDriver::MaybeSendUp(int mb, int64_t step) {
  auto it = states_.find({step, mb});
  if (it == states_.end()) return;
  MbState& st = it->second;
  if (!st.backward_done || (!st.below_seen && !trainer_->is_last())) return;
  UpwardMsg up;
  up.step = step;
  up.mb = mb;
  up.reports = std::move(st.reports);
  up.timings = std::move(st.timings);
  states_.erase(it);
  cb_.send_up(std::move(up));
}

}  // namespace interlock
