#include "worker/snapshot_store.h"

#include "absl/strings/str_cat.h"
#include "worker/worker_run.h"

namespace interlock {

absl::StatusOr<BlockStateRecord> SnapshotStore::Find(const std::string& run_id,
                                                     int64_t generation,
                                                     int block,
                                                     int64_t step) const {
  if (run_id_ != run_id || block_ != block || generation_ >= generation) {
    // Not naming what it does keep: the caller may not know that run.
    return absl::FailedPreconditionError(absl::StrCat(
        "configure: restore_step ", step,
        ", but this worker keeps no snapshots of block ", block, " of run ",
        Quoted(run_id), " before generation ", generation));
  }
  auto it = by_step_.find(step);
  if (it == by_step_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "configure: block ", block, " keeps no snapshot at step ", step,
        by_step_.empty()
            ? std::string(" (it keeps none)")
            : absl::StrCat(" (it keeps steps ", by_step_.begin()->first, " to ",
                           by_step_.rbegin()->first, ")")));
  }
  return it->second;
}

void SnapshotStore::Reset(const std::string& run_id, int64_t generation,
                          int block, int64_t keep) {
  by_step_.clear();
  run_id_ = run_id;
  generation_ = generation;
  block_ = block;
  keep_ = keep;
}

void SnapshotStore::Take(const BlockDriver& driver, int64_t step) {
  // The oldest snapshot's tensors take the new one when it is the one to
  // go: a snapshot per step then allocates nothing.
  BlockStateRecord record;
  if (!by_step_.empty() && static_cast<int64_t>(by_step_.size()) >= keep_) {
    record = std::move(by_step_.begin()->second);
    by_step_.erase(by_step_.begin());
  }
  if (!driver.CopyStateAtBoundary(&record).ok()) return;
  by_step_[step] = std::move(record);
  Trim();
}

void SnapshotStore::Put(int64_t step, BlockStateRecord record) {
  by_step_[step] = std::move(record);
  Trim();
}

void SnapshotStore::Trim() {
  while (static_cast<int64_t>(by_step_.size()) > keep_) {
    by_step_.erase(by_step_.begin());
  }
}

}  // namespace interlock
