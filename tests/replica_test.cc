// Block replicas (ARCHITECTURE: replicas): trainers that each run some of a
// step's micro-batches and reduce over real Gloo (loopback TCP, a real store)
// against one trainer that runs them all. ORDERED must be bitwise equal,
// BatchNorm running statistics and optimizer state included.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "collective/gloo_collective.h"
#include "rpc/rendezvous.h"
#include "services/config.h"
#include "services/data.h"
#include "services/models.h"
#include "services/runtime.h"
#include "services/state_archive.h"
#include "services/trainer.h"
#include "worker/replica_group.h"

namespace interlock {
namespace {

using interlock::v1::RunConfig;
using interlock::v1::TrainingSpec;

constexpr int kSteps = 3;
constexpr int kMicrobatches = 4;

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
  optimizer { kind: SGD momentum: 0.9 nesterov: true weight_decay: 0.0005 }
  schedule { kind: CONSTANT lr: 0.05 }
  training { mode: INTERLOCK n: 2 batch_size: 16 microbatches: 4 seed: 3 }
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
  schedule { kind: CONSTANT lr: 0.003 }
  training { mode: INTERLOCK n: 2 batch_size: 8 microbatches: 4 seed: 5 }
)pb";

RunConfig Parse(const std::string& text) {
  auto c = ParseRunConfig(text, "test");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : RunConfig();
}

// Everything one block sees in kSteps steps of kMicrobatches micro-batches:
// inputs (data for block 0, fixed random activations further down),
// targets and the gradient lists from below.
struct Inputs {
  RunConfig config;
  DataShape shape;
  int block = 0;
  std::vector<std::vector<torch::Tensor>> x, y;
  std::vector<std::vector<std::vector<torch::Tensor>>> down;
  // Replaced by NaN (SKIP_STEP tests): {step, mb}.
  std::pair<int, int> poisoned{-1, -1};
};

Inputs MakeInputs(RunConfig config, int block) {
  ApplyDefaults(config);
  Inputs in;
  in.config = config;
  in.block = block;
  const int64_t context = config.model().has_transformer()
                              ? config.model().transformer().context()
                              : 0;
  auto data = LoadData(config.data(), context);
  EXPECT_TRUE(data.ok()) << data.status();
  in.shape = data->shape;
  auto shapes = BlockOutputShapes(config.model(), in.shape);
  EXPECT_TRUE(shapes.ok()) << shapes.status();
  auto trainer = BlockTrainer::Create(config, in.shape, block);
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  const int d = (*trainer)->DownstreamListSize();
  const int unused = (*trainer)->UnusedDownstream();
  const int64_t b = config.training().batch_size() / kMicrobatches;
  torch::manual_seed(11);
  for (int s = 0; s < kSteps; ++s) {
    in.x.emplace_back();
    in.y.emplace_back();
    in.down.emplace_back();
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      std::vector<int64_t> idx;
      for (int64_t i = 0; i < b; ++i) {
        idx.push_back(((s * kMicrobatches + mb) * b + i) % data->train->size());
      }
      auto [x, y] = data->train->Gather(idx);
      if (block > 0) {
        std::vector<int64_t> dims = (*shapes)[block - 1];
        dims.insert(dims.begin(), b);
        x = torch::randn(dims);
      }
      in.x.back().push_back(x);
      in.y.back().push_back(y);
      std::vector<torch::Tensor> list(d);
      std::vector<int64_t> out = (*shapes)[block];
      out.insert(out.begin(), b);
      for (int i = unused; i < d; ++i) list[i] = 0.01 * torch::randn(out);
      in.down.back().push_back(std::move(list));
    }
  }
  return in;
}

// What a trainer ends with.
struct Outcome {
  absl::Status status;
  std::vector<std::pair<std::string, torch::Tensor>> state;
  std::map<std::string, torch::Tensor> optimizer;
  std::vector<bool> skipped;
  std::vector<int> applied;
};

