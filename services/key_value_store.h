// The rendezvous store of a replicated run's reduction groups: a small
// key-value map the members of a group exchange their addresses through.
// The coordinator holds one (KeyValueStore) and serves it over its own
// authenticated gRPC (rpc/rendezvous.h); a worker reaches it through a
// KeyValueClient. No gRPC types here.
#ifndef INTERLOCK_SERVICES_KEY_VALUE_STORE_H_
#define INTERLOCK_SERVICES_KEY_VALUE_STORE_H_

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace interlock {

// What a group member asks of the store (the operations c10d's Store
// needs). Waiting for keys is the caller's: it polls Check.
class KeyValueClient {
 public:
  virtual ~KeyValueClient() = default;
  virtual absl::Status Set(const std::string& key,
                           const std::string& value) = 0;
  // The value, or nullopt when the key is not set.
  virtual absl::StatusOr<std::optional<std::string>> Get(
      const std::string& key) = 0;
  // Adds `amount` to the integer at `key` (0 when not set); the new value.
  virtual absl::StatusOr<int64_t> Add(const std::string& key,
                                      int64_t amount) = 0;
  // Sets `desired` when the value is `expected` (an unset key counts as
  // equal to an empty `expected`); returns the value after the call, or
  // `expected` when the key is unset and `expected` is not empty (as c10d).
  virtual absl::StatusOr<std::string> CompareSet(
      const std::string& key, const std::string& expected,
      const std::string& desired) = 0;
  // Whether every key is set.
  virtual absl::StatusOr<bool> Check(const std::vector<std::string>& keys) = 0;
  // Whether the key was set.
  virtual absl::StatusOr<bool> Delete(const std::string& key) = 0;
  virtual absl::StatusOr<int64_t> NumKeys() = 0;
};

// Limits that keep a store a caller cannot trust bounded.
struct KeyValueLimits {
  int64_t max_key_bytes = 1024;
  int64_t max_value_bytes = int64_t{1} << 20;
  int64_t max_keys = 100000;
  int64_t max_total_bytes = int64_t{64} << 20;
};

// The store itself, thread-safe. A key or value beyond the limits is
// INVALID_ARGUMENT; a store that is full, RESOURCE_EXHAUSTED.
class KeyValueStore : public KeyValueClient {
 public:
  explicit KeyValueStore(KeyValueLimits limits = {}) : limits_(limits) {}

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::optional<std::string>> Get(
      const std::string& key) override;
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t amount) override;
  absl::StatusOr<std::string> CompareSet(const std::string& key,
                                         const std::string& expected,
                                         const std::string& desired) override;
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override;
  absl::StatusOr<bool> Delete(const std::string& key) override;
  absl::StatusOr<int64_t> NumKeys() override;

 private:
  absl::Status CheckKey(const std::string& key) const;
  // Replaces (or adds) the value of `key` within the limits; mu_ held.
  absl::Status Put(const std::string& key, std::string value);

  const KeyValueLimits limits_;
  std::mutex mu_;
  std::map<std::string, std::string> values_;
  int64_t bytes_ = 0;
};

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_KEY_VALUE_STORE_H_
