// Text data sets: byte-level corpus windows and synthetic text.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "plan/status_macros.h"
#include "services/data.h"
#include "services/data_internal.h"

namespace interlock {
namespace data_internal {
namespace {

using v1::DataSpec;

// Default size of the synthetic text.
constexpr int64_t kSyntheticTextBytes = 64 * 1024;

// One contiguous slice [begin, begin + length) of a shared byte stream.
class TextDataset : public Dataset {
 public:
  TextDataset(std::shared_ptr<const std::string> bytes, int64_t begin,
              int64_t length, int64_t context, int64_t cap)
      : bytes_(std::move(bytes)),
        begin_(begin),
        context_(context),
        size_(Capped((length - 1) / context, cap)) {}

  int64_t size() const override { return size_; }

  std::pair<torch::Tensor, torch::Tensor> Gather(
      const std::vector<int64_t>& indices) const override {
    const int64_t b = static_cast<int64_t>(indices.size());
    torch::Tensor inputs = torch::empty({b, context_}, torch::kLong);
    torch::Tensor targets = torch::empty({b, context_}, torch::kLong);
    int64_t* in = inputs.data_ptr<int64_t>();
    int64_t* out = targets.data_ptr<int64_t>();
    const auto* base =
        reinterpret_cast<const unsigned char*>(bytes_->data()) + begin_;
    for (int64_t r = 0; r < b; ++r) {
      const int64_t i = indices[r];
      TORCH_CHECK(i >= 0 && i < size_, "text sample index ", i,
                  " out of range [0, ", size_, ")");
      const unsigned char* w = base + i * context_;
      int64_t* in_row = in + r * context_;
      int64_t* out_row = out + r * context_;
      for (int64_t t = 0; t < context_; ++t) {
        in_row[t] = w[t];
        out_row[t] = w[t + 1];
      }
    }
    return {inputs, targets};
  }

 private:
  std::shared_ptr<const std::string> bytes_;
  int64_t begin_;
  int64_t context_;
  int64_t size_;
};

// Splits the stream 90% / 5% / 5% (train / valid / test), contiguously.
absl::StatusOr<DataSplits> MakeTextSplits(
    std::shared_ptr<const std::string> bytes, const std::string& source,
    const DataSpec& spec, int64_t context) {
  const int64_t len = static_cast<int64_t>(bytes->size());
  const int64_t train_end = len * 90 / 100;
  const int64_t valid_end = len * 95 / 100;
  const int64_t train_len = train_end;
  const int64_t valid_len = valid_end - train_end;
  const int64_t test_len = len - valid_end;
  if (train_len < context + 1 || valid_len < context + 1 ||
      test_len < context + 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d bytes is too short for context %d: train/valid/test splits "
        "of %d/%d/%d bytes, each needs at least %d",
        source, len, context, train_len, valid_len, test_len, context + 1));
  }
  DataSplits splits;
  splits.shape.is_text = true;
  splits.shape.classes = 256;
  splits.shape.context = context;
  splits.train = std::make_unique<TextDataset>(bytes, 0, train_len, context,
                                               spec.max_train());
  splits.test = std::make_unique<TextDataset>(bytes, valid_end, test_len,
                                              context, spec.max_test());
  return splits;
}

}  // namespace

absl::StatusOr<DataSplits> LoadText(const DataSpec& spec, int64_t context) {
  const std::string path =
      spec.path().empty() ? DefaultTextPath() : spec.path();
  ASSIGN_OR_RETURN(std::string data, ReadFile(path));
  return MakeTextSplits(std::make_shared<const std::string>(std::move(data)),
                        path, spec, context);
}

namespace {

// Words from a fixed vocabulary strung together by a sparse Markov chain
// (two possible successors per word), with sentence breaks: plenty of
// structure for a byte-level model to learn at several scales.
std::string SyntheticText(int64_t length) {
  SplitMix64 rng(kSyntheticSeed ^ 0x7E47ULL);
  constexpr int kWords = 64;
  std::vector<std::string> words(kWords);
  std::vector<std::pair<int, int>> next(kWords);
  for (int w = 0; w < kWords; ++w) {
    const int n = 2 + static_cast<int>(rng.Bounded(7));
    for (int k = 0; k < n; ++k) {
      words[w].push_back(static_cast<char>('a' + rng.Bounded(26)));
    }
    next[w] = {static_cast<int>(rng.Bounded(kWords)),
               static_cast<int>(rng.Bounded(kWords))};
  }
  std::string text;
  text.reserve(static_cast<size_t>(length) + 16);
  int w = 0;
  int in_sentence = 0;
  while (static_cast<int64_t>(text.size()) < length) {
    text += words[w];
    if (++in_sentence == 8) {
      text += ".\n";
      in_sentence = 0;
    } else {
      text += ' ';
    }
    w = rng.Bounded(2) == 0 ? next[w].first : next[w].second;
  }
  text.resize(static_cast<size_t>(length));
  return text;
}

}  // namespace

absl::StatusOr<DataSplits> LoadSyntheticText(const DataSpec& spec,
                                             int64_t context) {
  // At least 64 KiB, and long enough for 8 test windows at any context.
  const int64_t length = std::max(kSyntheticTextBytes, 20 * (8 * context + 1));
  if (length > kMaxSyntheticElements) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "synthetic text: context %d needs %d bytes, more than the limit %d",
        context, length, kMaxSyntheticElements));
  }
  return MakeTextSplits(
      std::make_shared<const std::string>(SyntheticText(length)),
      "synthetic text", spec, context);
}

}  // namespace data_internal

using data_internal::JoinPath;

std::string DefaultTextPath() {
  const char* dir = std::getenv("INTERLOCK_DATA_DIR");
  if (dir != nullptr && dir[0] != '\0') return JoinPath(dir, "kjv.txt");
#ifdef INTERLOCK_SOURCE_DIR
  return JoinPath(INTERLOCK_SOURCE_DIR, ".cache/data/kjv.txt");
#else
  return ".cache/data/kjv.txt";
#endif
}

}  // namespace interlock
