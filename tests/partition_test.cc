// Balanced partitions (plan/partition.h, analysis/unit_costs.h): the exact cut
// on hand-checked and exhaustively checked costs, unit profiles and their cuts,
// and `interlock partition` / `partition: "auto"` / `simulate --partition`
// through the CLI, with clear errors for impossible requests.
#include "plan/partition.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "analysis/run_files.h"
#include "analysis/simulate.h"
#include "analysis/unit_costs.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

using interlock::testing::ExpectOneLineError;
using interlock::testing::ReadFile;
using interlock::testing::RunCommand;

const std::string kCli = INTERLOCK_CLI;
const std::string kSrc = INTERLOCK_SOURCE_DIR;
const std::string kTiny = kSrc + "/configs/tests/tiny_resnet.pbtxt";

UnitCosts Costs(std::vector<double> unit, std::vector<double> head = {}) {
  if (head.empty()) head.assign(unit.size(), 0.0);
  return UnitCosts{std::move(unit), std::move(head)};
}

double Max(const std::vector<double>& v) {
  return *std::max_element(v.begin(), v.end());
}

TEST(Partition, HandCheckedCut) {
  // 5,1,1,1,4,4 into 3: [5,1] [1,1,4] [4] costs 6,6,4. Filling blocks up to
  // the mean (16/3) greedily gives [5] [1,1,1] [4,4] with a block of 8.
  const UnitCosts c = Costs({5, 1, 1, 1, 4, 4});
  auto cut = BalancedPartition(c, 3);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(PartitionString(*cut), "2,3,1");
  EXPECT_EQ(BlockCosts(c, *cut), (std::vector<double>{6, 6, 4}));
  // One block: everything; as many blocks as units: one each.
  EXPECT_EQ(PartitionString(*BalancedPartition(c, 1)), "6");
  EXPECT_EQ(PartitionString(*BalancedPartition(c, 6)), "1,1,1,1,1,1");
}

TEST(Partition, HeadCostsMoveTheCut) {
  // Without heads 2,2,2,2 into 2 is 2,2 (4 and 4). A head of 5 on unit 1's
  // output makes that cut cost 9; cutting after unit 0 or 2 costs 6 at
  // most, and the first of those equal cuts is taken.
  EXPECT_EQ(PartitionString(*BalancedPartition(Costs({2, 2, 2, 2}), 2)), "2,2");
  const UnitCosts c = Costs({2, 2, 2, 2}, {0, 5, 0, 0});
  auto cut = BalancedPartition(c, 2);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(PartitionString(*cut), "1,3");
  EXPECT_EQ(BlockCosts(c, *cut), (std::vector<double>{2, 6}));
  // The last block's head (the model's own loss) counts as well.
  EXPECT_EQ(
      PartitionString(*BalancedPartition(Costs({1, 1, 1, 1}, {0, 0, 0, 2}), 2)),
      "3,1");
}

TEST(Partition, EvenAmongCutsOfTheSameMaximum) {
  // 4,1,1,1,1 into 3: every cut with [4] first has maximum 4; [1,1] [1,1]
  // (sum of squares 24) beats [1] [1,1,1] and [1,1,1] [1] (26).
  EXPECT_EQ(PartitionString(*BalancedPartition(Costs({4, 1, 1, 1, 1}), 3)),
            "1,2,2");
}

// Every composition of `units` into `blocks` positive parts.
void ForEachCut(int units, int blocks, std::vector<int>& prefix,
                const std::function<void(const std::vector<int>&)>& f) {
  if (blocks == 1) {
    prefix.push_back(units);
    f(prefix);
    prefix.pop_back();
    return;
  }
  for (int c = 1; c <= units - blocks + 1; ++c) {
    prefix.push_back(c);
    ForEachCut(units - c, blocks - 1, prefix, f);
    prefix.pop_back();
  }
}

TEST(Partition, OptimalAgainstEveryCut) {
  uint64_t state = 12345;
  auto next = [&state] {  // a fixed linear congruential sequence
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<double>((state >> 33) % 1000) / 100.0;
  };
  for (int trial = 0; trial < 60; ++trial) {
    const int units = 1 + trial % 9;
    UnitCosts c;
    for (int u = 0; u < units; ++u) {
      c.unit.push_back(next());
      c.head.push_back(trial % 2 == 0 ? 0.0 : next() / 3);
    }
    for (int k = 1; k <= units; ++k) {
      double best = std::numeric_limits<double>::infinity();
      std::vector<int> prefix;
      ForEachCut(units, k, prefix, [&](const std::vector<int>& cut) {
        best = std::min(best, Max(BlockCosts(c, cut)));
      });
      auto cut = BalancedPartition(c, k);
      ASSERT_TRUE(cut.ok()) << cut.status();
      ASSERT_EQ(static_cast<int>(cut->size()), k);
      int covered = 0;
      for (int n : *cut) {
        EXPECT_GE(n, 1);
        covered += n;
      }
      EXPECT_EQ(covered, units);
      EXPECT_DOUBLE_EQ(Max(BlockCosts(c, *cut)), best)
          << "trial " << trial << " K " << k << " cut "
          << PartitionString(*cut);
    }
  }
}

