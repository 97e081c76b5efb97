#include "coordinator/checkpoint.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "analysis/checked_write.h"
#include "google/protobuf/text_format.h"
#include "plan/status_macros.h"
#include "services/digest.h"

namespace interlock {
namespace {

namespace fs = std::filesystem;
namespace v1 = interlock::v1;

constexpr char kManifest[] = "manifest.pbtxt";
constexpr char kTrailer[] = "# sha256 ";
constexpr char kSealTrailer[] = "# hmac-sha256 ";
constexpr char kStepPrefix[] = "step-";
constexpr char kTempPrefix[] = ".tmp-";
constexpr int kMaxBlocks = 4096;

std::string Errno() { return std::strerror(errno); }

// Writes `bytes` to `path` and fsyncs it.
absl::Status WriteSynced(const std::string& path, absl::string_view bytes) {
  absl::Status s = WriteFileChecked(path, bytes, /*sync=*/true);
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("checkpoint: ", s.message()));
}

// HMAC-SHA256 of `text` keyed by `key`, as lowercase hex.
std::string HmacSha256Hex(const std::string& key, absl::string_view text) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(text.data()), text.size(), mac,
       &size);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(mac), size));
}

absl::Status SyncDir(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("checkpoint: cannot open folder ", path, ": ", Errno()));
  }
  const int rc = fsync(fd);
  const std::string e = rc != 0 ? Errno() : "";
  close(fd);
  if (rc != 0) {
    return absl::DataLossError(
        absl::StrCat("checkpoint: fsync of folder ", path, ": ", e));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadAll(const std::string& path, int64_t limit) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot be read"));
  }
  in.seekg(0, std::ios::end);
  const int64_t size = static_cast<int64_t>(in.tellg());
  if (size < 0) return absl::DataLossError(absl::StrCat(path, ": unreadable"));
  if (size > limit) {
    return absl::DataLossError(absl::StrCat(
        path, ": ", size, " bytes, more than expected (", limit, ")"));
  }
  in.seekg(0);
  std::string out(static_cast<size_t>(size), '\0');
  in.read(out.data(), size);
  if (in.gcount() != size) {
    return absl::DataLossError(absl::StrCat(path, ": short read"));
  }
  return out;
}

std::string BlockFileName(int block) {
  return absl::StrCat("block-", block, ".pt");
}

bool IsHex64(const std::string& s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!absl::ascii_isxdigit(c) || absl::ascii_isupper(c)) return false;
  }
  return true;
}

// The step of a "step-NNNNNNNNNN" folder name, or -1.
int64_t StepOfName(const std::string& name) {
  if (!absl::StartsWith(name, kStepPrefix)) return -1;
  int64_t step = -1;
  if (!absl::SimpleAtoi(name.substr(strlen(kStepPrefix)), &step)) return -1;
  return step;
}

// Text followed by its SHA-256 line and, with a `seal_key`, its HMAC line.
std::string Sealed(const std::string& text, const std::string& seal_key) {
  std::string out =
      absl::StrCat(text, kTrailer, Sha256Hex(text.data(), text.size()), "\n");
  if (!seal_key.empty()) {
    absl::StrAppend(&out, kSealTrailer, HmacSha256Hex(seal_key, text), "\n");
  }
  return out;
}

// The text a Sealed file holds, once its checksum (and, with a `seal_key`,
// its signature) is verified.
absl::StatusOr<absl::string_view> Unsealed(absl::string_view bytes,
                                           const std::string& what,
                                           const std::string& seal_key) {
  // A signature, if any, is the last line (after the checksum line).
  std::string signature;
  const size_t sealed_at = bytes.rfind(kSealTrailer);
  if (sealed_at != absl::string_view::npos &&
      (sealed_at == 0 || bytes[sealed_at - 1] == '\n')) {
    absl::string_view sig = bytes.substr(sealed_at + strlen(kSealTrailer));
    if (!absl::ConsumeSuffix(&sig, "\n") || sig.size() != 64) {
      return absl::DataLossError(
          absl::StrCat(what, ": malformed HMAC-SHA256 line (truncated?)"));
    }
    signature = std::string(sig);
    bytes = bytes.substr(0, sealed_at);
  }
  // The trailer seals everything before it: a flipped byte anywhere is
  // caught before any field is believed.
  const size_t at = bytes.rfind(kTrailer);
  if (at == absl::string_view::npos || (at > 0 && bytes[at - 1] != '\n')) {
    return absl::DataLossError(
        absl::StrCat(what, ": no '", kTrailer, "' line (truncated?)"));
  }
  const absl::string_view body = bytes.substr(0, at);
  absl::string_view sealed = bytes.substr(at + strlen(kTrailer));
  if (!absl::ConsumeSuffix(&sealed, "\n") || sealed.size() != 64) {
    return absl::DataLossError(
        absl::StrCat(what, ": malformed SHA-256 line (truncated?)"));
  }
  const std::string actual = Sha256Hex(body.data(), body.size());
  if (actual != sealed) {
    return absl::DataLossError(absl::StrCat(what, ": SHA-256 is ", actual,
                                            ", its last line says ", sealed,
                                            " (damaged)"));
  }
  // The checksum proves no accident; only the signature proves that a
  // holder of the token wrote this file.
  if (!seal_key.empty()) {
    if (signature.empty()) {
      return absl::PermissionDeniedError(absl::StrCat(
          what,
          ": not signed (written by a run without --token-file); a run "
          "with a token loads only what is signed with it"));
    }
    const std::string expected = HmacSha256Hex(seal_key, body);
    if (CRYPTO_memcmp(expected.data(), signature.data(), expected.size()) !=
        0) {
      return absl::PermissionDeniedError(absl::StrCat(
          what,
          ": HMAC-SHA256 signature does not match (altered after it was "
          "written, or signed with another token)"));
    }
  }
  return body;
}

