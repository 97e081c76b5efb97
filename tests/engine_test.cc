// The interlocking engine in one process: the worked examples
// (docs/ARCHITECTURE.md), equivalences with plain autograd, and determinism
// across schedules.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "coordinator/train.h"
#include "services/config.h"
#include "services/data.h"
#include "services/driver.h"
#include "services/models.h"
#include "services/optim.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

using interlock::testing::ParseParams;
using interlock::v1::RunConfig;

RunConfig Load(const std::string& rel) {
  auto c = LoadRunConfig(std::string(INTERLOCK_SOURCE_DIR) + "/" + rel);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

RunConfig Parse(const std::string& text) {
  auto c = ParseRunConfig(text, "test");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TrainResult MustTrain(const RunConfig& c, bool dump = true,
                      Schedule schedule = Schedule::kSequential) {
  TrainOptions o;
  o.output.quiet = true;
  o.output.dump_params = dump;
  o.engine.schedule = schedule;
  auto r = Train(c, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : TrainResult{};
}

void ExpectTheta(const std::map<std::string, std::vector<double>>& params,
                 int block, const std::vector<double>& want) {
  const std::string name = "block" + std::to_string(block) + ".block.0.theta";
  auto it = params.find(name);
  ASSERT_NE(it, params.end()) << name;
  ASSERT_EQ(it->second.size(), want.size()) << name;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(it->second[i], want[i], 1e-6) << name << "[" << i << "]";
  }
}

// The worked examples' table, library path.
TEST(WorkedExamples, E2E) {
  auto p = ParseParams(
      MustTrain(Load("configs/tests/example_e2e.pbtxt")).params_json);
  ExpectTheta(p, 0, {0.8});
  ExpectTheta(p, 1, {2.2});
  ExpectTheta(p, 2, {3.4});
}

TEST(WorkedExamples, OneWay) {
  auto p = ParseParams(
      MustTrain(Load("configs/tests/example_1way.pbtxt")).params_json);
  ExpectTheta(p, 0, {1.5, 2.5});
  ExpectTheta(p, 1, {2.0, 4.0});
  ExpectTheta(p, 2, {3.4, 3.4});
}

TEST(WorkedExamples, TwoWay) {
  auto p = ParseParams(
      MustTrain(Load("configs/tests/example_2way.pbtxt")).params_json);
  ExpectTheta(p, 0, {0.5, 3.5});
  ExpectTheta(p, 1, {2.2, 2.2});
  ExpectTheta(p, 2, {3.4, 3.4});
}

constexpr char kMlp[] = R"pb(
  name: "mlp"
  model {
    mlp { hidden: [ 32, 24, 16 ] }
    blocks: 3
    head: "fc"
  }
  data {
    kind: SYNTHETIC_VECTORS
    synthetic_shape: 20
    synthetic_classes: 5
    synthetic_train: 320
    synthetic_test: 64
  }
  optimizer { kind: SGD momentum: 0.9 weight_decay: 0.0001 }
  schedule { kind: CONSTANT lr: 0.05 }
  training { mode: E2E batch_size: 32 microbatches: 1 steps: 10 seed: 7 }
)pb";

constexpr char kResNet[] = R"pb(
  name: "resnet"
  model {
    resnet { architecture: "8,1/16,1/16,1" }
    partition: "2,1,rest"
    head: "conv8_bn_gbpl_fc"
  }
  data {
    kind: SYNTHETIC_IMAGES
    synthetic_shape: [ 3, 12, 12 ]
    synthetic_classes: 4
    synthetic_train: 128
    synthetic_test: 32
  }
  optimizer { kind: SGD momentum: 0.9 }
  schedule { kind: CONSTANT lr: 0.05 }
  training { mode: E2E batch_size: 16 microbatches: 1 steps: 10 seed: 3 }
)pb";