TEST(Partition, ImpossibleRequestsNameWhatIsWrong) {
  const UnitCosts c = Costs({5, 1, 1, 1, 4, 4});
  struct Case {
    UnitCosts costs;
    int blocks;
    std::string fragment;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const Case& t : std::vector<Case>{
           {c, 7, "7 blocks but the model has only 6 units"},
           {c, 0, "K must be >= 1"},
           {c, -2, "K must be >= 1"},
           {Costs({1, -1, 1}), 2, "unit 1 has cost -1"},
           {Costs({1, nan}), 1, "unit 1 has cost nan"},
           {UnitCosts{{1, 2}, {0}}, 1, "2 unit costs but 1 head costs"},
           {UnitCosts{}, 1, "no units"},
       }) {
    auto cut = BalancedPartition(t.costs, t.blocks);
    ASSERT_FALSE(cut.ok()) << t.fragment;
    EXPECT_EQ(cut.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(cut.status().message().find(t.fragment), std::string::npos)
        << cut.status();
  }
  auto parsed = ParsePartition("auto", 5, 3);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("'auto'"), std::string::npos);
}

// A unit profile of four units as `interlock partition` measures them.
Profile FourUnits() {
  Profile p;
  p.path = "units/profile.json";
  p.blocks = 4;
  p.microbatches = 2;
  p.mode.n = 1;
  p.partition = {1, 1, 1, 1};
  p.input_bytes = 100;
  p.down_bytes = {40, 30, 20};
  p.up_bytes = {0, 0, 0};
  p.parameters = {10, 20, 30, 40};
  const double forward[] = {1, 2, 3, 4}, backward[] = {2, 4, 6, 8},
               head[] = {0.5, 0.25, 0.125, 1};
  for (int u = 0; u < 4; ++u) {
    BlockProfile b;
    b.forward = forward[u];
    b.backward = backward[u];
    b.head = head[u];
    b.input_grad = 0;
    b.optimizer = 0.2;
    p.per_block.push_back(b);
  }
  return p;
}

TEST(Partition, UnitProfileCosts) {
  auto costs = UnitCostsOf(FourUnits());
  ASSERT_TRUE(costs.ok()) << costs.status();
  // forward + backward + optimizer / M.
  const double unit[] = {3.1, 6.1, 9.1, 12.1};
  ASSERT_EQ(costs->unit.size(), 4u);
  for (int u = 0; u < 4; ++u) EXPECT_DOUBLE_EQ(costs->unit[u], unit[u]);
  EXPECT_EQ(costs->head, (std::vector<double>{0.5, 0.25, 0.125, 1}));

  Profile blocks = FourUnits();
  blocks.partition = {2, 1, 1};
  blocks.blocks = 3;
  auto refused = UnitCostsOf(blocks);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("partition 2,1,1, not one unit"),
            std::string::npos)
      << refused.status();
  Profile old = FourUnits();
  old.partition.clear();
  refused = UnitCostsOf(old);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("records no partition"),
            std::string::npos);
  Profile two_way = FourUnits();
  two_way.mode.n = 2;
  refused = UnitCostsOf(two_way);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("1-way or E2E"), std::string::npos);
}

TEST(Partition, CutProfileSumsUnitsAndKeepsTheBoundary) {
  const Profile cut = CutProfile(FourUnits(), {1, 3});
  EXPECT_EQ(cut.blocks, 2);
  EXPECT_EQ(cut.partition, (std::vector<int>{1, 3}));
  ASSERT_EQ(cut.per_block.size(), 2u);
  EXPECT_DOUBLE_EQ(cut.per_block[0].forward, 1);
  EXPECT_DOUBLE_EQ(cut.per_block[1].forward, 9);
  EXPECT_DOUBLE_EQ(cut.per_block[1].backward, 18);
  EXPECT_DOUBLE_EQ(cut.per_block[1].optimizer, 0.6000000000000001);
  EXPECT_DOUBLE_EQ(cut.per_block[0].head, 0.5);  // unit 0's head
  EXPECT_DOUBLE_EQ(cut.per_block[1].head, 1);    // the model's loss
  EXPECT_EQ(cut.parameters, (std::vector<int64_t>{10, 90}));
  EXPECT_EQ(cut.down_bytes, (std::vector<int64_t>{40}));  // after unit 0
  EXPECT_EQ(cut.input_bytes, 100);
  // Its block costs are the unit costs' block costs: the simulator replays
  // what the partition was chosen on.
  const std::vector<double> blocks =
      BlockCosts(*UnitCostsOf(FourUnits()), {1, 3});
  EXPECT_DOUBLE_EQ(blocks[0], 3.1 + 0.5);
  EXPECT_DOUBLE_EQ(blocks[1], 6.1 + 9.1 + 12.1 + 1);
}