// The fields every manifest must have right (a journal's too).
absl::Status CheckManifestFields(const v1::CheckpointManifest& m,
                                 const std::string& what) {
  if (m.format() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": format ", m.format(), ", this build reads 1"));
  }
  if (m.num_blocks() < 1 || m.num_blocks() > kMaxBlocks) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": num_blocks ", m.num_blocks(), " outside [1, ",
                     kMaxBlocks, "]"));
  }
  if (m.step() < 0 || m.total_steps() < 0 || m.step() > m.total_steps()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": step ", m.step(), " of ", m.total_steps()));
  }
  return absl::OkStatus();
}

}  // namespace

std::string SerializeManifest(const v1::CheckpointManifest& m,
                              const std::string& seal_key) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(m, &text);
  return Sealed(text, seal_key);
}

std::string SerializeJournal(const v1::RunJournal& j,
                             const std::string& seal_key) {
  std::string text;
  google::protobuf::TextFormat::PrintToString(j, &text);
  return Sealed(text, seal_key);
}

absl::StatusOr<v1::RunJournal> ParseJournal(absl::string_view bytes,
                                            const std::string& what,
                                            const std::string& seal_key) {
  ASSIGN_OR_RETURN(const absl::string_view body,
                   Unsealed(bytes, what, seal_key));
  v1::RunJournal j;
  google::protobuf::TextFormat::Parser parser;
  if (!parser.ParseFromString(std::string(body), &j)) {
    return absl::DataLossError(absl::StrCat(what, ": not a run journal"));
  }
  if (j.format() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": format ", j.format(), ", this build reads 1"));
  }
  RETURN_IF_ERROR(CheckManifestFields(j.manifest(), what));
  if (j.run_id().empty() || j.generation() < 1 ||
      j.workers_size() != j.manifest().num_blocks() ||
      j.manifest().files_size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": run id, generation, workers (", j.workers_size(), " for ",
        j.manifest().num_blocks(), " blocks) or files out of place"));
  }
  return j;
}

absl::StatusOr<v1::CheckpointManifest> ParseManifest(
    absl::string_view bytes, const std::string& what,
    const std::string& seal_key) {
  ASSIGN_OR_RETURN(const absl::string_view body,
                   Unsealed(bytes, what, seal_key));
  v1::CheckpointManifest m;
  google::protobuf::TextFormat::Parser parser;
  if (!parser.ParseFromString(std::string(body), &m)) {
    return absl::DataLossError(
        absl::StrCat(what, ": not a checkpoint manifest"));
  }
  RETURN_IF_ERROR(CheckManifestFields(m, what));
  if (m.files_size() != m.num_blocks()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", m.files_size(), " files for ", m.num_blocks(), " blocks"));
  }
  std::set<int> seen;
  for (const auto& f : m.files()) {
    if (f.block() < 0 || f.block() >= m.num_blocks() ||
        !seen.insert(f.block()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": file for block ", f.block(),
                       " is out of range or repeated"));
    }
    // Only the names this code writes: nothing outside the folder.
    if (f.name() != BlockFileName(f.block())) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": unexpected file name '", f.name(),
                       "' for block ", f.block()));
    }
    if (f.bytes() < 0 || !IsHex64(f.sha256())) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": file ", f.name(), " has a bad size or SHA-256"));
    }
  }
  return m;
}

absl::StatusOr<Checkpoint> ReadCheckpoint(const std::string& dir,
                                          const std::string& seal_key) {
  Checkpoint c;
  c.dir = dir;
  const std::string mpath = absl::StrCat(dir, "/", kManifest);
  auto bytes = ReadAll(mpath, 64 << 20);
  if (!bytes.ok()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", dir, ": ", bytes.status().message()));
  }
  ASSIGN_OR_RETURN(
      c.manifest,
      ParseManifest(*bytes, absl::StrCat("checkpoint ", mpath), seal_key));
  c.blocks.resize(c.manifest.num_blocks());
  for (const auto& f : c.manifest.files()) {
    const std::string path = absl::StrCat(dir, "/", f.name());
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (ec) {
      return absl::DataLossError(absl::StrCat("checkpoint ", dir, ": file ",
                                              f.name(),
                                              " is missing: ", ec.message()));
    }
    if (static_cast<int64_t>(size) != f.bytes()) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint ", dir, ": file ", f.name(), " is ", size,
          " bytes, the manifest says ", f.bytes(), " (truncated or damaged)"));
    }
    auto data = ReadAll(path, f.bytes());
    if (!data.ok()) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", dir, ": ", data.status().message()));
    }
    const std::string sha = Sha256Hex(data->data(), data->size());
    if (sha != f.sha256()) {
      return absl::DataLossError(
          absl::StrCat("checkpoint ", dir, ": file ", f.name(), " has SHA-256 ",
                       sha, ", the manifest says ", f.sha256(), " (damaged)"));
    }
    c.blocks[f.block()] = *std::move(data);
  }
  return c;
}

