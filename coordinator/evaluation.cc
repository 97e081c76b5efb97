#include "coordinator/evaluation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "plan/status_macros.h"

namespace interlock {

absl::StatusOr<std::vector<HeadResult>> EvaluateHeads(
    Engine& engine, const Dataset& test, int64_t batch_size, bool text,
    CoordinatorMetrics* metrics) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  const int64_t eb = std::max<int64_t>(1, batch_size);
  std::map<int, HeadEval> sums;
  for (int64_t i = 0; i < test.size(); i += eb) {
    std::vector<int64_t> idx;
    for (int64_t j = i; j < std::min(test.size(), i + eb); ++j) {
      idx.push_back(j);
    }
    auto [x, y] = test.Gather(idx);
    ASSIGN_OR_RETURN(auto heads, engine.Evaluate(x, y));
    for (const auto& h : heads) {
      HeadEval& s = sums[h.block];
      s.block = h.block;
      s.loss_sum += h.loss_sum;
      s.correct += h.correct;
      s.count += h.count;
    }
  }
  std::vector<HeadResult> out;
  for (const auto& [block, s] : sums) {
    HeadResult r;
    r.block = block;
    r.final = block == engine.num_blocks() - 1;
    r.loss = s.count ? s.loss_sum / s.count : kNaN;
    r.accuracy = s.count ? static_cast<double>(s.correct) / s.count : kNaN;
    r.perplexity = text ? std::exp(r.loss) : kNaN;
    if (metrics) metrics->OnEval(block, r.accuracy, r.loss);
    out.push_back(r);
  }
  return out;
}

}  // namespace interlock
