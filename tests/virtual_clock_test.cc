// The virtual clock on hand-built timing traces. Every expected time below
// is worked out by hand in the comments, following the block schedule of
// services/driver.cc; links are free unless a test says otherwise.
#include "analysis/virtual_clock.h"

#include <gtest/gtest.h>

#include "services/gradient_lists.h"

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
  // f=1, h=0.5, b=2, o=0.5, window 2. Block 0: step 0 at 0-4 (forward 0-1,
  // head -1.5, backward -3.5, opt -4), step 1 at 4-8. Block 1 gets mb 0 at
  // 1.5: 1.5-5.5; mb 1 at 5.5: 5.5-9.5. Block 2 gets mb 0 at 3: forward 3-4,
  // head -4.5, backward -6.5, opt -7. Step 0 ends at 7. Block 2 gets mb 1 at
  // 7 (block 1 sent it after its head): 7-11. Step 1 ends at 11.
  // The completion of mb 0 waits in block 1 until its drain ends at 9.5, so
  // step 2 is submitted at 9.5: block 0 runs it 9.5-13.5, block 1 gets it at
  // 11 and runs 11-15, block 2 gets it at 12.5 and runs 12.5-16.5.
  PipelineSim sim(Shape(3, 1, false, 1), 10);
  Fill(sim, 3, 1.0, 0.5, 2.0, 0.5);
  ASSERT_EQ(sim.steps_finished(), 3);
  EXPECT_DOUBLE_EQ(sim.StepEnd(0), 7.0);
  EXPECT_DOUBLE_EQ(sim.StepEnd(1), 11.0);
  EXPECT_DOUBLE_EQ(sim.StepEnd(2), 16.5);
}

TEST(VirtualClockTest, TwoWayWaitsForTheNextBlockOnly) {
  // f=1, h=0.5, b=2, o=0.5, early pass 0.5 (only block 1 has one: its own
  // entry; block 2's entry comes out of its parameter pass).
  // Block 0: forward+head 0-1.5. Block 1: forward+head 1.5-3, own entry
  // 3-3.5, sent to block 0, which runs its backward 3.5-5.5, opt -6, and
  // step 1's forward+head 6-7.5 without waiting for block 2. Block 2:
  // forward+head 3-4.5, backward 4.5-6.5 (entry and report to block 1 at
  // 6.5), opt -7. Block 1: backward 6.5-8.5, opt -9; it passes block 2's
  // report on at 9 and takes step 1 (sent at 7.5): 9-10.5, entry 10.5-11.
  // Block 0: backward 11-13, opt -13.5. Block 2: 10.5-12, backward -14,
  // opt -14.5. Block 1: backward 14-16, opt -16.5.
  // Step 0 ends at max(6, 9, 7) = 9; step 1 at max(13.5, 16.5, 14.5).
  PipelineSim sim(Shape(3, 1, false, 2), 10);
  Fill(sim, 2, 1.0, 0.5, 2.0, 0.5, 0.5);
  ASSERT_EQ(sim.steps_finished(), 2);
  EXPECT_DOUBLE_EQ(sim.StepEnd(0), 9.0);
  EXPECT_DOUBLE_EQ(sim.StepEnd(1), 16.5);
  // Block 0 finished step 0 at 6, before block 2 finished its backward.
  double block0_opt_end = -1;
  for (const auto& s : sim.spans()) {
    if (s.block == 0 && s.step == 0 && s.kind == SpanKind::kOptimizer) {
      block0_opt_end = s.end;
    }
  }
  EXPECT_DOUBLE_EQ(block0_opt_end, 6.0);
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

}  // namespace
}  // namespace interlock
