// Text data sets: byte-level corpus windows, synthetic text, and token-id
// files (TOKEN_FILE, memory-mapped).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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

// Token i of a stream of `width`-byte little-endian tokens (1: bytes).
inline int64_t TokenAt(const unsigned char* base, int64_t i, int width) {
  const unsigned char* p = base + i * width;
  if (width == 1) return p[0];
  if (width == 2) return int64_t{p[0]} | (int64_t{p[1]} << 8);
  return int64_t{p[0]} | (int64_t{p[1]} << 8) | (int64_t{p[2]} << 16) |
         (int64_t{p[3]} << 24);
}

// Windows of a slice [begin, begin + length) of a token stream (a text's
// bytes, or a mapped token file): sample i is the `context` tokens from
// i * context (inputs) and the same shifted by one (targets). `owner` keeps
// the stream's memory alive.
class WindowDataset : public Dataset {
 public:
  WindowDataset(std::shared_ptr<const void> owner, const unsigned char* data,
                int width, int64_t begin, int64_t length, int64_t context,
                int64_t cap)
      : owner_(std::move(owner)),
        base_(data + begin * width),
        width_(width),
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
    for (int64_t r = 0; r < b; ++r) {
      const int64_t i = indices[r];
      TORCH_CHECK(i >= 0 && i < size_, "text sample index ", i,
                  " out of range [0, ", size_, ")");
      const int64_t w = i * context_;
      int64_t* in_row = in + r * context_;
      int64_t* out_row = out + r * context_;
      int64_t previous = TokenAt(base_, w, width_);
      for (int64_t t = 0; t < context_; ++t) {
        const int64_t next = TokenAt(base_, w + t + 1, width_);
        in_row[t] = previous;
        out_row[t] = next;
        previous = next;
      }
    }
    return {inputs, targets};
  }

 private:
  std::shared_ptr<const void> owner_;
  const unsigned char* base_;
  int width_;
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
  const auto* data = reinterpret_cast<const unsigned char*>(bytes->data());
  splits.train = std::make_unique<WindowDataset>(bytes, data, 1, 0, train_len,
                                                 context, spec.max_train());
  splits.test = std::make_unique<WindowDataset>(
      bytes, data, 1, valid_end, test_len, context, spec.max_test());
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

// ---------------------------------------------------------------- Token files

namespace {

// The largest of n little-endian tokens of type T: one pass, vectorised on
// a little-endian machine (the bytes are the values).
template <typename T>
int64_t LargestToken(const unsigned char* base, int64_t n) {
  T largest = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, base + i * sizeof(T), sizeof(T));
    largest = std::max(largest, v);
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    largest = std::max(largest, static_cast<T>(TokenAt(base, i, sizeof(T))));
  }
#endif
  return static_cast<int64_t>(largest);
}

// Maps a token file and checks, in one pass, that it holds whole tokens all
// below the vocabulary size.
absl::StatusOr<std::shared_ptr<const MappedFile>> OpenTokenFile(
    const std::string& path, int width, int64_t vocab) {
  ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file,
                   MappedFile::Open(path));
  const char* type = width == 2 ? "uint16" : "uint32";
  if (file->size() % static_cast<size_t>(width) != 0) {
    return absl::DataLossError(absl::StrFormat(
        "%s: %d bytes is not a whole number of %s tokens (%d bytes each)", path,
        file->size(), type, width));
  }
  const int64_t n = static_cast<int64_t>(file->size()) / width;
  const unsigned char* base = file->data();
  const int64_t largest = width == 2 ? LargestToken<uint16_t>(base, n)
                                     : LargestToken<uint32_t>(base, n);
  if (largest >= vocab) {
    int64_t at = 0;
    while (TokenAt(base, at, width) < vocab) ++at;
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: token %d at position %d (of %d %s tokens) is not below "
        "vocab_size %d",
        path, TokenAt(base, at, width), at, n, type, vocab));
  }
  return file;
}

}  // namespace

absl::StatusOr<DataSplits> LoadTokenFile(const DataSpec& spec,
                                         int64_t context) {
  if (spec.path().empty()) {
    return absl::InvalidArgumentError(
        "TOKEN_FILE needs data.path: a file of token ids");
  }
  if (spec.vocab_size() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("TOKEN_FILE: data.vocab_size ", spec.vocab_size(),
                     ", expected the (positive) number of token ids"));
  }
  const int width = spec.token_dtype() == DataSpec::UINT32 ? 4 : 2;
  const float fraction =
      spec.test_fraction() == 0.0f ? 0.1f : spec.test_fraction();
  if (!spec.test_path().empty() && spec.test_fraction() != 0.0f) {
    return absl::InvalidArgumentError(
        "TOKEN_FILE: give data.test_path or data.test_fraction, not both");
  }
  if (!(fraction > 0.0f && fraction < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("TOKEN_FILE: data.test_fraction ", spec.test_fraction(),
                     ", expected a share in (0, 1)"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> train,
                   OpenTokenFile(spec.path(), width, spec.vocab_size()));
  std::shared_ptr<const MappedFile> test = train;
  const int64_t train_tokens = static_cast<int64_t>(train->size()) / width;
  int64_t train_len = train_tokens;
  int64_t test_begin = 0;
  int64_t test_len = 0;
  if (!spec.test_path().empty()) {
    ASSIGN_OR_RETURN(test,
                     OpenTokenFile(spec.test_path(), width, spec.vocab_size()));
    test_len = static_cast<int64_t>(test->size()) / width;
  } else {
    test_len = static_cast<int64_t>(static_cast<double>(train_tokens) *
                                    static_cast<double>(fraction));
    train_len = train_tokens - test_len;
    test_begin = train_len;
  }
  if (train_len < context + 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d training tokens, too few for one window of context %d (%d "
        "tokens)",
        spec.path(), train_len, context, context + 1));
  }
  if (test_len < context + 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %d test tokens%s, too few for one window of context %d (%d "
        "tokens)",
        spec.test_path().empty() ? spec.path() : spec.test_path(), test_len,
        spec.test_path().empty()
            ? absl::StrCat(" (the last ", fraction, " of the file)")
            : std::string(),
        context, context + 1));
  }
  DataSplits splits;
  splits.shape.is_text = true;
  splits.shape.classes = spec.vocab_size();
  splits.shape.context = context;
  splits.train = std::make_unique<WindowDataset>(
      train, train->data(), width, 0, train_len, context, spec.max_train());
  splits.test =
      std::make_unique<WindowDataset>(test, test->data(), width, test_begin,
                                      test_len, context, spec.max_test());
  return splits;
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
