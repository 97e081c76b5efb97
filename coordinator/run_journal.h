// The coordinator's journal of a run on workers that live on their own
// (--workers, Kubernetes): OUT/journal.pbtxt names the run, the newest
// generation any Configure may have used, the workers, and the
// coordinator's part of a checkpoint at the newest step boundary every
// block passed. A coordinator started again on the same --out adopts the
// live workers from it (they continue from their own snapshots there)
// instead of restoring every block from the last checkpoint
// (docs/RELIABILITY.md). Written whole under a temporary name and renamed
// (no fsync: it serves a coordinator process that died, not a machine
// that lost power; a stale journal only falls back to the checkpoint),
// sealed like a checkpoint manifest, signed with the run's token.
#ifndef INTERLOCK_COORDINATOR_RUN_JOURNAL_H_
#define INTERLOCK_COORDINATOR_RUN_JOURNAL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "coordinator/live_run.h"
#include "proto/checkpoint.pb.h"
#include "proto/config.pb.h"

namespace interlock {

class RunJournal {
 public:
  RunJournal(const std::string& out_dir, std::string seal_key);

  const std::string& path() const { return path_; }
  // The journal a coordinator left in the folder, when there is one: its
  // signature and fields verified and its run `config`'s (else an error
  // naming what is wrong).
  absl::StatusOr<std::optional<interlock::v1::RunJournal>> Read(
      const interlock::v1::RunConfig& config) const;
  // The live workers the journal names, to be configured under the next
  // generation.
  static LiveRun Adoptable(const interlock::v1::RunJournal& journal);

  // Continues `journal`, the one read at the start (its workers are being
  // adopted).
  void Hold(interlock::v1::RunJournal journal) { held_ = std::move(journal); }
  // Generation `generation` of run `run_id` is about to be configured:
  // recorded first, so that a coordinator started again never reuses it.
  // A run the journal does not name yet has nothing to adopt until its
  // first Write: the file is removed.
  void Raise(const std::string& run_id, int64_t generation);
  // The workers of `live` hold snapshots at `manifest.step()`.
  void Write(const LiveRun& live, interlock::v1::CheckpointManifest manifest);
  // The run finished: there is nothing left to adopt.
  void Remove();

 private:
  void Store();

  const std::string path_;
  const std::string seal_key_;
  interlock::v1::RunJournal held_;
  bool warned_ = false;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_RUN_JOURNAL_H_
