// `interlock export`: a run's trained network out of Interlock. From the
// run's newest checkpoint (or one named), writes every block's and head's
// trained tensors as one file Python's torch.load reads (weights.pt), the
// run's model, data preparation and classes (export.pbtxt), and, for a
// scripted model, the whole network and its early exits as TorchScript
// (network.pt, exit_<k>.pt). The Python package (python/interlock) turns
// the weights of the built-in families into the same TorchScript files.
#ifndef INTERLOCK_COORDINATOR_EXPORT_H_
#define INTERLOCK_COORDINATOR_EXPORT_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace interlock {

struct ExportOptions {
  // The run's --out folder: its newest complete checkpoint is exported.
  std::string run_dir;
  // Or this checkpoint folder (OUT/checkpoints/step-N).
  std::string checkpoint;
  // Where to write; created if missing, files in it replaced.
  std::string to;
  // The run's token when its checkpoints are signed (--token-file).
  std::string seal_key;
};

absl::Status ExportRun(const ExportOptions& options, std::ostream& log);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_EXPORT_H_
