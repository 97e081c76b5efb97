// The cluster engine against real interlock-worker processes on loopback:
// bitwise equality with the in-process engine, hostile input, a worker
// killed mid-run, metrics, graceful shutdown.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "coordinator/train.h"
#include "plan/topology.h"
#include "proto/worker.grpc.pb.h"
#include "services/config.h"
#include "services/digest.h"
#include "services/wire.h"
#include "services/wire_codec.h"
#include "tests/cluster_util.h"
#include "tests/control_watcher.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;
using interlock::testing::Child;
using interlock::testing::ControlWatcher;
using interlock::testing::HealthStatus;
using interlock::testing::HttpGet;
using interlock::testing::kTwoBlocks;
using interlock::testing::LinesIn;
using interlock::testing::LoggedMetricsPort;
using interlock::testing::MakeTempDir;
using interlock::testing::MetricSum;
using interlock::testing::ReadFile;
using interlock::testing::StartWorker;
using interlock::testing::StopWorker;
using interlock::testing::WaitExit;
using interlock::testing::WorkerProcess;

const std::string kWorker = INTERLOCK_WORKER;
const std::string kCli = INTERLOCK_CLI;
const std::string kSrc = INTERLOCK_SOURCE_DIR;

v1::RunConfig Parse(const std::string& text) {
  auto c = ParseRunConfig(text, "test");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

constexpr char kResNet[] = R"pb(
  name: "resnet"
  model {
    resnet { architecture: "8,1/16,1/16,1" }
    head: "conv8_bn_gbpl_fc"
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
  training { batch_size: 16 steps: 10 seed: 11 }
)pb";

constexpr char kTransformer[] = R"pb(
  name: "gpt"
  model {
    transformer { d_model: 16 layers: 3 heads: 2 context: 12 }
    head: "ln_fc"
  }
  data { kind: SYNTHETIC_TEXT }
  optimizer { kind: ADAMW weight_decay: 0.01 }
  schedule { kind: COSINE lr: 0.003 warmup_steps: 2 }
  training { batch_size: 8 steps: 10 seed: 5 eval_batch_size: 32 }
)pb";

class ClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(MakeTempDir("cluster"));
    workers_ = new std::vector<WorkerProcess>();
    // Tests run on the CPU, asked for explicitly.
    for (int k = 0; k < 4; ++k) {
      workers_->push_back(StartWorker(kWorker, *dir_, k, {"--device=cpu"}));
    }
  }
  static void TearDownTestSuite() {
    for (auto& w : *workers_) {
      kill(w.pid, SIGTERM);
      int status = 0;
      waitpid(w.pid, &status, 0);
      // Graceful shutdown on SIGTERM exits 0.
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    }
    std::filesystem::remove_all(*dir_);
    delete workers_;
    delete dir_;
  }
  static std::vector<std::string> Addresses(int k) {
    std::vector<std::string> out;
    for (int i = 0; i < k; ++i) out.push_back((*workers_)[i].address());
    return out;
  }
  static std::string* dir_;
  static std::vector<WorkerProcess>* workers_;
};
std::string* ClusterTest::dir_ = nullptr;
std::vector<WorkerProcess>* ClusterTest::workers_ = nullptr;

// `c` trained quietly in process, then on `workers` (one per block).
void TrainBoth(const v1::RunConfig& c, const std::vector<std::string>& workers,
               TrainResult* local, TrainResult* cluster) {
  TrainOptions options;
  options.output.quiet = true;
  auto a = Train(c, options);
  ASSERT_TRUE(a.ok()) << a.status();
  options.engine.kind = EngineKind::kCluster;
  options.engine.workers = OnePerBlock(workers);
  auto b = Train(c, options);
  ASSERT_TRUE(b.ok()) << b.status();
  *local = *std::move(a);
  *cluster = *std::move(b);
}

// Every mode gives the same parameters, bit for bit, in one
// process and across worker processes (one intra-op thread per block).
void CompareEngines(const char* text, int k, const std::string& partition,
                    const std::vector<std::string>& workers) {
  struct Mode {
    v1::TrainingSpec::Mode mode;
    int n;
    v1::TrainingSpec::Rule rule;
  };
  const std::vector<Mode> modes = {
      {v1::TrainingSpec::E2E, 1, v1::TrainingSpec::FURTHEST},
      {v1::TrainingSpec::INTERLOCK, 1, v1::TrainingSpec::FURTHEST},
      {v1::TrainingSpec::INTERLOCK, 2, v1::TrainingSpec::FURTHEST},
      {v1::TrainingSpec::INTERLOCK, 3, v1::TrainingSpec::FURTHEST},
      {v1::TrainingSpec::INTERLOCK, 2, v1::TrainingSpec::SUM}};
  for (int m : {1, 4}) {
    for (const Mode& mode : modes) {
      v1::RunConfig c = Parse(text);
      c.mutable_model()->set_partition(partition);
      c.mutable_training()->set_mode(mode.mode);
      c.mutable_training()->set_n(mode.n);
      c.mutable_training()->set_rule(mode.rule);
      c.mutable_training()->set_microbatches(m);
      SCOPED_TRACE(::testing::Message()
                   << c.name() << " K=" << k << " M=" << m << " mode="
                   << mode.mode << " n=" << mode.n << " rule=" << mode.rule);
      TrainResult a, b;
      ASSERT_NO_FATAL_FAILURE(TrainBoth(c, workers, &a, &b));
      ASSERT_EQ(a.block_digests.size(), static_cast<size_t>(k));
      EXPECT_EQ(a.block_digests, b.block_digests);
      EXPECT_EQ(a.head_digests, b.head_digests);
      ASSERT_EQ(a.eval.size(), b.eval.size());
      for (size_t i = 0; i < a.eval.size(); ++i) {
        EXPECT_EQ(a.eval[i].loss, b.eval[i].loss);
        EXPECT_EQ(a.eval[i].accuracy, b.eval[i].accuracy);
      }
    }
  }
}