constexpr char kTransformer[] = R"pb(
  name: "gpt"
  model {
    transformer { d_model: 16 layers: 3 heads: 2 context: 12 }
    partition: "2,1,rest"
    head: "ln_fc"
  }
  data { kind: SYNTHETIC_TEXT }
  optimizer { kind: ADAMW weight_decay: 0.01 }
  schedule { kind: COSINE lr: 0.003 warmup_steps: 2 }
  training { mode: E2E batch_size: 8 microbatches: 2 steps: 6 seed: 5 }
)pb";

// Trains the whole model as one network with plain autograd: the reference
// that E2E through the engine must reproduce.
std::map<std::string, std::vector<double>> Monolithic(RunConfig c) {
  ApplyDefaults(c);
  auto data = LoadData(c.data(), 1);
  EXPECT_TRUE(data.ok()) << data.status();
  auto blocks = BuildModel(c.model(), data->shape, false, c.training().seed());
  EXPECT_TRUE(blocks.ok()) << blocks.status();
  std::vector<torch::Tensor> params;
  for (auto& b : *blocks) {
    for (auto& p : b.block->parameters()) params.push_back(p);
  }
  const auto& o = c.optimizer();
  torch::optim::SGD sgd(params, torch::optim::SGDOptions(c.schedule().lr())
                                    .momentum(o.momentum())
                                    .weight_decay(o.weight_decay()));
  const int64_t batch = c.training().batch_size();
  const int64_t per_epoch = data->train->size() / batch;
  for (int64_t s = 0; s < c.training().steps(); ++s) {
    auto perm = EpochPermutation(data->train->size(), c.training().seed(),
                                 s / per_epoch);
    const int64_t base = (s % per_epoch) * batch;
    std::vector<int64_t> idx(perm.begin() + base, perm.begin() + base + batch);
    auto [x, y] = data->train->Gather(idx);
    for (auto& b : *blocks) x = b.block->forward(x);
    sgd.zero_grad();
    torch::nn::functional::cross_entropy(x, y).backward();
    sgd.step();
  }
  std::map<std::string, std::vector<double>> out;
  for (size_t k = 0; k < blocks->size(); ++k) {
    for (auto& kv : (*blocks)[k].block->named_parameters()) {
      auto flat =
          kv.value().detach().to(torch::kFloat64).contiguous().view({-1});
      out["block" + std::to_string(k) + ".block." + kv.key()] =
          std::vector<double>(flat.data_ptr<double>(),
                              flat.data_ptr<double>() + flat.numel());
    }
  }
  return out;
}

void ExpectClose(const std::map<std::string, std::vector<double>>& want,
                 const std::map<std::string, std::vector<double>>& got,
                 double tol) {
  ASSERT_FALSE(want.empty());
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << name;
    ASSERT_EQ(it->second.size(), w.size()) << name;
    double worst = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      worst = std::max(worst, std::abs(w[i] - it->second[i]));
    }
    EXPECT_LE(worst, tol) << name;
  }
}

TEST(Equivalence, E2EMatchesMonolithicMlp) {
  RunConfig c = Parse(kMlp);
  ExpectClose(Monolithic(c), ParseParams(MustTrain(c).params_json), 1e-6);
}

TEST(Equivalence, E2EMatchesMonolithicResNet) {
  RunConfig c = Parse(kResNet);
  ExpectClose(Monolithic(c), ParseParams(MustTrain(c).params_json), 1e-6);
}

// n = K with FURTHEST trains every block by the final loss: the block
// parameters must equal E2E's bit for bit.
void ExpectFullWidthEqualsE2E(RunConfig c) {
  const TrainResult e2e = MustTrain(c, false);
  c.mutable_training()->set_mode(interlock::v1::TrainingSpec::INTERLOCK);
  c.mutable_training()->set_n(3);
  const TrainResult full = MustTrain(c, false);
  ASSERT_EQ(e2e.block_digests.size(), 3u);
  EXPECT_EQ(e2e.block_digests, full.block_digests);
  c.mutable_training()->set_n(2);
  EXPECT_NE(e2e.block_digests[0], MustTrain(c, false).block_digests[0])
      << "2-way must differ from E2E";
}

