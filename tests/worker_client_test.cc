// The one worker client (rpc/worker_client) against a real interlock-worker:
// failed calls keep their code and name the worker and the call, only
// transient codes count as transient, and a block's state goes out and comes
// back through the shared chunking. The chunking itself is checked without
// a worker first.
#include "rpc/worker_client.h"

#include <gtest/gtest.h>

#include "rpc/state_chunks.h"
#include "rpc/status.h"
#include "services/sha256.h"
#include "tests/control_watcher.h"
#include "tests/worker_test_util.h"

namespace interlock {
namespace {

using namespace interlock::worker_test;  // NOLINT
using interlock::testing::ControlWatcher;

BlockStateArchive Archive(std::string bytes) {
  BlockStateArchive a;
  a.run_id = "r";
  a.generation = 3;
  a.block = 2;
  a.step = 7;
  a.sha256 = Sha256Hex(bytes.data(), bytes.size());
  a.bytes = std::move(bytes);
  return a;
}

// Chunks `a` and reassembles them; the chunks' sizes go to `sizes`.
absl::StatusOr<BlockStateArchive> RoundTrip(const BlockStateArchive& a,
                                            int64_t chunk_bytes,
                                            std::vector<size_t>* sizes) {
  StateChunker chunker(&a, chunk_bytes);
  StateAssembler back("test");
  v1::StateChunk c;
  while (chunker.Next(&c)) {
    sizes->push_back(c.data().size());
    if (!back.started()) {
      back.Start(c);
      if (absl::Status s = back.Reserve(); !s.ok()) return s;
    }
    if (absl::Status s = back.Append(c); !s.ok()) return s;
  }
  return back.Finish();
}

TEST(StateChunks, SlicesAndReassemblesWithTheHeaderOnTheFirstChunkOnly) {
  std::vector<size_t> sizes;
  auto back = RoundTrip(Archive(std::string(2500, 'x')), 1000, &sizes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(sizes, (std::vector<size_t>{1000, 1000, 500}));
  EXPECT_EQ(back->bytes, std::string(2500, 'x'));
  EXPECT_EQ(back->run_id, "r");
  EXPECT_EQ(back->generation, 3);
  EXPECT_EQ(back->block, 2);
  EXPECT_EQ(back->step, 7);
  EXPECT_EQ(back->sha256, Archive(std::string(2500, 'x')).sha256);

  // An empty archive still sends its header once.
  sizes.clear();
  back = RoundTrip(Archive(""), 1000, &sizes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(sizes, std::vector<size_t>{0});
  EXPECT_EQ(back->block, 2);

  // The chunk size is clamped to the largest a caller may ask for.
  sizes.clear();
  back = RoundTrip(Archive(std::string(kMaxStateChunkBytes + 1, 'y')),
                   int64_t{1} << 40, &sizes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(sizes, (std::vector<size_t>{kMaxStateChunkBytes, 1}));
}

TEST(StateChunks, MoreOrFewerBytesThanAnnouncedAreRefused) {
  const BlockStateArchive a = Archive("abcdef");
  v1::StateChunk first;
  StateChunker(&a, 4).Next(&first);  // 4 of the 6 bytes
  {
    StateAssembler s("load_state");
    s.Start(first);
    ASSERT_TRUE(s.Append(first).ok());
    auto r = s.Finish();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(r.status().message().find("received 4 bytes of the 6"),
              std::string::npos)
        << r.status();
  }
  {
    StateAssembler s("load_state");
    s.Start(first);
    ASSERT_TRUE(s.Append(first).ok());
    absl::Status st = s.Append(first);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("more than the 6 bytes"), std::string::npos);
  }
  EXPECT_EQ(StateAssembler("load_state").Finish().status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RpcStatus, OnlyTransientCodesAreRetried) {
  for (auto code : {absl::StatusCode::kUnavailable, absl::StatusCode::kAborted,
                    absl::StatusCode::kDeadlineExceeded,
                    absl::StatusCode::kCancelled, absl::StatusCode::kUnknown}) {
    EXPECT_TRUE(IsTransient(absl::Status(code, "x"))) << code;
  }
  for (auto code :
       {absl::StatusCode::kOk, absl::StatusCode::kInvalidArgument,
        absl::StatusCode::kFailedPrecondition, absl::StatusCode::kDataLoss,
        absl::StatusCode::kUnauthenticated, absl::StatusCode::kPermissionDenied,
        absl::StatusCode::kResourceExhausted, absl::StatusCode::kNotFound,
        absl::StatusCode::kInternal, absl::StatusCode::kUnimplemented}) {
    EXPECT_FALSE(IsTransient(absl::Status(code, "x"))) << code;
  }
  absl::Status s = CallFailed(
      "worker 1 (h:1)", "get_state",
      grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "not yours"));
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(), "worker 1 (h:1): get_state failed: not yours");
}

class WorkerClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("client");
    worker_ = StartWorker(kWorker, dir_, 0);
    ASSERT_GT(worker_.port, 0);
    client_ = std::make_unique<WorkerClient>("worker 0", worker_.address(),
                                             1 << 20, TransportSecurity{});
    auto r = client_->Configure(OneBlockRequest("run-1"), Later(), true);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  void TearDown() override {
    StopWorker(worker_);
    std::filesystem::remove_all(dir_);
  }
  static absl::Time Later() { return absl::Now() + absl::Seconds(20); }

  std::string dir_;
  WorkerProcess worker_;
  std::unique_ptr<WorkerClient> client_;
};

TEST_F(WorkerClientTest, RefusalsKeepTheirCodeAndNameTheWorkerAndTheCall) {
  v1::GetStateRequest other;
  other.set_run_id("someone-else");
  auto r = client_->GetState(other, Later());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition)
      << r.status();
  EXPECT_EQ(r.status().message().rfind(
                "worker 0 (" + worker_.address() + "): get_state failed: ", 0),
            0u)
      << r.status();
  EXPECT_FALSE(IsTransient(r.status()));

