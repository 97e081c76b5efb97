// The virtual clock on hand-built timing traces. Every expected time below
// is worked out by hand in the comments, following the block schedule of
// services/driver.cc; links are free unless a test says otherwise.
#include "analysis/virtual_clock.h"

#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "plan/gradient_lists.h"
#include "plan/replica_routes.h"

namespace interlock {
namespace {

PipelineShape Shape(int k, int m, bool e2e, int n) {
  PipelineShape s;
  s.blocks = k;
  s.microbatches = m;
  s.window = 2 * m;
  s.e2e = e2e;
  s.n = n;
  s.link.latency_seconds = 0;
  s.link.bytes_per_second = 0;  // no bandwidth term
  return s;
}

// Every block: forward f, head h, backward b and early input-gradient
// passes g per micro-batch; optimizer o.
void Fill(PipelineSim& sim, int64_t steps, double f, double h, double b,
          double o, double g = 0.0) {
  const auto& sh = sim.shape();
  for (int64_t s = 0; s < steps; ++s) {
    for (int mb = 0; mb < sh.microbatches; ++mb) {
      sim.SetMicrobatch(s, mb,
                        std::vector<MbDurations>(sh.blocks, {f, h, b, g}));
    }
    for (int k = 0; k < sh.blocks; ++k) sim.SetOptimizer(s, k, o);
  }
  sim.SetSubmitted(steps * sh.microbatches);
  sim.Finish();
  sim.Advance();
}

TEST(VirtualClockTest, EndToEndThreeBlocksOneMicrobatch) {
  // f=1, b=2, o=0.5, no heads. Step 0: forwards 0-1, 1-2, 2-3; block 2
  // backward 3-5 (opt 5-5.5); block 1 backward 5-7 (opt 7-7.5); block 0
  // backward 7-9, opt 9-9.5. Step 1 repeats from 9.5: ends at 19.
  PipelineSim sim(Shape(3, 1, true, 3), 10);
  Fill(sim, 2, 1.0, 0.0, 2.0, 0.5);
  ASSERT_EQ(sim.steps_finished(), 2);
  EXPECT_DOUBLE_EQ(sim.StepEnd(0), 9.5);
  EXPECT_DOUBLE_EQ(sim.StepEnd(1), 19.0);
  // Each block is busy f + b + o = 3.5 per step.
  for (int k = 0; k < 3; ++k) EXPECT_DOUBLE_EQ(sim.Busy(k), 7.0);
}

TEST(VirtualClockTest, OneWayDoesNotWaitForTheChain) {
  // f=1, h=0.5, b=2, o=0.5, window 2; a block sends its output down before
  // its head runs. Block 0: step 0 at 0-4 (forward 0-1, output sent at 1,
  // head -1.5, backward -3.5, opt -4), step 1 at 4-8. Block 1 gets mb 0 at
  // 1: 1-5; mb 1 at 5: 5-9. Block 2 gets mb 0 at 2: forward 2-3, loss
  // -3.5, backward -5.5, opt -6. Step 0 ends at 6. Block 2 gets mb 1 at 6:
  // 6-10. Step 1 ends at 10.
  // The completion of mb 0 waits in block 1 until its drain ends at 9, so
  // step 2 is submitted at 9: block 0 runs its forward 9-10, block 1 10-11,
  // block 2 gets it at 11 and runs 11-15.
  PipelineSim sim(Shape(3, 1, false, 1), 10);
  Fill(sim, 3, 1.0, 0.5, 2.0, 0.5);
  ASSERT_EQ(sim.steps_finished(), 3);
  EXPECT_DOUBLE_EQ(sim.StepEnd(0), 6.0);
  EXPECT_DOUBLE_EQ(sim.StepEnd(1), 10.0);
  EXPECT_DOUBLE_EQ(sim.StepEnd(2), 15.0);
  // The head runs after the output has left: block 1's forward of step 0
  // starts when block 0's forward ends, not after its head.
  for (const auto& s : sim.spans()) {
    if (s.block == 1 && s.step == 0 && s.kind == SpanKind::kForward) {
      EXPECT_DOUBLE_EQ(s.start, 1.0);
    }
    if (s.block == 0 && s.step == 0 && s.kind == SpanKind::kHead) {
      EXPECT_DOUBLE_EQ(s.start, 1.0);
    }
  }
}

TEST(VirtualClockTest, TwoWayWaitsForTheNextBlockOnly) {
  // f=1, h=0.5, b=2, o=0.5, early pass 0.5 (only block 1 has one: its own
  // entry; block 2's entry comes out of its parameter pass).
  // Block 0: forward 0-1 (output sent at 1), head -1.5. Block 1: forward
  // 1-2, head -2.5, own entry 2.5-3, sent to block 0, which runs its
  // backward 3-5, opt -5.5, and step 1's forward 5.5-6.5 (head -7) without
  // waiting for block 2. Block 2: forward 2-3, loss -3.5, backward 3.5-5.5
  // (entry and report to block 1 at 5.5), opt -6. Block 1: backward
  // 5.5-7.5, opt -8; it passes block 2's report on at 8 and takes step 1
  // (sent at 6.5): forward 8-9, head -9.5, entry 9.5-10. Block 0: backward
  // 10-12, opt -12.5. Block 2: 9-10.5, backward -12.5, opt -13. Block 1:
  // backward 12.5-14.5, opt -15.
  // Step 0 ends at max(5.5, 8, 6) = 8; step 1 at max(12.5, 15, 13).
  PipelineSim sim(Shape(3, 1, false, 2), 10);
  Fill(sim, 2, 1.0, 0.5, 2.0, 0.5, 0.5);
  ASSERT_EQ(sim.steps_finished(), 2);
  EXPECT_DOUBLE_EQ(sim.StepEnd(0), 8.0);
  EXPECT_DOUBLE_EQ(sim.StepEnd(1), 15.0);
  // Block 0 finished step 0 at 5.5, before block 2 finished its backward.
  double block0_opt_end = -1;
  for (const auto& s : sim.spans()) {
    if (s.block == 0 && s.step == 0 && s.kind == SpanKind::kOptimizer) {
      block0_opt_end = s.end;
    }
  }
  EXPECT_DOUBLE_EQ(block0_opt_end, 5.5);
}

TEST(VirtualClockTest, MicrobatchesPipeline) {
  // E2E, K=2, M=4, f=1, b=1, o=0.5, no heads. Block 0 forwards mb 0-3 at
  // 0-4. Block 1 gets mb i at i+1 and runs forward+backward: mb 0 1-3,
  // mb 1 3-5, mb 2 5-7, mb 3 7-9, then opt 9-9.5. Block 0 gets the
  // gradients at 3, 5, 7, 9; the first waits for its forwards to end at 4:
  // backwards 4-5, 5-6, 7-8, 9-10; opt 10-10.5. Step 0 ends at 10.5.
  PipelineSim sim(Shape(2, 4, true, 2), 10);
  Fill(sim, 1, 1.0, 0.0, 1.0, 0.5);
  ASSERT_EQ(sim.steps_finished(), 1);
  EXPECT_DOUBLE_EQ(sim.StepEnd(0), 10.5);
}

TEST(VirtualClockTest, NextStepWaitsForTheBlocksOwnOptimizerStep) {
  // 1-way, K=2, M=2, f=1, b=1, o=3, window 4 (all of steps 0 and 1 are
  // submitted at 0). Block 0: step 0 forward+backward 0-2, 2-4, opt 4-7;
  // step 1 may only start after its own opt: 7-9, 9-11, opt 11-14.
  PipelineSim sim(Shape(2, 2, false, 1), 10);
  Fill(sim, 2, 1.0, 0.0, 1.0, 3.0);
  ASSERT_EQ(sim.steps_finished(), 2);
  double first_step1_forward = -1;
  for (const auto& s : sim.spans()) {
    if (s.block == 0 && s.step == 1 && s.kind == SpanKind::kForward &&
        s.mb == 0) {
      first_step1_forward = s.start;
    }
  }
  EXPECT_DOUBLE_EQ(first_step1_forward, 7.0);
  // Block 1 gets mb 0 at 1, mb 1 at 3 (block 0 forwards mb 1 after mb 0's
  // backward): 1-3, 3-5, opt 5-8; step 1 mbs at 8 and 10: 8-10, 10-12,
  // opt 12-15. Step 1 ends at max(14, 15).
  EXPECT_DOUBLE_EQ(sim.StepEnd(0), 8.0);
  EXPECT_DOUBLE_EQ(sim.StepEnd(1), 15.0);
}

TEST(VirtualClockTest, LinksAddLatencyAndBandwidth) {
  // As EndToEndThreeBlocksOneMicrobatch with 1000 bytes down and up on each
  // link at 1000 B/s and 0.5 s latency: each of the 4 hops of the critical
  // path (2 down, 2 up) costs 1.5 s; the input to block 0 and the final
  // completion are 0.5 s latency each but only the input is on the path.
  PipelineShape sh = Shape(3, 1, true, 3);
  sh.link.latency_seconds = 0.5;
  sh.link.bytes_per_second = 1000;
  sh.down_bytes = {1000, 1000};
  sh.up_bytes = {1000, 1000};
  PipelineSim sim(sh, 10);
  Fill(sim, 1, 1.0, 0.0, 2.0, 0.5);
  ASSERT_EQ(sim.steps_finished(), 1);
  EXPECT_DOUBLE_EQ(sim.StepEnd(0), 9.5 + 4 * 1.5 + 0.5);
}

TEST(VirtualClockTest, WaitsForDurationsThatHaveNotArrived) {
  // The runner learns durations late; the replay stops where it lacks one
  // and ends identically once everything is known.
  PipelineSim sim(Shape(3, 1, true, 3), 10);
  sim.SetSubmitted(2);
  sim.SetMicrobatch(0, 0, std::vector<MbDurations>(3, {1.0, 0.0, 2.0, 0.0}));
  sim.Advance();
  EXPECT_EQ(sim.steps_finished(), 0);  // optimizer times missing
  for (int k = 0; k < 3; ++k) sim.SetOptimizer(0, k, 0.5);
  sim.Advance();
  EXPECT_EQ(sim.steps_finished(), 1);
  EXPECT_DOUBLE_EQ(sim.StepEnd(0), 9.5);
  sim.SetMicrobatch(1, 0, std::vector<MbDurations>(3, {1.0, 0.0, 2.0, 0.0}));
  for (int k = 0; k < 3; ++k) sim.SetOptimizer(1, k, 0.5);
  sim.Finish();
  sim.Advance();
  ASSERT_EQ(sim.steps_finished(), 2);
  EXPECT_DOUBLE_EQ(sim.StepEnd(1), 19.0);
}

TEST(VirtualClockTest, SimulatePredictsSteadyStepTime) {
  // E2E K=3 from the first test: 9.5 per step in steady state.
  std::vector<BlockProfile> blocks(3, BlockProfile{1.0, 0.0, 2.0, 0.0, 0.5});
  SimResult r = Simulate(Shape(3, 1, true, 3), blocks, 10, 2);
  EXPECT_DOUBLE_EQ(r.step_seconds, 9.5);
  EXPECT_NEAR(r.utilisation, 3.5 / 9.5, 1e-12);
}

TEST(VirtualClockTest, InputOnlyPassesFollowTheTrainer) {
  // 4 blocks, 3-way FURTHEST: block 1 gets 2 entries from below, its list
  // has 3 (losses 1, 2, 3), it sends 2 up, none of them the parameter
  // entry; loss 1 trains no block (block 0 trains on loss 2): 1 pass.
  EXPECT_EQ(InputOnlyPasses(false, 3, false, 4, 1), 1);
  // Block 3 (last): list [own], sends 1 up, shared with the parameter pass.
  EXPECT_EQ(InputOnlyPasses(false, 3, false, 4, 3), 0);
  // Block 2: list [own, from 3], sends 2 up; entry 1 is shared.
  EXPECT_EQ(InputOnlyPasses(false, 3, false, 4, 2), 1);
  // SUM: the parameter pass uses the summed gradient, nothing is shared.
  EXPECT_EQ(InputOnlyPasses(false, 3, true, 4, 2), 2);
  EXPECT_EQ(InputOnlyPasses(true, 4, false, 4, 2), 0);
  EXPECT_EQ(InputOnlyPasses(false, 2, false, 4, 0), 0);
}

// FURTHEST trains block b on loss min(b + n - 1, K - 1): the gradients of
// the losses below min(n - 1, K - 1) reach no parameter and are skipped.
TEST(VirtualClockTest, EntriesThatTrainNoBlockAreNotComputed) {
  auto passes = [](int n, bool sum_rule, bool compute_unused) {
    int total = 0;
    for (int k = 0; k < 4; ++k) {
      total +=
          GradientLists{4, false, n, sum_rule, compute_unused}.EarlyCount(k);
    }
    return total;
  };
  // Computed before: 4-way 3 passes (block 1: losses 1 and 2; block 2:
  // loss 2), 3-way 3 (block 1: losses 1 and 2; block 2: loss 2).
  EXPECT_EQ(passes(4, false, true), 3);
  EXPECT_EQ(passes(4, false, false), 0);
  EXPECT_EQ(passes(3, false, true), 3);
  EXPECT_EQ(passes(3, false, false), 2);  // loss 1 at block 1 skipped
  EXPECT_EQ(passes(2, false, false), passes(2, false, true));
  // SUM trains every block on every loss of its list: nothing to skip.
  EXPECT_EQ(passes(3, true, false), passes(3, true, true));
  GradientLists four{4, false, 4, false, false};
  EXPECT_EQ(four.UnusedDown(0), 2);  // losses 1 and 2 never reach block 0
  EXPECT_EQ(four.UnusedDown(1), 1);  // loss 2 never reaches block 1
  EXPECT_EQ(four.UnusedDown(2), 0);
  // The entry a parameter pass trains on is always used.
  for (int n = 1; n <= 4; ++n) {
    GradientLists l{4, false, n, false, false};
    for (int k = 0; k < 4; ++k) EXPECT_TRUE(l.Used(k, l.Down(k))) << n << k;
  }
}

// Block replicas (ARCHITECTURE: replicas): one track per replica, the routes
// the coordinator stamps, and a reduction that costs what the link model gives.

// K = 2, 1-way, M = 4; block 0 costs 3 per micro-batch (forward 1, backward
// 2), block 1 costs 1 (0.5 + 0.5): block 0 costs block 1 x 3. Optimizer
// steps are free. Links carry no bytes and have no latency; the reduction
// moves ORDERED's M x P x 4 = 16000 bytes at 1e5 B/s.
PipelineShape SlowFirstBlock(std::vector<int> replicas) {
  PipelineShape s = Shape(2, 4, false, 1);
  s.link.bytes_per_second = 1e5;
  s.replicas = std::move(replicas);
  s.parameters = {1000, 1000};
  return s;
}
const std::vector<BlockProfile> kSlowFirst = {{1.0, 0.0, 2.0, 0.0, 0.0},
                                              {0.5, 0.0, 0.5, 0.0, 0.0}};

TEST(VirtualClockTest, ReplicasOfOneEachReplayExactlyAsWithout) {
  // The 2-way case above (early passes, gradients both ways), with replicas
  // given explicitly as one each: the same spans, steps and busy times.
  PipelineShape plain = Shape(3, 2, false, 2);
  PipelineShape ones = plain;
  ones.replicas = {1, 1, 1};
  ones.parameters = {100, 200, 300};  // no reduction with one replica
  PipelineSim a(plain, 10), b(ones, 10);
  Fill(a, 3, 1.0, 0.5, 2.0, 0.5, 0.5);
  Fill(b, 3, 1.0, 0.5, 2.0, 0.5, 0.5);
  ASSERT_EQ(a.steps_finished(), 3);
  ASSERT_EQ(b.steps_finished(), 3);
  for (int s = 0; s < 3; ++s) EXPECT_EQ(a.StepEnd(s), b.StepEnd(s));
  ASSERT_EQ(a.spans().size(), b.spans().size());
  for (size_t i = 0; i < a.spans().size(); ++i) {
    EXPECT_EQ(a.spans()[i].start, b.spans()[i].start);
    EXPECT_EQ(a.spans()[i].end, b.spans()[i].end);
    EXPECT_EQ(a.spans()[i].block, b.spans()[i].block);
  }
  for (int k = 0; k < 3; ++k) EXPECT_EQ(a.Busy(k), b.Busy(k));
}

TEST(VirtualClockTest, ASecondReplicaOfTheSlowBlockHalvesItsStep) {
  // One replica each: block 0 never waits (1-way needs nothing from below)
  // and runs 4 x 3 = 12 per step. Replicas 2,1: each replica of block 0
  // runs 2 micro-batches, 2 x 3 = 6, then the reduction: two ring
  // all-reduces over 2 members, 2 x (0 + 0 / 2 / 1e5) for the metadata and
  // 2 x (0 + 16000 / 2 / 1e5) = 0.16 for the gradients; block 1 (4 per
  // step) keeps up. Steady step 6.16: 12 / 6.16 = 1.95x the samples/s.
  const SimResult one = Simulate(SlowFirstBlock({}), kSlowFirst, 10, 3);
  const SimResult two = Simulate(SlowFirstBlock({2, 1}), kSlowFirst, 10, 3);
  EXPECT_NEAR(one.step_seconds, 12.0, 1e-9);
  EXPECT_NEAR(two.step_seconds, 6.16, 1e-9);
  EXPECT_GE(one.step_seconds / two.step_seconds, 1.6);
  // Per replica: (6 + 0.16) of every 6.16 busy after the first step, and
  // the block's ratio is the mean over its replicas.
  ASSERT_EQ(two.replica_busy_ratio.size(), 2u);
  ASSERT_EQ(two.replica_busy_ratio[0].size(), 2u);
  EXPECT_NEAR(two.replica_busy_ratio[0][0], two.replica_busy_ratio[0][1],
              1e-12);
  EXPECT_NEAR(two.busy_ratio[0], two.replica_busy_ratio[0][0], 1e-12);
  EXPECT_GT(two.busy_ratio[0], 0.95);
  EXPECT_NEAR(two.busy_ratio[1], 4.0 / 6.16, 0.05);
}

TEST(VirtualClockTest, ReplicasRunTheirRoutesAndReduceTogether) {
  PipelineSim sim(SlowFirstBlock({2, 1}), 10);
  const auto& sh = sim.shape();
  for (int64_t s = 0; s < 3; ++s) {
    for (int mb = 0; mb < 4; ++mb) {
      sim.SetMicrobatch(s, mb, {{1.0, 0.0, 2.0, 0.0}, {0.5, 0.0, 0.5, 0.0}});
    }
    sim.SetOptimizer(s, 0, 0.25);
    sim.SetOptimizer(s, 1, 0.25);
  }
  sim.SetSubmitted(12);
  sim.Finish();
  sim.Advance();
  ASSERT_EQ(sim.steps_finished(), 3);
  EXPECT_EQ(sh.Tracks(), 3);
  std::map<int64_t, std::vector<Span>> reduce, optimizer;
  for (const Span& s : sim.spans()) {
    if (s.block == 0 && s.kind == SpanKind::kForward) {
      // The replica the coordinator's routes name for this micro-batch.
      EXPECT_EQ(s.replica, RouteStep(s.step, 4, {2, 1})[s.mb * 2 + 0])
          << "step " << s.step << " mb " << s.mb;
    }
    if (s.block == 1) {
      EXPECT_EQ(s.replica, 0);
    }
    if (s.block == 0 && s.kind == SpanKind::kReduce)
      reduce[s.step].push_back(s);
    if (s.block == 0 && s.kind == SpanKind::kOptimizer) {
      optimizer[s.step].push_back(s);
    }
  }
  for (int64_t s = 0; s < 3; ++s) {
    ASSERT_EQ(reduce[s].size(), 2u) << s;
    ASSERT_EQ(optimizer[s].size(), 2u) << s;
    EXPECT_EQ(reduce[s][0].start, reduce[s][1].start);
    EXPECT_NEAR(reduce[s][0].end - reduce[s][0].start, 0.16, 1e-12);
    EXPECT_EQ(optimizer[s][0].end, optimizer[s][1].end);
    EXPECT_EQ(optimizer[s][0].start, reduce[s][0].end);
  }
  // Step 0 by hand: each replica 0-6, reduction 6-6.16, optimizer -6.41.
  EXPECT_NEAR(reduce[0][0].start, 6.0, 1e-12);
  EXPECT_NEAR(optimizer[0][0].end, 6.41, 1e-12);
  // Busy: every replica runs the optimizer, so the block counts it twice.
  EXPECT_NEAR(sim.BusyPhase(0, SpanKind::kOptimizer), 2 * 3 * 0.25, 1e-12);
  EXPECT_NEAR(sim.Busy(0), sim.ReplicaBusy(0, 0) + sim.ReplicaBusy(0, 1),
              1e-12);
}

TEST(VirtualClockTest, MembershipChangesTakeEffectAtTheirStep) {
  // Block 0 (3 per micro-batch, 12 per step alone) gains replica 1 before
  // step 3 and loses replica 0 before step 6: steps 0-2 take 12, steps 3-5
  // 6 + the 0.16 reduction (each replica runs 2 of the 4), steps 6-8 12
  // again on replica 1 alone, without a reduction. The same whether the
  // changes come as the run reaches them or all before the replay starts.
  auto feed = [](PipelineSim& sim, int64_t from, int64_t to) {
    for (int64_t s = from; s < to; ++s) {
      for (int mb = 0; mb < 4; ++mb) {
        sim.SetMicrobatch(s, mb, {{1.0, 0.0, 2.0, 0.0}, {0.5, 0.0, 0.5, 0.0}});
      }
      sim.SetOptimizer(s, 0, 0.0);
      sim.SetOptimizer(s, 1, 0.0);
    }
    sim.SetSubmitted(to * 4);
    sim.Advance();
  };
  PipelineSim live(SlowFirstBlock({}), 20), ahead(SlowFirstBlock({}), 20);
  feed(live, 0, 3);
  // The replay runs behind the submissions: step 2 waits for more.
  ASSERT_EQ(live.steps_finished(), 2);
  live.SetMembers(3, {{0, 1}, {0}});
  feed(live, 3, 6);
  live.SetMembers(6, {{1}, {0}});
  feed(live, 6, 9);
  live.Finish();
  live.Advance();
  ahead.SetMembers(3, {{0, 1}, {0}});
  ahead.SetMembers(6, {{1}, {0}});
  feed(ahead, 0, 9);
  ahead.Finish();
  ahead.Advance();
  for (const PipelineSim* sim : {&live, &ahead}) {
    ASSERT_EQ(sim->steps_finished(), 9);
    const std::vector<double> step = {12, 12, 12, 6.16, 6.16, 6.16, 12, 12, 12};
    double end = 0;
    for (int s = 0; s < 9; ++s) {
      end += step[s];
      EXPECT_NEAR(sim->StepEnd(s), end, 1e-9) << "step " << s;
    }
    EXPECT_EQ(sim->shape().replicas, (std::vector<int>{2, 1}));
    EXPECT_EQ(sim->shape().Tracks(), 3);
    EXPECT_EQ(sim->Members(2, 0), (std::vector<int>{0}));
    EXPECT_EQ(sim->Members(4, 0), (std::vector<int>{0, 1}));
    EXPECT_EQ(sim->Members(8, 0), (std::vector<int>{1}));
    // 12 + 6 micro-batches each: alone, shared, alone.
    EXPECT_EQ(sim->ReplicaMicrobatches(0, 0), 18);
    EXPECT_EQ(sim->ReplicaMicrobatches(0, 1), 18);
    for (const Span& sp : sim->spans()) {
      if (sp.block != 0) continue;
      if (sp.kind == SpanKind::kReduce) {
        EXPECT_TRUE(sp.step >= 3 && sp.step < 6) << sp.step;
      }
      if (sp.replica == 0) {
        EXPECT_LT(sp.step, 6);
      } else {
        EXPECT_GE(sp.step, 3);
      }
    }
  }
}

TEST(VirtualClockTest, ReductionCostFollowsBytesAndBandwidth) {
  PipelineShape sh = SlowFirstBlock({2, 1});
  sh.link.latency_seconds = 0.001;
  sh.link.bytes_per_second = 1e6;
  // ORDERED: M x P x 4 = 16000 bytes; a ring all-reduce over R = 2 takes
  // 2 (R - 1) hops of latency + bytes / R / bandwidth; the metadata's one
  // adds 2 (R - 1) latencies: 0.002 + 2 x (0.001 + 0.008) = 0.02.
  EXPECT_EQ(sh.ReductionBytes(0), 16000);
  EXPECT_NEAR(sh.ReductionSeconds(0), 0.02, 1e-12);
  EXPECT_EQ(sh.ReductionSeconds(1), 0.0);  // one replica: nothing to reduce
  // RING: P x 4 = 4000 bytes: 0.002 + 2 x (0.001 + 0.002) = 0.008.
  sh.ring_reduction = true;
  EXPECT_EQ(sh.ReductionBytes(0), 4000);
  EXPECT_NEAR(sh.ReductionSeconds(0), 0.008, 1e-12);
  // Three replicas: 4 hops each, of a third of the bytes.
  sh.ring_reduction = false;
  sh.replicas = {3, 1};
  EXPECT_NEAR(sh.ReductionSeconds(0), 4 * 0.001 + 4 * (0.001 + 16000 / 3 / 1e6),
              1e-9);

  // On the clock: more parameters cost more, more bandwidth less.
  auto step = [](int64_t params, double bandwidth) {
    PipelineShape s = SlowFirstBlock({2, 1});
    s.parameters = {params, 1000};
    s.link.bytes_per_second = bandwidth;
    return Simulate(s, kSlowFirst, 10, 3).step_seconds;
  };
  EXPECT_NEAR(step(1000, 1e5), 6.16, 1e-9);
  EXPECT_NEAR(step(10000, 1e5), 6.0 + 1.6, 1e-9);
  EXPECT_GT(step(10000, 1e5), step(1000, 1e5));
  EXPECT_LT(step(10000, 1e6), step(10000, 1e5));
  EXPECT_NEAR(step(10000, 1e6), 6.16, 1e-9);
}

// Routes the runner sets (measured throughput) are the ones
// replayed, and each replica's micro-batches and seconds are what the
// runner weighs the next routes by.
TEST(VirtualClockTest, SetRoutesAreReplayedAndGiveEachReplicaItsRate) {
  PipelineSim sim(SlowFirstBlock({2, 1}), 10);
  // Step 0 split equally; steps 1 and 2: replica 0 of block 0 runs three
  // micro-batches, replica 1 one (routes[mb * K + k]).
  const std::vector<int32_t> three_one = {0, 0, 0, 0, 1, 0, 0, 0};
  sim.SetRoutes(1, three_one);
  sim.SetRoutes(2, three_one);
  for (int64_t s = 0; s < 3; ++s) {
    for (int mb = 0; mb < 4; ++mb) {
      // Micro-batch 2 of steps 1 and 2 runs on replica 1: three times
      // slower there (forward 3, backward 6).
      const double f = (s > 0 && mb == 2) ? 3.0 : 1.0;
      sim.SetMicrobatch(s, mb, {{f, 0.0, 2 * f, 0.0}, {0.5, 0.0, 0.5, 0.0}});
    }
    sim.SetOptimizer(s, 0, 0.0);
    sim.SetOptimizer(s, 1, 0.0);
  }
  sim.SetSubmitted(12);
  sim.Finish();
  sim.Advance();
  ASSERT_EQ(sim.steps_finished(), 3);
  // Step 0: 2 + 2; steps 1-2: 3 + 1 each.
  EXPECT_EQ(sim.ReplicaMicrobatches(0, 0), 2 + 3 + 3);
  EXPECT_EQ(sim.ReplicaMicrobatches(0, 1), 2 + 1 + 1);
  EXPECT_EQ(sim.ReplicaMicrobatches(1, 0), 12);
  EXPECT_NEAR(sim.ReplicaMicrobatchSeconds(0, 0), 8 * 3.0, 1e-9);
  EXPECT_NEAR(sim.ReplicaMicrobatchSeconds(0, 1), 2 * 3.0 + 2 * 9.0, 1e-9);
  int on_replica_1 = 0;
  for (const Span& sp : sim.spans()) {
    if (sp.block == 0 && sp.step > 0 && sp.kind == SpanKind::kForward) {
      EXPECT_EQ(sp.replica, sp.mb == 2 ? 1 : 0) << sp.step << " " << sp.mb;
      on_replica_1 += sp.replica;
    }
  }
  EXPECT_EQ(on_replica_1, 2);
  // Rates 8/24 and 4/24 micro-batches per second: 2:1, so a step of 4
  // gives the faster replica 3 and the slower 1 (at least one each).
  const std::vector<std::vector<double>> rates = {
      {8.0 / sim.ReplicaMicrobatchSeconds(0, 0),
       4.0 / sim.ReplicaMicrobatchSeconds(0, 1)},
      {}};
  const std::vector<int32_t> routes = RouteStep(3, 4, {2, 1}, rates);
  int first = 0;
  for (int mb = 0; mb < 4; ++mb) first += routes[mb * 2] == 0;
  EXPECT_EQ(first, 3);
}

TEST(VirtualClockTest, ReplicasFinishEveryModeAndRouting) {
  // Gradients go back to the replica that ran the micro-batch's forward;
  // every mode and topology must replay to the end, and here more replicas
  // of a block never slow the replay down (the reduction is free).
  for (bool e2e : {true, false}) {
    for (int n = 1; n <= 3; ++n) {
      if (e2e && n > 1) break;
      for (bool sum : {false, true}) {
        for (const std::vector<int>& replicas :
             std::vector<std::vector<int>>{{2, 2, 1}, {1, 3, 2}, {4, 1, 4}}) {
          PipelineShape sh = Shape(3, 4, e2e, e2e ? 3 : n);
          sh.sum_rule = sum;
          // The runner's window, 2KM: with 2M, {4, 1, 4} in 1-way waits for
          // completions (reports come up through one replica each) and
          // ends 3 later than without replicas.
          sh.window = 2 * 3 * 4;
          PipelineShape rep = sh;
          rep.replicas = replicas;
          PipelineSim a(sh), b(rep, 5);
          Fill(a, 5, 1.0, 0.5, 2.0, 0.5, 0.5);
          Fill(b, 5, 1.0, 0.5, 2.0, 0.5, 0.5);
          ASSERT_EQ(b.steps_finished(), 5) << e2e << n << sum;
          // Each replica runs exactly the micro-batches routed to it (with
          // M = 4 over 3 replicas the shares rotate, 2,1,1 then 1,2,1),
          // and reduces only after all of their backward passes.
          std::map<std::tuple<int, int, int64_t>, int> backwards;
          std::map<std::tuple<int, int, int64_t>, double> last_backward;
          for (const Span& s : b.spans()) {
            if (s.kind != SpanKind::kBackward) continue;
            const auto key = std::make_tuple(s.block, s.replica, s.step);
            ++backwards[key];
            last_backward[key] = std::max(last_backward[key], s.end);
            EXPECT_EQ(s.replica,
                      RouteStep(s.step, 4, replicas)[s.mb * 3 + s.block]);
          }
          for (const Span& s : b.spans()) {
            if (s.kind != SpanKind::kReduce) continue;
            const auto key = std::make_tuple(s.block, s.replica, s.step);
            int routed = 0;
            const auto routes = RouteStep(s.step, 4, replicas);
            for (int mb = 0; mb < 4; ++mb) {
              routed += routes[mb * 3 + s.block] == s.replica;
            }
            EXPECT_EQ(backwards[key], routed);
            EXPECT_GE(s.start, last_backward[key]);
          }
          EXPECT_LE(b.StepEnd(4), a.StepEnd(4) + 1e-9) << e2e << n << sum;
          for (int k = 0; k < 3; ++k) {
            // The same work, plus one optimizer step per extra replica.
            EXPECT_NEAR(b.Busy(k) - b.BusyPhase(k, SpanKind::kOptimizer),
                        a.Busy(k) - a.BusyPhase(k, SpanKind::kOptimizer), 1e-9);
          }
        }
      }
    }
  }
}

TEST(VirtualClockTest, ReplicaSharesThatRotateAreRunInFull) {
  // K = 2, 1-way, M = 4, replicas 1,3: block 1's replicas run 2,1,1
  // micro-batches in step 0 and 1,2,1 in step 1 (the extra one rotates).
  // Block 0 is fast, so step 1's forwards wait at replica 1 while it
  // finishes step 0: after its optimizer step it must run both of them
  // before it reduces again.
  PipelineShape sh = Shape(2, 4, false, 1);
  sh.window = 16;
  sh.replicas = {1, 3};
  PipelineSim sim(sh, 10);
  for (int64_t s = 0; s < 3; ++s) {
    for (int mb = 0; mb < 4; ++mb) {
      sim.SetMicrobatch(s, mb, {{0.1, 0.0, 0.1, 0.0}, {1.0, 0.0, 2.0, 0.0}});
    }
    sim.SetOptimizer(s, 0, 0.1);
    sim.SetOptimizer(s, 1, 0.1);
  }
  sim.SetSubmitted(12);
  sim.Finish();
  sim.Advance();
  ASSERT_EQ(sim.steps_finished(), 3);
  std::map<std::pair<int64_t, int>, int> backwards;  // (step, replica)
  for (const Span& s : sim.spans()) {
    if (s.block == 1 && s.kind == SpanKind::kBackward) {
      ++backwards[{s.step, s.replica}];
    }
  }
  for (int64_t s = 0; s < 3; ++s) {
    const auto routes = RouteStep(s, 4, {1, 3});
    for (int r = 0; r < 3; ++r) {
      int routed = 0;
      for (int mb = 0; mb < 4; ++mb) routed += routes[mb * 2 + 1] == r;
      EXPECT_EQ((backwards[{s, r}]), routed)
          << "step " << s << " replica " << r;
    }
  }
  // Block 1's replicas hold 2 micro-batches (6) then reduce and step
  // (0.1): every step ends after 6.1 of block 1's time at most.
  EXPECT_LE(sim.StepEnd(2) - sim.StepEnd(1), 6.1 + 1e-9);
}

}  // namespace
}  // namespace interlock