TEST(Equivalence, FullWidthEqualsE2EResNet) {
  ExpectFullWidthEqualsE2E(Parse(kResNet));
}

TEST(Equivalence, FullWidthEqualsE2ETransformer) {
  ExpectFullWidthEqualsE2E(Parse(kTransformer));
}

TEST(Equivalence, MicroBatchesEqualOneBatch) {
  RunConfig c = Parse(kMlp);
  c.mutable_training()->set_mode(interlock::v1::TrainingSpec::INTERLOCK);
  c.mutable_training()->set_n(2);
  c.mutable_training()->set_microbatches(1);
  auto one = ParseParams(MustTrain(c).params_json);
  c.mutable_training()->set_microbatches(4);
  auto four = ParseParams(MustTrain(c).params_json);
  ExpectClose(one, four, 1e-6);
}

TEST(Equivalence, SumRuleDiffersFromFurthestAndEqualsItAtN1) {
  RunConfig c = Parse(kResNet);
  c.mutable_training()->set_mode(interlock::v1::TrainingSpec::INTERLOCK);
  c.mutable_training()->set_n(1);
  const auto furthest1 = MustTrain(c, false).digest;
  c.mutable_training()->set_rule(interlock::v1::TrainingSpec::SUM);
  EXPECT_EQ(furthest1, MustTrain(c, false).digest);
  c.mutable_training()->set_n(2);
  const auto sum2 = MustTrain(c, false).digest;
  c.mutable_training()->set_rule(interlock::v1::TrainingSpec::FURTHEST);
  EXPECT_NE(sum2, MustTrain(c, false).digest);
}

// FURTHEST skips the gradient entries that train no block (3-way: one per
// micro-batch at K = 4, 4-way: three); the parameters are bitwise what
// computing and sending them gives, in every mode and on both schedules.
TEST(Equivalence, SkippingEntriesThatTrainNoBlockChangesNoParameter) {
  RunConfig c = Load("configs/tests/tiny_resnet_k4.pbtxt");
  c.mutable_training()->set_steps(12);
  using interlock::v1::TrainingSpec;
  struct Mode {
    TrainingSpec::Mode mode;
    int n;
    TrainingSpec::Rule rule;
  };
  for (const Mode& m :
       std::vector<Mode>{{TrainingSpec::E2E, 4, TrainingSpec::FURTHEST},
                         {TrainingSpec::INTERLOCK, 1, TrainingSpec::FURTHEST},
                         {TrainingSpec::INTERLOCK, 2, TrainingSpec::FURTHEST},
                         {TrainingSpec::INTERLOCK, 3, TrainingSpec::FURTHEST},
                         {TrainingSpec::INTERLOCK, 4, TrainingSpec::FURTHEST},
                         {TrainingSpec::INTERLOCK, 3, TrainingSpec::SUM}}) {
    c.mutable_training()->set_mode(m.mode);
    c.mutable_training()->set_n(m.n);
    c.mutable_training()->set_rule(m.rule);
    c.mutable_training()->set_compute_unused_gradients(true);
    const std::string all = MustTrain(c, false).digest;
    c.mutable_training()->set_compute_unused_gradients(false);
    const std::string used = MustTrain(c, false).digest;
    EXPECT_EQ(used, all) << m.mode << " n " << m.n << " rule " << m.rule;
    EXPECT_EQ(MustTrain(c, false, Schedule::kThreaded).digest, all)
        << m.mode << " n " << m.n << " rule " << m.rule << " threaded";
  }
}

