// The files of a scripted model (model { scripted { path: DIR } }): the
// TorchScript units and user heads that the Python package exported. The
// coordinator reads them from DIR and sends each worker those of its own
// block (PutModelFile, in chunks, then Configure naming them); a worker
// holds what it was sent, by content, and never reads a path. The family itself
// is in scripted.cc.
#ifndef INTERLOCK_SERVICES_SCRIPTED_H_
#define INTERLOCK_SERVICES_SCRIPTED_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/config.pb.h"

namespace interlock {

struct BlockModules;  // services/models.h

// One file of a scripted model: its name in the model folder, its SHA-256
// (lower-case hex) and its bytes.
struct ScriptedFile {
  std::string name;
  std::string sha256;
  std::string bytes;
};

// The files block `block` of the spec's cut needs: its units and, unless it
// is the last block, the user head on its last unit if there is one. Read
// from the model folder and checked against the manifest's hashes. An
// empty list for other families. The spec must be resolved
// (ResolveModelSpec).
absl::StatusOr<std::vector<ScriptedFile>> ScriptedFilesOfBlock(
    const interlock::v1::ModelSpec& spec, int block);

// A worker receives a model's files ahead of Configure (PutModelFile) and
// keeps them by content here, at most `max_bytes` in all.
//
// Whether this process holds a file with this SHA-256 (a caller need not
// send it again).
bool HoldsScriptedFile(const std::string& sha256);
// Keeps one file sent ahead of Configure. Its bytes must hash to its
// sha256 (INVALID_ARGUMENT naming it). Files sent earlier that the
// configured block does not use are dropped, oldest first, to make room;
// RESOURCE_EXHAUSTED when there is still none.
absl::Status StageScriptedFile(ScriptedFile file, int64_t max_bytes);

// Makes `files` the ones this process builds scripted units from, instead
// of reading the model folder (a worker: what Configure named). A file
// with bytes must hash to its sha256, or INVALID_ARGUMENT naming it; one
// without bytes must have been staged (FAILED_PRECONDITION naming it).
// At most `max_bytes` in all (RESOURCE_EXHAUSTED). On any error nothing
// changes; on success only these files are kept.
absl::Status HoldScriptedFiles(std::vector<ScriptedFile> files,
                               int64_t max_bytes);

// What an exported network carries besides its modules (export.pbtxt's
// fields of the same names): attributes of the TorchScript module, and the
// normalisation its forward applies first when `mean` is set (inputs
// stored as bytes are taken scaled to [0, 1]).
struct NetworkInfo {
  std::vector<int64_t> input_shape;
  std::string input_dtype;
  std::vector<double> mean, std;
  std::vector<std::string> class_names;
  bool language_model = false;
};

// Writes the trained network of a scripted model as TorchScript that plain
// PyTorch loads (torch.jit.load), in eval mode: network.pt, every unit in
// order, and exit_<k>.pt for each block k whose head is a user head (the
// units of blocks 0..k, then that head). Heads built from model.head are
// LibTorch modules, not TorchScript: the Python package builds those exits
// from the exported weights (python/interlock, the same attributes and
// normalisation). Returns (file name, exit block or -1) per file.
absl::StatusOr<std::vector<std::pair<std::string, int>>> WriteScriptedNetworks(
    const std::vector<BlockModules>& blocks, const NetworkInfo& info,
    const std::string& dir);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_SCRIPTED_H_