absl::StatusOr<CheckpointStore> CheckpointStore::Open(
    const std::string& root, int keep, std::vector<std::string>* removed,
    const std::string& seal_key) {
  if (keep < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--keep-checkpoints: ", keep, ", must be at least 1"));
  }
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat(
        "--checkpoint-dir: cannot create ", root, ": ", ec.message()));
  }
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (!absl::StartsWith(name, kTempPrefix)) continue;
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    if (rm) {
      return absl::PermissionDeniedError(
          absl::StrCat("--checkpoint-dir: cannot remove the unfinished ",
                       e.path().string(), ": ", rm.message()));
    }
    if (removed) removed->push_back(e.path().string());
  }
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat(
        "--checkpoint-dir: cannot list ", root, ": ", ec.message()));
  }
  return CheckpointStore(root, keep, seal_key);
}

std::vector<std::string> CheckpointStore::List() const {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    const int64_t step = StepOfName(e.path().filename().string());
    if (step >= 0 && e.is_directory()) found.emplace_back(step, e.path());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, path] : found) out.push_back(std::move(path));
  return out;
}

absl::StatusOr<std::string> CheckpointStore::Write(
    v1::CheckpointManifest manifest, const std::vector<std::string>& blocks,
    const std::function<void()>& before_rename) const {
  const std::string name =
      absl::StrFormat("%s%010d", kStepPrefix, manifest.step());
  const std::string final_dir = absl::StrCat(root_, "/", name);
  const std::string temp_dir =
      absl::StrCat(root_, "/", kTempPrefix, name, "-", getpid());
  std::error_code ec;
  fs::remove_all(temp_dir, ec);
  if (!fs::create_directory(temp_dir, ec) || ec) {
    return absl::PermissionDeniedError(absl::StrCat(
        "checkpoint: cannot create ", temp_dir, ": ", ec.message()));
  }
  manifest.set_format(1);
  manifest.set_num_blocks(static_cast<int>(blocks.size()));
  manifest.clear_files();
  for (size_t k = 0; k < blocks.size(); ++k) {
    auto* f = manifest.add_files();
    f->set_name(BlockFileName(static_cast<int>(k)));
    f->set_block(static_cast<int>(k));
    f->set_bytes(static_cast<int64_t>(blocks[k].size()));
    f->set_sha256(Sha256Hex(blocks[k].data(), blocks[k].size()));
    RETURN_IF_ERROR(
        WriteSynced(absl::StrCat(temp_dir, "/", f->name()), blocks[k]));
  }
  RETURN_IF_ERROR(WriteSynced(absl::StrCat(temp_dir, "/", kManifest),
                              SerializeManifest(manifest, seal_key_)));
  RETURN_IF_ERROR(SyncDir(temp_dir));
  if (before_rename) before_rename();
  // A checkpoint of the same step (written again after a replay) is
  // replaced: moved aside under a temporary name first, so a crash here
  // leaves the older checkpoints, never a half-written one.
  if (fs::exists(final_dir, ec)) {
    const std::string old =
        absl::StrCat(root_, "/", kTempPrefix, "old-", name, "-", getpid());
    fs::rename(final_dir, old, ec);
    if (ec) {
      return absl::PermissionDeniedError(absl::StrCat(
          "checkpoint: cannot move ", final_dir, " aside: ", ec.message()));
    }
    fs::remove_all(old, ec);
  }
  fs::rename(temp_dir, final_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat(
        "checkpoint: cannot rename ", temp_dir, ": ", ec.message()));
  }
  RETURN_IF_ERROR(SyncDir(root_));
  // Keep the newest `keep_`: retired ones are renamed to a temporary name
  // first (atomic), so a crash while deleting leaves nothing half-valid.
  std::vector<std::string> all = List();
  for (size_t i = 0; i + keep_ < all.size(); ++i) {
    const std::string doomed =
        absl::StrCat(root_, "/", kTempPrefix, "retired-",
                     fs::path(all[i]).filename().string(), "-", getpid());
    fs::rename(all[i], doomed, ec);
    if (!ec) fs::remove_all(doomed, ec);
  }
  RETURN_IF_ERROR(SyncDir(root_));
  return final_dir;
}

std::optional<Checkpoint> CheckpointStore::Latest(
    std::vector<std::string>* refused) const {
  std::vector<std::string> all = List();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    auto c = ReadCheckpoint(*it, seal_key_);
    if (c.ok()) return *std::move(c);
    if (refused) refused->push_back(std::string(c.status().message()));
  }
  return std::nullopt;
}

}  // namespace interlock
