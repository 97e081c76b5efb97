// The virtual model-parallel clock (ARCHITECTURE: the virtual clock): replays a
// run's schedule with the durations its blocks measured, as if every block had
// an accelerator of its own, and says when each step would have finished.
//
// The replay follows the schedule the code really runs (services/driver.cc):
// a block handles one message at a time; its drain loop runs the next
// forward (block, then head), then the next parameter backward in
// micro-batch order once that micro-batch's gradient list from below is
// complete, then the optimizer step once all M backward passes are done;
// forwards of step s+1 wait for that step. Blocks that need no gradient
// from below (1-way, the last block) run their backward right after their
// forward. Upstream entries that need only an input gradient are computed
// as soon as their entry is known (after the forward for the block's own,
// on arrival for one from below) and sent at once; the entry the parameter
// pass yields goes after that pass; the reports go last.
// Messages cost latency + bytes / bandwidth on each link. The coordinator
// keeps `window` micro-batches in flight and submits the next one when a
// completion comes back from block 0. Evaluation is not part of the clock.
//
// Block replicas (ARCHITECTURE: replicas): each replica is a track of its own
// (its own busy timeline). Micro-batch m of a step runs on the replica of block
// k the coordinator routes it to (RouteStep, plan/replica_routes.h), and a
// replica runs its own micro-batches in micro-batch order, as
// services/driver.cc does. After its last backward pass of a step a replica
// waits for the others at the reduction; the reduction starts when the last
// one arrives and costs PipelineShape::ReductionSeconds on every replica;
// then each replica runs the optimizer step. With one replica per block the
// replay is the one above, unchanged.
//
// No LibTorch and no gRPC here: the same replay serves the training runner
// (durations arrive as the run goes) and the simulator (durations from a
// profile).
#ifndef INTERLOCK_ANALYSIS_VIRTUAL_CLOCK_H_
#define INTERLOCK_ANALYSIS_VIRTUAL_CLOCK_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <queue>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "plan/gradient_lists.h"

namespace interlock {

struct LinkModel {
  // Loopback gRPC with our codec moved 32 MiB tensors at about 420 MiB/s
  // (docs/BENCHMARKS.md, "wire", after the fixes). The latency is an
  // estimate, not measured: small messages are a negligible part of a step.
  double latency_seconds = 100e-6;
  double bytes_per_second = 4.4e8;
  double Seconds(int64_t bytes) const {
    return latency_seconds +
           (bytes_per_second > 0 ? static_cast<double>(bytes) / bytes_per_second
                                 : 0.0);
  }
  // A ring all-reduce (Gloo's algorithm) of `bytes` over `members`: a
  // reduce-scatter and an all-gather, 2 (R - 1) hops of bytes / R each, so
  // every member sends 2 (R - 1) / R of the bytes: 2 (R - 1) (latency +
  // bytes / (R bandwidth)). Zero for one member.
  double AllReduceSeconds(int members, int64_t bytes) const {
    if (members <= 1) return 0.0;
    return 2.0 * (members - 1) * Seconds(bytes / members);
  }
};

struct PipelineShape {
  int blocks = 1;        // K
  int microbatches = 1;  // M
  int window = 2;        // micro-batches in flight (the runner uses 2M)
  bool e2e = false;
  int n = 1;  // interlocking width (ignored for E2E)
  bool sum_rule = false;
  bool compute_unused = false;      // GradientLists::compute_unused
  int64_t input_bytes = 0;          // one micro-batch into block 0
  std::vector<int64_t> down_bytes;  // block k -> k+1 per micro-batch (K-1)
  // Block k+1 -> k per micro-batch: the whole gradient list (K-1).
  std::vector<int64_t> up_bytes;
  LinkModel link;
  // Replicas per block (empty: one each) and what their reduction moves:
  // each block's trained parameters P (block and head; empty or 0: only
  // the reduction's latency counts) and training.reduction.
  std::vector<int> replicas;
  std::vector<int64_t> parameters;
  bool ring_reduction = false;
  // The run's number of the replay's step 0 (a resumed run's first step):
  // a step without routes of its own is split as the engine splits it,
  // which rotates by the run's step number.
  int64_t first_step = 0;

