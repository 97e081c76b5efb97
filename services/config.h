// Run configuration: parsing protobuf text files, defaults and validation.
#ifndef INTERLOCK_SERVICES_CONFIG_H_
#define INTERLOCK_SERVICES_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "proto/config.pb.h"

namespace interlock {

// Parses a RunConfig from text format; errors name the file, line and column
// (an unknown field, a bad value).
absl::StatusOr<interlock::v1::RunConfig> ParseRunConfig(
    const std::string& text, const std::string& source_name);
absl::StatusOr<interlock::v1::RunConfig> LoadRunConfig(const std::string& path);

// Fills unset fields with their defaults (mode INTERLOCK, n 2, rule FURTHEST,
// M 1, SGD, constant rate 0.1, batch 64, one epoch, threads 1) and writes
// the wire codecs in one canonical form (FP32 as unset, see config.cc).
void ApplyDefaults(interlock::v1::RunConfig& config);

// Checks everything that can be checked without data: n within 1..K, the
// partition covers the model, head layers are known, batch divides by M, ...
// Errors name the field.
absl::Status ValidateRunConfig(const interlock::v1::RunConfig& config);

// SHA-256 (hex) of the model a run trains (architecture, partition, heads,
// after defaults): a worker registering for a block of another model is
// refused (ARCHITECTURE: replicas).
std::string ModelFingerprint(const interlock::v1::RunConfig& config);

// The largest learning rate a block accepts: parameters are float32, and
// LibTorch refuses to turn a larger scalar into one.
inline constexpr double kMaxLearningRate = 3.4028234663852886e38;

// A learning rate from a schedule or the wire: finite, >= 0 and at most
// kMaxLearningRate. The error starts with `what`.
absl::Status CheckLearningRate(double lr, const std::string& what);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_CONFIG_H_
