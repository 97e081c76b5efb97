// The worker's core: hosts one block in a BlockHost (services/block_host.h),
// checks everything it receives, and talks to its neighbours through two
// small interfaces the gRPC adapter implements. No gRPC types here.
#ifndef INTERLOCK_WORKER_WORKER_CORE_H_
#define INTERLOCK_WORKER_WORKER_CORE_H_

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/worker.pb.h"
#include "services/block_archive.h"
#include "services/block_host.h"
#include "services/key_value_store.h"
#include "services/scripted.h"
#include "services/state_archive.h"
#include "services/wire.h"
#include "services/wire_frame.h"
#include "worker/metrics.h"
#include "worker/snapshot_store.h"

namespace interlock {

class Collective;

// The upstream end of this block's incoming stream.
class UpstreamSink {
 public:
  virtual ~UpstreamSink() = default;
  virtual void Send(const UpFrame& msg) = 0;
  // Ends the stream with this status (once; later calls are ignored).
  virtual void Finish(const absl::Status& status) = 0;
};

// The worker's control stream to the coordinator.
class ControlSink {
 public:
  virtual ~ControlSink() = default;
  virtual void Send(interlock::v1::ControlEvent event) = 0;
  // Ends the stream with this status (once; later calls are ignored).
  virtual void Finish(const absl::Status& status) = 0;
};

// The stream to block k+1.
class DownstreamLink {
 public:
  virtual ~DownstreamLink() = default;
  virtual void Send(const DownFrame& msg) = 0;
  virtual void Close() = 0;
};

struct WorkerOptions {
  // The server's receive limit; a run needing larger messages is refused.
  int64_t max_message_bytes = 256 << 20;
  // A scripted model's files this worker keeps (PutModelFile), in all.
  int64_t max_model_bytes = int64_t{1} << 30;
  TensorLimits limits;
  // Largest block state LoadState accepts (a configured block's own bound,
  // derived from its tensors, is usually far smaller).
  int64_t max_state_bytes = int64_t{4} << 30;
  // A new Stream must send its first message, naming the configured run,
  // within this time or it is ended: until then it holds one of the
  // --max_concurrent_streams slots. The coordinator opens block 0's stream
  // before it restores a checkpoint into every block, so this leaves room
  // for large restores.
  std::chrono::milliseconds stream_proof_timeout{30000};
  // Where the configured block runs (--device; checked usable at startup).
  c10::Device device = c10::Device(c10::kCPU);
  // The address this worker's reduction traffic with the other replicas of
  // its block uses (--collective_host; empty: the machine's host name).
  std::string collective_host;
  // A client of the rendezvous store at an address ("host:port", from
  // Configure): the coordinator's, over gRPC with the worker's token and
  // TLS (server.cc).
  std::function<std::shared_ptr<KeyValueClient>(const std::string& address)>
      store_client;
};

class WorkerCore {
 public:
  // Opens the link to the next block. `on_message` and `on_done` may be
  // called on any thread.
  using LinkFactory = std::function<std::unique_ptr<DownstreamLink>(
      const std::string& address, int64_t max_message_bytes,
      std::function<void(UpFrame)> on_message,
      std::function<void(absl::Status)> on_done)>;

  WorkerCore(WorkerOptions options, WorkerMetrics* metrics,
             LinkFactory link_factory);
  ~WorkerCore();

  // Asynchronous: `done` runs on the executor thread.
  void Configure(
      const interlock::v1::ConfigureRequest& request,
      std::function<void(absl::StatusOr<interlock::v1::ConfigureResponse>)>
          done);
  void GetState(
      const interlock::v1::GetStateRequest& request,
      std::function<void(absl::StatusOr<interlock::v1::GetStateResponse>)>
          done);

  // The block's training state at a step boundary (nothing in flight).
  void SaveState(const interlock::v1::SaveStateRequest& request,
                 std::function<void(absl::StatusOr<BlockStateArchive>)> done);
  // LoadState's first chunk, before anything is buffered: `header` (no
  // bytes) must name the configured run, generation and block, and
  // `total_bytes` fit what this block's state can be.
  void CheckLoadState(const BlockStateArchive& header, int64_t total_bytes,
                      std::function<void(absl::Status)> done);
  // Replaces the block's training state; checks run, generation, block,
  // size and SHA-256 before decoding anything. Answers the loaded step.
  void LoadState(BlockStateArchive state,
                 std::function<void(absl::StatusOr<int64_t>)> done);
  // A scripted model's file sent ahead of Configure (PutModelFile): kept
  // by content within options().max_model_bytes. HoldsModelFile: whether
  // one with this SHA-256 is kept already (it need not come again).
  bool HoldsModelFile(const std::string& sha256) const;
  absl::Status StageModelFile(ScriptedFile file);
  const WorkerOptions& options() const { return options_; }
  // This process's identity (random, drawn at construction).
  const std::string& instance_id() const { return instance_id_; }

