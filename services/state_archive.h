// Structural checks of a block state archive (the zip that
// torch::pickle_save writes) before LibTorch reads it. LibTorch 1.13 trusts
// the file: a deflated entry may claim gigabytes, and the unpickler reserves
// whatever a string length or memo index in the pickle says. Both were
// found by fuzz_checkpoint_reader. No LibTorch here.
#ifndef INTERLOCK_SERVICES_STATE_ARCHIVE_H_
#define INTERLOCK_SERVICES_STATE_ARCHIVE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace interlock {

// OK when `bytes` is a zip of one part, without encryption (its directory
// taken from the zip64 record when there is one, as LibTorch's reader
// does), whose entries are all under 4 GiB, stored uncompressed inside the
// buffer and in one folder, with a version record and one data.pkl entry
// holding a protocol-2 pickle that uses only the opcodes LibTorch's pickler
// writes, every length and memo index within bounds, ending in STOP.
// Otherwise INVALID_ARGUMENT naming `what` and the first problem.
absl::Status CheckStateArchive(absl::string_view bytes,
                               const std::string& what);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_STATE_ARCHIVE_H_