TEST_F(ClusterTest, ResNetK3BitwiseEqualsInProcess) {
  CompareEngines(kResNet, 3, "2,1,rest", Addresses(3));
}
TEST_F(ClusterTest, ResNetK4BitwiseEqualsInProcess) {
  CompareEngines(kResNet, 4, "2,1,1,rest", Addresses(4));
}
TEST_F(ClusterTest, TransformerK3BitwiseEqualsInProcess) {
  CompareEngines(kTransformer, 3, "2,1,rest", Addresses(3));
}
TEST_F(ClusterTest, TransformerK4BitwiseEqualsInProcess) {
  CompareEngines(kTransformer, 4, "2,1,1,rest", Addresses(4));
}

// A block whose parameters are larger than any message of its run (784 x
// 2048 weights, 6.4 MB, beside activations of 64 KB and the 4 MiB floor of
// the run's message limit): the coordinator still reads its state for the
// digests, which equal the in-process run's.
constexpr char kWideMlp[] = R"pb(
  name: "wide_mlp"
  model {
    mlp { hidden: [ 2048 ] }
    blocks: 2
    head: "fc"
  }
  data {
    kind: SYNTHETIC_VECTORS
    synthetic_shape: 784
    synthetic_classes: 4
    synthetic_train: 64
    synthetic_test: 16
  }
  optimizer { kind: SGD momentum: 0.9 }
  schedule { kind: CONSTANT lr: 0.05 }
  training {
    mode: INTERLOCK
    n: 2
    batch_size: 8
    microbatches: 1
    steps: 2
    seed: 3
  }
)pb";

TEST_F(ClusterTest, BlockStateLargerThanAnyMessageIsRead) {
  TrainResult a, b;
  ASSERT_NO_FATAL_FAILURE(TrainBoth(Parse(kWideMlp), Addresses(2), &a, &b));
  ASSERT_EQ(a.block_digests.size(), 2u);
  EXPECT_EQ(a.block_digests, b.block_digests);
  EXPECT_EQ(a.head_digests, b.head_digests);
}

// Every wire codec keeps the cluster bitwise equal to the in-process
// engine (2-way, two micro-batches), and each changes the parameters.
void CompareCodecs(const char* text, const std::vector<std::string>& workers) {
  std::vector<std::string> digests;
  for (const char* wire : {"bf16", "fp16", "int8", "fp16:int8"}) {
    v1::RunConfig c = Parse(text);
    c.mutable_model()->set_partition("2,1,rest");
    c.mutable_training()->set_mode(v1::TrainingSpec::INTERLOCK);
    c.mutable_training()->set_n(2);
    c.mutable_training()->set_microbatches(2);
    c.mutable_training()->set_steps(4);
    ASSERT_TRUE(ParseWireName(wire, c.mutable_wire()).ok());
    // Blocks of 100 leave a short last block in every tensor.
    c.mutable_wire()->set_int8_block_size(100);
    SCOPED_TRACE(::testing::Message() << c.name() << " wire " << wire);
    TrainOptions local;
    local.output.quiet = true;
    auto a = Train(c, local);
    ASSERT_TRUE(a.ok()) << a.status();
    TrainOptions cluster = local;
    cluster.engine.kind = EngineKind::kCluster;
    cluster.engine.workers = OnePerBlock(workers);
    auto b = Train(c, cluster);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->block_digests, b->block_digests);
    EXPECT_EQ(a->head_digests, b->head_digests);
    ASSERT_EQ(a->eval.size(), b->eval.size());
    for (size_t i = 0; i < a->eval.size(); ++i) {
      EXPECT_EQ(a->eval[i].loss, b->eval[i].loss);
      EXPECT_EQ(a->eval[i].accuracy, b->eval[i].accuracy);
    }
    EXPECT_EQ(std::count(digests.begin(), digests.end(), a->digest), 0);
    digests.push_back(a->digest);
  }
}

TEST_F(ClusterTest, ResNetCodecsBitwiseEqualInProcess) {
  CompareCodecs(kResNet, Addresses(3));
}
TEST_F(ClusterTest, TransformerCodecsBitwiseEqualInProcess) {
  CompareCodecs(kTransformer, Addresses(3));
}

