#include "plan/partition.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace interlock {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

absl::StatusOr<std::vector<int>> ParsePartition(const std::string& partition,
                                                int units, int blocks) {
  std::vector<int> counts;
  if (partition == kAutoPartition) {
    return absl::InvalidArgumentError(
        "model.partition: 'auto' is chosen from measured costs before the "
        "blocks are built (interlock train, compare and partition do it); "
        "this caller got it unresolved");
  }
  if (partition.empty()) {
    if (blocks <= 0) {
      return absl::InvalidArgumentError(
          "model.partition: empty and model.blocks not set; give one of them");
    }
    if (blocks > units) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.blocks: ", blocks,
                       " blocks but the model has only ", units, " units"));
    }
    for (int k = 0; k < blocks; ++k) {
      counts.push_back((k + 1) * units / blocks - k * units / blocks);
    }
    return counts;
  }
  std::vector<std::string> parts = absl::StrSplit(partition, ',');
  int used = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    if (p == "rest") {
      if (i + 1 != parts.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model.partition: 'rest' may only be last in '", partition, "'"));
      }
      if (units - used <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("model.partition: '", partition,
                         "' leaves no unit for 'rest' (the "
                         "model has ",
                         units, " units)"));
      }
      counts.push_back(units - used);
      used = units;
      continue;
    }
    int v;
    if (!absl::SimpleAtoi(p, &v) || v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.partition: '", p, "' in '", partition,
                       "' is not a positive integer, 'rest' or 'auto'"));
    }
    counts.push_back(v);
    used += v;
  }
  if (used != units) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.partition: '", partition, "' covers ", used,
        " units but the model has ", units,
        " (stem/embedding + residual blocks/layers + classifier)"));
  }
  if (blocks > 0 && static_cast<int>(counts.size()) != blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.partition: '", partition, "' gives ", counts.size(),
                     " blocks but model.blocks is ", blocks));
  }
  return counts;
}

std::string PartitionString(const std::vector<int>& counts) {
  return absl::StrJoin(counts, ",");
}

std::vector<double> BlockCosts(const UnitCosts& costs,
                               const std::vector<int>& counts) {
  std::vector<double> out;
  size_t next = 0;
  for (int c : counts) {
    double sum = 0;
    for (int i = 0; i < c; ++i) sum += costs.unit[next++];
    out.push_back(sum + costs.head[next - 1]);
  }
  return out;
}

absl::StatusOr<std::vector<int>> BalancedPartition(const UnitCosts& costs,
                                                   int blocks) {
  const int units = static_cast<int>(costs.unit.size());
  if (costs.head.size() != costs.unit.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition: ", costs.unit.size(), " unit costs but ",
                     costs.head.size(), " head costs"));
  }
  if (units == 0) {
    return absl::InvalidArgumentError("partition: the model has no units");
  }
  if (blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition: ", blocks, " blocks; K must be >= 1"));
  }
  if (blocks > units) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition: ", blocks, " blocks but the model has only ",
                     units, " units (each block needs at least one)"));
  }
  for (int u = 0; u < units; ++u) {
    for (double c : {costs.unit[u], costs.head[u]}) {
      if (!std::isfinite(c) || c < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("partition: unit ", u, " has cost ", c,
                         "; costs must be finite and non-negative"));
      }
    }
  }
  // prefix[u]: units 0..u-1. One function computes every block's cost, so
  // the same block always gets the bitwise same value: the second pass can
  // compare against the first pass's optimum exactly.
  std::vector<double> prefix(units + 1, 0.0);
  for (int u = 0; u < units; ++u) prefix[u + 1] = prefix[u] + costs.unit[u];
  auto cost = [&](int i, int j) {  // units i..j-1
    return prefix[j] - prefix[i] + costs.head[j - 1];
  };
  // Suffix tables: best[k][i] for units i..units-1 cut into k blocks.
  // First pass: the least possible maximum block cost.
  std::vector<std::vector<double>> most(blocks + 1,
                                        std::vector<double>(units + 1, kInf));
  for (int i = 0; i < units; ++i) most[1][i] = cost(i, units);
  for (int k = 2; k <= blocks; ++k) {
    for (int i = 0; i + k <= units; ++i) {
      for (int j = i + 1; j + k - 1 <= units; ++j) {
        most[k][i] = std::min(most[k][i], std::max(cost(i, j), most[k - 1][j]));
      }
    }
  }
  const double limit = most[blocks][0];
  // Second pass: within that maximum, the least sum of squares; ties keep
  // the earliest end of the first block.
  std::vector<std::vector<double>> squares(
      blocks + 1, std::vector<double>(units + 1, kInf));
  std::vector<std::vector<int>> end(blocks + 1, std::vector<int>(units + 1));
  for (int i = 0; i < units; ++i) {
    const double c = cost(i, units);
    if (c <= limit) squares[1][i] = c * c;
    end[1][i] = units;
  }
  for (int k = 2; k <= blocks; ++k) {
    for (int i = 0; i + k <= units; ++i) {
      for (int j = i + 1; j + k - 1 <= units; ++j) {
        const double c = cost(i, j);
        if (c > limit || squares[k - 1][j] == kInf) continue;
        const double s = c * c + squares[k - 1][j];
        if (s < squares[k][i]) {
          squares[k][i] = s;
          end[k][i] = j;
        }
      }
    }
  }
  std::vector<int> counts;
  for (int k = blocks, i = 0; k >= 1; --k) {
    const int j = end[k][i];
    counts.push_back(j - i);
    i = j;
  }
  return counts;
}

}  // namespace interlock
