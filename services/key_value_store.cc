#include "services/key_value_store.h"

#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"

namespace interlock {

absl::Status KeyValueStore::CheckKey(const std::string& key) const {
  if (key.empty() || static_cast<int64_t>(key.size()) > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("store: a key of ",
                                                   key.size(), " bytes (1 to ",
                                                   limits_.max_key_bytes, ")"));
  }
  return absl::OkStatus();
}

absl::Status KeyValueStore::Put(const std::string& key, std::string value) {
  if (static_cast<int64_t>(value.size()) > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("store: a value of ", value.size(), " bytes (at most ",
                     limits_.max_value_bytes, ")"));
  }
  auto it = values_.find(key);
  const int64_t before =
      it == values_.end()
          ? 0
          : static_cast<int64_t>(key.size() + it->second.size());
  const int64_t after = static_cast<int64_t>(key.size() + value.size());
  if (it == values_.end() &&
      static_cast<int64_t>(values_.size()) >= limits_.max_keys) {
    return absl::ResourceExhaustedError(
        absl::StrCat("store: ", limits_.max_keys, " keys already"));
  }
  if (bytes_ - before + after > limits_.max_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "store: more than ", limits_.max_total_bytes, " bytes in all"));
  }
  bytes_ += after - before;
  values_[key] = std::move(value);
  return absl::OkStatus();
}

absl::Status KeyValueStore::Set(const std::string& key,
                                const std::string& value) {
  RETURN_IF_ERROR(CheckKey(key));
  std::lock_guard<std::mutex> l(mu_);
  return Put(key, value);
}

absl::StatusOr<std::optional<std::string>> KeyValueStore::Get(
    const std::string& key) {
  RETURN_IF_ERROR(CheckKey(key));
  std::lock_guard<std::mutex> l(mu_);
  auto it = values_.find(key);
  if (it == values_.end()) return std::optional<std::string>();
  return std::optional<std::string>(it->second);
}

absl::StatusOr<int64_t> KeyValueStore::Add(const std::string& key,
                                           int64_t amount) {
  RETURN_IF_ERROR(CheckKey(key));
  std::lock_guard<std::mutex> l(mu_);
  int64_t value = 0;
  if (auto it = values_.find(key); it != values_.end()) {
    if (!absl::SimpleAtoi(it->second, &value)) {
      return absl::FailedPreconditionError(
          "store: add to a key that does not hold an integer");
    }
  }
  if ((amount > 0 && value > std::numeric_limits<int64_t>::max() - amount) ||
      (amount < 0 && value < std::numeric_limits<int64_t>::min() - amount)) {
    return absl::InvalidArgumentError("store: add overflows");
  }
  value += amount;
  RETURN_IF_ERROR(Put(key, absl::StrCat(value)));
  return value;
}

absl::StatusOr<std::string> KeyValueStore::CompareSet(
    const std::string& key, const std::string& expected,
    const std::string& desired) {
  RETURN_IF_ERROR(CheckKey(key));
  std::lock_guard<std::mutex> l(mu_);
  auto it = values_.find(key);
  if (it == values_.end()) {
    if (!expected.empty()) return expected;
    RETURN_IF_ERROR(Put(key, desired));
    return desired;
  }
  if (it->second != expected) return it->second;
  RETURN_IF_ERROR(Put(key, desired));
  return desired;
}

absl::StatusOr<bool> KeyValueStore::Check(
    const std::vector<std::string>& keys) {
  for (const auto& k : keys) RETURN_IF_ERROR(CheckKey(k));
  std::lock_guard<std::mutex> l(mu_);
  for (const auto& k : keys) {
    if (!values_.count(k)) return false;
  }
  return true;
}

absl::StatusOr<bool> KeyValueStore::Delete(const std::string& key) {
  RETURN_IF_ERROR(CheckKey(key));
  std::lock_guard<std::mutex> l(mu_);
  auto it = values_.find(key);
  if (it == values_.end()) return false;
  bytes_ -= static_cast<int64_t>(key.size() + it->second.size());
  values_.erase(it);
  return true;
}

absl::StatusOr<int64_t> KeyValueStore::NumKeys() {
  std::lock_guard<std::mutex> l(mu_);
  return static_cast<int64_t>(values_.size());
}

}  // namespace interlock