// model.resnet.memory_format CHANNELS_LAST: the wire carries NCHW and every
// block re-lays what it receives out channels-last, so the cluster stays
// bitwise equal to the in-process engine; the numbers are the contiguous
// run's up to the order of summation.
TEST_F(ClusterTest, ResNetChannelsLastBitwiseEqualsInProcess) {
  struct Mode {
    v1::TrainingSpec::Mode mode;
    int n;
    v1::TrainingSpec::Rule rule;
    int microbatches;
  };
  for (const Mode& mode :
       {Mode{v1::TrainingSpec::E2E, 1, v1::TrainingSpec::FURTHEST, 1},
        Mode{v1::TrainingSpec::INTERLOCK, 2, v1::TrainingSpec::FURTHEST, 2},
        Mode{v1::TrainingSpec::INTERLOCK, 3, v1::TrainingSpec::SUM, 1}}) {
    v1::RunConfig c = Parse(kResNet);
    c.mutable_model()->set_partition("2,1,rest");
    c.mutable_training()->set_mode(mode.mode);
    c.mutable_training()->set_n(mode.n);
    c.mutable_training()->set_rule(mode.rule);
    c.mutable_training()->set_microbatches(mode.microbatches);
    SCOPED_TRACE(::testing::Message() << "mode=" << mode.mode << " n=" << mode.n
                                      << " rule=" << mode.rule);
    TrainOptions local;
    local.output.quiet = true;
    auto contiguous = Train(c, local);
    ASSERT_TRUE(contiguous.ok()) << contiguous.status();

    c.mutable_model()->mutable_resnet()->set_memory_format(
        v1::ResNetSpec::CHANNELS_LAST);
    auto a = Train(c, local);
    ASSERT_TRUE(a.ok()) << a.status();
    TrainOptions cluster = local;
    cluster.engine.kind = EngineKind::kCluster;
    cluster.engine.workers = OnePerBlock(Addresses(3));
    auto b = Train(c, cluster);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->block_digests, b->block_digests);
    EXPECT_EQ(a->head_digests, b->head_digests);
    // The format is in effect: oneDNN sums in another order.
    EXPECT_NE(a->digest, contiguous->digest);
    ASSERT_EQ(a->eval.size(), b->eval.size());
    ASSERT_EQ(a->eval.size(), contiguous->eval.size());
    for (size_t i = 0; i < a->eval.size(); ++i) {
      EXPECT_EQ(a->eval[i].loss, b->eval[i].loss);
      EXPECT_NEAR(a->eval[i].loss, contiguous->eval[i].loss,
                  1e-4 * std::abs(contiguous->eval[i].loss));
    }
  }
}

TEST_F(ClusterTest, WrongWorkerCountIsRefused) {
  v1::RunConfig c = Parse(kResNet);
  c.mutable_model()->set_partition("2,1,rest");
  TrainOptions o;
  o.output.quiet = true;
  o.engine.kind = EngineKind::kCluster;
  o.engine.workers = OnePerBlock(Addresses(2));
  auto r = Train(c, o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("--workers"), std::string::npos);
}

// --- Hostile and malformed input straight at a worker's stream. -----------

constexpr char kOneBlock[] = R"pb(
  model {
    resnet { architecture: "8,1" }
    partition: "rest"
  }
  data {
    kind: SYNTHETIC_IMAGES
    synthetic_shape: [ 3, 8, 8 ]
    synthetic_classes: 4
  }
  training { mode: INTERLOCK n: 1 batch_size: 4 microbatches: 2 }
)pb";

