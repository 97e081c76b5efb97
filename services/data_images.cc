// Image and vector data sets: Fashion-MNIST (gzipped idx), CIFAR-10/100
// (binary), synthetic images and vectors, rows written in the config.
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "plan/status_macros.h"
#include "services/data.h"
#include "services/data_info.h"
#include "services/data_internal.h"

namespace interlock {
namespace data_internal {
namespace {

using v1::DataSpec;

constexpr char kFashionMnistDefaultDir[] = "/usr/share/datasets/fashion-mnist";

// Default sizes of the synthetic data sets.
constexpr int64_t kSyntheticTrain = 512;
constexpr int64_t kSyntheticTest = 128;
constexpr int64_t kSyntheticClasses = 10;
constexpr int64_t kSyntheticFeatures = 32;

uint32_t BigEndian32(const std::string& data, size_t offset) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data()) + offset;
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) |
         (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string BaseName(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Images or vectors, already normalised: inputs [N, ...] float32, targets
// [N] int64.
class TensorDataset : public Dataset {
 public:
  TensorDataset(torch::Tensor inputs, torch::Tensor targets)
      : inputs_(inputs.contiguous()), targets_(targets.contiguous()) {}

  int64_t size() const override { return inputs_.size(0); }

  std::pair<torch::Tensor, torch::Tensor> Gather(
      const std::vector<int64_t>& indices) const override {
    // from_blob without a copy: the index is only read inside index_select,
    // which also checks the bounds.
    const torch::Tensor index =
        torch::from_blob(const_cast<int64_t*>(indices.data()),
                         {static_cast<int64_t>(indices.size())}, torch::kLong);
    return {inputs_.index_select(0, index), targets_.index_select(0, index)};
  }

 private:
  torch::Tensor inputs_;
  torch::Tensor targets_;
};

// Converts uint8 images [N, C, H, W] to float32 scaled to [0, 1] and
// normalised per channel.
// Per-channel mean and standard deviation of the training images scaled to
// [0, 1] (DataInfoOf tells exports).
const std::vector<double> kFashionMnistMean = {0.2860};
const std::vector<double> kFashionMnistStd = {0.3530};
const std::vector<double> kCifarMean = {0.4914, 0.4822, 0.4465};
const std::vector<double> kCifarStd = {0.2470, 0.2435, 0.2616};

torch::Tensor NormaliseImages(const torch::Tensor& bytes,
                              const std::vector<double>& mean,
                              const std::vector<double>& std) {
  const int64_t c = static_cast<int64_t>(mean.size());
  const torch::Tensor m =
      torch::tensor(mean, torch::kDouble).to(torch::kFloat).view({1, c, 1, 1});
  const torch::Tensor s =
      torch::tensor(std, torch::kDouble).to(torch::kFloat).view({1, c, 1, 1});
  return bytes.to(torch::kFloat).div_(255.0f).sub_(m).div_(s);
}

// ----------------------------------------------------------------
// Fashion-MNIST

constexpr uint32_t kIdxImagesMagic = 2051;
constexpr uint32_t kIdxLabelsMagic = 2049;
constexpr int64_t kMnistSide = 28;

absl::StatusOr<std::unique_ptr<Dataset>> LoadIdxSplit(const std::string& dir,
                                                      const std::string& prefix,
                                                      int64_t cap) {
  const std::string images_path =
      JoinPath(dir, prefix + "-images-idx3-ubyte.gz");
  const std::string labels_path =
      JoinPath(dir, prefix + "-labels-idx1-ubyte.gz");
  const std::string images_name = BaseName(images_path);

  ASSIGN_OR_RETURN(std::string images, ReadGzFile(images_path));
  if (images.size() < 16) {
    return absl::DataLossError(
        absl::StrFormat("%s: %d bytes, expected at least a 16-byte idx3 header",
                        images_path, images.size()));
  }
  const uint32_t magic = BigEndian32(images, 0);
  if (magic != kIdxImagesMagic) {
    return absl::DataLossError(absl::StrFormat(
        "%s: bad magic %u, expected %u", images_path, magic, kIdxImagesMagic));
  }
  const uint64_t n = BigEndian32(images, 4);
  const uint32_t rows = BigEndian32(images, 8);
  const uint32_t cols = BigEndian32(images, 12);
  if (rows != kMnistSide || cols != kMnistSide) {
    return absl::DataLossError(
        absl::StrFormat("%s: images are %ux%u, expected %dx%d", images_path,
                        rows, cols, kMnistSide, kMnistSide));
  }
  const uint64_t image_bytes = kMnistSide * kMnistSide;
  if (images.size() != 16 + n * image_bytes) {
    return absl::DataLossError(absl::StrFormat(
        "%s: %d bytes after decompression, expected %d for %d images",
        images_path, images.size(), 16 + n * image_bytes, n));
  }

  ASSIGN_OR_RETURN(std::string labels, ReadGzFile(labels_path));
  if (labels.size() < 8) {
    return absl::DataLossError(
        absl::StrFormat("%s: %d bytes, expected at least an 8-byte idx1 header",
                        labels_path, labels.size()));
  }
  const uint32_t label_magic = BigEndian32(labels, 0);
  if (label_magic != kIdxLabelsMagic) {
    return absl::DataLossError(absl::StrFormat("%s: bad magic %u, expected %u",
                                               labels_path, label_magic,
                                               kIdxLabelsMagic));
  }
  const uint64_t label_count = BigEndian32(labels, 4);
  if (label_count != n) {
    return absl::DataLossError(
        absl::StrFormat("%s: %d labels, expected %d to match %s", labels_path,
                        label_count, n, images_name));
  }
  if (labels.size() != 8 + n) {
    return absl::DataLossError(absl::StrFormat(
        "%s: %d bytes after decompression, expected %d for %d labels",
        labels_path, labels.size(), 8 + n, n));
  }
  const auto* label_bytes =
      reinterpret_cast<const unsigned char*>(labels.data()) + 8;
  for (uint64_t i = 0; i < n; ++i) {
    if (label_bytes[i] >= 10) {
      return absl::DataLossError(
          absl::StrFormat("%s: label %d of sample %d, expected 0..9",
                          labels_path, label_bytes[i], i));
    }
  }

  const int64_t kept = Capped(static_cast<int64_t>(n), cap);
  const torch::Tensor raw = torch::from_blob(
      images.data() + 16, {kept, 1, kMnistSide, kMnistSide}, torch::kUInt8);
  torch::Tensor inputs =
      NormaliseImages(raw, kFashionMnistMean, kFashionMnistStd);
  torch::Tensor targets =
      torch::from_blob(const_cast<unsigned char*>(label_bytes), {kept},
                       torch::kUInt8)
          .to(torch::kLong);
  return std::unique_ptr<Dataset>(
      new TensorDataset(std::move(inputs), std::move(targets)));
}

}  // namespace

absl::StatusOr<DataSplits> LoadFashionMnist(const DataSpec& spec) {
  const std::string dir =
      spec.path().empty() ? kFashionMnistDefaultDir : spec.path();
  RETURN_IF_ERROR(CheckExists(dir, /*want_dir=*/true));
  DataSplits splits;
  splits.shape.channels = 1;
  splits.shape.height = kMnistSide;
  splits.shape.width = kMnistSide;
  splits.shape.classes = 10;
  ASSIGN_OR_RETURN(splits.train, LoadIdxSplit(dir, "train", spec.max_train()));
  ASSIGN_OR_RETURN(splits.test, LoadIdxSplit(dir, "t10k", spec.max_test()));
  return splits;
}

namespace {

// ---------------------------------------------------------------- CIFAR

constexpr int64_t kCifarPixels = 3 * 32 * 32;

struct CifarFormat {
  int64_t label_bytes;   // 1 (CIFAR-10) or 2 (CIFAR-100: coarse, fine).
  int64_t label_offset;  // Which label byte we use.
  int64_t classes;
};

// Reads and concatenates CIFAR binary files into one split.
absl::StatusOr<std::unique_ptr<Dataset>> LoadCifarSplit(
    const std::vector<std::string>& paths, const CifarFormat& format,
    int64_t cap) {
  const int64_t record = format.label_bytes + kCifarPixels;
  std::vector<std::string> contents;
  int64_t total = 0;
  for (const std::string& path : paths) {
    ASSIGN_OR_RETURN(std::string data, ReadFile(path));
    const int64_t size = static_cast<int64_t>(data.size());
    if (size == 0 || size % record != 0) {
      return absl::DataLossError(absl::StrFormat(
          "%s: %d bytes, expected a non-zero multiple of the %d-byte record",
          path, size, record));
    }
    const auto* bytes = reinterpret_cast<const unsigned char*>(data.data());
    for (int64_t i = 0; i < size / record; ++i) {
      const int label = bytes[i * record + format.label_offset];
      if (label >= format.classes) {
        return absl::DataLossError(
            absl::StrFormat("%s: label %d in record %d, expected 0..%d", path,
                            label, i, format.classes - 1));
      }
    }
    total += size / record;
    contents.push_back(std::move(data));
  }

  const int64_t kept = Capped(total, cap);
  torch::Tensor pixels = torch::empty({kept, 3, 32, 32}, torch::kUInt8);
  torch::Tensor targets = torch::empty({kept}, torch::kLong);
  auto* out = pixels.data_ptr<uint8_t>();
  auto* labels = targets.data_ptr<int64_t>();
  int64_t row = 0;
  for (const std::string& data : contents) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(data.data());
    const int64_t count = static_cast<int64_t>(data.size()) / record;
    for (int64_t i = 0; i < count && row < kept; ++i, ++row) {
      const unsigned char* rec = bytes + i * record;
      labels[row] = rec[format.label_offset];
      std::memcpy(out + row * kCifarPixels, rec + format.label_bytes,
                  kCifarPixels);
    }
  }
  contents.clear();
  torch::Tensor inputs = NormaliseImages(pixels, kCifarMean, kCifarStd);
  return std::unique_ptr<Dataset>(
      new TensorDataset(std::move(inputs), std::move(targets)));
}

}  // namespace

absl::StatusOr<DataSplits> LoadCifar(const DataSpec& spec, bool cifar100) {
  const char* name = cifar100 ? "CIFAR100" : "CIFAR10";
  if (spec.path().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " needs data.path: the folder of the binary files"));
  }
  const std::string& dir = spec.path();
  RETURN_IF_ERROR(CheckExists(dir, /*want_dir=*/true));

  CifarFormat format;
  std::vector<std::string> train_paths;
  std::string test_path;
  if (cifar100) {
    format = {2, 1, 100};
    train_paths.push_back(JoinPath(dir, "train.bin"));
    test_path = JoinPath(dir, "test.bin");
  } else {
    format = {1, 0, 10};
    for (int i = 1; i <= 5; ++i) {
      const std::string path =
          JoinPath(dir, absl::StrCat("data_batch_", i, ".bin"));
      if (IsRegularFile(path)) train_paths.push_back(path);
    }
    if (train_paths.empty()) {
      return absl::NotFoundError(absl::StrCat(
          JoinPath(dir, "data_batch_1.bin"),
          ": no such file (need at least one of data_batch_1..5.bin)"));
    }
    test_path = JoinPath(dir, "test_batch.bin");
  }

  DataSplits splits;
  splits.shape.channels = 3;
  splits.shape.height = 32;
  splits.shape.width = 32;
  splits.shape.classes = format.classes;
  ASSIGN_OR_RETURN(splits.train,
                   LoadCifarSplit(train_paths, format, spec.max_train()));
  ASSIGN_OR_RETURN(splits.test,
                   LoadCifarSplit({test_path}, format, spec.max_test()));
  return splits;
}