// Runs the micro-batches `own` of every step (all when a single trainer),
// forwards first, then the parameter passes, as a block's driver would.
Outcome RunTrainer(const Inputs& in, const std::vector<int>& own,
                   std::shared_ptr<Collective> group = nullptr,
                   TrainingSpec::Reduction mode = TrainingSpec::ORDERED) {
  ConfigureThreads(1);
  Outcome o;
  auto created = BlockTrainer::Create(in.config, in.shape, in.block);
  if (!created.ok()) {
    o.status = created.status();
    return o;
  }
  BlockTrainer& t = **created;
  t.SetReplicas(group, mode);
  for (int s = 0; s < kSteps; ++s) {
    for (int mb : own) {
      torch::Tensor x = in.x[s][mb];
      if (in.poisoned == std::make_pair(s, mb)) {
        x = torch::full_like(x, std::numeric_limits<float>::quiet_NaN());
      }
      auto f = t.Forward(mb, x, in.y[s][mb]);
      if (!f.ok()) {
        o.status = f.status();
        return o;
      }
      if (!t.NeedsDownstream()) {
        auto b = t.Backward(mb, {});
        if (!b.ok()) {
          o.status = b.status();
          return o;
        }
      }
    }
    if (t.NeedsDownstream()) {
      for (int mb : own) {
        auto b = t.Backward(mb, in.down[s][mb]);
        if (!b.ok()) {
          o.status = b.status();
          return o;
        }
      }
    }
    auto stepped = t.Step(in.config.schedule().lr());
    if (!stepped.ok()) {
      o.status = stepped.status();
      return o;
    }
    o.skipped.push_back(t.last_step_skipped());
    o.applied.push_back(t.last_applied());
  }
  for (const auto& [name, v] : t.NamedState()) {
    o.state.emplace_back(name, v.detach().clone());
  }
  auto archive = t.SaveState(kSteps);
  EXPECT_TRUE(archive.ok()) << archive.status();
  auto record = DecodeBlockState(*archive, "test");
  EXPECT_TRUE(record.ok()) << record.status();
  o.optimizer = record->optimizer;
  return o;
}

// Same dtype, shape and bits (so -0.0 differs from 0.0, NaN equals NaN of
// the same payload).
bool SameBits(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) {
    return false;
  }
  auto bits = [](const torch::Tensor& t) {
    torch::Tensor c = t.contiguous();
    switch (c.element_size()) {
      case 4:
        return c.view(torch::kInt32);
      case 8:
        return c.view(torch::kInt64);
      default:
        return c;
    }
  };
  return torch::equal(bits(a), bits(b));
}

void ExpectBitwise(const Outcome& want, const Outcome& got,
                   const std::string& what) {
  ASSERT_TRUE(want.status.ok()) << what << ": " << want.status;
  ASSERT_TRUE(got.status.ok()) << what << ": " << got.status;
  ASSERT_EQ(want.state.size(), got.state.size()) << what;
  int differ = 0;
  for (size_t i = 0; i < want.state.size(); ++i) {
    EXPECT_EQ(want.state[i].first, got.state[i].first) << what;
    if (!SameBits(want.state[i].second, got.state[i].second)) {
      ADD_FAILURE() << what << ": " << want.state[i].first << " differs";
      ++differ;
    }
  }
  ASSERT_EQ(want.optimizer.size(), got.optimizer.size()) << what;
  for (const auto& [name, w] : want.optimizer) {
    auto it = got.optimizer.find(name);
    ASSERT_NE(it, got.optimizer.end()) << what << ": optimizer " << name;
    EXPECT_TRUE(SameBits(w, it->second)) << what << ": optimizer " << name;
  }
  EXPECT_EQ(want.skipped, got.skipped) << what;
  EXPECT_EQ(want.applied, got.applied) << what;
  EXPECT_EQ(differ, 0) << what;
}