// Configures block 0 of `config` (3x8x8 images, 4 classes) on a worker, as
// the coordinator would.
grpc::Status ConfigureBlock0(v1::Worker::Stub* stub, const std::string& run_id,
                             const char* config, int num_blocks,
                             const std::string& next_address) {
  v1::ConfigureRequest req;
  req.set_run_id(run_id);
  req.set_generation(1);
  *req.mutable_config() = Parse(config);
  req.set_block(0);
  req.set_num_blocks(num_blocks);
  req.set_next_address(next_address);
  auto* s = req.mutable_shape();
  s->set_channels(3);
  s->set_height(8);
  s->set_width(8);
  s->set_classes(4);
  req.set_max_message_bytes(1 << 20);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::ConfigureResponse resp;
  return stub->Configure(&ctx, req, &resp);
}

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("bad");
    worker_ = StartWorker(kWorker, dir_, 0);
    ASSERT_GT(worker_.port, 0);
    stub_ = v1::Worker::NewStub(grpc::CreateChannel(
        worker_.address(), grpc::InsecureChannelCredentials()));
    Configure("run-1");
  }
  void TearDown() override {
    control_.reset();
    StopWorker(worker_);
    if (HasFailure()) {
      std::cerr << "worker log:\n"
                << std::ifstream(dir_ + "/w0.log").rdbuf() << "\n";
    }
    std::filesystem::remove_all(dir_);
  }

  void Configure(const std::string& run_id) {
    control_.reset();
    grpc::Status st = ConfigureBlock0(stub_.get(), run_id, kOneBlock, 1, "");
    ASSERT_TRUE(st.ok()) << st.error_message();
    control_ = std::make_unique<ControlWatcher>(stub_.get(), run_id);
    ASSERT_TRUE(control_->opened());
    run_id_ = run_id;
    step_ = 0;
    mb_ = 0;
  }

  v1::DownMessage Valid() {
    v1::DownMessage m;
    m.mutable_header()->set_run_id(run_id_);
    m.mutable_header()->set_generation(1);
    auto* f = m.mutable_forward();
    f->set_step(step_);
    f->set_microbatch(mb_);
    f->set_microbatches(2);
    f->set_learning_rate(0.1);
    EncodeTensor(torch::rand({2, 3, 8, 8}), f->mutable_input());
    EncodeTensor(torch::tensor({1, 3}, torch::kInt64), f->mutable_target());
    return m;
  }

  // Sends one message on a fresh stream; returns the stream's final status
  // and, if one came, the first reply.
  grpc::Status SendOnce(const v1::DownMessage& m, v1::UpMessage* reply) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    auto stream = stub_->Stream(&ctx);
    stream->Write(m);
    v1::UpMessage first;
    const bool got = stream->Read(&first);
    if (got && reply) *reply = first;
    stream->WritesDone();
    v1::UpMessage rest;
    while (stream->Read(&rest)) {
    }
    return stream->Finish();
  }

  // A valid micro-batch is processed: the worker still serves. Waits for
  // the completion and, when the micro-batch ends a step, the step report,
  // so nothing of this exchange spills into the next stream.
  void ExpectServes() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    auto stream = stub_->Stream(&ctx);
    stream->Write(Valid());
    const bool ends_step = mb_ == 1;
    bool upward = false, step_done = false;
    v1::UpMessage reply;
    while (!upward && stream->Read(&reply)) {
      if (reply.has_upward()) {
        upward = true;
        EXPECT_EQ(reply.upward().step(), step_);
        EXPECT_EQ(reply.upward().microbatch(), mb_);
      }
    }
    // The step report comes on the control stream.
    if (ends_step) {
      auto done =
          control_->Await([](const auto& e) { return e.has_step_done(); });
      step_done = done.has_value();
      if (done) {
        EXPECT_EQ(done->step_done().step(), step_);
      }
    }
    stream->WritesDone();
    while (stream->Read(&reply)) {
    }
    grpc::Status s = stream->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(upward);
    ASSERT_TRUE(step_done || !ends_step);
    if (++mb_ == 2) {
      mb_ = 0;
      ++step_;
    }
  }

  void ExpectRefused(const v1::DownMessage& m, grpc::StatusCode code,
                     const std::string& fragment) {
    grpc::Status s = SendOnce(m, nullptr);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(fragment), std::string::npos)
        << "'" << s.error_message() << "' lacks '" << fragment << "'";
    ExpectServes();
  }

  std::string dir_;
  WorkerProcess worker_;
  std::unique_ptr<v1::Worker::Stub> stub_;
  std::string run_id_;
  std::unique_ptr<ControlWatcher> control_;
  int64_t step_ = 0;
  int mb_ = 0;
};

