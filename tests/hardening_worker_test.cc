// Hostile clients against a real interlock-worker process on loopback:
// Stream takeover, memory growth and stuck state transfers
// (docs/RELIABILITY.md, "Attacks and mistakes").
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/cluster_util.h"
#include "tests/worker_test_util.h"

namespace interlock::worker_test {
namespace {

using interlock::testing::Contains;
using interlock::testing::HealthStatus;
using interlock::testing::WaitExit;
using Clock = std::chrono::steady_clock;

using WorkerHardeningTest = WorkerFixture;

double RssMiB(const WorkerProcess& w) {
  return ProcStatusKiB(w.pid, "VmRSS") / 1024.0;
}

// The one-block run of OneBlockRequest with side x side images (larger
// forwards) and `window` micro-batches in flight (0: the default, 2).
v1::ConfigureRequest ImageRequest(const std::string& run_id, int side,
                                  int window) {
  v1::ConfigureRequest req = OneBlockRequest(run_id);
  auto* shape = req.mutable_config()->mutable_data()->mutable_synthetic_shape();
  shape->Set(1, side);
  shape->Set(2, side);
  req.mutable_shape()->set_height(side);
  req.mutable_shape()->set_width(side);
  req.set_max_message_bytes(16 << 20);
  req.set_window(window);
  return req;
}

v1::DownMessage ImageForward(const std::string& run_id, int64_t step,
                             int side) {
  v1::DownMessage m = Forward(run_id, step);
  EncodeTensor(torch::rand({2, 3, side, side}),
               m.mutable_forward()->mutable_input());
  return m;
}

grpc::Status ConfigureWith(v1::Worker::Stub* stub,
                           const v1::ConfigureRequest& req) {
  grpc::ClientContext ctx;
  Deadline(&ctx, 60);
  v1::ConfigureResponse resp;
  return stub->Configure(&ctx, req, &resp);
}

// LoadState whose first chunk carries `header` and announces `total` bytes,
// then sends `chunks` chunks of 1 MiB (or as many as the worker takes).
grpc::Status LoadAnnouncing(v1::Worker::Stub* stub, v1::StateChunk header,
                            int64_t total, int chunks) {
  grpc::ClientContext ctx;
  Deadline(&ctx, 60);
  v1::LoadStateResponse resp;
  auto writer = stub->LoadState(&ctx, &resp);
  header.set_total_bytes(total);
  header.set_data(std::string(1 << 20, 'x'));
  bool open = writer->Write(header);
  v1::StateChunk more;
  more.set_data(std::string(1 << 20, 'y'));
  for (int i = 1; open && i < chunks; ++i) open = writer->Write(more);
  writer->WritesDone();
  return writer->Finish();
}

v1::StateChunk Header(const std::string& run_id, int64_t generation = 1,
                      int block = 0) {
  v1::StateChunk c;
  c.set_run_id(run_id);
  c.set_generation(generation);
  c.set_block(block);
  return c;
}

// Streams that never name the run, or name another, neither replace the live
// stream of a run nor get past --max_concurrent_streams; one that sends
// nothing is ended; a reconnect of the run itself still takes over.
TEST_F(WorkerHardeningTest, StreamFloodLeavesTheLiveStreamAndTheLimitIntact) {
  WorkerProcess w = Start({"--max_concurrent_streams=8"});
  auto stub = v1::Worker::NewStub(Plaintext(w));
  ASSERT_TRUE(Configure(stub.get(), "run-flood").ok());
  int64_t step = 0;
  OpenStream live(stub.get(), 300);
  ASSERT_TRUE(live.Write(Forward("run-flood", step++)));
  ASSERT_TRUE(live.AwaitCompletion());
  // Sends nothing: ended by the worker once the proof time is up.
  const auto idle_opened = Clock::now();
  auto idle = std::make_unique<OpenStream>(stub.get(), 300);

  // A finished stream's slot is freed when the server's reactor is done,
  // a moment after the client has its status; under load a few of these
  // moments overlap. One after the other, a stream must get in within 5 s.
  auto admitted_soon = [](const std::function<grpc::Status()>& call) {
    grpc::Status s = call();
    for (int retry = 0;
         retry < 100 && s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
         ++retry) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      s = call();
    }
    return s;
  };
  // Hundreds of streams one after the other: empty, foreign, stale.
  for (int i = 0; i < 300; ++i) {
    if (i % 3 == 0) {
      grpc::Status s = admitted_soon([&] {
        OpenStream empty(stub.get());
        return empty.Finish();
      });
      EXPECT_NE(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << s.error_message();
    } else {
      v1::DownMessage m = Forward(i % 3 == 1 ? "intruder" : "run-flood", 0);
      if (i % 3 == 2) m.mutable_header()->set_generation(7);
      grpc::Status s = admitted_soon([&] { return StreamOnce(stub.get(), m); });
      EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
          << s.error_message();
      EXPECT_TRUE(Contains(s.error_message(), "not the run this worker"))
          << s.error_message();
      if (i % 3 == 1) {
        EXPECT_TRUE(Contains(s.error_message(), "intruder"));
        EXPECT_FALSE(Contains(s.error_message(), "run-flood"))
            << "the refusal leaks the run id: " << s.error_message();
      } else {
        EXPECT_FALSE(Contains(s.error_message(), "generation 1"))
            << "the refusal leaks the generation: " << s.error_message();
      }
    }
    if (i % 50 == 49) {
      ASSERT_TRUE(live.Write(Forward("run-flood", step++)));
      ASSERT_TRUE(live.AwaitCompletion()) << "after " << i + 1 << " streams";
    }
  }

  // Many at once: the live and the idle stream hold two of the 8 slots, so
  // at most 6 more are admitted; the rest are refused at once.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::seconds(5);
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<
      std::unique_ptr<grpc::ClientReaderWriter<v1::DownMessage, v1::UpMessage>>>
      flood;
  for (int i = 0; i < 200; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(deadline);
    flood.push_back(stub->Stream(contexts.back().get()));
  }
  // Each status is awaited on its own thread: a call whose status is not
  // collected before its deadline reports DEADLINE_EXCEEDED instead.
  std::vector<grpc::Status> statuses(flood.size());
  std::vector<std::thread> waiters;
  for (size_t i = 0; i < flood.size(); ++i) {
    waiters.emplace_back([&, i] { statuses[i] = flood[i]->Finish(); });
  }
  // While they are open, the live stream flows (no ASSERT: the waiters
  // must be joined).
  EXPECT_TRUE(live.Write(Forward("run-flood", step++)));
  EXPECT_TRUE(live.AwaitCompletion());
  for (auto& t : waiters) t.join();
  int refused = 0;
  int admitted = 0;
  for (const grpc::Status& s : statuses) {
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++refused;
      EXPECT_TRUE(Contains(s.error_message(), "max_concurrent_streams"))
          << s.error_message();
    } else {
      ++admitted;
      // Held open and silent until the client's deadline.
      EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
          << s.error_message();
    }
  }
  EXPECT_LE(admitted, 6);
  EXPECT_GE(refused, 194);
  ASSERT_TRUE(live.Write(Forward("run-flood", step++)));
  ASSERT_TRUE(live.AwaitCompletion());

