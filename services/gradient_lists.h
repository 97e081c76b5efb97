// The lengths of the capped gradient lists (DESIGN §1), in one place for
// the trainer and the virtual clock. No LibTorch here.
#ifndef INTERLOCK_SERVICES_GRADIENT_LISTS_H_
#define INTERLOCK_SERVICES_GRADIENT_LISTS_H_

#include <algorithm>

namespace interlock {

struct GradientLists {
  int blocks = 1;  // K
  bool e2e = false;
  int n = 1;
  bool sum_rule = false;

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
    return i >= 0 && i < Up(k) && i != Shared(k);
  }
  int EarlyCount(int k) const { return Up(k) - (Shared(k) >= 0 ? 1 : 0); }
};

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_GRADIENT_LISTS_H_