// A client of the rendezvous store on this machine's `port`, no token.
std::shared_ptr<KeyValueClient> StoreAt(int port) {
  return std::make_shared<RendezvousClient>(absl::StrCat("127.0.0.1:", port),
                                            TransportSecurity{});
}

std::string NextPrefix() {
  static int n = 0;
  return absl::StrCat("replica_test/", n++);
}

// Runs one replica per entry of `split` in threads, each in its own Gloo
// group member.
std::vector<Outcome> RunReplicas(
    const Inputs& in, const std::vector<std::vector<int>>& split,
    TrainingSpec::Reduction mode = TrainingSpec::ORDERED,
    absl::Duration timeout = absl::Seconds(30)) {
  auto server = RendezvousServer::Start("127.0.0.1", 0, {});
  EXPECT_TRUE(server.ok()) << server.status();
  const std::string prefix = NextPrefix();
  const int size = static_cast<int>(split.size());
  std::vector<Outcome> out(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions o;
      o.store = StoreAt((*server)->port());
      o.prefix = prefix;
      o.rank = r;
      o.size = size;
      o.timeout = timeout;
      auto group = ConnectGloo(o);
      if (!group.ok()) {
        out[r].status = group.status();
        return;
      }
      out[r] = RunTrainer(in, split[r], *group, mode);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

const std::vector<int> kAll = {0, 1, 2, 3};

// The single trainer against 2 replicas ({0,2}, {1,3}) and 3 ({0}, {1,3},
// {2}).
void ExpectOrderedBitwise(const Inputs& in, const std::string& what) {
  const Outcome single = RunTrainer(in, kAll);
  ASSERT_TRUE(single.status.ok()) << single.status;
  for (const auto& split : std::vector<std::vector<std::vector<int>>>{
           {{0, 2}, {1, 3}}, {{0}, {1, 3}, {2}}}) {
    const auto replicas = RunReplicas(in, split);
    for (size_t r = 0; r < replicas.size(); ++r) {
      ExpectBitwise(single, replicas[r],
                    absl::StrCat(what, ", replica ", r, " of ", split.size()));
    }
  }
}

RunConfig WithMode(RunConfig c, TrainingSpec::Mode mode, int n,
                   TrainingSpec::Rule rule = TrainingSpec::FURTHEST) {
  c.mutable_training()->set_mode(mode);
  c.mutable_training()->set_n(n);
  c.mutable_training()->set_rule(rule);
  return c;
}

TEST(Replicas, OrderedResNetLastBlockIsBitwise) {
  ExpectOrderedBitwise(MakeInputs(Parse(kResNet), 2), "resnet last block");
}

TEST(Replicas, OrderedResNetMiddleBlockIsBitwiseInEveryMode) {
  const RunConfig base = Parse(kResNet);
  struct Mode {
    TrainingSpec::Mode mode;
    int n;
    TrainingSpec::Rule rule;
    const char* name;
  };
  for (const Mode& m : std::vector<Mode>{
           {TrainingSpec::INTERLOCK, 1, TrainingSpec::FURTHEST, "1-way"},
           {TrainingSpec::INTERLOCK, 2, TrainingSpec::FURTHEST, "2-way"},
           {TrainingSpec::INTERLOCK, 2, TrainingSpec::SUM, "2-way sum"},
           {TrainingSpec::E2E, 1, TrainingSpec::FURTHEST, "e2e"}}) {
    ExpectOrderedBitwise(MakeInputs(WithMode(base, m.mode, m.n, m.rule), 1),
                         absl::StrCat("resnet block 1, ", m.name));
  }
}

TEST(Replicas, OrderedResNetFirstBlockIsBitwise) {
  ExpectOrderedBitwise(MakeInputs(Parse(kResNet), 0), "resnet block 0");
}

// Channels-last blocks (model.resnet.memory_format): BatchNorm's running
// statistics replayed from per-micro-batch captures still match one trainer
// that ran every micro-batch, bit for bit.
TEST(Replicas, OrderedChannelsLastResNetIsBitwise) {
  RunConfig c = Parse(kResNet);
  c.mutable_model()->mutable_resnet()->set_memory_format(
      interlock::v1::ResNetSpec::CHANNELS_LAST);
  ExpectOrderedBitwise(MakeInputs(c, 0), "channels-last resnet block 0");
  ExpectOrderedBitwise(MakeInputs(c, 1), "channels-last resnet block 1");
}

TEST(Replicas, OrderedTransformerIsBitwise) {
  const RunConfig c = Parse(kTransformer);
  ExpectOrderedBitwise(MakeInputs(c, 0), "transformer block 0");
  ExpectOrderedBitwise(MakeInputs(c, 2), "transformer last block");
  ExpectOrderedBitwise(
      MakeInputs(WithMode(c, TrainingSpec::INTERLOCK, 2, TrainingSpec::SUM), 1),
      "transformer block 1, 2-way sum");
}

// The largest absolute difference over every tensor of the state.
double MaxDifference(const Outcome& a, const Outcome& b) {
  double worst = 0;
  for (size_t i = 0; i < a.state.size(); ++i) {
    const auto& x = a.state[i].second;
    const auto& y = b.state[i].second;
    if (!x.is_floating_point()) {
      EXPECT_TRUE(torch::equal(x, y)) << a.state[i].first;
      continue;
    }
    worst = std::max(worst, (x - y).abs().max().item<double>());
  }
  return worst;
}

// RING: reproducible for a fixed topology; close to the single trainer.
// The tolerance: float sums in another order differ by a few ulps per step;
// three SGD steps with momentum keep that far below 1e-5 here.
TEST(Replicas, RingIsReproducibleAndClose) {
  const Inputs in = MakeInputs(Parse(kResNet), 1);
  const Outcome single = RunTrainer(in, kAll);
  ASSERT_TRUE(single.status.ok()) << single.status;
  for (const auto& split : std::vector<std::vector<std::vector<int>>>{
           {{0, 2}, {1, 3}}, {{0}, {1, 3}, {2}}}) {
    const auto first = RunReplicas(in, split, TrainingSpec::RING);
    const auto second = RunReplicas(in, split, TrainingSpec::RING);
    for (size_t r = 0; r < split.size(); ++r) {
      const std::string what =
          absl::StrCat("ring replica ", r, " of ", split.size());
      ExpectBitwise(first[0], first[r], what + " vs replica 0");
      ExpectBitwise(first[r], second[r], what + " vs its rerun");
      if (!first[r].status.ok()) continue;  // reported above
      const double diff = MaxDifference(single, first[r]);
      EXPECT_LE(diff, 1e-5) << what;
      std::cout << what << ": max |single - ring| = " << diff << "\n";
    }
  }
}

// One replica meets NaN under SKIP_STEP: every replica skips that step, as
// the single trainer does, and all still end bitwise equal to it.
TEST(Replicas, NonFiniteOnOneReplicaSkipsTheStepEverywhere) {
  RunConfig c = Parse(kResNet);
  c.mutable_training()->set_nonfinite_policy(TrainingSpec::SKIP_STEP);
  Inputs in = MakeInputs(c, 2);
  in.poisoned = {1, 2};  // step 1, micro-batch 2: replica 0 of {0,2},{1,3}
  const Outcome single = RunTrainer(in, kAll);
  ASSERT_TRUE(single.status.ok()) << single.status;
  EXPECT_EQ(single.skipped, (std::vector<bool>{false, true, false}));
  const auto replicas = RunReplicas(in, {{0, 2}, {1, 3}});
  for (size_t r = 0; r < replicas.size(); ++r) {
    ExpectBitwise(single, replicas[r], absl::StrCat("replica ", r));
  }
}

// A member of a Gloo group (options `o`) on a thread of its own: it joins,
// then holds the group without ever reducing until Leave (or destruction).
class SilentPeer {
 public:
  explicit SilentPeer(const GlooOptions& o)
      : thread_([this, o] {
          auto group = ConnectGloo(o);
          EXPECT_TRUE(group.ok()) << group.status();
          done_.WaitForNotification();
        }) {}
  ~SilentPeer() { Leave(); }
  void Leave() {
    if (!thread_.joinable()) return;
    done_.Notify();
    thread_.join();
  }

 private:
  absl::Notification done_;
  std::thread thread_;
};

// A member that joins but never reduces: Step fails within the timeout on
// the other, without a hang or a crash; the group stays failed.
TEST(Replicas, SilentPeerFailsTheStepWithinTheTimeout) {
  const Inputs in = MakeInputs(Parse(kResNet), 2);
  auto server = RendezvousServer::Start("127.0.0.1", 0, {});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string prefix = NextPrefix();
  const absl::Duration timeout = absl::Seconds(2);
  GlooOptions o{StoreAt((*server)->port()), prefix, 1, 2};
  o.timeout = timeout;
  SilentPeer silent(o);
  o.rank = 0;
  auto group = ConnectGloo(o);
  ASSERT_TRUE(group.ok()) << group.status();
  const auto t0 = std::chrono::steady_clock::now();
  const Outcome out = RunTrainer(in, {0, 2}, *group);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  silent.Leave();
  std::cout << "after " << seconds << " s: " << out.status << "\n";
  EXPECT_FALSE(out.status.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(out.status) ||
              absl::IsUnavailable(out.status))
      << out.status;
  EXPECT_NE(out.status.message().find(prefix), std::string::npos) << out.status;
  EXPECT_LT(seconds, 2 * absl::ToDoubleSeconds(timeout) + 3) << out.status;
  torch::Tensor t = torch::zeros({4});
  EXPECT_FALSE((*group)->AllReduceSum(t).ok()) << "a failed group stays failed";
}

// Starts a reduction on `group` in a thread, abandons the group from this
// one 0.3 s later (as a worker's Configure of the next generation does),
// and checks that the reduction ends as abandoned, well before `bound`
// seconds, and that every later call is refused the same way.
void ExpectAbandonEndsTheReduction(Collective& group, const std::string& prefix,
                                   double bound) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status status;
  std::thread reducer([&] {
    torch::Tensor t = torch::ones({1024});
    status = group.AllReduceSum(t);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  group.Abandon();
  reducer.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_NE(status.message().find("abandoned"), std::string::npos) << status;
  EXPECT_NE(status.message().find(prefix), std::string::npos) << status;
  EXPECT_LT(seconds, bound) << status;
  torch::Tensor t = torch::zeros({4});
  const absl::Status later = group.AllReduceSum(t);
  EXPECT_NE(later.message().find("abandoned"), std::string::npos) << later;
}

// A peer that hangs (here: never reduces) holds a reduction until Gloo's
// timeout; Abandon, called from another thread as a worker's Configure
// does, ends it at once, and the group then refuses every later call.
// Destroying the abandoned group does not wait for the operation either.
TEST(Replicas, AbandonEndsAWaitingReductionAtOnce) {
  auto server = RendezvousServer::Start("127.0.0.1", 0, {});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string prefix = NextPrefix();
  const absl::Duration timeout = absl::Seconds(60);
  GlooOptions o{StoreAt((*server)->port()), prefix, 1, 2};
  o.timeout = timeout;
  o.rendezvous_timeout = timeout;
  SilentPeer silent(o);
  o.rank = 0;
  auto group = ConnectGloo(o);
  ASSERT_TRUE(group.ok()) << group.status();
  // Not the 60 s of the timeout: ended by Abandon.
  ExpectAbandonEndsTheReduction(**group, prefix, 20.0);
  const auto t1 = std::chrono::steady_clock::now();
  group->reset();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1)
                .count(),
            20.0);
  silent.Leave();
}

// A block's group connects at its first reduction. A peer that never
// comes, or that published its address and then died, holds that
// rendezvous for Gloo's timeouts (the connect phase waits five times the
// rendezvous timeout: 50 s); Abandon, as a worker's Configure of the next
// generation calls it, ends the wait at once.
TEST(Replicas, AbandonEndsARendezvousAtOnce) {
  auto server = RendezvousServer::Start("127.0.0.1", 0, {});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string prefix = NextPrefix();
  auto group = ReplicaGroup(
      absl::StrCat("127.0.0.1:", (*server)->port()),
      [](const std::string& a) {
        return std::shared_ptr<KeyValueClient>(
            std::make_shared<RendezvousClient>(a, TransportSecurity{}));
      },
      prefix, /*rank=*/0, /*size=*/2, "127.0.0.1");
  ASSERT_TRUE(group.ok()) << group.status();
  // Not the 10 s of the rendezvous timeout.
  ExpectAbandonEndsTheReduction(**group, prefix, 5.0);
}

TEST(Replicas, MissingMemberFailsTheRendezvousWithinTheTimeout) {
  auto server = RendezvousServer::Start("127.0.0.1", 0, {});
  ASSERT_TRUE(server.ok()) << server.status();
  GlooOptions o{StoreAt((*server)->port()), NextPrefix(), 0, 2};
  o.rendezvous_timeout = absl::Seconds(1);
  const auto t0 = std::chrono::steady_clock::now();
  auto group = ConnectGloo(o);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  EXPECT_FALSE(group.ok());
  EXPECT_LT(seconds, 10.0);
}

// The reduction's integer sum keeps every float bit pattern.
TEST(Replicas, IntegerSumOfFloatBitsIsACopy) {
  auto server = RendezvousServer::Start("127.0.0.1", 0, {});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string prefix = NextPrefix();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const torch::Tensor values =
      torch::tensor({-0.0f, 0.0f, nan, -nan, inf, -inf, 1e-45f, -3.5f});
  std::vector<torch::Tensor> got(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions o{StoreAt((*server)->port()), prefix, r, 3};
      auto group = ConnectGloo(o);
      ASSERT_TRUE(group.ok()) << group.status();
      torch::Tensor t = r == 1 ? values.clone() : torch::zeros_like(values);
      torch::Tensor bits = t.view(torch::kInt32);
      EXPECT_TRUE((*group)->AllReduceSum(bits).ok());
      got[r] = t;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(SameBits(values, got[r])) << "rank " << r;
  }
}

// A fail-over restarts the store on the port it had (a Kubernetes Service
// names it): the port is free again at once, and a member waiting on the
// old store fails instead of waiting out its timeout.
TEST(Replicas, StoreRestartsOnItsPortAndFreesWaitingMembers) {
  auto first = RendezvousServer::Start("127.0.0.1", 0, {});
  ASSERT_TRUE(first.ok()) << first.status();
  const int port = (*first)->port();
  GlooOptions o{StoreAt(port), NextPrefix(), 0, 2};
  o.rendezvous_timeout = absl::Seconds(20);
  absl::StatusOr<std::shared_ptr<Collective>> waiting;
  double seconds = 0;
  std::thread member([&] {
    const auto t0 = std::chrono::steady_clock::now();
    waiting = ConnectGloo(o);  // rank 1 never comes
    seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
  });
  absl::SleepFor(absl::Milliseconds(500));
  first->reset();
  auto second = RendezvousServer::Start("127.0.0.1", port, {});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ((*second)->port(), port);
  member.join();
  EXPECT_FALSE(waiting.ok());
  EXPECT_LT(seconds, 10.0) << waiting.status();
}

TEST(Replicas, UnreachableStoreFailsWithinTheTimeout) {
  int port = 0;
  {
    auto server = RendezvousServer::Start("127.0.0.1", 0, {});
    ASSERT_TRUE(server.ok()) << server.status();
    port = (*server)->port();
  }
  GlooOptions o{StoreAt(port), NextPrefix(), 0, 2};
  o.rendezvous_timeout = absl::Seconds(1);
  const auto t0 = std::chrono::steady_clock::now();
  auto group = ConnectGloo(o);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  EXPECT_FALSE(group.ok());
  EXPECT_LT(seconds, 10.0);
}

// A member whose peers contribute nothing: one trainer that runs every
// micro-batch through the replica path must end as it would alone.
class Alone : public Collective {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  absl::Status AllReduceSum(torch::Tensor&) override {
    return absl::OkStatus();
  }
};

// BatchNorm1d with a cumulative average (momentum unset: the factor is
// 1 / num_batches_tracked) next to the default BatchNorm2d path.
TEST(Replicas, CumulativeBatchNorm1dIsReplayedBitwise) {
  namespace nn = torch::nn;
  torch::manual_seed(5);
  nn::Sequential proto(
      nn::Linear(6, 8),
      nn::BatchNorm1d(nn::BatchNormOptions(8).momentum(c10::nullopt)),
      nn::ReLU(), nn::Linear(8, 3));
  TrainerOptions options;
  options.microbatches = kMicrobatches;
  interlock::v1::OptimizerSpec sgd;
  sgd.set_kind(interlock::v1::OptimizerSpec::SGD);
  sgd.set_momentum(0.9);
  std::vector<std::vector<std::pair<torch::Tensor, torch::Tensor>>> data(
      kSteps);
  for (auto& step : data) {
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      step.emplace_back(torch::randn({5, 6}) * 3 + 1,
                        torch::randint(0, 3, {5}, torch::kInt64));
    }
  }
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> ends;
  for (const bool replica : {false, true}) {
    BlockModules m;
    m.block = std::dynamic_pointer_cast<nn::SequentialImpl>(proto->clone());
    auto t = BlockTrainer::FromModules(options, m, sgd);
    ASSERT_TRUE(t.ok()) << t.status();
    if (replica) (*t)->SetReplicas(std::make_shared<Alone>(), {});
    for (const auto& step : data) {
      for (int mb = 0; mb < kMicrobatches; ++mb) {
        ASSERT_TRUE(
            (*t)->Forward(mb, step[mb].first, step[mb].second).status().ok());
        ASSERT_TRUE((*t)->Backward(mb, {}).status().ok());
      }
      ASSERT_TRUE((*t)->Step(0.1).status().ok());
    }
    ends.push_back((*t)->NamedState());
  }
  ASSERT_EQ(ends[0].size(), ends[1].size());
  for (size_t i = 0; i < ends[0].size(); ++i) {
    EXPECT_TRUE(SameBits(ends[0][i].second, ends[1][i].second))
        << ends[0][i].first;
  }
}

