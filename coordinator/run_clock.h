// The run's virtual model-parallel clock (ARCHITECTURE: the virtual clock):
// feeds the measured durations of every micro-batch and optimizer step into the
// replay (analysis' PipelineSim), once each even when a recovery replays them,
// and answers the run's questions in the run's step numbers: when a step ended
// on the virtual clock, whether a budget is reached, the summary figures.
// A resumed run replays from the step it resumed at, after the checkpoint's
// virtual time. With block replicas each replica is a track of its own and
// a block's reduction costs what the link model gives for its bytes
// (analysis/virtual_clock.h).
#ifndef INTERLOCK_COORDINATOR_RUN_CLOCK_H_
#define INTERLOCK_COORDINATOR_RUN_CLOCK_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "analysis/virtual_clock.h"
#include "plan/topology.h"
#include "proto/config.pb.h"
#include "services/data.h"

namespace interlock {

struct OpTiming;
class WireCodec;

// Steps of the run kept in the timeline (timeline.json, timeline.png).
constexpr int64_t kTimelineSteps = 64;

// The clock's figures for summary.json: end of the last step, mean step
// time after the first step, busy / elapsed per block (the mean over every
// replica it had) and overall, and per replica of every block (in the order
// they first joined).
struct ClockSummary {
  double virtual_seconds = 0.0;
  double mean_step_virtual = 0.0;
  double utilisation = 0.0;
  std::vector<double> busy_ratio;
  std::vector<std::vector<double>> replica_busy_ratio;
};

class RunClock {
 public:
  // `replicas`: per block (empty: one each), as the engine runs them or,
  // in process, as the clock is asked to model them.
  explicit RunClock(LinkModel link, std::vector<int> replicas = {})
      : link_(link), replicas_(std::move(replicas)) {}

  // Continues a resumed run: replays steps from `base` on, after `offset`
  // virtual seconds of the earlier run.
  void Resume(int64_t base, double offset) {
    base_ = base;
    offset_ = offset;
  }
  bool started() const { return sim_ != nullptr; }
  // Starts the replay at the first submitted micro-batch; it needs the bytes
  // every link carries per micro-batch as `codec` encodes them: the input
  // batch (`rows` samples, `input_bytes` on the wire), each block's
  // activation with the targets (raw), and the gradient list; and, for the
  // replicas' reduction, every block's trained parameter count.
  absl::Status Start(const interlock::v1::RunConfig& config,
                     const DataShape& shape, const WireCodec& codec, int blocks,
                     int window, int64_t rows, int64_t input_bytes,
                     int64_t target_bytes);

  // Micro-batch `mb` of `step` (of M per step) was submitted. A replay after
  // a recovery submits again what the clock knows already.
  void Submitted(int64_t step, int mb, int m);
  // The routes the engine runs `step` with (before it is submitted).
  void SetRoutes(int64_t step, std::vector<int32_t> routes);
  // The engine's workers from `step` on (before it is submitted): the first
  // call names the replicas the clock started with; a later one that
  // differs is a membership change. A replica is known by its address, so
  // one that left and comes back is the same track. Steps the clock was
  // submitted already (a replay after a fail-over) keep the topology they
  // were first run with, as they keep their durations.
  void SetTopology(int64_t step, const Topology& workers);
  // Each replica's measured throughput, micro-batches per second of its
  // per-micro-batch work, by block then replica in routing order (of the
  // next step's members); empty until every one of them in a replicated
  // block has run `min_microbatches`.
  std::vector<std::vector<double>> ReplicaRates(int64_t min_microbatches) const;
  // Measured durations; a replayed step's are on the clock already.
  void OnMicrobatch(int64_t step, int mb, const std::vector<OpTiming>& t);
  void OnOptimizer(int64_t step, int block, double seconds);
  // Nothing more is submitted: the replay may run past the last step.
  void Finish();
  void Advance();
  // A checkpoint at `steps`: replays never go back before it.
  void Checkpointed(int64_t steps);

  // Virtual time at the end of `step`. A step the replay has not placed yet
  // reads as the replay's time so far (a lower bound).
  double End(int64_t step) const;
  // Steps the replay has placed (in the run's numbering).
  int64_t Finished() const;
  int64_t base() const { return base_; }
  double offset() const { return offset_; }
  // Whether starting `step` would pass `budget` virtual seconds: its end is
  // projected from the replayed steps' mean (the replay runs up to two
  // steps behind the real run).
  bool WouldExceed(int64_t step, double budget);
  // Busy / elapsed per block so far (the mean over its replicas).
  std::vector<double> BusyNow() const;
  // The figures of the part this process replayed, up to `steps`.
  ClockSummary Summary(int64_t steps) const;
  // Null until started.
  const PipelineSim* sim() const { return sim_.get(); }
  // Per block, from the calibrated micro-batches (BlockTrainer::Calibrate):
  // the median share a parameter pass that also yields the input gradient
  // costs more than one that does not, and the median cost of an
  // input-only pass against a parameter pass; -1 where none was measured.
  std::vector<double> SharedExtra() const;
  std::vector<double> InputShare() const;

 private:
  const LinkModel link_;
  const std::vector<int> replicas_;
  std::unique_ptr<PipelineSim> sim_;
  int64_t base_ = 0;
  double offset_ = 0.0;
  int64_t submitted_ = 0;
  // Steps with a micro-batch submitted, in the replay's numbering.
  int64_t StepsBegun() const;
  // Per block, the replica (track) number of every worker address seen.
  std::vector<std::map<std::string, int>> slots_;
  // (step, micro-batch) and (step, -1 - block) whose durations the clock
  // has: a replay after a recovery does not give them twice.
  std::set<std::pair<int64_t, int>> fed_;
  // Per block, the calibrated passes' seconds: parameters, shared, input.
  struct Passes {
    std::vector<double> param, shared, input;
  };
  std::vector<Passes> passes_;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RUN_CLOCK_H_
