#include "analysis/virtual_clock.h"

#include <algorithm>

#include "plan/replica_routes.h"

namespace interlock {

const char* SpanKindName(SpanKind kind) {
  switch (kind) {
    case SpanKind::kForward:
      return "forward";
    case SpanKind::kHead:
      return "head";
    case SpanKind::kBackward:
      return "backward";
    case SpanKind::kOptimizer:
      return "optimizer";
    case SpanKind::kInputGrad:
      return "input_grad";
    case SpanKind::kReduce:
      return "reduce";
  }
  return "?";
}

PipelineSim::PipelineSim(PipelineShape shape, int64_t keep_span_steps)
    : shape_(std::move(shape)), keep_span_steps_(keep_span_steps) {
  shape_.down_bytes.resize(std::max(0, shape_.blocks - 1), 0);
  shape_.up_bytes.resize(std::max(0, shape_.blocks - 1), 0);
  shape_.window = std::max(1, shape_.window);
  shape_.replicas.resize(shape_.blocks, 1);
  for (int& r : shape_.replicas) r = std::max(1, r);
  shape_.parameters.resize(shape_.blocks, 0);
  index_.resize(shape_.blocks);
  initial_.resize(shape_.blocks);
  for (int k = 0; k < shape_.blocks; ++k) {
    for (int r = 0; r < shape_.replicas[k]; ++r) {
      index_[k].push_back(static_cast<int>(tracks_.size()));
      initial_[k].push_back(r);
      Track& t = tracks_.emplace_back();
      t.block = k;
      t.replica = r;
    }
  }
  for (int k = 0; k < static_cast<int>(tracks_.size()); ++k) BeginStep(k, 0);
}

void PipelineSim::SetMembers(int64_t step,
                             std::vector<std::vector<int>> members) {
  members.resize(shape_.blocks);
  for (int k = 0; k < shape_.blocks; ++k) {
    if (members[k].empty()) members[k] = Members(step, k);
    for (int r : members[k]) {
      while (r >= shape_.replicas[k]) {
        // A new replica: idle in every step until `step`, counted as done
        // with each from the first step not yet finished on.
        index_[k].push_back(static_cast<int>(tracks_.size()));
        Track& t = tracks_.emplace_back();
        t.block = k;
        t.replica = shape_.replicas[k]++;
        t.member = false;
        t.step = steps_finished();
      }
    }
  }
  members_[step] = std::move(members);
  // Nothing of `step` or later has been submitted (RunClock sees to it):
  // routes and the tracks' shares of those steps are worked out afresh.
  routes_.erase(routes_.lower_bound(step), routes_.end());
  for (int k = 0; k < static_cast<int>(tracks_.size()); ++k) {
    if (tracks_[k].step >= step) BeginStep(k, tracks_[k].step);
  }
  // The tracks just added may be behind steps already under way.
  SkipIdle();
}

const std::vector<int>& PipelineSim::Members(int64_t step, int block) const {
  auto it = members_.upper_bound(step);
  return it == members_.begin() ? initial_[block]
                                : std::prev(it)->second[block];
}

void PipelineSim::SkipIdle() {
  const int m = shape_.microbatches;
  const int64_t begun = (sent_ + m - 1) / m;  // steps with a micro-batch sent
  for (int k = 0; k < static_cast<int>(tracks_.size()); ++k) {
    Track& t = tracks_[k];
    while (!t.member && t.step < begun) {
      ++partial_end_[t.step].first;
      BeginStep(k, t.step + 1);
    }
  }
}

double PipelineSim::Busy(int block) const {
  double busy = 0;
  for (int r = 0; r < shape_.Replicas(block); ++r) {
    busy += ReplicaBusy(block, r);
  }
  return busy;
}

double PipelineSim::BusyPhase(int block, SpanKind kind,
                              bool after_first) const {
  double busy = 0;
  for (int r = 0; r < shape_.Replicas(block); ++r) {
    const Track& t = tracks_[Index(block, r)];
    busy += t.phase_busy[static_cast<int>(kind)];
    if (after_first) busy -= t.first_step_busy[static_cast<int>(kind)];
  }
  return busy;
}

double PipelineSim::ReplicaMicrobatchSeconds(int block, int replica) const {
  const Track& t = tracks_[Index(block, replica)];
  double seconds = 0;
  for (SpanKind kind : {SpanKind::kForward, SpanKind::kHead,
                        SpanKind::kBackward, SpanKind::kInputGrad}) {
    seconds += t.phase_busy[static_cast<int>(kind)];
  }
  return seconds;
}

int PipelineSim::TrackOf(int block, int64_t step, int mb) {
  const std::vector<int>& members = Members(step, block);
  if (members.size() == 1) return Index(block, members[0]);
  auto it = routes_.find(step);
  if (it == routes_.end()) {
    std::vector<int> counts(shape_.blocks);
    for (int k = 0; k < shape_.blocks; ++k) {
      counts[k] = static_cast<int>(Members(step, k).size());
    }
    it = routes_
             .emplace(step, RouteStep(step + shape_.first_step,
                                      shape_.microbatches, counts))
             .first;
  }
  // Routes index the step's members; one out of range (routes of another
  // topology) wraps rather than reading past them.
  const int r = it->second[static_cast<size_t>(mb) * shape_.blocks + block];
  return Index(block,
               members[static_cast<size_t>(std::max(0, r)) % members.size()]);
}

void PipelineSim::BeginStep(int k, int64_t step) {
  Track& t = tracks_[k];
  t.step = step;
  t.forwarded = t.backwarded = 0;
  t.at_reduction = t.reduced = false;
  t.own.clear();
  const auto& members = Members(step, t.block);
  t.member =
      std::find(members.begin(), members.end(), t.replica) != members.end();
  if (!t.member) return;
  for (int mb = 0; mb < shape_.microbatches; ++mb) {
    if (TrackOf(t.block, step, mb) == k) t.own.push_back(mb);
  }
}

void PipelineSim::ArriveAtReduction(int k, double t) {
  Track& tr = tracks_[k];
  tr.at_reduction = true;
  Barrier& b = barriers_[{tr.step, tr.block}];
  ++b.arrived;
  b.last = std::max(b.last, t);
  const std::vector<int>& members = Members(tr.step, tr.block);
  const int n = static_cast<int>(members.size());
  if (b.arrived < n) return;
  // Everyone is in: the reduction runs from the last arrival on every
  // replica at once, and ends together.
  const double seconds = shape_.ReductionSeconds(tr.block, n);
  for (int r : members) {
    AddSpan(Index(tr.block, r), SpanKind::kReduce, tr.step, -1, b.last,
            seconds);
    Push(b.last + seconds, Index(tr.block, r), MsgKind::kReduced, tr.step, -1);
  }
  barriers_.erase({tr.step, tr.block});
}

void PipelineSim::SetMicrobatch(int64_t step, int mb,
                                std::vector<MbDurations> blocks) {
  blocks.resize(shape_.blocks);
  mb_durations_[{step, mb}] = std::move(blocks);
}

void PipelineSim::SetOptimizer(int64_t step, int block, double seconds) {
  optimizer_[{step, block}] = seconds;
}

void PipelineSim::SetSubmitted(int64_t count) {
  submitted_known_ = std::max(submitted_known_, count);
}

void PipelineSim::Finish() { finished_ = true; }

const MbDurations* PipelineSim::Durations(int64_t step, int mb, int k) const {
  auto it = mb_durations_.find({step, mb});
  return it == mb_durations_.end() ? nullptr : &it->second[k];
}

void PipelineSim::Push(double time, int dest, MsgKind kind, int64_t step,
                       int mb, int entry) {
  Event e;
  e.time = time;
  e.seq = seq_++;
  e.dest = dest;
  e.kind = kind;
  e.step = step;
  e.mb = mb;
  e.entry = entry;
  events_.push(e);
}

void PipelineSim::AddSpan(int k, SpanKind kind, int64_t step, int mb,
                          double start, double seconds) {
  Track& b = tracks_[k];
  b.busy += seconds;
  b.phase_busy[static_cast<int>(kind)] += seconds;
  if (step == 0) b.first_step_busy[static_cast<int>(kind)] += seconds;
  if (step < keep_span_steps_ && seconds > 0) {
    spans_.push_back(
        Span{b.block, kind, step, mb, start, start + seconds, b.replica});
  }
}

bool PipelineSim::Submit(double t) {
  const int m = shape_.microbatches;
  while (sent_ - completed_ < shape_.window) {
    if (sent_ >= submitted_known_) {
      // Unknown whether the runner submits more: wait for it to say.
      return finished_;
    }
    const int64_t step = sent_ / m;
    const int mb = static_cast<int>(sent_ % m);
    Push(t + shape_.link.Seconds(shape_.input_bytes), TrackOf(0, step, mb),
         MsgKind::kForward, step, mb);
    ++sent_;
  }
  return true;
}

// Upstream entry i of block k, sent to block k-1 as its downstream entry i.
void PipelineSim::EntryPass(int k, int64_t step, int mb, int i,
                            const MbDurations& d, double& t) {
  const int block = tracks_[k].block;
  const double seconds = d.input_grad / std::max(1, shape_.EarlyCount(block));
  AddSpan(k, SpanKind::kInputGrad, step, mb, t, seconds);
  t += seconds;
  const int64_t entry_bytes =
      shape_.up_bytes[block - 1] / std::max(1, shape_.Down(block - 1));
  Push(t + shape_.link.Seconds(entry_bytes), TrackOf(block - 1, step, mb),
       MsgKind::kGradient, step, mb, i);
}

void PipelineSim::SendFinal(int k, int mb, int64_t step, double t) {
  // Reports and timings only: small.
  const int block = tracks_[k].block;
  Push(t + shape_.link.Seconds(0),
       block == 0 ? -1 : TrackOf(block - 1, step, mb),
       block == 0 ? MsgKind::kCompletion : MsgKind::kFinal, step, mb);
  tracks_[k].states.erase({step, mb});
}

void PipelineSim::Backward(int k, int mb, double& t) {
  Track& b = tracks_[k];
  const int block = b.block;
  const MbDurations& d = *Durations(b.step, mb, block);
  AddSpan(k, SpanKind::kBackward, b.step, mb, t, d.backward);
  t += d.backward;
  ++b.backwarded;
  const int shared = shape_.Shared(block);
  if (shared >= 0) {
    const int64_t entry_bytes =
        shape_.up_bytes[block - 1] / std::max(1, shape_.Down(block - 1));
    Push(t + shape_.link.Seconds(entry_bytes), TrackOf(block - 1, b.step, mb),
         MsgKind::kGradient, b.step, mb, shared);
  }
  MbState& st = b.states[{b.step, mb}];
  st.backward_done = true;
  if (st.below_seen || block + 1 == shape_.blocks) {
    SendFinal(k, mb, b.step, t);
  }
}

bool PipelineSim::Drain(int k, double& t) {
  Track& b = tracks_[k];
  const int block = b.block;
  const int down = shape_.Down(block);
  bool progress = true;
  while (progress && b.member) {
    progress = false;
    // This step's micro-batches here (BeginStep below changes them).
    const int mine = static_cast<int>(b.own.size());
    if (b.forwarded < mine &&
        b.forward_queue.count({b.step, b.own[b.forwarded]})) {
      const int mb = b.own[b.forwarded];
      const MbDurations* d = Durations(b.step, mb, block);
      if (d == nullptr) return false;
      b.forward_queue.erase({b.step, mb});
      AddSpan(k, SpanKind::kForward, b.step, mb, t, d->forward);
      t += d->forward;
      // The output leaves before the head runs, as BlockDriver sends it.
      if (block + 1 < shape_.blocks) {
        Push(t + shape_.link.Seconds(shape_.down_bytes[block]),
             TrackOf(block + 1, b.step, mb), MsgKind::kForward, b.step, mb);
      }
      AddSpan(k, SpanKind::kHead, b.step, mb, t, d->head);
      t += d->head;
      ++b.forwarded;
      ++b.microbatches;
      // Entries that train no block never come (GradientLists::Used).
      b.states[{b.step, mb}].down_count += shape_.Lists().UnusedDown(block);
      if (shape_.Early(block, 0)) EntryPass(k, b.step, mb, 0, *d, t);
      if (down == 0) Backward(k, mb, t);
      progress = true;
    }
    if (down > 0 && b.backwarded < b.forwarded) {
      const int mb = b.own[b.backwarded];
      auto it = b.states.find({b.step, mb});
      if (it != b.states.end() && it->second.down_count == down) {
        if (Durations(b.step, mb, block) == nullptr) return false;
        Backward(k, mb, t);
        progress = true;
      }
    }
    if (b.backwarded == mine) {
      if (Members(b.step, block).size() > 1 && !b.reduced) {
        // The optimizer step waits for the reduction (a kReduced event).
        if (!b.at_reduction) ArriveAtReduction(k, t);
        break;
      }
      auto it = optimizer_.find({b.step, block});
      if (it == optimizer_.end()) return false;
      AddSpan(k, SpanKind::kOptimizer, b.step, -1, t, it->second);
      t += it->second;
      auto& [count, end] = partial_end_[b.step];
      ++count;
      end = std::max(end, t);
      BeginStep(k, b.step + 1);
      progress = true;
    }
  }
  b.free_at = t;
  return true;
}

bool PipelineSim::Deliver(const Event& e, double& t) {
  Track& b = tracks_[e.dest];
  switch (e.kind) {
    case MsgKind::kForward:
      b.forward_queue.insert({e.step, e.mb});
      return true;
    case MsgKind::kGradient: {
      // Downstream entry j is list entry j + 1: its early pass runs now.
      const bool pass = shape_.Early(b.block, e.entry + 1);
      const MbDurations* d = Durations(e.step, e.mb, b.block);
      if (pass && d == nullptr) return false;
      ++b.states[{e.step, e.mb}].down_count;
      if (pass) EntryPass(e.dest, e.step, e.mb, e.entry + 1, *d, t);
      b.free_at = t;
      return true;
    }
    case MsgKind::kFinal: {
      MbState& st = b.states[{e.step, e.mb}];
      st.below_seen = true;
      if (st.backward_done) SendFinal(e.dest, e.mb, e.step, t);
      return true;
    }
    case MsgKind::kReduced:
      b.reduced = true;
      return true;
    case MsgKind::kCompletion:
      break;
  }
  return true;
}

void PipelineSim::RecordFinishedSteps() {
  SkipIdle();
  for (auto it = partial_end_.find(steps_finished());
       it != partial_end_.end() && it->second.first == shape_.Tracks();
       it = partial_end_.find(steps_finished())) {
    step_end_.push_back(it->second.second);
    partial_end_.erase(it);
    // Every block is past this step: its durations are not needed again.
    const int64_t done = steps_finished() - 1;
    mb_durations_.erase(mb_durations_.lower_bound({done, 0}),
                        mb_durations_.lower_bound({done + 1, 0}));
    optimizer_.erase(optimizer_.lower_bound({done, 0}),
                     optimizer_.lower_bound({done + 1, 0}));
    routes_.erase(done);
  }
}

void PipelineSim::Advance() {
  AdvanceEvents();
  RecordFinishedSteps();
}

void PipelineSim::AdvanceEvents() {
  // Pick up where an interrupted replay stopped.
  switch (stall_) {
    case Stall::kNone:
      if (sent_ == 0 && !Submit(0.0)) {
        stall_ = Stall::kSubmit;
        stalled_time_ = 0.0;
        return;
      }
      break;
    case Stall::kSubmit:
      if (!Submit(stalled_time_)) return;
      break;
    case Stall::kDrain:
      if (!Drain(stalled_event_.dest, stalled_time_)) return;
      break;
    case Stall::kDeliver:
      events_.push(stalled_event_);
      break;
  }
  stall_ = Stall::kNone;
  while (!events_.empty()) {
    RecordFinishedSteps();
    const Event e = events_.top();
    events_.pop();
    now_ = std::max(now_, e.time);
    if (e.kind == MsgKind::kCompletion) {
      ++completed_;
      if (!Submit(e.time)) {
        stall_ = Stall::kSubmit;
        stalled_time_ = e.time;
        return;
      }
      continue;
    }
    double t = std::max(tracks_[e.dest].free_at, e.time);
    if (!Deliver(e, t)) {
      stall_ = Stall::kDeliver;
      stalled_event_ = e;
      return;
    }
    if (e.kind == MsgKind::kFinal) continue;  // no work: reports pass on
    if (!Drain(e.dest, t)) {
      stall_ = Stall::kDrain;
      stalled_event_ = e;
      stalled_time_ = t;
      return;
    }
  }
}

int InputOnlyPasses(bool e2e, int n, bool sum_rule, int blocks, int k) {
  return GradientLists{blocks, e2e, n, sum_rule}.EarlyCount(k);
}

SimResult Simulate(const PipelineShape& shape,
                   const std::vector<BlockProfile>& blocks, int64_t steps,
                   int64_t warmup) {
  PipelineSim sim(shape);
  std::vector<MbDurations> per_mb(shape.blocks);
  for (int k = 0; k < shape.blocks; ++k) {
    per_mb[k] = {blocks[k].forward, blocks[k].head, blocks[k].backward,
                 blocks[k].input_grad};
  }
  for (int64_t s = 0; s < steps; ++s) {
    for (int mb = 0; mb < shape.microbatches; ++mb) {
      sim.SetMicrobatch(s, mb, per_mb);
    }
    for (int k = 0; k < shape.blocks; ++k) {
      sim.SetOptimizer(s, k, blocks[k].optimizer);
    }
  }
  sim.SetSubmitted(steps * shape.microbatches);
  sim.Finish();
  sim.Advance();
  SimResult r;
  if (sim.steps_finished() < steps || steps == 0) return r;
  warmup = std::clamp<int64_t>(warmup, 0, steps - 1);
  const double from = warmup == 0 ? 0.0 : sim.StepEnd(warmup - 1);
  r.elapsed = sim.StepEnd(steps - 1);
  r.step_seconds = (r.elapsed - from) / static_cast<double>(steps - warmup);
  const PipelineShape& sh = sim.shape();
  auto ratio = [&](double busy, int tracks) {
    return r.elapsed > 0 ? busy / (tracks * r.elapsed) : 0.0;
  };
  double total = 0;
  for (int k = 0; k < shape.blocks; ++k) {
    const double busy = sim.Busy(k);
    total += busy;
    r.busy_ratio.push_back(ratio(busy, sh.Replicas(k)));
    auto& replicas = r.replica_busy_ratio.emplace_back();
    for (int i = 0; i < sh.Replicas(k); ++i) {
      replicas.push_back(ratio(sim.ReplicaBusy(k, i), 1));
    }
  }
  r.utilisation = ratio(total, sh.Tracks());
  return r;
}

}  // namespace interlock