TEST_F(BadInputTest, EveryMalformedTensorIsRefusedAndWorkerKeepsServing) {
  ExpectServes();
  const auto invalid = grpc::StatusCode::INVALID_ARGUMENT;
  {
    auto m = Valid();
    EncodeTensor(torch::zeros({2, 3, 8, 8}, torch::kInt64),
                 m.mutable_forward()->mutable_input());
    ExpectRefused(m, invalid, "dtype");
  }
  {
    auto m = Valid();
    EncodeTensor(torch::zeros({2, 3, 64}),
                 m.mutable_forward()->mutable_input());
    ExpectRefused(m, invalid, "rank 3");
  }
  {
    auto m = Valid();
    EncodeTensor(torch::zeros({2, 3, 8, 9}),
                 m.mutable_forward()->mutable_input());
    ExpectRefused(m, invalid, "dimension 3 is 9, expected 8");
  }
  {
    auto m = Valid();
    EncodeTensor(torch::zeros({3, 3, 8, 8}),
                 m.mutable_forward()->mutable_input());
    ExpectRefused(m, invalid, "dimension 0 is 3, expected 2");
  }
  {
    auto m = Valid();
    m.mutable_forward()->mutable_input()->mutable_data()->resize(100);
    ExpectRefused(m, invalid, "data bytes");
  }
  {
    auto m = Valid();
    m.mutable_forward()->mutable_input()->set_shape(1, -3);
    ExpectRefused(m, invalid, "negative");
  }
  {
    auto m = Valid();
    auto* in = m.mutable_forward()->mutable_input();
    in->clear_shape();
    for (int i = 0; i < 4; ++i) in->add_shape(int64_t{1} << 20);
    ExpectRefused(m, invalid, "overflow");
  }
  {
    auto m = Valid();
    auto* in = m.mutable_forward()->mutable_input();
    in->clear_shape();
    for (int i = 0; i < 9; ++i) in->add_shape(1);
    ExpectRefused(m, invalid, "rank 9 exceeds");
  }
  {
    auto m = Valid();
    m.mutable_forward()->mutable_input()->set_dtype(
        static_cast<v1::Tensor::DType>(42));
    ExpectRefused(m, invalid, "unknown dtype");
  }
  {
    auto m = Valid();
    auto x = torch::rand({2, 3, 8, 8});
    x[1][2][3][4] = std::numeric_limits<float>::quiet_NaN();
    EncodeTensor(x, m.mutable_forward()->mutable_input());
    ExpectRefused(m, invalid, "NaN");
  }
  {
    auto m = Valid();
    EncodeTensor(torch::tensor({1, 7}, torch::kInt64),
                 m.mutable_forward()->mutable_target());
    ExpectRefused(m, invalid, "target values");
  }
  {
    auto m = Valid();
    m.mutable_forward()->set_microbatch(5);
    ExpectRefused(m, invalid, "micro-batch index");
  }
  {
    auto m = Valid();
    m.mutable_forward()->set_microbatches(3);
    ExpectRefused(m, invalid, "microbatches 3");
  }
  {
    auto m = Valid();
    m.mutable_forward()->set_learning_rate(
        std::numeric_limits<double>::infinity());
    ExpectRefused(m, invalid, "learning rate");
  }
  {
    auto m = Valid();
    for (int i = 0; i < 3; ++i) m.mutable_forward()->add_routes(0);
    ExpectRefused(m, invalid, "3 route entries for 2 micro-batches");
  }
  {
    auto m = Valid();
    m.mutable_header()->mutable_route()->set_block(2);
    ExpectRefused(m, invalid, "routed to block 2");
  }
  {
    auto m = Valid();
    m.mutable_header()->set_run_id("someone-else");
    ExpectRefused(m, grpc::StatusCode::FAILED_PRECONDITION, "someone-else");
  }
  // And a following valid run works.
  Configure("run-2");
  ExpectServes();
  ExpectServes();
}

// Parameters and buffers of the configured block, hashed.
std::string StateDigest(v1::Worker::Stub* stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::GetStateRequest req;
  v1::GetStateResponse resp;
  grpc::Status s = stub->GetState(&ctx, req, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
  std::string all = std::to_string(resp.step());
  for (const auto& nt : resp.block()) all += nt.name() + nt.tensor().data();
  for (const auto& nt : resp.head()) all += nt.name() + nt.tensor().data();
  return Sha256Hex(all.data(), all.size());
}

// A (step, micro-batch) the worker already applied is acknowledged, not
// applied again, and the stream stays open.
TEST_F(BadInputTest, RepeatedMicroBatchIsAcknowledgedNotApplied) {
  ExpectServes();
  ExpectServes();  // step 0 done
  const std::string before = StateDigest(stub_.get());
  for (const auto& [step, mb] :
       std::vector<std::pair<int, int>>{{0, 0}, {0, 1}}) {
    v1::DownMessage m = Valid();
    m.mutable_forward()->set_step(step);
    m.mutable_forward()->set_microbatch(mb);
    // No reply comes on the stream: the acknowledgement is on the control
    // stream, and the stream ends normally once closed.
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    auto stream = stub_->Stream(&ctx);
    stream->Write(m);
    auto ack = control_->Await([](const auto& e) { return e.has_duplicate(); });
    stream->WritesDone();
    v1::UpMessage rest;
    while (stream->Read(&rest)) {
    }
    grpc::Status s = stream->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(ack.has_value());
    EXPECT_EQ(ack->duplicate().step(), step);
    EXPECT_EQ(ack->duplicate().microbatch(), mb);
    EXPECT_EQ(ack->duplicate().block(), 0);
  }
  EXPECT_EQ(StateDigest(stub_.get()), before);
  ExpectServes();
  ExpectServes();
  EXPECT_NE(StateDigest(stub_.get()), before);
}

// SaveState streams the block's state in chunks; LoadState restores it
// exactly and refuses damaged, foreign or oversized state, and the worker
// keeps serving.
TEST_F(BadInputTest, StateSavesAndLoadsOverTheWire) {
  ExpectServes();
  ExpectServes();  // step 0 done: momentum-free SGD, but BN buffers moved
  const std::string at_step1 = StateDigest(stub_.get());
  std::vector<v1::StateChunk> chunks;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    v1::SaveStateRequest req;
    req.set_run_id(run_id_);
    req.set_generation(1);
    req.set_chunk_bytes(1000);  // several chunks
    auto reader = stub_->SaveState(&ctx, req);
    v1::StateChunk c;
    while (reader->Read(&c)) chunks.push_back(c);
    grpc::Status s = reader->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  ASSERT_GT(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].step(), 1);
  EXPECT_EQ(chunks[0].block(), 0);
  EXPECT_EQ(chunks[0].sha256().size(), 64u);
  ExpectServes();
  ExpectServes();
  ASSERT_NE(StateDigest(stub_.get()), at_step1);

  auto load = [&](std::vector<v1::StateChunk> cs) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    v1::LoadStateResponse resp;
    auto writer = stub_->LoadState(&ctx, &resp);
    for (const auto& c : cs) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  };
  {
    auto bad = chunks;
    std::string& d = *bad[1].mutable_data();
    d[d.size() / 2] ^= 0x20;
    grpc::Status s = load(bad);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
    EXPECT_NE(s.error_message().find("SHA-256"), std::string::npos);
  }
  {
    auto bad = chunks;
    bad.pop_back();
    grpc::Status s = load(bad);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  }
  {
    auto bad = chunks;
    bad[0].set_run_id("someone-else");
    grpc::Status s = load(bad);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << s.error_message();
  }
  {
    auto bad = chunks;
    bad[0].set_total_bytes(int64_t{1} << 40);
    grpc::Status s = load(bad);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << s.error_message();
  }
  EXPECT_NE(StateDigest(stub_.get()), at_step1);
  grpc::Status s = load(chunks);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(StateDigest(stub_.get()), at_step1);
  // The block continues from step 1.
  step_ = 1;
  mb_ = 0;
  ExpectServes();
  ExpectServes();
}