  // The silent stream is ended with a clear status once its time is up.
  grpc::Status s = idle->AwaitEnd();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "no message naming the configured"))
      << s.error_message();
  EXPECT_GE(Clock::now() - idle_opened, std::chrono::seconds(25));
  idle.reset();

  // A reconnect of the run (same id and generation) replaces the live one.
  bool completed = false;
  s = StreamOnce(stub.get(), Forward("run-flood", step++), &completed);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(completed);
  EXPECT_FALSE(live.AwaitCompletion());
  s = live.Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "replaced")) << s.error_message();
}

// Knowing the run's id and generation is not enough to take over a block's
// stream (a tokenless run once lost 5,100 steps to one such message): the
// first message must carry this generation's stream key, which Configure
// gives only the two ends of the link. A stream without it is refused
// before anything else and changes nothing; the key's holder reconnects.
TEST_F(WorkerHardeningTest, AStreamWithoutTheGenerationsKeyChangesNothing) {
  WorkerProcess w = Start({});
  auto stub = v1::Worker::NewStub(Plaintext(w));
  const std::string kKey = "key-of-generation-1";
  v1::ConfigureRequest req = OneBlockRequest("run-keyed");
  req.set_stream_key(kKey);
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::ConfigureResponse resp;
    ASSERT_TRUE(stub->Configure(&ctx, req, &resp).ok());
  }
  int64_t step = 0;
  OpenStream live(stub.get(), 300);
  v1::DownMessage first = Forward("run-keyed", step++);
  first.mutable_header()->set_stream_key(kKey);
  ASSERT_TRUE(live.Write(first));
  ASSERT_TRUE(live.AwaitCompletion());
  for (const std::string& key :
       {std::string(), std::string("key-of-generation-0"), kKey + "x",
        kKey.substr(0, kKey.size() - 1)}) {
    // The run's next step, its id and generation right: were the stream
    // taken, the step would be applied and the live stream ended.
    v1::DownMessage m = Forward("run-keyed", step);
    m.mutable_header()->set_stream_key(key);
    bool completed = false;
    grpc::Status s = StreamOnce(stub.get(), m, &completed);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << s.error_message();
    EXPECT_FALSE(completed);
    EXPECT_FALSE(Contains(s.error_message(), "run-keyed")) << s.error_message();
  }
  // The live stream is untouched and applies that step itself.
  ASSERT_TRUE(live.Write(Forward("run-keyed", step++)));
  ASSERT_TRUE(live.AwaitCompletion());
  // The key's holder (the coordinator after a broken stream) takes over.
  v1::DownMessage again = Forward("run-keyed", step++);
  again.mutable_header()->set_stream_key(kKey);
  bool completed = false;
  grpc::Status s = StreamOnce(stub.get(), again, &completed);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(completed);
  EXPECT_FALSE(live.AwaitCompletion());
  s = live.Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED) << s.error_message();
}

