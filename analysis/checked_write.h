// Checked writes of the files a run leaves behind (metrics.jsonl,
// eval.jsonl, summary.json, profile.json, timelines, reports, checkpoints).
// Every write and the close are checked: a full disk or a failing device is
// an error naming the path and the reason (RESOURCE_EXHAUSTED for a full
// disk or quota, else DATA_LOSS), never a silently short file.
#ifndef INTERLOCK_ANALYSIS_CHECKED_WRITE_H_
#define INTERLOCK_ANALYSIS_CHECKED_WRITE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace interlock {

// Writes `bytes` to `path` (created or truncated); with `sync`, fsyncs it.
absl::Status WriteFileChecked(const std::string& path, absl::string_view bytes,
                              bool sync = false);

// Writes PATH.tmp and renames it to `path`: a reader sees the old file or the
// whole new one, never half of it.
absl::Status WriteFileReplacing(const std::string& path,
                                absl::string_view bytes);

// A file written a line at a time as a run goes (metrics.jsonl).
class AppendFile {
 public:
  AppendFile() = default;
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;
  ~AppendFile();

  // Opens `path`, continuing it (`append`) or truncating it.
  absl::Status Open(const std::string& path, bool append);
  bool is_open() const { return fd_ >= 0; }
  absl::Status Append(absl::string_view line);  // adds the newline
  absl::Status Close();

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace interlock

#endif  // INTERLOCK_ANALYSIS_CHECKED_WRITE_H_