// ---------------------------------------------------------------- Synthetic

// Class c has a fixed mean pattern in [-1, 1]; a sample is its class pattern
// plus Gaussian noise (std 0.5): learnable, though not perfectly separable.
absl::StatusOr<DataSplits> LoadSyntheticTensors(const DataSpec& spec,
                                                bool vectors) {
  const char* what = vectors ? "SYNTHETIC_VECTORS" : "SYNTHETIC_IMAGES";
  std::vector<int64_t> sample_shape;
  if (spec.synthetic_shape_size() == 0) {
    sample_shape = vectors ? std::vector<int64_t>{kSyntheticFeatures}
                           : std::vector<int64_t>{3, 32, 32};
  } else {
    sample_shape.assign(spec.synthetic_shape().begin(),
                        spec.synthetic_shape().end());
  }
  const size_t rank = vectors ? 1 : 3;
  bool positive = true;
  for (int64_t d : sample_shape) positive = positive && d > 0;
  if (sample_shape.size() != rank || !positive) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: synthetic_shape [%s], expected %s of positive sizes", what,
        absl::StrJoin(sample_shape, ","), vectors ? "[features]" : "[C,H,W]"));
  }
  const int64_t classes = spec.synthetic_classes() == 0
                              ? kSyntheticClasses
                              : spec.synthetic_classes();
  const int64_t n_train =
      spec.synthetic_train() == 0 ? kSyntheticTrain : spec.synthetic_train();
  const int64_t n_test =
      spec.synthetic_test() == 0 ? kSyntheticTest : spec.synthetic_test();
  if (classes < 1 || classes > 1 << 20 || n_train < 1 || n_test < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: synthetic_classes %d, synthetic_train %d, synthetic_test %d; "
        "expected positive values (classes at most %d)",
        what, classes, n_train, n_test, 1 << 20));
  }
  int64_t elements = 1;
  for (int64_t d : sample_shape) {
    elements *= d;
    if (elements > kMaxSyntheticElements) break;
  }
  if (elements > kMaxSyntheticElements ||
      elements * (n_train + n_test + classes) > kMaxSyntheticElements) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: shape [%s] x %d samples exceeds the limit of %d elements", what,
        absl::StrJoin(sample_shape, ","), n_train + n_test,
        kMaxSyntheticElements));
  }

  SplitMix64 rng(kSyntheticSeed);
  std::vector<float> patterns(static_cast<size_t>(classes * elements));
  for (float& p : patterns) p = static_cast<float>(2.0 * rng.Uniform() - 1.0);

  auto make = [&](int64_t n, int64_t cap) {
    const int64_t kept = Capped(n, cap);
    std::vector<int64_t> dims = {kept};
    dims.insert(dims.end(), sample_shape.begin(), sample_shape.end());
    torch::Tensor inputs = torch::empty(dims, torch::kFloat);
    torch::Tensor targets = torch::empty({kept}, torch::kLong);
    float* x = inputs.data_ptr<float>();
    int64_t* y = targets.data_ptr<int64_t>();
    // Generate all n samples so capping does not change the ones kept.
    for (int64_t i = 0; i < n; ++i) {
      const int64_t label = static_cast<int64_t>(rng.Bounded(classes));
      const float* pattern = patterns.data() + label * elements;
      for (int64_t e = 0; e < elements; ++e) {
        const float v = pattern[e] + 0.5f * static_cast<float>(rng.Normal());
        if (i < kept) x[i * elements + e] = v;
      }
      if (i < kept) y[i] = label;
    }
    return std::unique_ptr<Dataset>(
        new TensorDataset(std::move(inputs), std::move(targets)));
  };

  DataSplits splits;
  splits.shape.classes = classes;
  if (vectors) {
    splits.shape.is_vector = true;
    splits.shape.channels = sample_shape[0];
    splits.shape.height = 1;
    splits.shape.width = 1;
  } else {
    splits.shape.channels = sample_shape[0];
    splits.shape.height = sample_shape[1];
    splits.shape.width = sample_shape[2];
  }
  splits.train = make(n_train, spec.max_train());
  splits.test = make(n_test, spec.max_test());
  return splits;
}

