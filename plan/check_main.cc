// interlock_plan_check: links interlock_plan and nothing else of ours and
// runs each part of the ground floor once on known answers. It fails to
// build if the floor needs anything above it (LibTorch, gRPC, protobuf),
// and exits 1 naming the first wrong answer.
#include <iostream>
#include <string>
#include <vector>

#include "plan/gradient_lists.h"
#include "plan/partition.h"
#include "plan/replica_routes.h"
#include "plan/status_macros.h"
#include "plan/topology.h"

namespace interlock {
namespace {

absl::StatusOr<int> Units(const std::string& partition) {
  ASSIGN_OR_RETURN(const std::vector<int> counts,
                   ParsePartition(partition, 6, 0));
  int sum = 0;
  for (int c : counts) sum += c;
  return sum;
}

int Check() {
  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      std::cerr << "plan check: " << what << "\n";
      ++failures;
    }
  };
  auto counts = ParsePartition("1,2,rest", 6, 0);
  expect(counts.ok() && PartitionString(*counts) == "1,2,3",
         "ParsePartition(1,2,rest) over 6 units");
  expect(!ParsePartition("4,4", 6, 0).ok(), "a partition over too many units");
  auto units = Units("2,rest");
  expect(units.ok() && *units == 6, "status macros");
  UnitCosts costs{{1, 1, 4, 1, 1, 1}, {0, 0, 0, 0, 0, 0}};
  auto cut = BalancedPartition(costs, 3);
  expect(cut.ok() && PartitionString(*cut) == "2,1,3", "BalancedPartition");
  GradientLists lists{4, false, 2, false, false};
  expect(lists.Down(0) == 1 && lists.Down(3) == 0, "GradientLists::Down");
  const std::vector<int32_t> routes = RouteStep(0, 4, {2, 1});
  expect(routes.size() == 8 && CheckRoutes(routes, 4, {2, 1}, "check").ok(),
         "RouteStep / CheckRoutes");
  auto topology = ParseWorkers("a:1+a:2,b:1");
  expect(topology.ok() && ReplicaCounts(*topology) == std::vector<int>{2, 1},
         "ParseWorkers");
  expect(!ParseWorkers("a:1,a:1").ok(), "a worker listed twice");
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace interlock

int main() { return interlock::Check(); }
