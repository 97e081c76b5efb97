// RunClock: the run's virtual clock as the runner drives it, here through
// membership changes (ARCHITECTURE: replicas).
#include "coordinator/run_clock.h"

#include <gtest/gtest.h>

#include "services/config.h"
#include "services/trainer.h"
#include "services/wire_codec.h"

namespace interlock {
namespace {

constexpr char kConfig[] = R"pb(
  name: "clock"
  model {
    mlp { hidden: [ 16 ] }
    blocks: 2
    head: "fc"
  }
  data {
    kind: SYNTHETIC_VECTORS
    synthetic_shape: 8
    synthetic_classes: 3
    synthetic_train: 64
    synthetic_test: 16
  }
  training { mode: INTERLOCK n: 1 batch_size: 16 microbatches: 4 steps: 8 }
)pb";

class RunClockTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto config = ParseRunConfig(kConfig, "clock");
    ASSERT_TRUE(config.ok()) << config.status();
    auto codec = WireCodec::ForRun(*config);
    ASSERT_TRUE(codec.ok()) << codec.status();
    DataShape shape;
    shape.is_vector = true;
    shape.channels = 8;
    shape.height = shape.width = 1;
    shape.classes = 3;
    ASSERT_TRUE(clock_.Start(*config, shape, *codec, 2, 8, 4, 128, 32).ok());
  }

  // Steps [from, to): block 0 takes 3 s per micro-batch, block 1 1 s.
  void Run(int64_t from, int64_t to) {
    for (int64_t s = from; s < to; ++s) {
      for (int mb = 0; mb < 4; ++mb) clock_.Submitted(s, mb, 4);
      for (int mb = 0; mb < 4; ++mb) {
        clock_.OnMicrobatch(s, mb,
                            {{0, Phase::kForward, 1.0},
                             {0, Phase::kBackward, 2.0},
                             {1, Phase::kForward, 0.5},
                             {1, Phase::kBackward, 0.5}});
      }
      clock_.OnOptimizer(s, 0, 0.0);
      clock_.OnOptimizer(s, 1, 0.0);
      clock_.Advance();
    }
  }

  // Messages and reductions cost nothing: step times by hand.
  RunClock clock_{LinkModel{0.0, 0.0}, {2, 1}};
};

TEST_F(RunClockTest, FollowsTheTopologyByAddressFromTheNextStep) {
  // The first topology names the replicas the clock started with.
  clock_.SetTopology(0, {{"a:1", "b:1"}, {"c:1"}});
  ASSERT_EQ(clock_.sim()->Members(0, 0), (std::vector<int>{0, 1}));
  Run(0, 2);
  auto rates = clock_.ReplicaRates(4);
  ASSERT_EQ(rates.size(), 2u);
  ASSERT_EQ(rates[0].size(), 2u);  // 4 micro-batches each in 12 s
  EXPECT_NEAR(rates[0][0], 1.0 / 3.0, 1e-9);
  EXPECT_TRUE(rates[1].empty());  // one replica: nothing to weigh

  // a:1 fails and d:1 joins block 1 before step 2. Asked for step 1 (a
  // replay after a fail-over), the clock still starts them at step 2: step
  // 1 was submitted with the old topology.
  clock_.SetTopology(1, {{"b:1"}, {"c:1", "d:1"}});
  EXPECT_EQ(clock_.sim()->Members(1, 0), (std::vector<int>{0, 1}));
  EXPECT_EQ(clock_.sim()->Members(2, 0), (std::vector<int>{1}));
  EXPECT_EQ(clock_.sim()->Members(2, 1), (std::vector<int>{0, 1}));
  // The joiner has run nothing yet: no measured routes.
  EXPECT_TRUE(clock_.ReplicaRates(4).empty());
  Run(2, 4);
  rates = clock_.ReplicaRates(4);
  ASSERT_EQ(rates.size(), 2u);
  EXPECT_TRUE(rates[0].empty());
  ASSERT_EQ(rates[1].size(), 2u);  // c:1, then d:1
  EXPECT_GT(rates[1][1], 0.0);

  // a:1 comes back: the same track, after b:1 in routing order.
  clock_.SetTopology(4, {{"b:1", "a:1"}, {"c:1", "d:1"}});
  EXPECT_EQ(clock_.sim()->Members(4, 0), (std::vector<int>{1, 0}));
  Run(4, 6);
  clock_.Finish();
  clock_.Advance();
  EXPECT_EQ(clock_.Finished(), 6);
  const PipelineSim& sim = *clock_.sim();
  EXPECT_EQ(sim.shape().replicas, (std::vector<int>{2, 2}));
  // Block 0: a:1 ran 2 of 4 in steps 0-1 and 4-5, b:1 those and all 4 in
  // steps 2-3; block 1's joiner 2 of 4 from step 2 on.
  EXPECT_EQ(sim.ReplicaMicrobatches(0, 0), 8);
  EXPECT_EQ(sim.ReplicaMicrobatches(0, 1), 16);
  EXPECT_EQ(sim.ReplicaMicrobatches(1, 0), 16);
  EXPECT_EQ(sim.ReplicaMicrobatches(1, 1), 8);
  // Steps 2-3 ran block 0 alone on b:1: 12 s each instead of 6.
  EXPECT_NEAR(clock_.End(3) - clock_.End(1), 24.0, 1e-9);
  const ClockSummary summary = clock_.Summary(6);
  ASSERT_EQ(summary.replica_busy_ratio.size(), 2u);
  EXPECT_EQ(summary.replica_busy_ratio[1].size(), 2u);
  EXPECT_GT(summary.replica_busy_ratio[1][1], 0.0);
}

}  // namespace
}  // namespace interlock
