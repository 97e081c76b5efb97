#include "coordinator/progress.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace interlock {

std::string FormatDuration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return absl::StrFormat("%dh%02dm", t / 3600, (t / 60) % 60);
  if (t >= 60) return absl::StrFormat("%dm%02ds", t / 60, t % 60);
  return absl::StrFormat("%ds", t);
}

Progress::Progress(std::ostream* out, bool bar, bool quiet, int64_t total,
                   std::string title, double budget_seconds)
    : out_(out),
      bar_(bar),
      quiet_(quiet),
      total_(total),
      title_(title),
      budget_seconds_(budget_seconds) {}

void Progress::Update(int64_t done, const std::vector<double>& losses,
                      double sps, double elapsed) {
  if (quiet_ || out_ == nullptr) return;
  std::vector<std::string> ls;
  for (double l : losses) {
    if (std::isfinite(l)) ls.push_back(absl::StrFormat("%.3f", l));
  }
  double eta =
      done > 0 ? elapsed / static_cast<double>(done) * (total_ - done) : 0.0;
  if (budget_seconds_ > 0) {
    eta = std::min(eta, std::max(0.0, budget_seconds_ - elapsed));
  }
  const std::string stats =
      absl::StrFormat("loss %s | %.0f samples/s | ETA %s",
                      absl::StrJoin(ls, "/"), sps, FormatDuration(eta));
  if (bar_) {
    constexpr int kWidth = 24;
    const int filled =
        total_ > 0 ? static_cast<int>(kWidth * done / total_) : kWidth;
    std::string bar(filled, '=');
    if (filled < kWidth) bar += '>' + std::string(kWidth - filled - 1, ' ');
    *out_ << "\r\033[K" << title_ << " [" << bar << "] " << done << "/"
          << total_ << " " << stats << std::flush;
    drawn_ = true;
    return;
  }
  const bool tenth = total_ >= 10 ? (done - last_logged_) * 10 >= total_ : true;
  if (done == total_ || tenth || elapsed - last_log_ >= 10.0) {
    *out_ << title_ << " step " << done << "/" << total_ << " " << stats
          << "\n";
    last_log_ = elapsed;
    last_logged_ = done;
  }
}

void Progress::Finish() {
  if (drawn_) *out_ << "\n";
  drawn_ = false;
}

}  // namespace interlock
