// Fuzz inputs as a worker's stream receives messages: in pieces (gRPC
// slices), owned by the message (services/wire_frame.h).
#ifndef INTERLOCK_TESTS_FUZZ_RECEIVED_H_
#define INTERLOCK_TESTS_FUZZ_RECEIVED_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "services/wire.h"

namespace interlock::fuzz {

// `bytes` cut into pieces of `piece` bytes (the last shorter).
inline Payload Received(std::string bytes, size_t piece) {
  auto owner = std::make_shared<const std::string>(std::move(bytes));
  const absl::string_view all(*owner);
  piece = std::max<size_t>(piece, 1);
  std::vector<absl::string_view> pieces;
  for (size_t i = 0; i < all.size(); i += piece) {
    pieces.push_back(all.substr(i, piece));
  }
  return Payload(std::move(pieces), owner);
}

// `data` as length-delimited field `field` of an enclosing message.
inline std::string AsField(int field, absl::string_view data) {
  std::string out(1, static_cast<char>(field << 3 | 2));
  for (uint64_t n = data.size();; n >>= 7) {
    out.push_back(static_cast<char>((n & 0x7f) | (n >= 0x80 ? 0x80 : 0)));
    if (n < 0x80) break;
  }
  out.append(data.data(), data.size());
  return out;
}

}  // namespace interlock::fuzz

#endif  // INTERLOCK_TESTS_FUZZ_RECEIVED_H_
