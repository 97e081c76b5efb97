// What a worker knows of the run its block is configured for, shared by
// the parts of WorkerCore (worker_core.cc: configuration and state;
// worker_messages.cc: the messages of its two streams). Private to worker/.
#ifndef INTERLOCK_WORKER_WORKER_RUN_H_
#define INTERLOCK_WORKER_WORKER_RUN_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "services/wire_codec.h"
#include "worker/worker_core.h"

namespace interlock {

struct WorkerCore::Run {
  explicit Run(WireCodec c) : codec(std::move(c)) {}

  std::string run_id;
  int64_t generation = 0;
  int block = 0;
  int num_blocks = 1;
  int microbatches = 1;
  int64_t eval_batch = 1;
  int64_t classes = 0;
  // Replica `replica` of `replicas` hosting the block; the replicas of the
  // next block, in order.
  int replica = 0;
  int replicas = 1;
  std::vector<std::string> next_addresses;
  int64_t max_message_bytes = 0;
  std::vector<int64_t> sample_shape;  // block input, no batch dimension
  std::vector<int64_t> output_shape;  // block output, no batch dimension
  std::vector<int64_t> target_shape;  // no batch dimension
  int64_t mb_size = 1;
  // Micro-batches the coordinator keeps in flight, and what follows from
  // it: how many steps ahead of the block a forward can be, how many
  // forwards can wait in the driver's queue.
  int window = 0;
  int64_t max_steps_ahead = 0;
  int64_t max_queued = 0;
  // The largest archive this block's SaveState can produce, with margin.
  int64_t max_state_bytes = 0;
  torch::ScalarType input_dtype = torch::kFloat32;
  WireCodec codec;
  BlockDriver* driver = nullptr;  // the host's
  // Links to the next block's replicas, opened on first use.
  struct Link {
    std::unique_ptr<DownstreamLink> link;
    uint64_t id = 0;
  };
  std::map<int, Link> links;
  // The replica of block k-1 each micro-batch in flight came from.
  std::map<std::pair<int64_t, int>, int> senders;
  // The next block's replica whose link has this id (-1: none).
  int LinkReplica(uint64_t id) const {
    for (const auto& [replica, l] : links) {
      if (l.id == id) return replica;
    }
    return -1;
  }
  void CloseLinks() {
    for (auto& [replica, l] : links) l.link->Close();
  }
  bool failed = false;
  // Keeps step-boundary snapshots (ConfigureRequest.snapshots).
  bool snapshots = false;
  BlockMetrics* metrics = nullptr;
  int64_t nonfinite_seen = 0;  // the trainer's count already exported
  interlock::v1::ConfigureResponse response;

  // Refuses a non-finite received tensor, counting it.
  absl::Status CheckFinite(const torch::Tensor& t, const std::string& what) {
    absl::Status s = ExpectFinite(t, what);
    if (!s.ok()) metrics->nonfinite->Increment();
    return s;
  }
  // Exports the non-finite losses and gradients the trainer met.
  void SyncNonFinite() {
    if (!driver) return;
    const int64_t n = driver->trainer().nonfinite_count();
    if (n > nonfinite_seen) {
      metrics->nonfinite->Increment(static_cast<double>(n - nonfinite_seen));
      nonfinite_seen = n;
    }
  }
};

// `s` with the batch dimension `b` in front.
std::vector<int64_t> WithBatch(int64_t b, const std::vector<int64_t>& s);
// A caller's string in an error message: escaped and cut short (it may be
// as long as a whole message).
std::string Quoted(const std::string& s);
// The header of a message of run (`run_id`, `generation`) for `block`.
void SetHeader(const std::string& run_id, int64_t generation, int block,
               interlock::v1::DownMessage* m);

}  // namespace interlock

#endif  // INTERLOCK_WORKER_WORKER_RUN_H_