TEST_F(BadInputTest, HealthIsServingOnlyOnceConfigured) {
  WorkerProcess fresh = StartWorker(kWorker, dir_, 9);
  auto status = [&](const WorkerProcess& w) {
    return HealthStatus(
        grpc::CreateChannel(w.address(), grpc::InsecureChannelCredentials()));
  };
  EXPECT_EQ(status(fresh), 2);    // NOT_SERVING: nothing configured yet
  EXPECT_EQ(status(worker_), 1);  // SERVING: configured in SetUp
  StopWorker(fresh);
}

// A hostile block k+1: answers every forward with the gradient list the test
// chose (NaN values, a wrong shape).
class HostileDownstream final : public v1::Worker::Service {
 public:
  explicit HostileDownstream(std::function<torch::Tensor(c10::IntArrayRef)> g)
      : gradient_(std::move(g)) {}
  grpc::Status Stream(grpc::ServerContext* ctx,
                      grpc::ServerReaderWriter<v1::UpMessage, v1::DownMessage>*
                          stream) override {
    v1::DownMessage down;
    while (stream->Read(&down)) {
      if (!down.has_forward()) continue;
      std::vector<int64_t> shape(down.forward().input().shape().begin(),
                                 down.forward().input().shape().end());
      v1::UpMessage up;
      up.mutable_upward()->set_step(down.forward().step());
      up.mutable_upward()->set_microbatch(down.forward().microbatch());
      EncodeTensor(gradient_(shape), up.mutable_upward()->add_gradients());
      stream->Write(up);
    }
    return grpc::Status::OK;
  }

 private:
  std::function<torch::Tensor(c10::IntArrayRef)> gradient_;
};

void ExpectGradientRefused(std::function<torch::Tensor(c10::IntArrayRef)> g,
                           const std::string& fragment) {
  const std::string dir = MakeTempDir("hostile");
  HostileDownstream fake(std::move(g));
  grpc::ServerBuilder builder;
  int fake_port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &fake_port);
  builder.RegisterService(&fake);
  auto server = builder.BuildAndStart();
  ASSERT_GT(fake_port, 0);
  const std::string fake_address = "127.0.0.1:" + std::to_string(fake_port);
  WorkerProcess w = StartWorker(kWorker, dir, 0);
  auto stub = v1::Worker::NewStub(
      grpc::CreateChannel(w.address(), grpc::InsecureChannelCredentials()));
  auto configure = [&](const std::string& run_id) {
    return ConfigureBlock0(stub.get(), run_id, kTwoBlocks, 2, fake_address);
  };
  ASSERT_TRUE(configure("hostile-1").ok());
  auto control = std::make_unique<ControlWatcher>(stub.get(), "hostile-1");
  ASSERT_TRUE(control->opened());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->Stream(&ctx);
  v1::DownMessage m;
  m.mutable_header()->set_run_id("hostile-1");
  m.mutable_header()->set_generation(1);
  auto* f = m.mutable_forward();
  f->set_microbatches(1);
  f->set_learning_rate(0.1);
  EncodeTensor(torch::rand({2, 3, 8, 8}), f->mutable_input());
  EncodeTensor(torch::tensor({0, 1}, torch::kInt64), f->mutable_target());
  stream->Write(m);
  v1::UpMessage up;
  while (stream->Read(&up)) {
  }
  grpc::Status st = stream->Finish();
  // Reported first-hand on the control stream, naming the culprit.
  auto reported = control->Await([](const auto& e) { return e.has_failure(); });
  ASSERT_TRUE(reported.has_value());
  EXPECT_EQ(reported->failure().block(), 1);
  EXPECT_EQ(reported->failure().address(), fake_address);
  const std::string failure = reported->failure().message();
  control.reset();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << st.error_message();
  EXPECT_NE(st.error_message().find(fragment), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find(fake_address), std::string::npos)
      << "names the peer that sent it: " << st.error_message();
  EXPECT_NE(failure.find(fragment), std::string::npos) << failure;
  // The worker survives and takes the next run.
  EXPECT_TRUE(configure("hostile-2").ok());
  StopWorker(w);
  server->Shutdown();
  std::filesystem::remove_all(dir);
}

