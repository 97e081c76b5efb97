// The worker's configuration resolver and snapshot store, without a server:
// every refusal of a ConfigureRequest is decided by ResolveBlockRun before
// the worker lets go of the run it has.
#include "worker/block_run_spec.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "services/config.h"
#include "worker/snapshot_store.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

constexpr char kThreeBlocks[] = R"pb(
  model {
    resnet { architecture: "8,1/16,1/16,1" }
    partition: "2,1,rest"
    head: "conv8_bn_gbpl_fc"
  }
  data {
    kind: SYNTHETIC_IMAGES
    synthetic_shape: [ 3, 12, 12 ]
    synthetic_classes: 4
  }
  training { mode: INTERLOCK n: 2 batch_size: 16 microbatches: 2 }
)pb";

// Block 1 of the three, replica 0 of 2, feeding one replica of block 2.
v1::ConfigureRequest MiddleBlock() {
  v1::ConfigureRequest req;
  req.set_run_id("run-a");
  req.set_generation(3);
  auto config = ParseRunConfig(kThreeBlocks, "test");
  EXPECT_TRUE(config.ok()) << config.status();
  *req.mutable_config() = *config;
  req.set_block(1);
  req.set_num_blocks(3);
  req.set_replica(0);
  req.set_replicas(2);
  req.set_collective_address("127.0.0.1:1");
  req.set_next_address("127.0.0.1:2");
  auto* s = req.mutable_shape();
  s->set_channels(3);
  s->set_height(12);
  s->set_width(12);
  s->set_classes(4);
  req.set_max_message_bytes(1 << 20);
  return req;
}

TEST(BlockRunSpec, ResolvesADefaultedSpec) {
  auto spec = ResolveBlockRun(MiddleBlock(), 1 << 24);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->run_id, "run-a");
  EXPECT_EQ(spec->generation, 3);
  EXPECT_EQ(spec->block, 1);
  EXPECT_EQ(spec->num_blocks, 3);
  EXPECT_EQ(spec->replicas, 2);
  EXPECT_EQ(spec->next_addresses, std::vector<std::string>{"127.0.0.1:2"});
  EXPECT_EQ(spec->microbatches, 2);
  EXPECT_EQ(spec->mb_size, 8);
  // Two micro-batches of each of three blocks in flight by default; a
  // forward at most ceil(W/M)+2 steps ahead; W+M forwards queued.
  EXPECT_EQ(spec->window, 12);
  EXPECT_EQ(spec->max_steps_ahead, 8);
  EXPECT_EQ(spec->max_queued, 14);
  EXPECT_EQ(spec->sample_shape.size(), 3u);  // block 0's output, C x H x W
  EXPECT_EQ(spec->input_dtype, torch::kFloat32);
  EXPECT_EQ(spec->classes, 4);
  EXPECT_FALSE(spec->restore_step.has_value());
  // Defaults applied: the run's optimizer has a learning rate schedule.
  EXPECT_TRUE(spec->config.has_schedule());
}

TEST(BlockRunSpec, RefusesWhatCannotRun) {
  struct Case {
    std::string want;  // in the refusal
    std::function<void(v1::ConfigureRequest&)> change;
  };
  const std::vector<Case> cases = {
      {"run_id is empty", [](auto& r) { r.clear_run_id(); }},
      {"num_blocks 4 but the model has 3",
       [](auto& r) { r.set_num_blocks(4); }},
      {"block 3 outside [0, 3)", [](auto& r) { r.set_block(3); }},
      {"replica 2 outside [0, 2)", [](auto& r) { r.set_replica(2); }},
      {"3 replicas but a step has only 2 micro-batches",
       [](auto& r) {
         r.set_replicas(3);
         r.set_replica(0);
       }},
      {"2 replicas need collective_address",
       [](auto& r) { r.clear_collective_address(); }},
      {"block 1 needs next_address", [](auto& r) { r.clear_next_address(); }},
      {"next_address is not the first of next_addresses",
       [](auto& r) { r.add_next_addresses("127.0.0.1:9"); }},
      {"3 replicas of block 2 but a step has only 2",
       [](auto& r) {
         r.clear_next_address();
         for (int i = 0; i < 3; ++i) r.add_next_addresses("127.0.0.1:9");
       }},
      {"an empty address in next_addresses",
       [](auto& r) {
         r.clear_next_address();
         r.add_next_addresses("");
       }},
      {"window -1 outside", [](auto& r) { r.set_window(-1); }},
      {"raise --max_message_bytes",
       [](auto& r) { r.set_max_message_bytes(int64_t{1} << 30); }},
      {"microbatches", [](auto& r) {
         r.mutable_config()->mutable_training()->set_microbatches(3);
       }}};
  for (const auto& c : cases) {
    v1::ConfigureRequest req = MiddleBlock();
    c.change(req);
    auto spec = ResolveBlockRun(req, 1 << 24);
    ASSERT_FALSE(spec.ok()) << c.want;
    EXPECT_NE(spec.status().message().find(c.want), std::string::npos)
        << spec.status();
  }
}

BlockStateRecord Record(int64_t step) {
  BlockStateRecord r;
  r.step = step;
  return r;
}

TEST(SnapshotStore, KeepsTheLastBoundariesOfOneRunAndGeneration) {
  SnapshotStore store;
  store.Reset("run-a", 3, 1, /*keep=*/2);
  for (int64_t s = 10; s <= 13; ++s) store.Put(s, Record(s));
  // A later generation of the same run and block finds a kept boundary.
  auto kept = store.Find("run-a", 4, 1, 13);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->step, 13);
  auto gone = store.Find("run-a", 4, 1, 11);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("keeps steps 12 to 13"),
            std::string::npos)
      << gone.status();
  // Another run, block, or a generation not later: nothing, and the
  // refusal does not name the run it keeps.
  for (auto s : {store.Find("run-b", 4, 1, 13), store.Find("run-a", 4, 2, 13),
                 store.Find("run-a", 3, 1, 13)}) {
    EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  }
  auto other = store.Find("run-b", 4, 1, 13);
  EXPECT_EQ(other.status().message().find("run-a"), std::string::npos);
  store.Clear();
  EXPECT_NE(store.Find("run-a", 4, 1, 13).status().message().find("none"),
            std::string::npos);
}

}  // namespace
}  // namespace interlock
