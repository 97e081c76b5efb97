#include "coordinator/trained_model.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "services/config.h"
#include "services/models.h"

namespace interlock {

absl::StatusOr<Checkpoint> FindRunCheckpoint(const RunSource& s) {
  if (!s.checkpoint.empty()) return ReadCheckpoint(s.checkpoint, s.seal_key);
  if (s.run_dir.empty()) {
    return absl::InvalidArgumentError("give --run OUT or --checkpoint DIR");
  }
  const std::string root = s.run_dir + "/checkpoints";
  std::error_code ec;
  if (!std::filesystem::is_directory(root, ec)) {
    return absl::NotFoundError(absl::StrCat(
        root,
        ": no checkpoints; train with --out and --checkpoint-every N (the "
        "last step is always kept then)"));
  }
  // Read only: CheckpointStore::Open would tidy the folder, and the run
  // may still be writing to it.
  std::vector<std::string> dirs;
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("step-", 0) == 0 &&
        name.find('.') == std::string::npos) {
      dirs.push_back(e.path().string());
    }
  }
  std::sort(dirs.rbegin(), dirs.rend());  // newest first (zero-padded)
  std::string refused;
  for (const auto& dir : dirs) {
    auto c = ReadCheckpoint(dir, s.seal_key);
    if (c.ok()) return c;
    if (refused.empty()) refused = std::string(c.status().message());
  }
  return absl::NotFoundError(
      absl::StrCat("no complete checkpoint in ", root,
                   refused.empty() ? "" : absl::StrCat(" (", refused, ")")));
}

absl::StatusOr<TrainedModel> LoadTrainedModel(const RunSource& source) {
  TrainedModel m;
  ASSIGN_OR_RETURN(m.checkpoint, FindRunCheckpoint(source));
  m.config = m.checkpoint.manifest.config();
  ApplyDefaults(m.config);
  ASSIGN_OR_RETURN(m.data,
                   LoadData(m.config.data(), TextContext(m.config.model())));
  ASSIGN_OR_RETURN(const int k_blocks, NumBlocks(m.config.model()));
  if (static_cast<int>(m.checkpoint.blocks.size()) != k_blocks) {
    return absl::DataLossError(
        absl::StrCat(m.checkpoint.dir, " holds ", m.checkpoint.blocks.size(),
                     " blocks but the run's model has ", k_blocks));
  }
  for (int k = 0; k < k_blocks; ++k) {
    ASSIGN_OR_RETURN(auto trainer,
                     BlockTrainer::Create(m.config, m.data.shape, k));
    RETURN_IF_ERROR(
        trainer->LoadState(m.checkpoint.blocks[k], m.checkpoint.manifest.step())
            .status());
    trainer->block()->eval();
    if (trainer->head()) trainer->head()->eval();
    m.blocks.push_back(std::move(trainer));
  }
  return m;
}

}  // namespace interlock
