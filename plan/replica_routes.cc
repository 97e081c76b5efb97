#include "plan/replica_routes.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "plan/status_macros.h"

namespace interlock {

absl::StatusOr<std::vector<int>> ParseReplicas(const std::string& flag) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(flag, ',')) {
    int r = 0;
    if (!absl::SimpleAtoi(part, &r) || r < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--replicas: '", part, "' is not a replica count (an integer >= 1)"));
    }
    out.push_back(r);
  }
  return out;
}

bool Replicated(const std::vector<int>& replicas) {
  return std::any_of(replicas.begin(), replicas.end(),
                     [](int r) { return r > 1; });
}

absl::Status CheckReplicas(const std::vector<int>& replicas, int num_blocks,
                           int microbatches, const std::string& what) {
  if (static_cast<int>(replicas.size()) != num_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", replicas.size(), " blocks given for a model ",
                     "of ", num_blocks, " blocks"));
  }
  for (int k = 0; k < num_blocks; ++k) {
    if (replicas[k] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": block ", k, " has none"));
    }
    if (replicas[k] > microbatches) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": block ", k, " has ", replicas[k],
          " replicas but a step has only ", microbatches,
          " micro-batches (training.microbatches); each replica needs one"));
    }
  }
  return absl::OkStatus();
}

namespace {

// How many of `m` micro-batches each replica runs: in proportion to the
// weights, at least one each (largest remainder); ties and the remainder go
// round-robin from `start`. Each replica gets one, then the rest goes by
// how far each still is below its proportional share, so 2:1 over 4 gives
// 3 and 1. Equal weights split the rest equally.
std::vector<int> Shares(int m, const std::vector<double>& w, int start) {
  const int r = static_cast<int>(w.size());
  std::vector<int> n(r, 1);
  int left = m - r;
  if (left <= 0) return n;
  double total = 0;
  for (double x : w) total += std::max(x, 0.0);
  std::vector<double> need(r, 1.0);
  double needed = 0;
  const bool equal =
      std::all_of(w.begin(), w.end(), [&](double x) { return x == w[0]; });
  if (total > 0 && !equal) {
    for (int i = 0; i < r; ++i) {
      need[i] = std::max(m * std::max(w[i], 0.0) / total - 1.0, 0.0);
      needed += need[i];
    }
  }
  if (!(needed > 0)) {
    need.assign(r, 1.0);
    needed = r;
  }
  std::vector<double> rest(r, 0.0);
  int given = 0;
  for (int i = 0; i < r; ++i) {
    const double exact = left * need[i] / needed;
    const int whole = static_cast<int>(exact);
    n[i] += whole;
    given += whole;
    rest[i] = exact - whole;
  }
  // The remainder: largest fraction first, rotating ties by `start`.
  std::vector<int> order(r);
  for (int i = 0; i < r; ++i) order[i] = (start + i) % r;
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return rest[a] > rest[b]; });
  for (int i = 0; given < left; ++i, ++given) ++n[order[i % r]];
  return n;
}

}  // namespace

std::vector<int32_t> RouteStep(
    int64_t step, int microbatches, const std::vector<int>& replicas,
    const std::vector<std::vector<double>>& weights) {
  const int k_blocks = static_cast<int>(replicas.size());
  std::vector<int32_t> routes(static_cast<size_t>(microbatches) * k_blocks, 0);
  for (int k = 0; k < k_blocks; ++k) {
    const int r = replicas[k];
    if (r <= 1) continue;
    std::vector<double> w = k < static_cast<int>(weights.size()) &&
                                    static_cast<int>(weights[k].size()) == r
                                ? weights[k]
                                : std::vector<double>(r, 1.0);
    const int start = static_cast<int>(step % r);
    std::vector<int> left = Shares(microbatches, w, start);
    // Interleave: each micro-batch goes to the replica furthest behind its
    // share (smooth weighted round-robin), ties to the lowest rotation.
    std::vector<int> given(r, 0);
    for (int mb = 0; mb < microbatches; ++mb) {
      int best = -1;
      double best_gap = 0;
      for (int j = 0; j < r; ++j) {
        const int i = (start + j) % r;
        if (given[i] >= left[i]) continue;
        const double gap = double(left[i] - given[i]) / left[i];
        if (best < 0 || gap > best_gap) {
          best = i;
          best_gap = gap;
        }
      }
      ++given[best];
      routes[static_cast<size_t>(mb) * k_blocks + k] = best;
    }
  }
  return routes;
}

absl::Status CheckBlockRoutes(absl::Span<const int32_t> routes,
                              int microbatches, int num_blocks, int block,
                              int replicas, int next_replicas,
                              const std::string& where) {
  const bool last = block + 1 >= num_blocks;
  if (routes.empty()) {
    if (replicas > 1 || (!last && next_replicas > 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": no routes, but blocks have replicas"));
    }
    return absl::OkStatus();
  }
  const size_t k_blocks = static_cast<size_t>(num_blocks);
  if (routes.size() != static_cast<size_t>(microbatches) * k_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": ", routes.size(), " route entries for ", microbatches,
        " micro-batches of ", num_blocks, " blocks"));
  }
  std::vector<bool> used(std::max(replicas, 0), false);
  for (int mb = 0; mb < microbatches; ++mb) {
    const size_t at = static_cast<size_t>(mb) * k_blocks + block;
    const int32_t own = routes[at];
    const int32_t down = last ? 0 : routes[at + 1];
    if (own < 0 || own >= replicas || down < 0 ||
        (!last && down >= next_replicas)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": micro-batch ", mb, " routed to replica ", own, " of ",
          replicas, " of block ", block, " and replica ", down, " of ",
          last ? 1 : next_replicas, " of the next block"));
    }
    used[own] = true;
  }
  for (int i = 0; i < replicas; ++i) {
    if (!used[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the routes give replica ", i, " of block ",
                       block, " no micro-batch of the step"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRoutes(absl::Span<const int32_t> routes, int microbatches,
                         const std::vector<int>& replicas,
                         const std::string& where) {
  const int k_blocks = static_cast<int>(replicas.size());
  for (int k = 0; k < k_blocks; ++k) {
    RETURN_IF_ERROR(
        CheckBlockRoutes(routes, microbatches, k_blocks, k, replicas[k],
                         k + 1 < k_blocks ? replicas[k + 1] : 1, where));
  }
  return absl::OkStatus();
}

}  // namespace interlock
