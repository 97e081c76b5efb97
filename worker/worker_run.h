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
#include "worker/block_run_spec.h"
#include "worker/worker_core.h"

namespace interlock {

// The resolved configuration (fixed from Configure on) and the live state
// of the block's run.
struct WorkerCore::Run : BlockRunSpec {
  Run(BlockRunSpec spec, WireCodec c)
      : BlockRunSpec(std::move(spec)), codec(std::move(c)) {}

  // The largest archive this block's SaveState can produce, with margin.
  int64_t max_state_bytes = 0;
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
// The header of a message of run (`run_id`, `generation`) for `block`,
// with that block's stream key.
void SetHeader(const std::string& run_id, int64_t generation, int block,
               const std::string& stream_key, interlock::v1::DownMessage* m);
// Whether a stream's key is the one expected, in time independent of where
// they differ.
bool SameKey(const std::string& given, const std::string& expected);

}  // namespace interlock

#endif  // INTERLOCK_WORKER_WORKER_RUN_H_