// 2-way: block 1 sends its own entry up as soon as it has forwarded, before
// anything comes from below, so block 0 waits for one block, not the chain.
TEST(Driver, EntriesTravelAsSoonAsTheyExist) {
  RunConfig c = Parse(kMlp);
  c.mutable_training()->set_mode(interlock::v1::TrainingSpec::INTERLOCK);
  c.mutable_training()->set_n(2);
  ApplyDefaults(c);
  auto data = LoadData(c.data(), 1);
  ASSERT_TRUE(data.ok()) << data.status();
  auto outs = BlockOutputShapes(c.model(), data->shape);
  ASSERT_TRUE(outs.ok()) << outs.status();
  auto trainer = BlockTrainer::Create(c, data->shape, 1);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  std::vector<UpwardMsg> ups;
  int downs = 0, steps = 0;
  BlockDriver::Callbacks cb;
  cb.send_down = [&](ForwardMsg) { ++downs; };
  cb.send_up = [&](UpwardMsg m) { ups.push_back(std::move(m)); };
  cb.step_done = [&](StepDone) { ++steps; };
  BlockDriver driver(std::move(*trainer), cb);

  const int64_t batch = c.training().batch_size();
  std::vector<int64_t> in = {batch}, out = {batch};
  in.insert(in.end(), (*outs)[0].begin(), (*outs)[0].end());
  out.insert(out.end(), (*outs)[1].begin(), (*outs)[1].end());
  ForwardMsg f;
  f.lr = 0.05;
  f.input = torch::randn(in);
  f.target = torch::randint(0, 5, {batch}, torch::kLong);
  ASSERT_TRUE(driver.OnForward(f).ok());
  EXPECT_EQ(downs, 1);
  ASSERT_EQ(ups.size(), 1u);
  EXPECT_FALSE(ups[0].final);
  EXPECT_EQ(ups[0].first_entry, 0);
  ASSERT_EQ(ups[0].grads.size(), 1u);
  EXPECT_EQ(ups[0].grads[0].sizes(), c10::IntArrayRef(in));
  EXPECT_EQ(steps, 0);

  // The final message may not overtake the gradient entry it follows.
  UpwardMsg early_final;
  EXPECT_EQ(driver.OnUpward(early_final).code(),
            absl::StatusCode::kInvalidArgument);
  UpwardMsg entry;
  entry.final = false;
  entry.grads.push_back(torch::randn(out));
  ASSERT_TRUE(driver.OnUpward(entry).ok());
  EXPECT_EQ(steps, 1);        // M = 1: the block stepped on its gradient
  EXPECT_EQ(ups.size(), 1u);  // its report waits for the one from below
  EXPECT_EQ(driver.OnUpward(entry).code(),
            absl::StatusCode::kInvalidArgument);  // entry 0 again
  UpwardMsg final_msg;
  final_msg.reports.push_back({2, 1.5, 3, 32});
  ASSERT_TRUE(driver.OnUpward(final_msg).ok());
  ASSERT_EQ(ups.size(), 2u);
  EXPECT_TRUE(ups[1].final);
  EXPECT_TRUE(ups[1].grads.empty());
  ASSERT_EQ(ups[1].reports.size(), 2u);
  EXPECT_EQ(ups[1].reports[0].block, 1);
  EXPECT_EQ(ups[1].reports[1].block, 2);
}

// Budgets stop a run early, between steps, and the run still evaluates.
TEST(Budgets, VirtualAndWallBudgetsStopTheRun) {
  RunConfig c = Parse(kMlp);
  c.mutable_training()->set_mode(interlock::v1::TrainingSpec::INTERLOCK);
  c.mutable_training()->set_n(2);
  c.mutable_training()->set_steps(10);
  const TrainResult probe = MustTrain(c, false);
  ASSERT_GT(probe.mean_step_virtual, 0);
  ASSERT_GT(probe.utilisation, 0);
  ASSERT_EQ(probe.evals.size(), 1u);

  c.mutable_training()->set_steps(100000);
  TrainOptions o;
  o.output.quiet = true;
  const double budget = 20 * probe.mean_step_virtual;
  o.budget.virtual_time = absl::Seconds(budget);
  auto r = Train(c, o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->steps, 0);
  EXPECT_LT(r->steps, 100000);
  // Projected from the replayed steps: it ends near the budget, not past
  // it by more than a few steps' worth.
  EXPECT_LT(r->virtual_seconds, budget + 5 * r->mean_step_virtual);
  EXPECT_FALSE(r->eval.empty());

  TrainOptions w;
  w.output.quiet = true;
  w.budget.wall = absl::Milliseconds(500);
  auto rw = Train(c, w);
  ASSERT_TRUE(rw.ok()) << rw.status();
  EXPECT_LT(rw->steps, 100000);
  EXPECT_LT(rw->wall_seconds, 5.0);
}