TEST(Replicas, ForwardChecksTheMicroBatch) {
  const Inputs in = MakeInputs(Parse(kResNet), 2);
  auto t = BlockTrainer::Create(in.config, in.shape, 2);
  ASSERT_TRUE(t.ok()) << t.status();
  (*t)->SetReplicas(std::make_shared<Alone>(), TrainingSpec::ORDERED);
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*t)->Forward(kMicrobatches, in.x[0][0], in.y[0][0]).status()));
  ASSERT_TRUE((*t)->Forward(1, in.x[0][1], in.y[0][1]).status().ok());
  ASSERT_TRUE((*t)->Backward(1, {}).status().ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(
      (*t)->Forward(1, in.x[0][1], in.y[0][1]).status()));
  ASSERT_TRUE((*t)->Step(0.1).status().ok());
  EXPECT_EQ((*t)->last_applied(), 1);
  // A new step takes micro-batch 1 again.
  EXPECT_TRUE((*t)->Forward(1, in.x[0][1], in.y[0][1]).status().ok());
}

TEST(Replicas, RendezvousServerPicksAFreePort) {
  auto a = RendezvousServer::Start("127.0.0.1", 0, {});
  auto b = RendezvousServer::Start("127.0.0.1", 0, {});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_GT((*a)->port(), 0);
  EXPECT_NE((*a)->port(), (*b)->port());
}

