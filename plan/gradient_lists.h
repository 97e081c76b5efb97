// The lengths of the capped gradient lists (ARCHITECTURE: the rule), in one
// place for the trainer and the virtual clock. No LibTorch here.
#ifndef INTERLOCK_PLAN_GRADIENT_LISTS_H_
#define INTERLOCK_PLAN_GRADIENT_LISTS_H_

#include <algorithm>

namespace interlock {

struct GradientLists {
  int blocks = 1;  // K
  bool e2e = false;
  int n = 1;
  bool sum_rule = false;
  // training.compute_unused_gradients: compute and send the entries no block
  // trains on too (only for comparisons; the parameters are the same).
  bool compute_unused = false;

  // Entry i of block k's list [own, downstream...] is the gradient of loss
  // k + i. FURTHEST trains block b with loss min(b + n - 1, K - 1), so the
  // losses below min(n - 1, K - 1) train no block (only their own heads, on
  // detached outputs): their entries are neither computed nor sent.
  int FirstUsedLoss() const {
    if (e2e || sum_rule || compute_unused) return 0;
    return std::min(n - 1, blocks - 1);
  }
  bool Used(int k, int i) const { return k + i >= FirstUsedLoss(); }
  // Downstream entries block k never receives (unused; always the first).
  int UnusedDown(int k) const {
    return std::clamp(FirstUsedLoss() - (k + 1), 0, Down(k));
  }

  // Entries block k gets from block k+1.
  int Down(int k) const {
    if (k + 1 >= blocks) return 0;
    if (e2e) return 1;
    return std::min(n - 1, blocks - k - 1);
  }
  // Entries block k sends to block k-1.
  int Up(int k) const {
    if (k == 0) return 0;
    if (e2e) return 1;
    return std::min(n - 1, blocks - k);
  }
  // The upstream entry block k's parameter pass yields (-1: none). The list
  // is [own, downstream...]; FURTHEST trains on its last entry.
  int Shared(int k) const {
    const int up = Up(k);
    if (up == 0) return -1;
    if (e2e) return 0;
    const int last = Down(k);
    const int shared = (!sum_rule || last == 0) ? last : -1;
    return shared < up ? shared : -1;
  }
  // Upstream entries computed by input-gradient-only passes.
  bool Early(int k, int i) const {
    return i >= 0 && i < Up(k) && i != Shared(k) && Used(k, i);
  }
  int EarlyCount(int k) const {
    int count = 0;
    for (int i = 0; i < Up(k); ++i) count += Early(k, i) ? 1 : 0;
    return count;
  }
};

}  // namespace interlock

#endif  // INTERLOCK_PLAN_GRADIENT_LISTS_H_