  v1::SaveStateRequest save;
  save.set_run_id("run-1");
  save.set_generation(2);  // not the configured generation
  auto s = client_->SaveState(save, 0, Later(), 1 << 30);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition)
      << s.status();
  EXPECT_NE(s.status().message().find("save_state failed"), std::string::npos);

  // Nobody listens: unreachable, which a caller may retry.
  WorkerClient nobody("worker 5", "127.0.0.1:1", 1 << 20, {});
  auto gone = nobody.GetState({}, absl::Now() + absl::Seconds(2));
  EXPECT_TRUE(IsTransient(gone.status())) << gone.status();
  EXPECT_NE(gone.status().message().find("worker 5 (127.0.0.1:1)"),
            std::string::npos);
}

TEST_F(WorkerClientTest, PingNoticesAWorkerKilledWhileItsChannelWasReady) {
  ASSERT_TRUE(client_->Ping(Later()).ok());
  // The channel was READY a moment ago; a real call, not the channel's
  // state, tells that the process behind it is gone.
  StopWorker(worker_, SIGKILL);
  const absl::Time t0 = absl::Now();
  absl::Status s = client_->Ping(absl::Now() + absl::Seconds(1));
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(IsTransient(s)) << s;
  EXPECT_NE(s.message().find("worker 0 (" + worker_.address() +
                             "): health check failed"),
            std::string::npos)
      << s;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
}

TEST_F(WorkerClientTest, StateGoesOutAndComesBackWhole) {
  auto stub = v1::Worker::NewStub(Plaintext(worker_));
  // The parameters and step of the block, as GetState reports them.
  auto state_of = [&] {
    auto r = client_->GetState({}, Later());
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->SerializeAsString() : std::string();
  };
  ASSERT_TRUE(StreamOnce(stub.get(), Forward("run-1", 0)).ok());
  const std::string after_one = state_of();

  v1::SaveStateRequest save;
  save.set_run_id("run-1");
  save.set_generation(1);
  save.set_chunk_bytes(1000);  // several chunks
  auto saved = client_->SaveState(save, 0, Later(), 1 << 30);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_GT(saved->bytes.size(), 2000u);
  EXPECT_EQ(saved->step, 1);
  EXPECT_EQ(saved->block, 0);

  // A caller bounding the state below its size refuses it.
  auto small = client_->SaveState(save, 0, Later(), 100);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kDataLoss);

  ASSERT_TRUE(StreamOnce(stub.get(), Forward("run-1", 1)).ok());
  ASSERT_NE(state_of(), after_one);

  // Bytes altered on the way: the worker's SHA-256 check refuses them, and
  // the client reports that code, not UNAVAILABLE.
  BlockStateArchive bad = *saved;
  bad.bytes[bad.bytes.size() / 2] ^= 0x20;
  absl::Status refused = client_->LoadState(bad, Later());
  EXPECT_EQ(refused.code(), absl::StatusCode::kDataLoss) << refused;
  EXPECT_NE(refused.message().find("load_state failed"), std::string::npos);

  absl::Status loaded = client_->LoadState(*saved, Later());
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_EQ(state_of(), after_one);
}

