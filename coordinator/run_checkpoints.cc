#include "coordinator/run_checkpoints.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/message_differencer.h"
#include "plan/status_macros.h"
#include "services/wire_codec.h"

namespace interlock {

namespace fs = std::filesystem;

absl::StatusOr<std::unique_ptr<RunCheckpoints>> RunCheckpoints::Open(
    const std::string& dir, int keep, const std::string& seal_key) {
  std::vector<std::string> removed;
  ASSIGN_OR_RETURN(CheckpointStore store,
                   CheckpointStore::Open(dir, keep, &removed, seal_key));
  for (const auto& r : removed) {
    LOG(WARNING) << "removed the unfinished checkpoint " << r;
  }
  return std::unique_ptr<RunCheckpoints>(
      new RunCheckpoints(std::move(store), seal_key));
}

absl::StatusOr<std::optional<Checkpoint>> RunCheckpoints::FindResume(
    const std::string& resume) const {
  std::vector<std::string> refused;
  std::optional<Checkpoint> found;
  std::string where = store_.root();
  if (!resume.empty()) {
    where = resume;
    std::error_code ec;
    if (!fs::is_directory(resume, ec)) {
      return absl::NotFoundError(
          absl::StrCat("--resume: ", resume, " is not a folder"));
    }
    const fs::path path = fs::weakly_canonical(resume, ec);
    if (fs::exists(path / "manifest.pbtxt", ec)) {
      // One checkpoint; if it is damaged, the previous complete one beside
      // it.
      auto c = ReadCheckpoint(path.string(), seal_key_);
      if (c.ok()) {
        found = *std::move(c);
      } else {
        refused.push_back(std::string(c.status().message()));
        auto siblings = CheckpointStore::Open(path.parent_path().string(),
                                              1 << 30, nullptr, seal_key_);
        if (siblings.ok()) {
          for (const auto& dir : siblings->List()) {
            if (fs::path(dir).filename() >= path.filename()) {
              continue;
            }
            auto older = ReadCheckpoint(dir, seal_key_);
            if (older.ok()) {
              found = *std::move(older);  // the newest older one wins
            } else {
              refused.push_back(std::string(older.status().message()));
            }
          }
        }
      }
    } else {
      auto store = CheckpointStore::Open(resume, 1 << 30, nullptr, seal_key_);
      if (!store.ok()) return store.status();
      found = store->Latest(&refused);
    }
  } else {
    found = store_.Latest(&refused);
  }
  for (const auto& r : refused) {
    LOG(WARNING) << "refused damaged checkpoint: " << r;
  }
  if (!found && !refused.empty()) {
    return absl::DataLossError(absl::StrCat("no complete checkpoint in ", where,
                                            ": ",
                                            absl::StrJoin(refused, "; ")));
  }
  if (!found && !resume.empty()) {
    return absl::NotFoundError(
        absl::StrCat("--resume: no checkpoint in ", resume));
  }
  return found;
}

absl::StatusOr<std::string> RunCheckpoints::Take(
    Engine& engine, v1::CheckpointManifest manifest) {
  ASSIGN_OR_RETURN(std::vector<std::string> blocks, engine.SaveState());
  manifest.set_created(
      absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone()));
  return store_.Write(std::move(manifest), blocks);
}

absl::Status CheckSameRun(const v1::CheckpointManifest& manifest,
                          const v1::RunConfig& config,
                          const std::string& where) {
  google::protobuf::util::MessageDifferencer diff;
  std::string report;
  diff.ReportDifferencesToString(&report);
  if (diff.Compare(manifest.config(), config)) return absl::OkStatus();
  // One line per difference, prefixed "modified:", "added:" or "deleted:".
  std::vector<std::string> lines =
      absl::StrSplit(report, '\n', absl::SkipEmpty());
  // The codecs change what every block receives: say so in words.
  std::string codecs;
  const v1::WireSpec& was = manifest.config().wire();
  const v1::WireSpec& now = config.wire();
  if (!google::protobuf::util::MessageDifferencer::Equals(was, now)) {
    auto words = [](const v1::WireSpec& w) {
      std::string s = absl::StrCat("activations ", CodecName(w.activations()),
                                   ", gradients ", CodecName(w.gradients()));
      if (w.int8_block_size() > 0) {
        absl::StrAppend(&s, ", int8 blocks of ", w.int8_block_size());
      }
      return s;
    };
    codecs = absl::StrCat(": its wire codecs (", words(was),
                          ") are not this run's (", words(now), ")");
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "the checkpoint in ", where,
      " belongs to a run with a different configuration", codecs,
      " (checkpoint -> now: ", absl::StrJoin(lines, "; "),
      "); resume with the same configuration, or use another --out or "
      "--checkpoint-dir"));
}

absl::Status Restore(Engine& engine, const Checkpoint& c) {
  if (c.manifest.num_blocks() != engine.num_blocks()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", c.dir, " has ", c.manifest.num_blocks(),
                     " blocks, the run ", engine.num_blocks()));
  }
  return engine.LoadState(c.manifest.step(), c.blocks);
}

}  // namespace interlock
