// Block replicas (ARCHITECTURE: replicas) on real worker processes on loopback:
// routes, topology checks, and the extended determinism contract (ORDERED: any
// topology ends bitwise equal to the single chain; RING: reproducible).
#include "plan/topology.h"

#include <gtest/gtest.h>

#include <set>

#include "coordinator/train.h"
#include "services/config.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

TEST(Topology, WorkersFlagGroupsReplicasAndRefusesMistakes) {
  auto t = ParseWorkers("a:1+a:2,b:1,c:1+c:2+c:3");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(ReplicaCounts(*t), (std::vector<int>{2, 1, 3}));
  EXPECT_EQ((*t)[2][1], "c:2");
  for (const char* bad : {"a:1,,b:1", "a:1++a:2", "a:1,a:1", "a:1+b:1,b:1"}) {
    auto r = ParseWorkers(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("--workers"), std::string::npos);
  }
  for (const char* bad : {"2,0,1", "2,x", "", "1,-1"}) {
    auto r = ParseReplicas(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("--replicas"), std::string::npos);
  }
  EXPECT_TRUE(CheckReplicas({2, 3, 1, 1}, 4, 4).ok());
  auto too_many = CheckReplicas({2, 5, 1, 1}, 4, 4);
  EXPECT_EQ(too_many.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.message().find("block 1 has 5 replicas"),
            std::string::npos)
      << too_many;
  EXPECT_FALSE(CheckReplicas({2, 1}, 4, 4).ok());
}

TEST(Topology, RoutesGiveEveryReplicaWorkInProportionAndAreDeterministic) {
  const std::vector<int> replicas = {2, 3, 1, 1};
  for (int64_t step = 0; step < 6; ++step) {
    for (int m : {3, 4, 7}) {
      auto routes = RouteStep(step, m, replicas);
      ASSERT_EQ(routes.size(), static_cast<size_t>(m) * 4);
      EXPECT_EQ(routes, RouteStep(step, m, replicas));
      for (int k = 0; k < 4; ++k) {
        std::vector<int> count(replicas[k], 0);
        for (int mb = 0; mb < m; ++mb) {
          const int r = routes[mb * 4 + k];
          ASSERT_GE(r, 0);
          ASSERT_LT(r, replicas[k]);
          ++count[r];
        }
        for (int c : count) {
          EXPECT_GE(c, 1);
          // Equal weights: shares differ by at most one.
          EXPECT_LE(c, (m + replicas[k] - 1) / replicas[k]);
        }
      }
    }
  }
  // Weights 3:1 over 8 micro-batches: 6 and 2 (one each first, then 4.5
  // and 1.5, the half going to the larger remainder's rotation).
  auto routes = RouteStep(0, 8, {2}, {{3.0, 1.0}});
  int first = 0;
  for (int r : routes) first += r == 0;
  EXPECT_GE(first, 5);
  EXPECT_LE(first, 6);
}

// What a worker refuses from a hostile coordinator, and what the
// coordinator uses to tell whether the runner's routes fit its topology:
// one check for both.
TEST(Topology, RoutesAreCheckedAgainstTheTopology) {
  const std::vector<int> replicas = {2, 3, 1};
  for (int64_t step = 0; step < 4; ++step) {
    EXPECT_TRUE(
        CheckRoutes(RouteStep(step, 4, replicas), 4, replicas, "r").ok());
  }
  auto expect_refused = [&](std::vector<int32_t> routes, const char* what) {
    absl::Status s = CheckRoutes(routes, 4, replicas, "step 7");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
    EXPECT_NE(s.message().find("step 7: "), std::string::npos) << s;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
  };
  const std::vector<int32_t> good = RouteStep(0, 4, replicas);
  expect_refused({}, "no routes, but blocks have replicas");
  expect_refused({good.begin(), good.end() - 1},
                 "11 route entries for 4 micro-batches of 3 blocks");
  auto bad = good;
  bad[2 * 3 + 1] = 3;  // block 1 has replicas 0..2; block 0 sees it first
  expect_refused(bad, "and replica 3 of 3 of the next block");
  bad = good;
  bad[0] = -1;
  expect_refused(bad, "routed to replica -1");
  bad = good;
  bad[1 * 3 + 2] = 1;  // the last block has one replica
  expect_refused(bad, "and replica 1 of 1 of the next block");
  EXPECT_NE(CheckBlockRoutes(bad, 4, 3, 2, 1, 1, "w")
                .message()
                .find("routed to replica 1 of 1 of block 2"),
            std::string::npos);
  bad = good;
  for (int mb = 0; mb < 4; ++mb) bad[mb * 3] = 0;  // replica 1 of block 0 idle
  expect_refused(bad, "the routes give replica 1 of block 0 no micro-batch");
  // A worker sees its own block and the next block's count only: block 0
  // checks that micro-batches go to block 1's replicas it has links to.
  bad = good;
  bad[3 * 3 + 1] = 2;
  EXPECT_TRUE(CheckBlockRoutes(good, 4, 3, 0, 2, 3, "w").ok());
  EXPECT_FALSE(CheckBlockRoutes(bad, 4, 3, 0, 2, 2, "w").ok());
  // No replicas anywhere: no routes needed, and any given must be zeros.
  EXPECT_TRUE(CheckRoutes({}, 4, {1, 1, 1}, "w").ok());
  EXPECT_TRUE(CheckRoutes(std::vector<int32_t>(12, 0), 4, {1, 1, 1}, "w").ok());
}

