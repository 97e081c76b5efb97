// What the data set files share: the seeded generator, file reading and
// mapping, and the loader of each kind (images in data_images.cc, text and
// token files in data_text.cc, .npy arrays in data_npy.cc, image folders in
// data_folder.cc; data.cc picks one). Private to services/data*.cc.
#ifndef INTERLOCK_SERVICES_DATA_INTERNAL_H_
#define INTERLOCK_SERVICES_DATA_INTERNAL_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/config.pb.h"
#include "services/data.h"

namespace interlock {
namespace data_internal {

// Fixed seed: synthetic data must be identical on every machine of a run.
constexpr uint64_t kSyntheticSeed = 0x1A7E'10C4'DA7A'5EEDULL;
// Refuse synthetic sets larger than this many elements (4 GiB of floats).
constexpr int64_t kMaxSyntheticElements = int64_t{1} << 30;

// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and fully specified, so
// shuffles and synthetic data do not depend on the standard library.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

  // Uniform in [0, bound), bound > 0. Rejects the low (2^64 mod bound) values
  // so every residue is equally likely.
  uint64_t Bounded(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      const uint64_t r = Next();
      if (r >= threshold) return r % bound;
    }
  }

  // Uniform in [0, 1) with 53 random bits.
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

  static constexpr double kTwoPi = 6.283185307179586476925;

  // Standard normal by Box-Muller (one value per call keeps it stateless).
  double Normal() {
    const double u1 = 1.0 - Uniform();  // (0, 1]: log stays finite.
    const double u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
  }

 private:
  uint64_t state_;
};

std::string JoinPath(const std::string& dir, const std::string& name);
bool IsRegularFile(const std::string& path);
// NOT_FOUND for a missing path, INVALID_ARGUMENT for one of the wrong type.
absl::Status CheckExists(const std::string& path, bool want_dir);
absl::StatusOr<std::string> ReadFile(const std::string& path);
absl::StatusOr<std::string> ReadGzFile(const std::string& path);

// A whole file mapped read-only (mmap): its pages are read on demand and
// belong to the page cache, so they count as the process's file-backed
// memory (RssFile), never its anonymous memory (RssAnon), and the kernel can
// drop them under pressure. Unmapped when the last reference goes.
class MappedFile {
 public:
  // NOT_FOUND for a missing file, as CheckExists.
  static absl::StatusOr<std::shared_ptr<const MappedFile>> Open(
      const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const unsigned char* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const unsigned char* data_;
  size_t size_;
};

// A tensor viewing `bytes` of a mapping without a copy; it keeps the mapping
// alive. Read-only: writing into it faults.
torch::Tensor MappedTensor(const std::shared_ptr<const MappedFile>& file,
                           const unsigned char* bytes,
                           const std::vector<int64_t>& shape,
                           torch::ScalarType dtype);

// Applies a max_train / max_test cap (0 = no cap).
inline int64_t Capped(int64_t n, int64_t cap) {
  return cap > 0 && cap < n ? cap : n;
}

// data_images.cc
absl::StatusOr<DataSplits> LoadFashionMnist(const v1::DataSpec& spec);
absl::StatusOr<DataSplits> LoadCifar(const v1::DataSpec& spec, bool cifar100);
absl::StatusOr<DataSplits> LoadSyntheticTensors(const v1::DataSpec& spec,
                                                bool vectors);
absl::StatusOr<DataSplits> LoadInline(const v1::DataSpec& spec);

// data_text.cc
absl::StatusOr<DataSplits> LoadText(const v1::DataSpec& spec, int64_t context);
absl::StatusOr<DataSplits> LoadSyntheticText(const v1::DataSpec& spec,
                                             int64_t context);
absl::StatusOr<DataSplits> LoadTokenFile(const v1::DataSpec& spec,
                                         int64_t context);

// data_npy.cc
absl::StatusOr<DataSplits> LoadNpy(const v1::DataSpec& spec);
// Whether DIR/train_x.npy holds bytes (scaled to [0, 1] by the loader), and
// its channels (features of vectors); false when it cannot be read.
bool NpyInputsAreBytes(const std::string& dir, int64_t* channels);
// Samples of shape `sample` from one .npy file ([N, ...] or one sample),
// float32 (bytes scaled to [0, 1], as training reads them).
absl::StatusOr<torch::Tensor> ReadNpyInputs(const std::string& path,
                                            const std::vector<int64_t>& sample);

// data_folder.cc
absl::StatusOr<DataSplits> LoadImageFolder(const v1::DataSpec& spec);
// The class folders of ROOT/train, sorted (the class ids in order).
absl::StatusOr<std::vector<std::string>> ImageFolderClasses(
    const std::string& root);

}  // namespace data_internal
}  // namespace interlock

#endif  // INTERLOCK_SERVICES_DATA_INTERNAL_H_
