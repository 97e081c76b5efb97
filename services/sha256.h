// SHA-256 of bytes, without LibTorch, so rpc/ can check what it carries.
#ifndef INTERLOCK_SERVICES_SHA256_H_
#define INTERLOCK_SERVICES_SHA256_H_

#include <cstddef>
#include <string>

namespace interlock {

// Lower-case hex SHA-256 of arbitrary bytes (services/digest.cc).
std::string Sha256Hex(const void* data, size_t size);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_SHA256_H_