  int Replicas(int k) const {
    return k < static_cast<int>(replicas.size()) ? std::max(1, replicas[k]) : 1;
  }
  // Tracks (one per replica), block by block: replica r of block k is
  // track Track(k, r); with one replica each, track k is block k.
  int Track(int k, int r) const {
    int t = r;
    for (int j = 0; j < k; ++j) t += Replicas(j);
    return t;
  }
  int Tracks() const { return Track(blocks, 0); }
  // Bytes one replica of block k puts into the gradient reduction per step
  // (services/replication.h): ORDERED sums the M x P float32 rows of
  // per-micro-batch gradients, RING the P float32 accumulated gradients.
  int64_t ReductionBytes(int k) const {
    const int64_t p =
        k < static_cast<int>(parameters.size()) ? parameters[k] : 0;
    return (ring_reduction ? 1 : microbatches) * p * 4;
  }
  // Seconds of block k's reduction per step: two ring all-reduces, the
  // small per-micro-batch metadata (latency only) and the gradients.
  double ReductionSeconds(int k) const {
    return ReductionSeconds(k, Replicas(k));
  }
  // The same among r replicas.
  double ReductionSeconds(int k, int r) const {
    return link.AllReduceSeconds(r, 0) +
           link.AllReduceSeconds(r, ReductionBytes(k));
  }

  // The gradient lists of services/trainer.h.
  GradientLists Lists() const {
    return {blocks, e2e, n, sum_rule, compute_unused};
  }
  int Down(int k) const { return Lists().Down(k); }
  int Up(int k) const { return Lists().Up(k); }
  int Shared(int k) const { return Lists().Shared(k); }
  bool Early(int k, int i) const { return Lists().Early(k, i); }
  int EarlyCount(int k) const { return Lists().EarlyCount(k); }
};

// One block's measured work on one micro-batch.
struct MbDurations {
  double forward = 0.0;
  double head = 0.0;        // head forward+backward, or the final loss
  double backward = 0.0;    // the parameter pass
  double input_grad = 0.0;  // the early input-gradient passes together
};

enum class SpanKind {
  kForward,
  kHead,
  kBackward,
  kOptimizer,
  kInputGrad,
  kReduce,  // the replicas' gradient reduction
};
constexpr int kSpanKinds = 6;
const char* SpanKindName(SpanKind kind);

struct Span {
  int block = 0;
  SpanKind kind = SpanKind::kForward;
  int64_t step = 0;
  int mb = -1;  // -1 for the optimizer step
  double start = 0.0;
  double end = 0.0;
  int replica = 0;
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
  // Busy seconds of a block: the sum over its replicas.
  double Busy(int block) const;
  // `after_first`: leaving out the first replayed step (cold caches, first
  // allocations), as the mean step times do.
  double BusyPhase(int block, SpanKind kind, bool after_first = false) const;
  // Busy seconds of one replica of a block.
  double ReplicaBusy(int block, int replica) const {
    return tracks_[Index(block, replica)].busy;
  }
  // Micro-batches one replica has forwarded, and its seconds of
  // per-micro-batch work (forward, head, backward, input gradients; not the
  // optimizer or reduction): its measured throughput.
  int64_t ReplicaMicrobatches(int block, int replica) const {
    return tracks_[Index(block, replica)].microbatches;
  }
  double ReplicaMicrobatchSeconds(int block, int replica) const;
  // The routes of `step` as the engine runs them (before the step is
  // submitted); steps without them are split with equal weights.
  void SetRoutes(int64_t step, std::vector<int32_t> routes) {
    routes_[step] = std::move(routes);
  }
  // Membership changes (ARCHITECTURE: replicas): from `step` on, block k runs
  // on the replicas members[k] (replica numbers, in the order routes index
  // them). A number the shape does not have yet adds a replica (a track of its
  // own; shape().replicas grows to it); a replica left out stays idle
  // until a later change names it again; an empty list keeps the block's
  // members. Without a change every replica of the shape runs every step.
  void SetMembers(int64_t step, std::vector<std::vector<int>> members);
  // The replicas block `block` runs `step` on.
  const std::vector<int>& Members(int64_t step, int block) const;
  const std::vector<Span>& spans() const { return spans_; }
  // shape().replicas counts every replica the run has had.
  const PipelineShape& shape() const { return shape_; }

