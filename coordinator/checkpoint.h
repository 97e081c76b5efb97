// Checkpoints on disk: one directory per checkpoint, holding a manifest
// (manifest.pbtxt: the run's config, step, data cursor and a SHA-256 per
// file, itself sealed by a trailing SHA-256 line) and one LibTorch archive
// per block. Written under a temporary name, every file and the folder
// fsynced, renamed, the parent fsynced; loading verifies every checksum.
// A run with a token (--token-file) also signs the manifest: a second line
// "# hmac-sha256 <hex>" keyed by the token, since a checksum alone can be
// recomputed by whoever rewrites the weights. With a key, loading refuses an
// unsigned manifest or a bad signature; without one, the checksum is all.
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

// The manifest as written to disk: text format plus "# sha256 <hex>\n" and,
// with a `seal_key`, "# hmac-sha256 <hex>\n" (HMAC-SHA256 of the text).
std::string SerializeManifest(const interlock::v1::CheckpointManifest& m,
                              const std::string& seal_key = "");

// Parses a manifest file's bytes: checks the trailing SHA-256 (and, with a
// `seal_key`, the signature: PERMISSION_DENIED when it is missing or does
// not match), then the fields (format, block count, one plain file name per
// block, sizes, hex digests, step within the run). Other errors are
// DATA_LOSS or INVALID_ARGUMENT naming `what` and the problem.
absl::StatusOr<interlock::v1::CheckpointManifest> ParseManifest(
    absl::string_view bytes, const std::string& what = "manifest",
    const std::string& seal_key = "");

// The coordinator's journal (RunJournal) as written to disk: sealed like a
// manifest (SHA-256 line, and an HMAC line with a `seal_key`).
std::string SerializeJournal(const interlock::v1::RunJournal& j,
                             const std::string& seal_key = "");
// Parses a journal's bytes: the seal as ParseManifest checks it, then the
// fields (format, run id, generation, one worker list per block, a manifest
// with no files whose step is within the run).
absl::StatusOr<interlock::v1::RunJournal> ParseJournal(
    absl::string_view bytes, const std::string& what,
    const std::string& seal_key = "");

// Reads a checkpoint directory and verifies the manifest (its signature
// with a `seal_key`) and every state file (size and SHA-256). A damaged
// checkpoint is refused with DATA_LOSS naming the file.
absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& dir,
                                          const std::string& seal_key = "");

// The checkpoints of a run under one root folder (--checkpoint-dir).
class CheckpointStore {
 public:
  // Creates `root` if needed and removes temporary folders a crash left
  // behind (named in `removed`, if given). With a `seal_key` (the run's
  // token) manifests are signed, and only signed ones are read.
  static absl::StatusOr<CheckpointStore> Open(
      const std::string& root, int keep,
      std::vector<std::string>* removed = nullptr,
      const std::string& seal_key = "");

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
  CheckpointStore(std::string root, int keep, std::string seal_key)
      : root_(std::move(root)), keep_(keep), seal_key_(std::move(seal_key)) {}
  std::string root_;
  int keep_;
  std::string seal_key_;
};

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_CHECKPOINT_H_