  // The first message of a new incoming stream. If its header names the
  // configured run and generation, the stream takes over from the live one
  // of the same sender (Attach: the replica of block k-1 it names, or the
  // coordinator), the message is handled as by OnDown and `accepted` runs.
  // Otherwise the stream ends with a refusal that tells nothing of the
  // configured run, and the live stream is untouched. Runs on the executor.
  void OnFirstDown(std::shared_ptr<UpstreamSink> from, DownFrame msg,
                   std::function<void()> accepted);
  // Makes `sink` the incoming stream from replica `from` of block k-1 (the
  // coordinator: 0), ending the previous one of that sender. Only for a
  // stream that proved it belongs to the run (OnFirstDown), or a harness.
  void Attach(std::shared_ptr<UpstreamSink> sink, int from = 0);
  void Detach(const UpstreamSink* sink);
  // A message read from the incoming stream `from`; an error in it ends
  // that stream with the error.
  void OnDown(std::shared_ptr<UpstreamSink> from, DownFrame msg);
  // The upstream half-closed stream `from`: it ends (OK unless a message
  // already ended it) after the messages it sent have been handled.
  void OnDownClosed(std::shared_ptr<UpstreamSink> from);

  // Makes `sink` the control stream if `request` names the configured run
  // and generation (the previous one ends), and tells it so with an
  // `opened` event; otherwise ends `sink` with the refusal. On the executor.
  void OpenControl(const interlock::v1::ControlRequest& request,
                   std::shared_ptr<ControlSink> sink);
  void CloseControl(const ControlSink* sink);

  // The coordinator left this worker out of a newer generation of its run
  // (it stopped answering, and came back): the block is let go and
  // `on_released` runs, so that the process registers again or exits
  // instead of idling. The request must carry the configured run's id and
  // this block's stream key of the generation it holds (only the
  // coordinator and the block before know it) and a newer generation;
  // anything else is FAILED_PRECONDITION and changes nothing.
  void Release(const interlock::v1::ReleaseRequest& request,
               std::function<void(absl::Status)> done);

  // Called with true once a block is configured (health SERVING), false
  // once it was released.
  void set_on_configured(std::function<void(bool)> f) {
    on_configured_ = std::move(f);
  }
  // Called on the executor after Release, with the run and the generation
  // that left this worker out.
  void set_on_released(
      std::function<void(const std::string& run_id, int64_t generation)> f) {
    on_released_ = std::move(f);
  }
  // Stops the executor; pending work is abandoned.
  void Shutdown();

 private:
  struct Run;

  absl::StatusOr<interlock::v1::ConfigureResponse> DoConfigure(
      const interlock::v1::ConfigureRequest& request);
  absl::Status HandleDown(const DownFrame& msg);
  // Checks a forward's routes against the topology this worker knows.
  absl::Status CheckRoutes(const interlock::v1::ForwardData& f,
                           const std::string& where) const;
  // Handles a message of stream `from`, ending it on error.
  void ProcessDown(const std::shared_ptr<UpstreamSink>& from, DownFrame msg);
  absl::Status HandleForward(const DownFrame& msg, int from);
  absl::Status HandleEval(const DownFrame& msg);
  void HandleUp(uint64_t link_id, UpFrame msg);
  void HandleLinkDone(uint64_t link_id, absl::Status status);
  // To the sender of micro-batch (step, mb): its gradients and reports go
  // back the way its forward came.
  void SendUp(int64_t step, int mb, bool final, UpFrame msg);
  // To the coordinator, on the control stream (dropped when none is open:
  // the coordinator opens one before it sends anything).
  void SendControl(interlock::v1::ControlEvent event);
  // To replica `replica` of the next block.
  void SendDown(int replica, DownFrame msg);
  // Reports a failure to the coordinator and ends the incoming stream with
  // it, marked as reported (services/failure.h).
  void FailRun(int block, const std::string& address, const absl::Status& s);
  // Ends every incoming stream with `s`; the run stops here.
  void EndUpstream(const absl::Status& s);
  // The configured run, if `run_id` and `generation` name it.
  absl::Status CheckRun(const std::string& what, const std::string& run_id,
                        int64_t generation) const;
  // Ends the configured run (if any): its streams end with `ended`.
  void EndRun(const absl::Status& ended);
  // The response and state bound of a block whose trainer is `trainer`.
  void Describe(BlockTrainer& trainer, Run* run);
  // Routes the driver's messages to the streams and its reports to the
  // block's metrics.
  BlockDriver::Callbacks DriverCallbacks(Run* run);

  const WorkerOptions options_;
  const std::string instance_id_;
  WorkerMetrics* const metrics_;
  const LinkFactory link_factory_;
  std::function<void(bool)> on_configured_;
  std::function<void(const std::string&, int64_t)> on_released_;

  // Owned by the executor thread.
  std::unique_ptr<Run> run_;
  uint64_t next_link_id_ = 1;

  std::mutex sink_mu_;
  // Incoming streams by sending replica; guarded by sink_mu_.
  std::map<int, std::shared_ptr<UpstreamSink>> sinks_;
  std::shared_ptr<ControlSink> control_;  // guarded by sink_mu_

  // The block's state at recent step boundaries of the configured run: what
  // the next generation's Configure restores. On the executor.
  SnapshotStore snapshots_;

  // The configured run's reduction group, reachable off the executor: a
  // Configure of that run's next generation abandons the reduction in
  // progress, which would otherwise hold the executor, and so the
  // Configure, until Gloo's timeout when a peer replica hangs.
  struct LiveGroup {
    std::string run_id;
    int64_t generation = 0;
    std::string stream_key;
    std::shared_ptr<Collective> group;
  };
  std::mutex group_mu_;
  LiveGroup live_group_;  // guarded by group_mu_

  // Every touch of the block and of run_ happens on its executor. Last:
  // it stops before the rest goes.
  BlockHost host_;
};

}  // namespace interlock

#endif  // INTERLOCK_WORKER_WORKER_CORE_H_
