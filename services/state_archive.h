// A block's training state as bytes (checkpoints, SaveState/LoadState): the
// archive format, and the checks that run before LibTorch reads one.
// LibTorch 1.13 trusts the file: a deflated entry may claim gigabytes, its
// zip reader leaks when it refuses an archive, the unpickler reserves
// whatever a string length or memo index in the pickle says, and tensors
// come back with whatever sizes, offsets and storage sizes the file gives.
// All but the storage sizes were found by fuzz_checkpoint_reader.
// LibTorch's zip reader is not used on archives at all.
#ifndef INTERLOCK_SERVICES_STATE_ARCHIVE_H_
#define INTERLOCK_SERVICES_STATE_ARCHIVE_H_

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace interlock {

// OK when `bytes` is a zip of one part, without encryption or patch data
// (its directory taken from the zip64 record when there is one, as
// LibTorch's reader does), whose entries are all under 4 GiB, stored
// uncompressed inside the buffer, in one folder and under distinct names,
// with a version record LibTorch reads (1 to 10) and one data.pkl entry
// holding a protocol-2 pickle that uses only the opcodes LibTorch's pickler
// writes, every length and memo index within bounds, ending in STOP.
// Otherwise INVALID_ARGUMENT naming `what` and the first problem.
absl::Status CheckStateArchive(absl::string_view bytes,
                               const std::string& what);

// What one archive holds.
struct BlockStateRecord {
  int64_t block = 0;
  int64_t step = 0;  // optimizer steps taken: the next step the block runs
  // Parameters and buffers of block and head, by name.
  std::map<std::string, torch::Tensor> tensors;
  // Optimizer state by parameter index and field (Optimizer::StateTensors).
  std::map<std::string, torch::Tensor> optimizer;
};

// The archive of `record`: torch::pickle_save of the tuple
// (format, block, step, tensors, optimizer).
absl::StatusOr<std::string> EncodeBlockState(const BlockStateRecord& record);

// Reads an archive EncodeBlockState wrote: CheckStateArchive first, then
// LibTorch's unpickler over the entries that check located in `bytes` (each
// tensor record copied once at most), without a class resolver (only
// tensors and plain values), then every tensor is checked to be dense,
// contiguous and inside its storage, and every storage inside the record it
// was read from. It does not match names or shapes against a block (the
// trainer does). Errors name `what`.
absl::StatusOr<BlockStateRecord> DecodeBlockState(const std::string& bytes,
                                                  const std::string& what);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_STATE_ARCHIVE_H_
