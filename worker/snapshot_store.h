// The block's state at its recent step boundaries, kept in memory so that a
// membership change or a fail-over continues the block from its own copy
// instead of sending it state it already has (ConfigureRequest.snapshots and
// restore_step). Owned by the worker's executor; not thread-safe.
#ifndef INTERLOCK_WORKER_SNAPSHOT_STORE_H_
#define INTERLOCK_WORKER_SNAPSHOT_STORE_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "services/driver.h"
#include "services/state_archive.h"

namespace interlock {

class SnapshotStore {
 public:
  // The snapshot at `step` of `block` of run `run_id`, taken in a generation
  // before `generation` (copied: the Configure asking may still fail).
  absl::StatusOr<BlockStateRecord> Find(const std::string& run_id,
                                        int64_t generation, int block,
                                        int64_t step) const;
  // Forgets every snapshot; keeps the next ones for this run, generation and
  // block, at most `keep` boundaries.
  void Reset(const std::string& run_id, int64_t generation, int block,
             int64_t keep);
  // Forgets the snapshots of the current run (its state was replaced).
  void Clear() { by_step_.clear(); }
  // The state `driver` holds at the boundary before `step`. A snapshot that
  // cannot be taken is only missing: a recovery that needs it falls back to
  // the checkpoint.
  void Take(const BlockDriver& driver, int64_t step);
  // A snapshot taken elsewhere (the one a Configure just restored).
  void Put(int64_t step, BlockStateRecord record);

 private:
  void Trim();

  std::string run_id_;
  int64_t generation_ = 0;
  int block_ = 0;
  int64_t keep_ = 0;
  std::map<int64_t, BlockStateRecord> by_step_;  // CPU tensors
};

}  // namespace interlock

#endif  // INTERLOCK_WORKER_SNAPSHOT_STORE_H_