std::string TempDir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() /
           ("interlock_partition_" + name + "_" + std::to_string(getpid()));
  std::filesystem::remove_all(p);
  return p.string();
}

// The partition string of `interlock partition`'s first line.
std::string PrintedPartition(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex("partition: \"([0-9,]+)\""))) {
    return "";
  }
  return m[1];
}

TEST(PartitionCli, BadRequestsGiveOneLineErrors) {
  const std::string dir = TempDir("bad");
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  // A run profile of 3 blocks of several units: no unit costs.
  v1::RunProfile blocks;
  blocks.set_blocks(3);
  blocks.set_microbatches(1);
  blocks.set_mode("interlock");
  blocks.set_n(1);
  blocks.set_rule("furthest");
  for (int i = 0; i < 2; ++i) {
    blocks.add_down_bytes(1);
    blocks.add_up_bytes(0);
  }
  blocks.mutable_link()->set_latency_seconds(0);
  blocks.mutable_link()->set_bytes_per_second(1);
  for (int i = 0; i < 3; ++i) {
    v1::BlockCosts* b = blocks.add_per_block();
    b->set_forward(1);
    b->set_head(0);
    b->set_backward(1);
    b->set_optimizer(0);
  }
  blocks.mutable_step_seconds()->set_wall(1);
  blocks.mutable_step_seconds()->set_virtual_(1);
  for (int c : {2, 1, 2}) blocks.add_partition(c);
  ASSERT_TRUE(WriteProfileFile(dir + "/blocks.json", blocks).ok());
  // The same as a unit profile, but of 3 units where the model has 5.
  v1::RunProfile three = blocks;
  three.clear_partition();
  for (int i = 0; i < 3; ++i) three.add_partition(1);
  ASSERT_TRUE(WriteProfileFile(dir + "/three.json", three).ok());
  struct Case {
    std::string args;
    std::string fragment;
  };
  for (const Case& c : std::vector<Case>{
           {"--config " + kTiny + " --blocks 9",
            "model.blocks: 9 blocks but the model has only 5 units"},
           {"--config " + kTiny + " --blocks 0", "--blocks: 0"},
           {"--config " + kTiny + " --blocks -1", "--blocks: -1"},
           {"--config " + kTiny, "--blocks is required"},
           {"--blocks 2", "--config is required"},
           {"--config /nonexistent.pbtxt --blocks 2", "/nonexistent.pbtxt"},
           {"--config " + kTiny + " --blocks 2 --profile " + dir + "/missing",
            "cannot read " + dir + "/missing"},
           {"--config " + kTiny + " --blocks 2 --profile " + dir +
                "/blocks.json",
            "partition 2,1,2, not one unit per block"},
           {"--config " + kTiny + " --blocks 2 --profile " + dir +
                "/three.json",
            "a unit profile of 3 units, but the model of tiny_resnet has 5"},
           {"--config " + kSrc + "/configs/tests/example_e2e.pbtxt --blocks 2",
            "built as blocks, not from units that a partition cuts"},
       }) {
    ExpectOneLineError(RunCommand(kCli + " partition " + c.args), c.args,
                       c.fragment);
  }
  // Protobuf's JSON error quotes the bad text over several lines.
  auto garbage = RunCommand(kCli + " partition --config " + kTiny +
                            " --blocks 2 --profile " +
                            write("garbage.json", "{ not json"));
  EXPECT_EQ(garbage.exit_code, 1) << garbage.output;
  EXPECT_NE(garbage.output.find("interlock: error: " + dir +
                                "/garbage.json: not a JSON object"),
            std::string::npos)
      << garbage.output;
  // "auto" without K, and K beyond the units, in a run's config.
  for (const auto& [extra, fragment] :
       std::vector<std::pair<std::string, std::string>>{
           {"", "'auto' needs model.blocks"},
           {"blocks: 6", "model.blocks: 6 blocks but the model has only 5"}}) {
    std::string text = ReadFile(kTiny);
    text = std::regex_replace(text, std::regex("partition: \"2,1,rest\""),
                              "partition: \"auto\" " + extra);
    const std::string config = write("auto.pbtxt", text);
    auto r = RunCommand(kCli + " train --quiet --config " + config);
    EXPECT_NE(r.exit_code, 0) << extra;
    EXPECT_NE(r.output.find(fragment), std::string::npos) << r.output;
  }
  std::filesystem::remove_all(dir);
}

