// Data sets: Fashion-MNIST (gzipped idx), CIFAR-10/100 (binary), byte-level
// text, synthetic data, and a user's own: NumPy .npy arrays, token-id files,
// image folders. The built-in sets and image folders are read at start-up
// into memory; .npy and token files are memory-mapped and read per batch.
// Batches are cut in a seeded order that is identical on every machine.
#ifndef INTERLOCK_SERVICES_DATA_H_
#define INTERLOCK_SERVICES_DATA_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/config.pb.h"

namespace interlock {

// What a model needs to know about its input.
struct DataShape {
  bool is_text = false;
  // Images: channels, height, width. Vectors: channels = features, h = w = 1.
  int64_t channels = 0;
  int64_t height = 0;
  int64_t width = 0;
  // Classes (images, vectors) or vocabulary size (text: 256).
  int64_t classes = 0;
  // Text: tokens per sample.
  int64_t context = 0;
  bool is_vector = false;
};

enum class Split { kTrain, kTest };

// One split, in memory or memory-mapped. Gather always returns images as
// float32 [B, C, H, W] (vectors [B, F]) and targets as int64 [B]. Text: a
// flat token stream; sample i is the window starting at i * context of length
// context + 1 (input = first context tokens, target = the next context
// tokens), both int64 [B, context].
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // Stacks the samples with the given indices: inputs and targets.
  virtual std::pair<torch::Tensor, torch::Tensor> Gather(
      const std::vector<int64_t>& indices) const = 0;
};

struct DataSplits {
  DataShape shape;
  std::unique_ptr<Dataset> train;
  std::unique_ptr<Dataset> test;
};

// Whether a data kind holds token ids (TEXT, SYNTHETIC_TEXT, TOKEN_FILE):
// what the transformer and token models read.
bool IsTextKind(interlock::v1::DataSpec::Kind kind);

// Loads both splits as the config describes. Errors name the file and what
// was expected (NOT_FOUND for a missing file, DATA_LOSS / INVALID_ARGUMENT for
// a malformed one).
absl::StatusOr<DataSplits> LoadData(const interlock::v1::DataSpec& spec,
                                    int64_t text_context);

// Inputs to label, as a run of `spec` with `shape` would read them: a .npy
// file (one sample or [N, ...sample]; float32, float16 or uint8), an image
// (.png, .jpg, .jpeg) or a folder of images (sorted by name; decoded,
// cropped and resized as IMAGE_FOLDER does). Bytes are scaled to [0, 1];
// then the data set's normalisation (DataInfoOf) is applied. `names` gets
// one name per sample (the image's file name, or "PATH[i]"). Errors name
// the file. Not for text.
absl::StatusOr<torch::Tensor> ReadInputs(const std::string& path,
                                         const interlock::v1::DataSpec& spec,
                                         const DataShape& shape,
                                         std::vector<std::string>* names);

// Deterministic shuffling: the permutation of [0, n) for the given epoch of a
// run with the given seed. Uses its own generator (SplitMix64 + Fisher-Yates)
// so the order is the same on every platform and standard library.
std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed, int64_t epoch);

// The default location of the text corpus (the King James Bible extracted by
// scripts/setup.sh): $INTERLOCK_DATA_DIR/kjv.txt, else .cache/data/kjv.txt
// relative to the source tree.
std::string DefaultTextPath();

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_DATA_H_
