// Checkpoints on disk: one directory per checkpoint, holding a manifest
// (manifest.pbtxt: the run's config, step, data cursor and a SHA-256 per
// file, itself sealed by a trailing SHA-256 line) and one LibTorch archive
// per block. Written under a temporary name, every file and the folder
// fsynced, renamed, the parent fsynced; loading verifies every checksum.
#ifndef INTERLOCK_COORDINATOR_CHECKPOINT_H_
#define INTERLOCK_COORDINATOR_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/checkpoint.pb.h"

namespace interlock {

// A verified checkpoint: its manifest and each block's archive.
struct Checkpoint {
  std::string dir;
  interlock::v1::CheckpointManifest manifest;
  std::vector<std::string> blocks;  // archive bytes, index = block
};

// The manifest as written to disk: text format plus "# sha256 <hex>\n".
std::string SerializeManifest(const interlock::v1::CheckpointManifest& m);

// Parses a manifest file's bytes: checks the trailing SHA-256, then the
// fields (format, block count, one plain file name per block, sizes, hex
// digests, step within the run). Errors are DATA_LOSS or INVALID_ARGUMENT
// naming `what` and the problem.
absl::StatusOr<interlock::v1::CheckpointManifest> ParseManifest(
    absl::string_view bytes, const std::string& what = "manifest");

// Reads a checkpoint directory and verifies the manifest and every state
// file (size and SHA-256). A damaged checkpoint is refused with DATA_LOSS
// naming the file.
absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& dir);

// The checkpoints of a run under one root folder (--checkpoint-dir).
class CheckpointStore {
 public:
  // Creates `root` if needed and removes temporary folders a crash left
  // behind (named in `removed`, if given).
  static absl::StatusOr<CheckpointStore> Open(
      const std::string& root, int keep,
      std::vector<std::string>* removed = nullptr);

  // Writes a checkpoint of `manifest.step()` with one archive per block
  // (fills in the manifest's file list) and keeps the newest `keep`.
  // Returns the checkpoint's directory. `before_rename`, if set, runs when
  // everything is written and synced but not yet renamed (tests crash there).
  absl::StatusOr<std::string> Write(
      interlock::v1::CheckpointManifest manifest,
      const std::vector<std::string>& blocks,
      const std::function<void()>& before_rename = nullptr) const;

  // The newest checkpoint that verifies, or nullopt if there is none; each
  // newer one that was refused is described in `refused`.
  std::optional<Checkpoint> Latest(std::vector<std::string>* refused) const;

  // Complete checkpoint directories, oldest first.
  std::vector<std::string> List() const;
  const std::string& root() const { return root_; }

 private:
  CheckpointStore(std::string root, int keep)
      : root_(std::move(root)), keep_(keep) {}
  std::string root_;
  int keep_;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_CHECKPOINT_H_
