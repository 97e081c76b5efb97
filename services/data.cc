// Data sets: the loader each DataSpec kind picks, file reading and mapping,
// and the epoch order. The kinds themselves are in data_images.cc,
// data_text.cc, data_npy.cc and data_folder.cc.
#include "services/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "plan/status_macros.h"
#include "services/data_internal.h"

namespace interlock {
namespace data_internal {
namespace {

absl::Status ErrnoStatus(const std::string& path, const char* what, int err) {
  const std::string message =
      absl::StrCat(path, ": ", what, ": ", std::strerror(err));
  return err == EACCES ? absl::PermissionDeniedError(message)
                       : absl::FailedPreconditionError(message);
}

}  // namespace

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

absl::Status CheckExists(const std::string& path, bool want_dir) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return absl::NotFoundError(
          absl::StrCat(path, ": no such ", want_dir ? "folder" : "file"));
    }
    return ErrnoStatus(path, "cannot stat", errno);
  }
  if (want_dir && !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a folder"));
  }
  if (!want_dir && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a regular file"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  RETURN_IF_ERROR(CheckExists(path, /*want_dir=*/false));
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return ErrnoStatus(path, "cannot open", errno);
  }
  std::string data;
  char buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) data.append(buf, got);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return data;
}

absl::StatusOr<std::string> ReadGzFile(const std::string& path) {
  RETURN_IF_ERROR(CheckExists(path, /*want_dir=*/false));
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    return ErrnoStatus(path, "cannot open", errno);
  }
  std::string data;
  std::vector<char> buf(1 << 20);
  for (;;) {
    const int got = gzread(f, buf.data(), static_cast<unsigned>(buf.size()));
    if (got > 0) data.append(buf.data(), static_cast<size_t>(got));
    int err = Z_OK;
    const char* msg = gzerror(f, &err);
    // A truncated stream reports Z_BUF_ERROR; anything but OK is corruption.
    if (got < 0 || (err != Z_OK && err != Z_STREAM_END)) {
      std::string text = msg != nullptr ? msg : "unknown error";
      // zlib prefixes its message with the path; we add our own.
      if (absl::StartsWith(text, path + ": ")) text.erase(0, path.size() + 2);
      gzclose(f);
      return absl::DataLossError(
          absl::StrCat(path, ": gzip stream is corrupt: ", text));
    }
    if (got == 0) break;
  }
  gzclose(f);
  return data;
}

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::Open(
    const std::string& path) {
  RETURN_IF_ERROR(CheckExists(path, /*want_dir=*/false));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(path, "cannot open", errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(path, "cannot stat", err);
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* data = nullptr;
  if (size > 0) {
    data = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(path, "cannot map", err);
    }
  }
  ::close(fd);  // The mapping keeps the file open.
  return std::shared_ptr<const MappedFile>(
      new MappedFile(path, static_cast<const unsigned char*>(data), size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) {
    ::munmap(const_cast<unsigned char*>(data_), size_);
  }
}

torch::Tensor MappedTensor(const std::shared_ptr<const MappedFile>& file,
                           const unsigned char* bytes,
                           const std::vector<int64_t>& shape,
                           torch::ScalarType dtype) {
  return torch::from_blob(
      const_cast<unsigned char*>(bytes), shape, [file](void*) {},
      torch::TensorOptions().dtype(dtype));
}

}  // namespace data_internal

bool IsTextKind(v1::DataSpec::Kind kind) {
  return kind == v1::DataSpec::TEXT || kind == v1::DataSpec::SYNTHETIC_TEXT ||
         kind == v1::DataSpec::TOKEN_FILE;
}

namespace {

using data_internal::LoadCifar;
using data_internal::LoadFashionMnist;
using data_internal::LoadImageFolder;
using data_internal::LoadInline;
using data_internal::LoadNpy;
using data_internal::LoadSyntheticTensors;
using data_internal::LoadSyntheticText;
using data_internal::LoadText;
using data_internal::LoadTokenFile;
using data_internal::SplitMix64;
using v1::DataSpec;

absl::StatusOr<DataSplits> LoadDataImpl(const DataSpec& spec,
                                        int64_t text_context) {
  if (spec.max_train() < 0 || spec.max_test() < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("data: max_train %d / max_test %d must not be negative",
                        spec.max_train(), spec.max_test()));
  }
  if (IsTextKind(spec.kind()) && text_context <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "text data: context %d, expected a positive number of tokens",
        text_context));
  }
  switch (spec.kind()) {
    case DataSpec::FASHION_MNIST:
      return LoadFashionMnist(spec);
    case DataSpec::CIFAR10:
      return LoadCifar(spec, /*cifar100=*/false);
    case DataSpec::CIFAR100:
      return LoadCifar(spec, /*cifar100=*/true);
    case DataSpec::TEXT:
      return LoadText(spec, text_context);
    case DataSpec::SYNTHETIC_IMAGES:
      return LoadSyntheticTensors(spec, /*vectors=*/false);
    case DataSpec::SYNTHETIC_VECTORS:
      return LoadSyntheticTensors(spec, /*vectors=*/true);
    case DataSpec::SYNTHETIC_TEXT:
      return LoadSyntheticText(spec, text_context);
    case DataSpec::INLINE:
      return LoadInline(spec);
    case DataSpec::NPY:
      return LoadNpy(spec);
    case DataSpec::TOKEN_FILE:
      return LoadTokenFile(spec, text_context);
    case DataSpec::IMAGE_FOLDER:
      return LoadImageFolder(spec);
    default:
      return absl::InvalidArgumentError(absl::StrFormat(
          "data.kind %s (%d) is not a loadable data set",
          DataSpec::Kind_Name(spec.kind()), static_cast<int>(spec.kind())));
  }
}

}  // namespace

absl::StatusOr<DataSplits> LoadData(const interlock::v1::DataSpec& spec,
                                    int64_t text_context) {
  // Torch and the standard library report failures (allocation, shape
  // checks) by exception; callers expect a status instead.
  try {
    return LoadDataImpl(spec, text_context);
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("loading data: ", e.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("loading data: out of memory");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("loading data: ", e.what()));
  }
}

std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed, int64_t epoch) {
  if (n <= 0) return {};
  std::vector<int64_t> perm(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  SplitMix64 rng(seed ^ (static_cast<uint64_t>(epoch) * 0x9E3779B97F4A7C15ULL));
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j =
        static_cast<int64_t>(rng.Bounded(static_cast<uint64_t>(i) + 1));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

}  // namespace interlock
