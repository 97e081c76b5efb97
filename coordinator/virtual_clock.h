// The virtual model-parallel clock (DESIGN §2.2): replays a run's schedule
// with the durations its blocks measured, as if every block had an
// accelerator of its own, and says when each step would have finished.
//
// The replay follows the schedule the code really runs (services/driver.cc):
// a block handles one message at a time; its drain loop runs the next
// forward (block, then head), then the next backward in micro-batch order,
// then the optimizer step once all M backward passes are done, and forwards
// of step s+1 wait for that step. Blocks that need no gradient from below
// (1-way, the last block) run their backward right after their forward.
// Messages cost latency + bytes / bandwidth on each link. The coordinator
// keeps `window` micro-batches in flight and submits the next one when a
// completion comes back from block 0. Evaluation is not part of the clock.
//
// No LibTorch and no gRPC here: the same replay serves the training runner
// (durations arrive as the run goes) and the simulator (durations from a
// profile).
#ifndef INTERLOCK_COORDINATOR_VIRTUAL_CLOCK_H_
#define INTERLOCK_COORDINATOR_VIRTUAL_CLOCK_H_

#include <cstdint>
#include <functional>
#include <map>
#include <queue>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace interlock {

struct LinkModel {
  // Defaults measured on loopback (docs/BENCHMARKS.md, "wire").
  double latency_seconds = 100e-6;
  double bytes_per_second = 1.5e9;
  double Seconds(int64_t bytes) const {
    return latency_seconds +
           (bytes_per_second > 0 ? static_cast<double>(bytes) / bytes_per_second
                                 : 0.0);
  }
};

struct PipelineShape {
  int blocks = 1;        // K
  int microbatches = 1;  // M
  int window = 2;        // micro-batches in flight (the runner uses 2M)
  bool e2e = false;
  int n = 1;                        // interlocking width (ignored for E2E)
  int64_t input_bytes = 0;          // one micro-batch into block 0
  std::vector<int64_t> down_bytes;  // block k -> k+1 per micro-batch (K-1)
  std::vector<int64_t> up_bytes;    // block k+1 -> k per micro-batch (K-1)
  LinkModel link;

  // Whether block k waits for gradients from block k+1.
  bool NeedsDownstream(int k) const { return k + 1 < blocks && (e2e || n > 1); }
};

// One block's measured work on one micro-batch.
struct MbDurations {
  double forward = 0.0;
  double head = 0.0;  // head forward+backward, or the final loss
  double backward = 0.0;
};

enum class SpanKind { kForward, kHead, kBackward, kOptimizer };
const char* SpanKindName(SpanKind kind);

struct Span {
  int block = 0;
  SpanKind kind = SpanKind::kForward;
  int64_t step = 0;
  int mb = -1;  // -1 for the optimizer step
  double start = 0.0;
  double end = 0.0;
};

class PipelineSim {
 public:
  // Spans of steps below `keep_span_steps` are kept (for timelines).
  explicit PipelineSim(PipelineShape shape, int64_t keep_span_steps = 0);

  // Durations as they become known. `blocks` has one entry per block.
  void SetMicrobatch(int64_t step, int mb, std::vector<MbDurations> blocks);
  void SetOptimizer(int64_t step, int block, double seconds);
  // The runner submitted micro-batches up to (not including) global index
  // `count` = step * M + mb + 1.
  void SetSubmitted(int64_t count);
  // No more micro-batches will be submitted.
  void Finish();

  // Replays as far as the known durations allow.
  void Advance();

  // Steps every block has stepped in the replay, in order.
  int64_t steps_finished() const {
    return static_cast<int64_t>(step_end_.size());
  }
  // Virtual time at which step s was finished by every block.
  double StepEnd(int64_t s) const { return step_end_[s]; }
  // Latest time the replay has reached (a lower bound for what follows).
  double Now() const { return now_; }
  double Busy(int block) const { return blocks_[block].busy; }
  double BusyPhase(int block, SpanKind kind) const {
    return blocks_[block].phase_busy[static_cast<int>(kind)];
  }
  const std::vector<Span>& spans() const { return spans_; }
  const PipelineShape& shape() const { return shape_; }

 private:
  struct MbState {
    bool backward_done = false;
    bool below_seen = false;
  };
  struct Block {
    int64_t step = 0;
    int forwarded = 0;
    int backwarded = 0;
    std::set<std::pair<int64_t, int>> forward_queue;
    std::set<std::pair<int64_t, int>> upward_queue;
    std::map<std::pair<int64_t, int>, MbState> states;
    double free_at = 0.0;
    double busy = 0.0;
    double phase_busy[4] = {0, 0, 0, 0};
    int steps_done = 0;
  };
  enum class MsgKind { kForward, kUpward, kCompletion };
  struct Event {
    double time;
    int64_t seq;
    int dest;  // block
    MsgKind kind;
    int64_t step;
    int mb;
    bool operator>(const Event& o) const {
      return time != o.time ? time > o.time : seq > o.seq;
    }
  };

  // Each returns false when it needs a duration or submission not known yet;
  // state is then unchanged and the same call is repeated later.
  bool Drain(int k, double& t);
  bool Submit(double t);
  bool Backward(int k, int mb, double& t);
  void SendUp(int k, int mb, int64_t step, double t);
  void Push(double time, int dest, MsgKind kind, int64_t step, int mb);
  void AddSpan(int k, SpanKind kind, int64_t step, int mb, double start,
               double seconds);
  const MbDurations* Durations(int64_t step, int mb, int k) const;

  PipelineShape shape_;
  int64_t keep_span_steps_;
  std::vector<Block> blocks_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  int64_t seq_ = 0;
  std::map<std::pair<int64_t, int>, std::vector<MbDurations>> mb_durations_;
  std::map<std::pair<int64_t, int>, double> optimizer_;
  int64_t submitted_known_ = 0;  // the runner's submissions so far
  bool finished_ = false;
  int64_t sent_ = 0;       // micro-batches the replay has sent to block 0
  int64_t completed_ = 0;  // completions back at the coordinator
  // A replay interrupted for a missing duration: block (or -1 for the
  // coordinator) and the time it stopped at.
  bool stalled_ = false;
  int stalled_dest_ = 0;
  double stalled_time_ = 0.0;
  double now_ = 0.0;
  std::vector<double> step_end_;
  std::vector<Span> spans_;
  std::map<int64_t, std::pair<int, double>> partial_end_;  // blocks, max end
};

// Per-block means of a run, enough to predict other shapes (simulate).
struct BlockProfile {
  double forward = 0.0;  // per micro-batch
  double head = 0.0;
  double backward = 0.0;
  double optimizer = 0.0;  // per step
};

struct SimResult {
  double step_seconds = 0.0;       // mean over the steady steps
  double elapsed = 0.0;            // end of the last step
  std::vector<double> busy_ratio;  // per block: busy / elapsed
  double utilisation = 0.0;        // sum busy / (K * elapsed)
};

// Replays `steps` steps with the same durations for every micro-batch.
// Step time is measured over the steps after `warmup`.
SimResult Simulate(const PipelineShape& shape,
                   const std::vector<BlockProfile>& blocks, int64_t steps,
                   int64_t warmup);

// How many input-gradient-only backward passes block k runs per micro-batch
// in a mode (services/trainer.cc): entries of the capped list that need an
// input gradient but are not the parameter gradient's entry.
int InputOnlyPasses(bool e2e, int n, bool sum_rule, int blocks, int k);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_VIRTUAL_CLOCK_H_