 private:
  struct MbState {
    bool backward_done = false;
    bool below_seen = false;  // the final message from below
    int down_count = 0;       // gradient entries from below so far
  };
  // One replica of a block (one block without replicas).
  struct Track {
    int block = 0;
    int replica = 0;
    int64_t step = 0;
    std::vector<int> own;      // this step's micro-batches here, in order
    int forwarded = 0;         // of `own`
    int64_t microbatches = 0;  // forwarded in all steps
    int backwarded = 0;
    bool member = true;  // runs this step; else idle until a later change
    bool at_reduction = false;  // waiting for, or in, the step's reduction
    bool reduced = false;       // the optimizer step may run
    std::set<std::pair<int64_t, int>> forward_queue;
    std::map<std::pair<int64_t, int>, MbState> states;
    double free_at = 0.0;
    double busy = 0.0;
    double phase_busy[kSpanKinds] = {};
    double first_step_busy[kSpanKinds] = {};  // of it, in step 0
  };
  // The replicas of a block that reached a step's reduction.
  struct Barrier {
    int arrived = 0;
    double last = 0.0;
  };
  enum class MsgKind { kForward, kGradient, kFinal, kCompletion, kReduced };
  struct Event {
    double time = 0.0;
    int64_t seq = 0;
    int dest = 0;  // track (-1: the coordinator)
    MsgKind kind = MsgKind::kForward;
    int64_t step = 0;
    int mb = 0;
    int entry = 0;  // kGradient: index in the receiver's downstream list
    bool operator>(const Event& o) const {
      return time != o.time ? time > o.time : seq > o.seq;
    }
  };

  // These return false when they need a duration or a submission not known
  // yet; see stall_ for how the replay picks up from there.
  // `k` below is a track; tracks_[k].block its block.
  bool Deliver(const Event& e, double& t);
  bool Drain(int k, double& t);
  bool Submit(double t);
  void AdvanceEvents();
  void RecordFinishedSteps();
  void Backward(int k, int mb, double& t);
  void EntryPass(int k, int64_t step, int mb, int i, const MbDurations& d,
                 double& t);
  void SendFinal(int k, int mb, int64_t step, double t);
  void Push(double time, int dest, MsgKind kind, int64_t step, int mb,
            int entry = 0);
  void AddSpan(int k, SpanKind kind, int64_t step, int mb, double start,
               double seconds);
  const MbDurations* Durations(int64_t step, int mb, int k) const;
  // The track of block `block` that runs micro-batch mb of `step`.
  int TrackOf(int block, int64_t step, int mb);
  // Starts track k's step `step`: which micro-batches it runs.
  void BeginStep(int k, int64_t step);
  // Track k reached its step's reduction at t; the last replica to arrive
  // starts it, and every replica hears when it ends.
  void ArriveAtReduction(int k, double t);
  // The track of replica r of block k.
  int Index(int k, int r) const { return index_[k][r]; }
  // Moves tracks that are not members of their step past every step the
  // runner has begun to submit, counting them as done with it.
  void SkipIdle();

  PipelineShape shape_;
  int64_t keep_span_steps_;
  std::vector<Track> tracks_;
  std::vector<std::vector<int>> index_;  // block, replica -> track
  // Membership by first step; steps before the first change run on
  // `initial_`.
  std::map<int64_t, std::vector<std::vector<int>>> members_;
  std::vector<std::vector<int>> initial_;
  std::map<int64_t, std::vector<int32_t>> routes_;       // by step
  std::map<std::pair<int64_t, int>, Barrier> barriers_;  // (step, block)
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  int64_t seq_ = 0;
  std::map<std::pair<int64_t, int>, std::vector<MbDurations>> mb_durations_;
  std::map<std::pair<int64_t, int>, double> optimizer_;
  int64_t submitted_known_ = 0;  // the runner's submissions so far
  bool finished_ = false;
  int64_t sent_ = 0;       // micro-batches the replay has sent to block 0
  int64_t completed_ = 0;  // completions back at the coordinator
  // An interrupted replay: a message's delivery (retried whole, nothing of
  // it done), a block's drain (resumed where it stopped), or the
  // coordinator's submissions.
  enum class Stall { kNone, kDeliver, kDrain, kSubmit };
  Stall stall_ = Stall::kNone;
  Event stalled_event_;
  double stalled_time_ = 0.0;
  double now_ = 0.0;
  std::vector<double> step_end_;
  std::vector<Span> spans_;
  // Tracks that stepped, and the latest end.
  std::map<int64_t, std::pair<int, double>> partial_end_;
};

// Per-block means of a run, enough to predict other shapes (simulate).
struct BlockProfile {
  double forward = 0.0;  // per micro-batch
  double head = 0.0;
  double backward = 0.0;    // the parameter pass
  double input_grad = 0.0;  // the early input-gradient passes together
  double optimizer = 0.0;   // per step
};

struct SimResult {
  double step_seconds = 0.0;  // mean over the steady steps
  double elapsed = 0.0;       // end of the last step
  // Per block: busy / (replicas * elapsed), the mean over its replicas.
  std::vector<double> busy_ratio;
  // Per block, then replica: busy / elapsed.
  std::vector<std::vector<double>> replica_busy_ratio;
  double utilisation = 0.0;  // sum busy / (tracks * elapsed)
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

#endif  // INTERLOCK_ANALYSIS_VIRTUAL_CLOCK_H_