TEST(HostileNeighbour, NonFiniteGradientsAreRefused) {
  ExpectGradientRefused(
      [](c10::IntArrayRef shape) {
        return torch::full(shape, std::numeric_limits<float>::infinity());
      },
      "NaN or infinite");
}

TEST(HostileNeighbour, MisshapenGradientsAreRefused) {
  ExpectGradientRefused(
      [](c10::IntArrayRef shape) {
        std::vector<int64_t> wrong(shape.begin(), shape.end());
        wrong.back() += 1;
        return torch::zeros(wrong);
      },
      "gradient 0 from block 1");
}

// --- Failures and metrics with the CLI as the coordinator. ---------------

Child StartCli(const std::vector<std::string>& args, const std::string& log) {
  return interlock::testing::StartChild(kCli, args, log);
}

TEST(ClusterFailure, KilledWorkerStopsTheRunNamingIt) {
  const std::string dir = MakeTempDir("kill");
  std::vector<WorkerProcess> w;
  for (int k = 0; k < 3; ++k) w.push_back(StartWorker(kWorker, dir, k));
  const std::string addrs =
      w[0].address() + "," + w[1].address() + "," + w[2].address();
  Child cli = StartCli(
      {"train", "--quiet", "--engine=cluster", "--workers=" + addrs,
       "--config=" + kSrc + "/configs/tests/tiny_resnet.pbtxt",
       "--steps=100000", "--out=" + dir + "/out", "--recover-timeout=2s"},
      dir + "/cli.log");
  for (int i = 0; i < 600 && LinesIn(dir + "/out/metrics.jsonl") < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(LinesIn(dir + "/out/metrics.jsonl"), 3) << ReadFile(cli.log);
  // Nobody restarts it: after --recover-timeout the run stops, naming it.
  StopWorker(w[1], SIGKILL);
  const int code = WaitExit(cli.pid, 30);
  if (code == -1) kill(cli.pid, SIGKILL);
  EXPECT_GT(code, 0) << "the coordinator must exit non-zero within 30 s";
  const std::string out = ReadFile(cli.log);
  EXPECT_NE(out.find(w[1].address()), std::string::npos) << out;
  EXPECT_NE(out.find("worker 1"), std::string::npos) << out;
  StopWorker(w[0]);
  StopWorker(w[2]);
  std::filesystem::remove_all(dir);
}

TEST(ClusterFailure, UnreachableWorkerIsNamedQuickly) {
  const auto start = std::chrono::steady_clock::now();
  auto r = interlock::testing::RunCommand(
      kCli + " train --quiet --engine cluster --connect-timeout 2s" +
      " --workers 127.0.0.1:1,127.0.0.1:2,127.0.0.1:3 --config " + kSrc +
      "/configs/tests/tiny_resnet.pbtxt");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("worker 0 (127.0.0.1:1): not reachable"),
            std::string::npos)
      << r.output;
  EXPECT_LT(seconds, 20.0);
}