// Rows written in the config (tests, worked examples), used as both splits.
// The shape rules match ValidateConfig's: one dimension means vectors; two or
// three mean images [C, H(, W)] with the missing sizes 1.
absl::StatusOr<DataSplits> LoadInline(const DataSpec& spec) {
  std::vector<int64_t> sample_shape(spec.synthetic_shape().begin(),
                                    spec.synthetic_shape().end());
  bool positive = true;
  for (int64_t d : sample_shape) positive = positive && d > 0;
  if (sample_shape.empty() || sample_shape.size() > 3 || !positive) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "INLINE: synthetic_shape [%s], expected [features] or [C,H,W] of "
        "positive sizes",
        absl::StrJoin(sample_shape, ",")));
  }
  const int64_t classes = spec.synthetic_classes() > 0
                              ? spec.synthetic_classes()
                              : kSyntheticClasses;
  int64_t elements = 1;
  for (int64_t d : sample_shape) {
    elements *= d;
    if (elements > kMaxSyntheticElements) break;
  }
  const int64_t n = spec.inline_targets_size();
  if (n == 0 || elements > kMaxSyntheticElements ||
      spec.inline_inputs_size() != n * elements) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "INLINE: %d inline_inputs, expected %d (%d inline_targets x %d "
        "values of shape [%s]), at least one row",
        spec.inline_inputs_size(), n * elements, n, elements,
        absl::StrJoin(sample_shape, ",")));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = spec.inline_targets(static_cast<int>(i));
    if (t < 0 || t >= classes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("INLINE: inline_targets[%d] = %d, expected 0..%d", i,
                          t, classes - 1));
    }
  }

  DataSplits splits;
  splits.shape.classes = classes;
  std::vector<int64_t> dims = {n};
  if (sample_shape.size() == 1) {
    splits.shape.is_vector = true;
    splits.shape.channels = sample_shape[0];
    splits.shape.height = splits.shape.width = 1;
    dims.push_back(sample_shape[0]);
  } else {
    sample_shape.resize(3, 1);
    splits.shape.channels = sample_shape[0];
    splits.shape.height = sample_shape[1];
    splits.shape.width = sample_shape[2];
    dims.insert(dims.end(), sample_shape.begin(), sample_shape.end());
  }
  const torch::Tensor inputs =
      torch::tensor(std::vector<float>(spec.inline_inputs().begin(),
                                       spec.inline_inputs().end()),
                    torch::kFloat)
          .view(dims);
  const torch::Tensor targets =
      torch::tensor(std::vector<int64_t>(spec.inline_targets().begin(),
                                         spec.inline_targets().end()),
                    torch::kLong);
  const int64_t n_train = Capped(n, spec.max_train());
  const int64_t n_test = Capped(n, spec.max_test());
  splits.train =
      std::make_unique<TensorDataset>(inputs.narrow(0, 0, n_train).clone(),
                                      targets.narrow(0, 0, n_train).clone());
  splits.test =
      std::make_unique<TensorDataset>(inputs.narrow(0, 0, n_test).clone(),
                                      targets.narrow(0, 0, n_test).clone());
  return splits;
}

}  // namespace data_internal
DataInfo DataInfoOf(const v1::DataSpec& spec) {
  using v1::DataSpec;
  DataInfo info;
  switch (spec.kind()) {
    case DataSpec::FASHION_MNIST:
      info.mean = data_internal::kFashionMnistMean;
      info.std = data_internal::kFashionMnistStd;
      info.class_names = {"T-shirt/top", "Trouser",   "Pullover", "Dress",
                          "Coat",        "Sandal",    "Shirt",    "Sneaker",
                          "Bag",         "Ankle boot"};
      break;
    case DataSpec::CIFAR10:
      info.mean = data_internal::kCifarMean;
      info.std = data_internal::kCifarStd;
      info.class_names = {"airplane", "automobile", "bird",  "cat",  "deer",
                          "dog",      "frog",       "horse", "ship", "truck"};
      break;
    case DataSpec::CIFAR100:
      info.mean = data_internal::kCifarMean;
      info.std = data_internal::kCifarStd;
      break;
    case DataSpec::IMAGE_FOLDER: {
      // Bytes scaled to [0, 1] only; the classes are the folders' names.
      const int64_t c =
          spec.synthetic_shape_size() > 0 ? spec.synthetic_shape(0) : 3;
      info.mean.assign(static_cast<size_t>(std::max<int64_t>(c, 0)), 0.0);
      info.std.assign(info.mean.size(), 1.0);
      auto classes = data_internal::ImageFolderClasses(spec.path());
      if (classes.ok()) info.class_names = *std::move(classes);
      break;
    }
    case DataSpec::NPY: {
      int64_t c = 0;
      if (data_internal::NpyInputsAreBytes(spec.path(), &c)) {
        info.mean.assign(static_cast<size_t>(c), 0.0);
        info.std.assign(info.mean.size(), 1.0);
      }
      break;
    }
    default:
      break;
  }
  return info;
}

}  // namespace interlock
