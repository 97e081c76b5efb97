// A trained network read back from a run's checkpoint: what `interlock
// export`, `eval`, `predict` and `generate` start from.
#ifndef INTERLOCK_COORDINATOR_TRAINED_MODEL_H_
#define INTERLOCK_COORDINATOR_TRAINED_MODEL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/checkpoint.h"
#include "proto/config.pb.h"
#include "services/data.h"
#include "services/trainer.h"

namespace interlock {

// Which state: the newest complete checkpoint of a run's --out folder, or
// one checkpoint folder; `seal_key` is the run's token when its checkpoints
// are signed.
struct RunSource {
  std::string run_dir;
  std::string checkpoint;
  std::string seal_key;
};

absl::StatusOr<Checkpoint> FindRunCheckpoint(const RunSource& source);

// The run's blocks and heads as it built them, holding the checkpoint's
// state, and the run's data.
struct TrainedModel {
  Checkpoint checkpoint;
  interlock::v1::RunConfig config;
  DataSplits data;
  std::vector<std::unique_ptr<BlockTrainer>> blocks;
};

absl::StatusOr<TrainedModel> LoadTrainedModel(const RunSource& source);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_TRAINED_MODEL_H_
