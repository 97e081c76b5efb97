// A block's serialised state as it travels between processes: whose it is,
// the SHA-256 of its bytes, and the LibTorch archive itself. No LibTorch
// types, so the rpc layer carries it without the heavy headers.
#ifndef INTERLOCK_SERVICES_BLOCK_ARCHIVE_H_
#define INTERLOCK_SERVICES_BLOCK_ARCHIVE_H_

#include <cstdint>
#include <string>

namespace interlock {

struct BlockStateArchive {
  std::string run_id;
  int64_t generation = 0;
  int block = 0;
  int64_t step = 0;
  std::string sha256;  // hex, of `bytes`
  std::string bytes;   // a LibTorch archive
};

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_BLOCK_ARCHIVE_H_
