#include "coordinator/virtual_clock.h"

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
                       int mb) {
  events_.push(Event{time, seq_++, dest, kind, step, mb});
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

void PipelineSim::SendUp(int k, int mb, int64_t step, double t) {
  if (k == 0) {
    // Completions are small: reports and timings only.
    Push(t + shape_.link.Seconds(0), -1, MsgKind::kCompletion, step, mb);
  } else {
    const int64_t bytes =
        shape_.NeedsDownstream(k - 1) ? shape_.up_bytes[k - 1] : 0;
    Push(t + shape_.link.Seconds(bytes), k - 1, MsgKind::kUpward, step, mb);
  }
}

bool PipelineSim::Backward(int k, int mb, double& t) {
  Block& b = blocks_[k];
  const MbDurations* d = Durations(b.step, mb, k);
  if (d == nullptr) return false;
  AddSpan(k, SpanKind::kBackward, b.step, mb, t, d->backward);
  t += d->backward;
  ++b.backwarded;
  MbState& st = b.states[{b.step, mb}];
  st.backward_done = true;
  if (st.below_seen || k + 1 == shape_.blocks) {
    SendUp(k, mb, b.step, t);
    b.states.erase({b.step, mb});
  }
  return true;
}

bool PipelineSim::Drain(int k, double& t) {
  Block& b = blocks_[k];
  const int m = shape_.microbatches;
  const bool needs_down = shape_.NeedsDownstream(k);
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
      b.states[{b.step, mb}];
      if (k + 1 < shape_.blocks) {
        Push(t + shape_.link.Seconds(shape_.down_bytes[k]), k + 1,
             MsgKind::kForward, b.step, mb);
      }
      // Cannot fail: the durations were checked above.
      if (!needs_down) Backward(k, mb, t);
      progress = true;
    }
    if (b.backwarded < b.forwarded &&
        b.upward_queue.count({b.step, b.backwarded})) {
      const int mb = b.backwarded;
      if (Durations(b.step, mb, k) == nullptr) return false;
      b.upward_queue.erase({b.step, mb});
      b.states[{b.step, mb}].below_seen = true;
      Backward(k, mb, t);
      progress = true;
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

void PipelineSim::Advance() {
  if (stalled_) {
    double t = stalled_time_;
    const bool ok =
        stalled_dest_ < 0 ? Submit(t) : Drain(stalled_dest_, stalled_time_);
    if (!ok) return;
    stalled_ = false;
  } else if (sent_ == 0 && completed_ == 0) {
    if (!Submit(0.0)) {
      stalled_ = true;
      stalled_dest_ = -1;
      stalled_time_ = 0.0;
      return;
    }
  }
  while (true) {
    // Record steps every block has finished, in order.
    for (auto it = partial_end_.find(steps_finished());
         it != partial_end_.end() && it->second.first == shape_.blocks;
         it = partial_end_.find(steps_finished())) {
      step_end_.push_back(it->second.second);
      partial_end_.erase(it);
    }
    if (events_.empty()) return;
    const Event e = events_.top();
    events_.pop();
    now_ = std::max(now_, e.time);
    if (e.kind == MsgKind::kCompletion) {
      ++completed_;
      if (!Submit(e.time)) {
        stalled_ = true;
        stalled_dest_ = -1;
        stalled_time_ = e.time;
        return;
      }
      continue;
    }
    Block& b = blocks_[e.dest];
    if (e.kind == MsgKind::kForward) {
      b.forward_queue.insert({e.step, e.mb});
    } else if (shape_.NeedsDownstream(e.dest)) {
      b.upward_queue.insert({e.step, e.mb});
    } else {
      // 1-way: only the reports travel on; the backward is long done.
      MbState& st = b.states[{e.step, e.mb}];
      st.below_seen = true;
      if (st.backward_done) {
        SendUp(e.dest, e.mb, e.step, std::max(b.free_at, e.time));
        b.states.erase({e.step, e.mb});
      }
      continue;
    }
    double t = std::max(b.free_at, e.time);
    if (!Drain(e.dest, t)) {
      stalled_ = true;
      stalled_dest_ = e.dest;
      stalled_time_ = t;
      return;
    }
  }
}

int InputOnlyPasses(bool e2e, int n, bool sum_rule, int blocks, int k) {
  if (k == 0) return 0;
  if (e2e) return 0;
  const int up = std::min(n - 1, blocks - k);
  const int list = 1 + std::min(n - 1, blocks - k - 1);
  const int last = list - 1;
  const int shared = (!sum_rule || last == 0) ? last : -1;
  return up - ((shared >= 0 && shared < up) ? 1 : 0);
}

SimResult Simulate(const PipelineShape& shape,
                   const std::vector<BlockProfile>& blocks, int64_t steps,
                   int64_t warmup) {
  PipelineSim sim(shape);
  std::vector<MbDurations> per_mb(shape.blocks);
  for (int k = 0; k < shape.blocks; ++k) {
    per_mb[k] = {blocks[k].forward, blocks[k].head, blocks[k].backward};
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
