#include "coordinator/run_journal.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "analysis/checked_write.h"
#include "coordinator/checkpoint.h"
#include "coordinator/run_checkpoints.h"
#include "plan/status_macros.h"
#include "services/logging.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

// A journal holds a config and a manifest's evaluations: far below this.
constexpr std::streamoff kMaxJournalBytes = 16 << 20;

}  // namespace

RunJournal::RunJournal(const std::string& out_dir, std::string seal_key)
    : path_(out_dir + "/journal.pbtxt"), seal_key_(std::move(seal_key)) {}

absl::StatusOr<std::optional<v1::RunJournal>> RunJournal::Read(
    const v1::RunConfig& config) const {
  std::error_code ec;
  if (!std::filesystem::exists(path_, ec)) return std::nullopt;
  std::ifstream in(path_, std::ios::binary);
  std::ostringstream bytes;
  if (!in || !(bytes << in.rdbuf())) {
    return absl::NotFoundError(absl::StrCat(path_, ": cannot be read"));
  }
  if (bytes.tellp() > kMaxJournalBytes) {
    return absl::DataLossError(absl::StrCat(path_, ": larger than a journal"));
  }
  ASSIGN_OR_RETURN(v1::RunJournal j,
                   ParseJournal(bytes.str(), path_, seal_key_));
  RETURN_IF_ERROR(CheckSameRun(j.manifest(), config, path_));
  return j;
}

LiveRun RunJournal::Adoptable(const v1::RunJournal& journal) {
  LiveRun live;
  live.run_id = journal.run_id();
  live.generation = journal.generation() + 1;
  live.step = journal.manifest().step();
  for (const std::string& block : journal.workers()) {
    live.workers.push_back(absl::StrSplit(block, ','));
  }
  return live;
}

void RunJournal::Raise(const std::string& run_id, int64_t generation) {
  if (held_.run_id() != run_id) {
    held_.Clear();
    std::error_code ec;
    std::filesystem::remove(path_, ec);
    return;
  }
  if (generation <= held_.generation()) return;
  held_.set_generation(generation);
  Store();
}

void RunJournal::Write(const LiveRun& live, v1::CheckpointManifest manifest) {
  held_.set_format(1);
  held_.set_run_id(live.run_id);
  held_.set_generation(std::max(held_.generation(), live.generation));
  held_.clear_workers();
  for (const auto& block : live.workers) {
    held_.add_workers(absl::StrJoin(block, ","));
  }
  *held_.mutable_manifest() = std::move(manifest);
  Store();
}

void RunJournal::Store() {
  const absl::Status s =
      WriteFileReplacing(path_, SerializeJournal(held_, seal_key_));
  if (!s.ok() && !warned_) {
    warned_ = true;
    LOG(WARNING) << "the run's journal cannot be written (" << s.message()
                 << "): a coordinator started again on this run falls back "
                    "to its checkpoint";
  }
  if (s.ok()) warned_ = false;
}

void RunJournal::Remove() {
  held_.Clear();
  std::error_code ec;
  std::filesystem::remove(path_, ec);
}

}  // namespace interlock