constexpr char kResNet[] = R"pb(
  name: "resnet"
  model {
    resnet { architecture: "8,1/16,1/16,1" }
    head: "conv8_bn_gbpl_fc"
    partition: "2,1,1,rest"
  }
  data {
    kind: SYNTHETIC_IMAGES
    synthetic_shape: [ 3, 12, 12 ]
    synthetic_classes: 4
    synthetic_train: 256
    synthetic_test: 32
  }
  optimizer { kind: SGD momentum: 0.9 nesterov: true weight_decay: 0.0005 }
  schedule { kind: COSINE lr: 0.05 warmup_steps: 2 }
  training { batch_size: 16 microbatches: 4 steps: 6 seed: 11 }
)pb";

v1::RunConfig Parse(const std::string& text) {
  auto c = ParseRunConfig(text, "test");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

absl::StatusOr<TrainResult> RunReplicated(const v1::RunConfig& c,
                                          const std::vector<int>& replicas) {
  TrainOptions o;
  o.output.quiet = true;
  o.engine.kind = EngineKind::kCluster;
  o.engine.replicas = replicas;
  return Train(c, o);
}

struct Mode {
  v1::TrainingSpec::Mode mode;
  int n;
  v1::TrainingSpec::Rule rule;
  const char* name;
};
const Mode kModes[] = {
    {v1::TrainingSpec::E2E, 1, v1::TrainingSpec::FURTHEST, "e2e"},
    {v1::TrainingSpec::INTERLOCK, 1, v1::TrainingSpec::FURTHEST, "1-way"},
    {v1::TrainingSpec::INTERLOCK, 2, v1::TrainingSpec::FURTHEST, "2-way"},
    {v1::TrainingSpec::INTERLOCK, 2, v1::TrainingSpec::SUM, "2-way sum"},
};

// Topology 2,3,1,1 with ORDERED reduction ends bitwise where the
// in-process single chain does, in every family of modes.
TEST(Replicas, OrderedTopologyBitwiseEqualsTheSingleChain) {
  for (const Mode& mode : kModes) {
    SCOPED_TRACE(mode.name);
    v1::RunConfig c = Parse(kResNet);
    c.mutable_training()->set_mode(mode.mode);
    c.mutable_training()->set_n(mode.n);
    c.mutable_training()->set_rule(mode.rule);
    TrainOptions local;
    local.output.quiet = true;
    auto a = Train(c, local);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = RunReplicated(c, {2, 3, 1, 1});
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->block_digests, b->block_digests);
    EXPECT_EQ(a->head_digests, b->head_digests);
    ASSERT_EQ(a->eval.size(), b->eval.size());
    for (size_t i = 0; i < a->eval.size(); ++i) {
      EXPECT_EQ(a->eval[i].loss, b->eval[i].loss);
    }
  }
}

// RING sums per-replica sums: the same topology twice gives the same bits;
// the single chain's values only within float tolerance.
TEST(Replicas, RingIsReproducibleForATopologyAndCloseToTheSingleChain) {
  v1::RunConfig c = Parse(kResNet);
  c.mutable_training()->set_mode(v1::TrainingSpec::INTERLOCK);
  c.mutable_training()->set_n(2);
  c.mutable_training()->set_reduction(v1::TrainingSpec::RING);
  TrainOptions local;
  local.output.quiet = true;
  auto single = Train(c, local);
  ASSERT_TRUE(single.ok()) << single.status();
  auto a = RunReplicated(c, {2, 2, 1, 1});
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = RunReplicated(c, {2, 2, 1, 1});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->digest, b->digest);
  ASSERT_EQ(single->eval.size(), a->eval.size());
  for (size_t i = 0; i < a->eval.size(); ++i) {
    EXPECT_NEAR(a->eval[i].loss, single->eval[i].loss,
                1e-3 * std::abs(single->eval[i].loss) + 1e-4);
  }
}

TEST(Replicas, MoreReplicasThanMicroBatchesIsRefusedNamingTheBlock) {
  v1::RunConfig c = Parse(kResNet);
  c.mutable_training()->set_microbatches(2);
  auto r = RunReplicated(c, {1, 3, 1, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("block 1 has 3 replicas"),
            std::string::npos)
      << r.status();
}

}  // namespace
}  // namespace interlock