TEST(PartitionCli, MeasuresCutsAndReusesUnitCosts) {
  const std::string dir = TempDir("run");
  auto r = RunCommand(kCli + " partition --config " + kTiny +
                      " --blocks 3 --out " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string printed = PrintedPartition(r.output);
  // The unit profile: one unit per block, the 5 units of tiny_resnet.
  auto units = LoadProfile(dir + "/units");
  ASSERT_TRUE(units.ok()) << units.status();
  EXPECT_EQ(units->partition, (std::vector<int>{1, 1, 1, 1, 1}));
  auto costs = UnitCostsOf(*units);
  ASSERT_TRUE(costs.ok()) << costs.status();
  auto expected = BalancedPartition(*costs, 3);
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(printed, PartitionString(*expected)) << r.output;
  // Block costs, the config's own cut for comparison, a row per mode.
  for (const char* line :
       {"block", "The config's partition \"2,1,2\"", "e2e", "1-way furthest",
        "2-way furthest", "3-way furthest"}) {
    EXPECT_NE(r.output.find(line), std::string::npos) << line << r.output;
  }
  // From the kept profile: the same cut, nothing measured.
  auto again = RunCommand(kCli + " partition --config " + kTiny +
                          " --blocks 3 --profile " + dir + "/units");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(PrintedPartition(again.output), printed);
  EXPECT_EQ(again.output.find("measuring"), std::string::npos);

  // simulate cuts a unit profile as asked, or balanced for another K.
  auto sim = RunCommand(kCli + " simulate --profile " + dir +
                        "/units --partition 2,1,rest");
  ASSERT_EQ(sim.exit_code, 0) << sim.output;
  EXPECT_NE(sim.output.find("the cut 2,1,2 of the profile's units"),
            std::string::npos)
      << sim.output;
  sim = RunCommand(kCli + " simulate --profile " + dir + "/units --blocks 3");
  ASSERT_EQ(sim.exit_code, 0) << sim.output;
  EXPECT_NE(sim.output.find("the balanced cut " + printed), std::string::npos)
      << sim.output;
  sim = RunCommand(kCli + " simulate --profile " + dir +
                   "/units --partition 2,9");
  EXPECT_EQ(sim.exit_code, 2) << sim.output;
  EXPECT_NE(sim.output.find("--partition: model.partition: '2,9' covers 11"),
            std::string::npos)
      << sim.output;

  // A run with partition "auto" and that unit profile trains the cut.
  std::string text = ReadFile(kTiny);
  text = std::regex_replace(
      text, std::regex("partition: \"2,1,rest\""),
      "partition: \"auto\" blocks: 3 partition_profile: \"" + dir + "/units\"");
  const std::string config = dir + "/auto.pbtxt";
  std::ofstream(config) << text;
  const std::string out = dir + "/train";
  auto train = RunCommand(kCli + " train --quiet --steps 2 --config " + config +
                          " --out " + out);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  EXPECT_NE(train.output.find("partition auto: \"" + printed + "\""),
            std::string::npos)
      << train.output;
  auto run = LoadProfile(out);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(PartitionString(run->partition), printed);
  std::filesystem::remove_all(dir);
}

TEST(PartitionCli, AutoMeasuresInTheRunFolder) {
  const std::string dir = TempDir("auto");
  std::filesystem::create_directories(dir);
  std::string text = ReadFile(kSrc + "/configs/tests/tiny_transformer.pbtxt");
  text = std::regex_replace(text, std::regex("partition: \"2,1,rest\""),
                            "partition: \"auto\" blocks: 2");
  const std::string config = dir + "/auto.pbtxt";
  std::ofstream(config) << text;
  auto train = RunCommand(kCli + " train --quiet --steps 2 --config " + config +
                          " --out " + dir + "/run");
  ASSERT_EQ(train.exit_code, 0) << train.output;
  // The embedding, 3 layers and the LM head, measured in OUT/units.
  auto units = LoadProfile(dir + "/run/units");
  ASSERT_TRUE(units.ok()) << units.status();
  EXPECT_EQ(units->partition, (std::vector<int>{1, 1, 1, 1, 1}));
  auto chosen = BalancedPartition(*UnitCostsOf(*units), 2);
  ASSERT_TRUE(chosen.ok());
  auto run = LoadProfile(dir + "/run");
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->partition, *chosen);
  EXPECT_NE(
      train.output.find("partition auto: \"" + PartitionString(*chosen) + "\""),
      std::string::npos)
      << train.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace interlock