// The rendezvous store the coordinator serves instead of LibTorch's
// TCPStore: calls without the run's token are refused (and counted), keys
// and values are bounded, the operations mean what c10d's Store needs,
// and a member notices a store restarted under it.
TEST(RendezvousStore, NeedsTheTokenBoundsItsKeysAndNoticesARestart) {
  TransportSecurity server;
  server.token = "store-token";
  auto store = RendezvousServer::Start("127.0.0.1", 0, server);
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*store)->port());
  RendezvousClient outsider(address, TransportSecurity{});
  EXPECT_EQ(outsider.Set("k", "v").code(), absl::StatusCode::kUnauthenticated);
  TransportSecurity wrong;
  wrong.token = "guess";
  EXPECT_EQ(RendezvousClient(address, wrong).Get("k").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*store)->refused(), 2);

  RendezvousClient member(address, server);
  ASSERT_TRUE(member.Set("a", std::string("\0x\xff", 3)).ok());
  auto got = member.Get("a");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(**got, std::string("\0x\xff", 3));
  EXPECT_FALSE(member.Get("nothing")->has_value());
  EXPECT_FALSE(outsider.Get("a").ok());  // still refused
  EXPECT_EQ(*member.Add("n", 3), 3);
  EXPECT_EQ(*member.Add("n", -5), -2);
  EXPECT_EQ(member.Add("a", 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // compareSet as c10d: an unset key takes the desired value only when
  // nothing was expected.
  EXPECT_EQ(*member.CompareSet("c", "x", "y"), "x");
  EXPECT_EQ(*member.CompareSet("c", "", "y"), "y");
  EXPECT_EQ(*member.CompareSet("c", "z", "w"), "y");
  EXPECT_EQ(*member.CompareSet("c", "y", "w"), "w");
  EXPECT_TRUE(*member.Check({"a", "n", "c"}));
  EXPECT_FALSE(*member.Check({"a", "nothing"}));
  EXPECT_EQ(*member.NumKeys(), 3);
  EXPECT_TRUE(*member.Delete("c"));
  EXPECT_FALSE(*member.Delete("c"));
  EXPECT_EQ(member.Set(std::string(2000, 'k'), "v").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(member.Set("big", std::string((1 << 20) + 1, 'v')).code(),
            absl::StatusCode::kInvalidArgument);

  // Restarted on its port: the member's next call fails, naming it.
  const int port = (*store)->port();
  store->reset();
  auto again = RendezvousServer::Start("127.0.0.1", port, server);
  ASSERT_TRUE(again.ok()) << again.status();
  absl::Status s = member.Set("a", "v");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("rendezvous store 127.0.0.1:"), std::string::npos)
      << s;
  EXPECT_EQ(RendezvousClient(address, server).Set("a", "v").code(),
            absl::StatusCode::kOk);
}

// The store itself, in process: the byte bound counts keys and values.
TEST(RendezvousStore, KeyValueStoreBoundsTheTotal) {
  KeyValueLimits limits;
  limits.max_total_bytes = 100;
  limits.max_keys = 3;
  KeyValueStore store(limits);
  ASSERT_TRUE(store.Set("a", std::string(60, 'x')).ok());
  EXPECT_EQ(store.Set("b", std::string(60, 'x')).code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(store.Set("a", std::string(10, 'x')).ok());  // replaced
  ASSERT_TRUE(store.Set("b", std::string(60, 'x')).ok());
  ASSERT_TRUE(store.Set("c", "").ok());
  EXPECT_EQ(store.Set("d", "").code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(*store.Delete("b"));
  EXPECT_TRUE(store.Set("d", std::string(60, 'x')).ok());
}

}  // namespace
}  // namespace interlock