// A scripted model's files go to a worker in chunks ahead of Configure,
// which names them by SHA-256; a file the worker holds is not read again,
// and one it was never sent, a wrong hash, a bad name or more than
// --max_model_bytes are refused naming the file.
TEST(ModelFiles, TravelInChunksAheadOfConfigureAndAreCheckedAndBounded) {
  const std::string dir = MakeTempDir("files");
  WorkerProcess w = StartWorker(kWorker, dir, 0, {"--max_model_bytes=5000000"});
  ASSERT_GT(w.port, 0);
  WorkerClient client("worker 0", w.address(), 1 << 20, TransportSecurity{});
  const absl::Time later = absl::Now() + absl::Seconds(30);
  std::string bytes(3 * (1 << 20) + 123, 'x');  // four chunks
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = static_cast<char>((i * 7919) >> 3);
  }
  const std::string sha = Sha256Hex(bytes.data(), bytes.size());
  ASSERT_TRUE(client.PutModelFile("unit_000.pt", sha, bytes, later, true).ok());

  // Sent again: the worker answers from the first chunk.
  auto stub = v1::Worker::NewStub(Plaintext(w));
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::PutModelFileResponse response;
    auto writer = stub->PutModelFile(&ctx, &response);
    v1::ModelFileChunk header;
    header.set_name("unit_000.pt");
    header.set_sha256(sha);
    header.set_total_bytes(static_cast<int64_t>(bytes.size()));
    writer->Write(header);
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
    EXPECT_TRUE(response.already_held());
  }
  auto refused = [&](const std::string& name, const std::string& hash,
                     const std::string& data, absl::StatusCode code,
                     const std::string& fragment) {
    absl::Status s = client.PutModelFile(name, hash, data, later, true);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(fragment), std::string::npos) << s;
  };
  std::string altered = bytes;
  altered[12345] ^= 1;
  const std::string wrong = Sha256Hex("other", 5);
  refused("unit_001.pt", wrong, altered, absl::StatusCode::kInvalidArgument,
          "model file unit_001.pt: its bytes do not match");
  const std::string big(5000001, 'b');
  refused("unit_002.pt", Sha256Hex(big.data(), big.size()), big,
          absl::StatusCode::kResourceExhausted, "--max_model_bytes");
  refused("../unit.pt", sha, bytes, absl::StatusCode::kInvalidArgument,
          "plain name");
  refused("unit_003.pt", "abc", bytes, absl::StatusCode::kInvalidArgument,
          "64 lower-case hex");
  // Room is made by dropping files no configured block uses, oldest first:
  // a second file that does not fit beside the first replaces it.
  const std::string other(2 * (1 << 20), 'o');
  const std::string other_sha = Sha256Hex(other.data(), other.size());
  ASSERT_TRUE(
      client.PutModelFile("unit_004.pt", other_sha, other, later, true).ok());

  // Configure names files by hash: one not held is refused naming it, one
  // held is used (this block is not scripted: the file is only kept).
  v1::ConfigureRequest req = OneBlockRequest("files-1");
  v1::ModelFile* f = req.add_model_files();
  f->set_name("unit_000.pt");
  f->set_sha256(sha);  // dropped for unit_004.pt
  auto configured = client.Configure(req, later, true);
  EXPECT_EQ(configured.status().code(), absl::StatusCode::kFailedPrecondition)
      << configured.status();
  EXPECT_NE(configured.status().message().find(
                "model file unit_000.pt (SHA-256 " + sha +
                ") was not sent to this worker before Configure"),
            std::string::npos)
      << configured.status();
  f->set_name("unit_004.pt");
  f->set_sha256(other_sha);
  configured = client.Configure(req, later, true);
  EXPECT_TRUE(configured.ok()) << configured.status();
  // The configured block's file is kept: a new one that does not fit beside
  // it is refused rather than dropping it.
  refused("unit_005.pt", Sha256Hex(altered.data(), altered.size()), altered,
          absl::StatusCode::kResourceExhausted, "--max_model_bytes");
  StopWorker(w);
  std::filesystem::remove_all(dir);
}

