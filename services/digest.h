// SHA-256 digests of parameters, so two runs can be compared exactly.
#ifndef INTERLOCK_SERVICES_DIGEST_H_
#define INTERLOCK_SERVICES_DIGEST_H_

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "services/sha256.h"

namespace interlock {

// Hex SHA-256 over every (name, dtype, shape, raw bytes) in order.
std::string DigestTensors(
    const std::vector<std::pair<std::string, torch::Tensor>>& named);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_DIGEST_H_
