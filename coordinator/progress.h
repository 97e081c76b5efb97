// Training progress: a bar redrawn in place on a terminal, plain log lines
// (about every 10% or 10 s) otherwise.
#ifndef INTERLOCK_COORDINATOR_PROGRESS_H_
#define INTERLOCK_COORDINATOR_PROGRESS_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace interlock {

class Progress {
 public:
  // `budget_seconds` > 0: a wall-time budget that may end the run before
  // `total` steps; the ETA is then the nearer of the two.
  Progress(std::ostream* out, bool bar, bool quiet, int64_t total,
           std::string title, double budget_seconds = 0.0);
  // `losses` per block (NaN where a block has no head).
  void Update(int64_t done, const std::vector<double>& losses,
              double samples_per_second, double elapsed_seconds);
  void Finish();

 private:
  std::ostream* out_;
  bool bar_;
  bool quiet_;
  int64_t total_;
  std::string title_;
  double budget_seconds_;
  double last_log_ = -1e9;
  int64_t last_logged_ = 0;
  bool drawn_ = false;
};

std::string FormatDuration(double seconds);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_PROGRESS_H_