// Block 0's and block 1's workers of run "cp-1", configured.
void ExpectEachReportsItsOwn(v1::Worker::Stub* stub0, v1::Worker::Stub* stub1) {
  // Another run's control stream is refused and takes nothing over.
  {
    ControlWatcher foreign(stub1, "cp-other");
    EXPECT_FALSE(foreign.opened());
    auto st = foreign.status();
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(st->error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << st->error_message();
  }
  auto first = std::make_unique<ControlWatcher>(stub1, "cp-1");
  ASSERT_TRUE(first->opened());
  // A newer one of the run replaces it.
  ControlWatcher control1(stub1, "cp-1");
  ASSERT_TRUE(control1.opened());
  first->Await([](const auto&) { return false; }, std::chrono::seconds(10));
  ASSERT_TRUE(first->status().has_value());
  EXPECT_EQ(first->status()->error_code(), grpc::StatusCode::ABORTED);
  first.reset();
  ControlWatcher control0(stub0, "cp-1");
  ASSERT_TRUE(control0.opened());

  bool completed = false;
  ASSERT_TRUE(StreamOnce(stub0, Forward("cp-1", 0), &completed).ok());
  EXPECT_TRUE(completed);
  auto block_step = [](int block) {
    return [block](const v1::ControlEvent& e) {
      return e.has_step_done() && e.step_done().block() == block;
    };
  };
  auto done1 = control1.Await(block_step(1));
  ASSERT_TRUE(done1.has_value());
  EXPECT_EQ(done1->step_done().step(), 0);
  auto done0 = control0.Await(block_step(0));
  ASSERT_TRUE(done0.has_value());
  EXPECT_EQ(done0->step_done().step(), 0);
  // Block 1's report did not come through worker 0.
  EXPECT_FALSE(
      control0.Await(block_step(1), std::chrono::seconds(1)).has_value());
}

// A two-block chain driven by hand: each worker reports its own block's
// step on its own control stream; nothing but gradients travels up the
// chain, and a control stream is only for the configured run.
TEST(ControlPlane, EachWorkerReportsItsOwnBlockDirectly) {
  const std::string dir = MakeTempDir("control");
  WorkerProcess w0 = StartWorker(kWorker, dir, 0);
  WorkerProcess w1 = StartWorker(kWorker, dir, 1);
  ASSERT_GT(w0.port, 0);
  ASSERT_GT(w1.port, 0);
  auto config = ParseRunConfig(interlock::testing::kTwoBlocks, "test");
  ASSERT_TRUE(config.ok()) << config.status();
  const absl::Time later = absl::Now() + absl::Seconds(30);
  WorkerClient c0("worker 0", w0.address(), 1 << 20, {});
  WorkerClient c1("worker 1", w1.address(), 1 << 20, {});
  for (int k : {1, 0}) {
    v1::ConfigureRequest req = OneBlockRequest("cp-1");
    *req.mutable_config() = *config;
    req.set_block(k);
    req.set_num_blocks(2);
    if (k == 0) req.set_next_address(w1.address());
    auto r = (k == 0 ? c0 : c1).Configure(req, later, true);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  auto stub0 = v1::Worker::NewStub(Plaintext(w0));
  auto stub1 = v1::Worker::NewStub(Plaintext(w1));
  ExpectEachReportsItsOwn(stub0.get(), stub1.get());
  StopWorker(w0);
  StopWorker(w1);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace interlock