// LoadState is checked against the configured block before anything is
// buffered and runs one at a time; forwards cannot queue beyond what the
// run's window allows. Memory stays bounded and the worker serves on.
TEST_F(WorkerHardeningTest, StateTransfersAndQueuedForwardsStayBounded) {
  WorkerProcess w = Start({});
  auto stub = v1::Worker::NewStub(Plaintext(w));
  const double rss0 = RssMiB(w);
  // Not configured: each 700 MiB announcement is refused at its first chunk.
  for (int i = 0; i < 3; ++i) {
    grpc::Status s =
        LoadAnnouncing(stub.get(), Header("run-m"), int64_t{700} << 20, 64);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << s.error_message();
    EXPECT_TRUE(Contains(s.error_message(), "no block configured"))
        << s.error_message();
  }
  EXPECT_LT(RssMiB(w) - rss0, 100) << "RSS " << rss0 << " -> " << RssMiB(w);

  constexpr int kSide = 224;  // 1.2 MB per forward
  ASSERT_TRUE(ConfigureWith(stub.get(), ImageRequest("run-m", kSide, 4)).ok());
  std::vector<v1::StateChunk> saved;
  ASSERT_TRUE(SaveState(stub.get(), "run-m", "", &saved).ok());
  ASSERT_FALSE(saved.empty());

  // Foreign or oversized announcements: refused without naming the run.
  {
    grpc::Status s = LoadAnnouncing(stub.get(), Header("intruder"), 1000, 1);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << s.error_message();
    EXPECT_FALSE(Contains(s.error_message(), "run-m")) << s.error_message();
    s = LoadAnnouncing(stub.get(), Header("run-m", 1, 3), 1000, 1);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
    s = LoadAnnouncing(stub.get(), Header("run-m"), int64_t{700} << 20, 64);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << s.error_message();
    EXPECT_TRUE(Contains(s.error_message(), "state is at most"))
        << s.error_message();
  }
  // One LoadState at a time: a second while the first is open is refused.
  {
    grpc::ClientContext ctx;
    Deadline(&ctx, 60);
    v1::LoadStateResponse resp;
    auto first = stub->LoadState(&ctx, &resp);
    v1::StateChunk c = saved[0];
    c.set_data(c.data().substr(0, 10));
    ASSERT_TRUE(first->Write(c));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    grpc::Status s = LoadState(stub.get(), "", saved);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << s.error_message();
    EXPECT_TRUE(Contains(s.error_message(), "one at a time"))
        << s.error_message();
    first->WritesDone();
    s = first->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
    s = LoadState(stub.get(), "", saved);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }

  // Window 4, one micro-batch per step: forwards up to 6 steps ahead, at
  // most 5 waiting. Steps 1..5 wait for step 0.
  OpenStream queue(stub.get());
  for (int step = 1; step <= 5; ++step) {
    ASSERT_TRUE(queue.Write(ImageForward("run-m", step, kSide)));
  }
  ASSERT_TRUE(queue.Write(ImageForward("run-m", 6, kSide)));
  grpc::Status s = queue.Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "already wait")) << s.error_message();
  for (int64_t far : {int64_t{7}, int64_t{1000000000000}}) {
    s = StreamOnce(stub.get(), ImageForward("run-m", far, kSide));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
    EXPECT_TRUE(Contains(s.error_message(), "steps ahead"))
        << s.error_message();
  }
  // Hundreds of distinct future steps (360 MB if they were kept).
  const double rss1 = RssMiB(w);
  for (int step = 8; step < 308; ++step) {
    s = StreamOnce(stub.get(), ImageForward("run-m", step, kSide));
    ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
  }
  EXPECT_LT(RssMiB(w) - rss1, 100) << "RSS " << rss1 << " -> " << RssMiB(w);

  // Step 0 releases the five waiting steps; the block is idle at step 6 and
  // its state can be saved.
  bool completed = false;
  s = StreamOnce(stub.get(), ImageForward("run-m", 0, kSide), &completed);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(completed);
  saved.clear();
  s = SaveState(stub.get(), "run-m", "", &saved);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_FALSE(saved.empty());
  EXPECT_EQ(saved[0].step(), 6);
}

