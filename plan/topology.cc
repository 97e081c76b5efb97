#include "plan/topology.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace interlock {

absl::StatusOr<Topology> ParseWorkers(const std::string& flag) {
  Topology t;
  std::set<std::string> seen;
  const std::vector<std::string> blocks = absl::StrSplit(flag, ',');
  for (size_t k = 0; k < blocks.size(); ++k) {
    if (blocks[k].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--workers: block ", k, " has no address"));
    }
    std::vector<std::string> replicas = absl::StrSplit(blocks[k], '+');
    for (const auto& a : replicas) {
      if (a.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--workers: block ", k, " has an empty replica address"));
      }
      if (!seen.insert(a).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("--workers: ", a,
                         " is listed twice (one worker hosts one "
                         "replica of one block)"));
      }
    }
    t.push_back(std::move(replicas));
  }
  return t;
}

Topology OnePerBlock(const std::vector<std::string>& addresses) {
  Topology t;
  for (const auto& a : addresses) t.push_back({a});
  return t;
}

std::vector<int> ReplicaCounts(const Topology& t) {
  std::vector<int> out;
  for (const auto& b : t) out.push_back(static_cast<int>(b.size()));
  return out;
}

}  // namespace interlock