TEST(ClusterMetrics, EveryProcessExportsItsMetrics) {
  const std::string dir = MakeTempDir("metrics");
  std::vector<WorkerProcess> w;
  for (int k = 0; k < 3; ++k) w.push_back(StartWorker(kWorker, dir, k));
  const std::string cfg = dir + "/run.pbtxt";
  std::string text = ReadFile(kSrc + "/configs/tests/tiny_resnet.pbtxt");
  text.replace(text.find("seed: 1 }"), 9, "seed: 1 eval_every_steps: 5 }");
  std::ofstream(cfg, std::ios::trunc) << text;
  Child cli =
      StartCli({"train", "--quiet", "--engine=cluster",
                "--workers=" + w[0].address() + "," + w[1].address() + "," +
                    w[2].address(),
                "--config=" + cfg, "--steps=100000", "--out=" + dir + "/out",
                "--wire=bf16:int8", "--metrics_port=0"},
               dir + "/cli.log");
  const int coord_port = LoggedMetricsPort(cli.log, 60);
  ASSERT_GT(coord_port, 0) << ReadFile(cli.log);
  for (int i = 0; i < 600 && LinesIn(dir + "/out/metrics.jsonl") < 12; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(LinesIn(dir + "/out/metrics.jsonl"), 12) << ReadFile(cli.log);
  for (int k = 0; k < 3; ++k) {
    SCOPED_TRACE("worker " + std::to_string(k));
    const std::string text = HttpGet(w[k].metrics_port, "/metrics");
    EXPECT_GT(MetricSum(text, "interlock_worker_microbatches_total"), 0);
    for (const char* phase : {"forward", "backward", "optimizer"}) {
      EXPECT_GT(MetricSum(text, "interlock_worker_compute_seconds_count",
                          std::string("phase=\"") + phase + "\""),
                0)
          << phase;
    }
    EXPECT_GT(MetricSum(text, "interlock_worker_compute_seconds_sum"), 0);
    EXPECT_GT(MetricSum(text, "interlock_worker_step"), 0);
    EXPECT_GT(MetricSum(text, "interlock_worker_head_loss"), 0);
    EXPECT_GT(MetricSum(text, "interlock_worker_received_bytes_total",
                        "direction=\"down\""),
              0);
    if (k < 2) {
      // 2-way: blocks 0 and 1 wait for gradients and send activations down.
      EXPECT_GT(MetricSum(text, "interlock_worker_idle_seconds_total"), 0);
      EXPECT_GT(MetricSum(text, "interlock_worker_sent_bytes_total",
                          "direction=\"down\""),
                0);
      EXPECT_GT(MetricSum(text, "interlock_worker_received_bytes_total",
                          "direction=\"up\""),
                0);
    }
    EXPECT_GT(MetricSum(text, "interlock_worker_sent_bytes_total",
                        "direction=\"up\""),
              0);
    // Bytes by codec (--wire bf16:int8): activations down, gradients up.
    EXPECT_EQ(MetricSum(text, "interlock_worker_received_bytes_total",
                        "codec=\"bf16\",direction=\"down\""),
              MetricSum(text, "interlock_worker_received_bytes_total",
                        "direction=\"down\""));
    EXPECT_EQ(MetricSum(text, "interlock_worker_sent_bytes_total",
                        "codec=\"int8\",direction=\"up\""),
              MetricSum(text, "interlock_worker_sent_bytes_total",
                        "direction=\"up\""));
    EXPECT_GT(MetricSum(text, "interlock_worker_sent_bytes_total",
                        "codec=\"none\",direction=\"control\""),
              0);
  }
  const std::string coord = HttpGet(coord_port, "/metrics");
  EXPECT_GT(MetricSum(coord, "interlock_coordinator_step"), 0) << coord;
  EXPECT_GT(MetricSum(coord, "interlock_coordinator_head_loss"), 0);
  EXPECT_GT(MetricSum(coord, "interlock_coordinator_samples_per_second"), 0);
  EXPECT_GT(MetricSum(coord, "interlock_coordinator_microbatches_total"), 0);
  EXPECT_GT(MetricSum(coord, "interlock_coordinator_eval_accuracy_ratio"), 0);
  kill(cli.pid, SIGTERM);
  EXPECT_NE(WaitExit(cli.pid, 30), -1);
  for (auto& x : w) StopWorker(x);
  std::filesystem::remove_all(dir);
}

// Ctrl-C on a local cluster stops every worker the CLI started; each worker
// was told its block's --device.
TEST(ClusterLocal, LocalClusterRunsAndLeavesNoOrphans) {
  const std::string dir = MakeTempDir("local");
  auto r = interlock::testing::RunCommand(
      kCli +
      " train --quiet --engine cluster --steps 6 --device cpu --config " +
      kSrc + "/configs/tests/tiny_resnet.pbtxt --out " + dir + "/out");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto in = interlock::testing::RunCommand(
      kCli + " train --quiet --steps 6 --config " + kSrc +
      "/configs/tests/tiny_resnet.pbtxt");
  auto digest = [](const std::string& s) {
    auto at = s.find("digest ");
    return at == std::string::npos ? std::string() : s.substr(at, 71);
  };
  EXPECT_EQ(digest(r.output), digest(in.output));
  EXPECT_FALSE(digest(r.output).empty());

  Child cli = StartCli({"train", "--quiet", "--engine=cluster",
                        "--steps=100000", "--device=cpu,CPU,cpu",
                        "--config=" + kSrc + "/configs/tests/tiny_resnet.pbtxt",
                        "--out=" + dir + "/out2"},
                       dir + "/cli.log");
  for (int i = 0; i < 600 && LinesIn(dir + "/out2/metrics.jsonl") < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // The workers are this CLI's children.
  auto children = interlock::testing::RunCommand(
      "pgrep -P " + std::to_string(cli.pid) + " -f interlock-worker");
  std::vector<pid_t> pids;
  std::istringstream listed(children.output);
  for (pid_t p; listed >> p;) pids.push_back(p);
  EXPECT_EQ(pids.size(), 3u) << children.output;
  for (pid_t p : pids) {
    std::string cmdline = ReadFile("/proc/" + std::to_string(p) + "/cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    EXPECT_NE(cmdline.find(" --device=cpu"), std::string::npos) << cmdline;
  }
  kill(cli.pid, SIGINT);
  EXPECT_NE(WaitExit(cli.pid, 30), -1);
  // Those very processes are gone (other tests may run local clusters of
  // their own at the same time, so no machine-wide search).
  auto alive = [&] {
    int n = 0;
    for (pid_t p : pids) {
      // Running unless /proc has no such process or only its zombie.
      const std::string stat = ReadFile("/proc/" + std::to_string(p) + "/stat");
      const auto paren = stat.rfind(')');
      if (paren != std::string::npos && paren + 2 < stat.size() &&
          stat[paren + 2] != 'Z') {
        ++n;
      }
    }
    return n;
  };
  for (int i = 0; i < 100 && alive() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(alive(), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace interlock