// One thread for all blocks and one thread per block: bitwise identical.
TEST(Determinism, ThreadedEqualsSequential) {
  for (const char* text : {kResNet, kTransformer}) {
    RunConfig c = Parse(text);
    c.mutable_training()->set_microbatches(2);
    for (auto [mode, n, rule] : std::vector<std::tuple<int, int, int>>{
             {1, 0, 1}, {2, 1, 1}, {2, 2, 1}, {2, 2, 2}}) {
      c.mutable_training()->set_mode(
          static_cast<interlock::v1::TrainingSpec::Mode>(mode));
      c.mutable_training()->set_n(n);
      c.mutable_training()->set_rule(
          static_cast<interlock::v1::TrainingSpec::Rule>(rule));
      const auto seq = MustTrain(c, false, Schedule::kSequential);
      const auto thr = MustTrain(c, false, Schedule::kThreaded);
      EXPECT_EQ(seq.digest, thr.digest)
          << c.name() << " mode " << mode << " n " << n << " rule " << rule;
      EXPECT_EQ(seq.steps, c.training().steps());
    }
  }
}

TEST(Schedules, LearningRates) {
  interlock::v1::ScheduleSpec s;
  s.set_kind(interlock::v1::ScheduleSpec::MULTISTEP);
  s.set_lr(1.0f);
  s.add_milestones(2);
  s.add_milestones(4);
  s.set_gamma(0.5f);
  EXPECT_DOUBLE_EQ(LearningRateAt(s, 1, 10), 1.0);
  EXPECT_DOUBLE_EQ(LearningRateAt(s, 2, 10), 0.5);
  EXPECT_DOUBLE_EQ(LearningRateAt(s, 5, 10), 0.25);
  s.Clear();
  s.set_kind(interlock::v1::ScheduleSpec::COSINE);
  s.set_lr(1.0f);
  s.set_warmup_steps(2);
  EXPECT_DOUBLE_EQ(LearningRateAt(s, 0, 12), 0.5);
  EXPECT_DOUBLE_EQ(LearningRateAt(s, 1, 12), 1.0);
  EXPECT_DOUBLE_EQ(LearningRateAt(s, 2, 12), 1.0);
  EXPECT_NEAR(LearningRateAt(s, 7, 12), 0.5, 1e-9);
  EXPECT_NEAR(LearningRateAt(s, 12, 12), 0.0, 1e-9);
}

TEST(Training, LossGoesDownAndEvalCoversEveryHead) {
  RunConfig c = Parse(kResNet);
  c.mutable_training()->set_mode(interlock::v1::TrainingSpec::INTERLOCK);
  c.mutable_training()->set_n(2);
  c.mutable_training()->set_steps(40);
  const auto r = MustTrain(c, false);
  ASSERT_EQ(r.eval.size(), 3u);
  // Four classes: chance is 0.25.
  for (const auto& h : r.eval) EXPECT_GT(h.accuracy, 0.4) << h.block;
  ASSERT_EQ(r.final_losses.size(), 3u);
  for (double l : r.final_losses) EXPECT_LT(l, std::log(4.0)) << "loss";
}

}  // namespace
}  // namespace interlock