// A block large enough that its state bound (about 8 x 64 MiB) exceeds what
// the worker can still map under the address-space limit set below.
v1::ConfigureRequest LargeMlpRequest(const std::string& run_id) {
  v1::ConfigureRequest req = OneBlockRequest(run_id);
  auto config = ParseRunConfig(
      R"pb(
        model {
          mlp { hidden: [ 4096 ] }
          partition: "rest"
        }
        data {
          kind: SYNTHETIC_VECTORS
          synthetic_shape: [ 4096 ]
          synthetic_classes: 4
        }
        training { mode: INTERLOCK n: 1 batch_size: 2 microbatches: 1 }
      )pb",
      "test");
  EXPECT_TRUE(config.ok()) << config.status();
  *req.mutable_config() = *config;
  req.clear_shape();
  req.mutable_shape()->set_is_vector(true);
  req.mutable_shape()->set_channels(4096);
  req.mutable_shape()->set_height(1);
  req.mutable_shape()->set_width(1);
  req.mutable_shape()->set_classes(4);
  return req;
}

// Under an address-space limit the buffer for an announced state cannot be
// reserved: the call ends with RESOURCE_EXHAUSTED, and SIGTERM still ends
// the worker promptly, a LoadState stalled mid-transfer included.
TEST_F(WorkerHardeningTest, UnreservableStateFailsCleanlyAndShutdownFinishes) {
  WorkerProcess w = Start({});
  auto stub = v1::Worker::NewStub(Plaintext(w));
  grpc::Status s = ConfigureWith(stub.get(), LargeMlpRequest("run-v"));
  ASSERT_TRUE(s.ok()) << s.error_message();
  // The block's bound, as the refusal of a larger announcement states it.
  s = LoadAnnouncing(stub.get(), Header("run-v"), int64_t{1} << 40, 1);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  const std::string& msg = s.error_message();
  const size_t at = msg.find("at most ");
  ASSERT_NE(at, std::string::npos) << msg;
  const int64_t bound = std::stoll(msg.substr(at + 8));
  ASSERT_GT(bound, int64_t{400} << 20) << msg;

  // Like `ulimit -v` set on the running worker: what it maps now plus
  // 192 MiB (its threads and allocations go on), far less than `bound`.
  const int64_t mapped = ProcStatusKiB(w.pid, "VmSize") * 1024;
  ASSERT_GT(mapped, 0);
  const rlimit limit{static_cast<rlim_t>(mapped + (int64_t{192} << 20)),
                     static_cast<rlim_t>(mapped + (int64_t{192} << 20))};
  ASSERT_EQ(prlimit(w.pid, RLIMIT_AS, &limit, nullptr), 0);

  s = LoadAnnouncing(stub.get(), Header("run-v"), bound, 4);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "cannot reserve"))
      << s.error_message();
  EXPECT_EQ(HealthStatus(Plaintext(w)), 1);
  // The slot is free again: the next LoadState gets its own answer.
  s = LoadAnnouncing(stub.get(), Header("run-v"), 1000, 1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << s.error_message();

  // A LoadState stalled after its first chunk while SIGTERM arrives.
  grpc::ClientContext ctx;
  Deadline(&ctx, 60);
  v1::LoadStateResponse resp;
  auto stalled = stub->LoadState(&ctx, &resp);
  v1::StateChunk c = Header("run-v");
  c.set_total_bytes(1000);
  c.set_data(std::string(100, 'z'));
  ASSERT_TRUE(stalled->Write(c));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto t0 = Clock::now();
  ASSERT_EQ(kill(w.pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(w.pid, 15), 0);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
  workers_.back().pid = -1;  // reaped
  s = stalled->Finish();
  EXPECT_FALSE(s.ok());
}

// A learning rate LibTorch cannot apply (1e300 is finite but no float) is
// refused before anything changes; the block then trains on without being
// reconfigured.
TEST_F(WorkerHardeningTest,
       UnrepresentableLearningRateIsRefusedAndBlockTrains) {
  WorkerProcess w = Start({});
  auto stub = v1::Worker::NewStub(Plaintext(w));
  ASSERT_TRUE(Configure(stub.get(), "run-lr").ok());
  for (double lr : {1e300, -0.5}) {
    v1::DownMessage m = Forward("run-lr", 0);
    m.mutable_forward()->set_learning_rate(lr);
    grpc::Status s = StreamOnce(stub.get(), m);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << s.error_message();
    EXPECT_TRUE(Contains(s.error_message(), "learning rate"))
        << s.error_message();
  }
  for (int64_t step = 0; step < 2; ++step) {
    bool completed = false;
    grpc::Status s =
        StreamOnce(stub.get(), Forward("run-lr", step), &completed);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(completed);
  }
  std::vector<v1::StateChunk> saved;
  grpc::Status s = SaveState(stub.get(), "run-lr", "", &saved);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_FALSE(saved.empty());
  EXPECT_EQ(saved[0].step(), 2);
}

// A membership change configures the replicas a block keeps with
// restore_step (ARCHITECTURE: replicas): the block continues from its own
// snapshot of the earlier generation, and is sent no state. A step it keeps no
// snapshot of, or a run it does not serve, is refused without naming the run it
// serves, and the block stays as it was.
TEST_F(WorkerHardeningTest, RestoreStepContinuesFromTheWorkersOwnSnapshot) {
  WorkerProcess w = Start({});
  auto stub = v1::Worker::NewStub(Plaintext(w));
  auto state = [&](v1::GetStateResponse* resp) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    return stub->GetState(&ctx, v1::GetStateRequest(), resp);
  };
  auto params = [](const v1::GetStateResponse& r) {
    std::string out;
    for (const auto& t : r.block()) out += t.SerializeAsString();
    return out;
  };
  v1::ConfigureRequest req = OneBlockRequest("run-r");
  req.set_snapshots(true);
  ASSERT_TRUE(ConfigureWith(stub.get(), req).ok());
  bool completed = false;
  ASSERT_TRUE(StreamOnce(stub.get(), Forward("run-r", 0), &completed).ok());
  ASSERT_TRUE(completed);
  v1::GetStateResponse trained;
  ASSERT_TRUE(state(&trained).ok());
  ASSERT_EQ(trained.step(), 1);

  req.set_generation(2);
  req.set_restore_step(5);
  grpc::Status s = ConfigureWith(stub.get(), req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_TRUE(Contains(s.error_message(), "no snapshot at step 5"))
      << s.error_message();
  v1::ConfigureRequest other = req;
  other.set_run_id("run-x");
  other.set_restore_step(1);
  s = ConfigureWith(stub.get(), other);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << s.error_message();
  EXPECT_FALSE(Contains(s.error_message(), "run-r")) << s.error_message();
  v1::GetStateResponse kept;
  ASSERT_TRUE(state(&kept).ok());
  EXPECT_EQ(kept.step(), 1);
  EXPECT_EQ(params(kept), params(trained));

  req.set_restore_step(1);
  s = ConfigureWith(stub.get(), req);
  ASSERT_TRUE(s.ok()) << s.error_message();
  v1::GetStateResponse restored;
  ASSERT_TRUE(state(&restored).ok());
  EXPECT_EQ(restored.step(), 1);
  EXPECT_EQ(params(restored), params(trained));
  // Without restore_step a generation starts afresh: what the restore kept
  // was the trained state, not the initial one.
  req.set_generation(3);
  req.clear_restore_step();
  ASSERT_TRUE(ConfigureWith(stub.get(), req).ok());
  v1::GetStateResponse fresh;
  ASSERT_TRUE(state(&fresh).ok());
  EXPECT_EQ(fresh.step(), 0);
  EXPECT_NE(params(fresh), params(trained));
}

// The coordinator's --window reaches the workers (ConfigureRequest.window):
// with 32 micro-batches in flight, forwards come further ahead, and more of
// them wait, than the default window of 2 x 3 blocks x 2 would allow; the
// run is accepted whole and equals the in-process one.
TEST(WorkerHardeningWindow, CoordinatorWindowReachesTheWorkers) {
  const std::string config =
      " --config " + kSrc + "/configs/tests/tiny_resnet.pbtxt --window 32";
  auto digest = [](const std::string& out) {
    const size_t at = out.find("digest ");
    return at == std::string::npos ? std::string() : out.substr(at, 71);
  };
  auto cluster = RunCommand(kCli + " train --quiet --engine cluster" + config);
  ASSERT_EQ(cluster.exit_code, 0) << cluster.output;
  EXPECT_FALSE(Contains(cluster.output, "recover")) << cluster.output;
  auto local = RunCommand(kCli + " train --quiet" + config);
  ASSERT_EQ(local.exit_code, 0) << local.output;
  EXPECT_FALSE(digest(cluster.output).empty());
  EXPECT_EQ(digest(cluster.output), digest(local.output));
}

}  // namespace
}  // namespace interlock::worker_test
