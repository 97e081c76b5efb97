#include "analysis/virtual_clock.h"

#include <algorithm>

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
  }
  return "?";
}

PipelineSim::PipelineSim(PipelineShape shape, int64_t keep_span_steps)
    : shape_(std::move(shape)),
      keep_span_steps_(keep_span_steps),
      blocks_(shape_.blocks) {
  shape_.down_bytes.resize(std::max(0, shape_.blocks - 1), 0);
  shape_.up_bytes.resize(std::max(0, shape_.blocks - 1), 0);
  shape_.window = std::max(1, shape_.window);
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
  Block& b = blocks_[k];
  b.busy += seconds;
  b.phase_busy[static_cast<int>(kind)] += seconds;
  if (step < keep_span_steps_ && seconds > 0) {
    spans_.push_back(Span{k, kind, step, mb, start, start + seconds});
  }
}

bool PipelineSim::Submit(double t) {
  const int m = shape_.microbatches;
  while (sent_ - completed_ < shape_.window) {
    if (sent_ >= submitted_known_) {
      // Unknown whether the runner submits more: wait for it to say.
      return finished_;
    }
    Push(t + shape_.link.Seconds(shape_.input_bytes), 0, MsgKind::kForward,
         sent_ / m, static_cast<int>(sent_ % m));
    ++sent_;
  }
  return true;
}

// Upstream entry i of block k, sent to block k-1 as its downstream entry i.
void PipelineSim::EntryPass(int k, int64_t step, int mb, int i,
                            const MbDurations& d, double& t) {
  const double seconds = d.input_grad / std::max(1, shape_.EarlyCount(k));
  AddSpan(k, SpanKind::kInputGrad, step, mb, t, seconds);
  t += seconds;
  const int64_t entry_bytes =
      shape_.up_bytes[k - 1] / std::max(1, shape_.Down(k - 1));
  Push(t + shape_.link.Seconds(entry_bytes), k - 1, MsgKind::kGradient, step,
       mb, i);
}

void PipelineSim::SendFinal(int k, int mb, int64_t step, double t) {
  // Reports and timings only: small.
  Push(t + shape_.link.Seconds(0), k - 1,
       k == 0 ? MsgKind::kCompletion : MsgKind::kFinal, step, mb);
  blocks_[k].states.erase({step, mb});
}

void PipelineSim::Backward(int k, int mb, double& t) {
  Block& b = blocks_[k];
  const MbDurations& d = *Durations(b.step, mb, k);
  AddSpan(k, SpanKind::kBackward, b.step, mb, t, d.backward);
  t += d.backward;
  ++b.backwarded;
  const int shared = shape_.Shared(k);
  if (shared >= 0) {
    const int64_t entry_bytes =
        shape_.up_bytes[k - 1] / std::max(1, shape_.Down(k - 1));
    Push(t + shape_.link.Seconds(entry_bytes), k - 1, MsgKind::kGradient,
         b.step, mb, shared);
  }
  MbState& st = b.states[{b.step, mb}];
  st.backward_done = true;
  if (st.below_seen || k + 1 == shape_.blocks) SendFinal(k, mb, b.step, t);
}

bool PipelineSim::Drain(int k, double& t) {
  Block& b = blocks_[k];
  const int m = shape_.microbatches;
  const int down = shape_.Down(k);
  bool progress = true;
  while (progress) {
    progress = false;
    if (b.forwarded < m && b.forward_queue.count({b.step, b.forwarded})) {
      const int mb = b.forwarded;
      const MbDurations* d = Durations(b.step, mb, k);
      if (d == nullptr) return false;
      b.forward_queue.erase({b.step, mb});
      AddSpan(k, SpanKind::kForward, b.step, mb, t, d->forward);
      t += d->forward;
      AddSpan(k, SpanKind::kHead, b.step, mb, t, d->head);
      t += d->head;
      ++b.forwarded;
      // Entries that train no block never come (GradientLists::Used).
      b.states[{b.step, mb}].down_count += shape_.Lists().UnusedDown(k);
      if (k + 1 < shape_.blocks) {
        Push(t + shape_.link.Seconds(shape_.down_bytes[k]), k + 1,
             MsgKind::kForward, b.step, mb);
      }
      if (shape_.Early(k, 0)) EntryPass(k, b.step, mb, 0, *d, t);
      if (down == 0) Backward(k, mb, t);
      progress = true;
    }
    if (down > 0 && b.backwarded < b.forwarded) {
      auto it = b.states.find({b.step, b.backwarded});
      if (it != b.states.end() && it->second.down_count == down) {
        if (Durations(b.step, b.backwarded, k) == nullptr) return false;
        Backward(k, b.backwarded, t);
        progress = true;
      }
    }
    if (b.backwarded == m) {
      auto it = optimizer_.find({b.step, k});
      if (it == optimizer_.end()) return false;
      AddSpan(k, SpanKind::kOptimizer, b.step, -1, t, it->second);
      t += it->second;
      optimizer_.erase(it);
      auto& [count, end] = partial_end_[b.step];
      ++count;
      end = std::max(end, t);
      ++b.step;
      b.forwarded = b.backwarded = 0;
      progress = true;
    }
  }
  b.free_at = t;
  return true;
}

bool PipelineSim::Deliver(const Event& e, double& t) {
  Block& b = blocks_[e.dest];
  switch (e.kind) {
    case MsgKind::kForward:
      b.forward_queue.insert({e.step, e.mb});
      return true;
    case MsgKind::kGradient: {
      // Downstream entry j is list entry j + 1: its early pass runs now.
      const bool pass = shape_.Early(e.dest, e.entry + 1);
      const MbDurations* d = Durations(e.step, e.mb, e.dest);
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
    case MsgKind::kCompletion:
      break;
  }
  return true;
}

void PipelineSim::RecordFinishedSteps() {
  for (auto it = partial_end_.find(steps_finished());
       it != partial_end_.end() && it->second.first == shape_.blocks;
       it = partial_end_.find(steps_finished())) {
    step_end_.push_back(it->second.second);
    partial_end_.erase(it);
    // Every block is past this step: its durations are not needed again.
    const int64_t done = steps_finished() - 1;
    mb_durations_.erase(mb_durations_.lower_bound({done, 0}),
                        mb_durations_.lower_bound({done + 1, 0}));
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
    double t = std::max(blocks_[e.dest].free_at, e.time);
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
  double total = 0;
  for (int k = 0; k < shape.blocks; ++k) {
    const double busy = sim.Busy(k);
    total += busy;
    r.busy_ratio.push_back(r.elapsed > 0 ? busy / r.elapsed : 0.0);
  }
  r.utilisation = r.elapsed > 0 ? total / (shape.blocks * r.elapsed) : 0.0;
  return r;
}

}  // namespace interlock
