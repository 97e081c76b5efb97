// A block's state travels as StateChunk messages: the first carries the
// header (run, generation, block, step, total size, SHA-256), each one a
// slice of the bytes. Both directions use these two classes: SaveState
// (worker -> caller) and LoadState (caller -> worker).
#ifndef INTERLOCK_RPC_STATE_CHUNKS_H_
#define INTERLOCK_RPC_STATE_CHUNKS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/worker.pb.h"
#include "services/block_archive.h"

namespace interlock {

// Chunk sizes a caller may ask for, and the default.
constexpr int64_t kDefaultStateChunkBytes = int64_t{1} << 20;
constexpr int64_t kMaxStateChunkBytes = int64_t{4} << 20;

class StateChunker {
 public:
  // `state` must outlive the chunker. `chunk_bytes` is clamped to
  // [1, kMaxStateChunkBytes].
  StateChunker(const BlockStateArchive* state, int64_t chunk_bytes)
      : StateChunker(state, &state->bytes, chunk_bytes) {}
  // The header from `header` (its own bytes are not read), the data from
  // `bytes`: a caller that keeps the archive elsewhere sends it uncopied.
  StateChunker(const BlockStateArchive* header, const std::string* bytes,
               int64_t chunk_bytes);
  // Fills the next chunk; false once every byte was given. An empty
  // archive still gives its header once.
  bool Next(interlock::v1::StateChunk* chunk);

 private:
  const BlockStateArchive* state_;
  const std::string* bytes_;
  int64_t chunk_bytes_;
  int64_t offset_ = 0;
  bool started_ = false;
};

class StateAssembler {
 public:
  // `what` prefixes every error, e.g. "load_state".
  explicit StateAssembler(std::string what) : what_(std::move(what)) {}

  bool started() const { return started_; }
  // Takes the header of the first chunk (its data is not taken: call
  // Append). The caller checks the announced size before Reserve.
  void Start(const interlock::v1::StateChunk& first);
  const BlockStateArchive& header() const { return state_; }
  int64_t total_bytes() const { return total_; }
  // Reserves the announced size: RESOURCE_EXHAUSTED when it cannot.
  absl::Status Reserve();
  // Takes a chunk's data: never past the announced size.
  absl::Status Append(const interlock::v1::StateChunk& chunk);
  // The whole archive, once exactly the announced bytes came.
  absl::StatusOr<BlockStateArchive> Finish();
  // Frees what was buffered.
  void Release();

 private:
  std::string what_;
  BlockStateArchive state_;
  int64_t total_ = 0;
  bool started_ = false;
};

}  // namespace interlock

#endif  // INTERLOCK_RPC_STATE_CHUNKS_H_
