// Using a trained run: `interlock eval` (every exit's loss and accuracy on
// a data set, through the same evaluation as the run's own), `predict`
// (labels of a data set's samples through any exit) and `generate` (text
// from a language model through any exit).
#ifndef INTERLOCK_COORDINATOR_INFERENCE_H_
#define INTERLOCK_COORDINATOR_INFERENCE_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/run_result.h"
#include "coordinator/trained_model.h"

namespace interlock {

struct EvalOptions {
  RunSource source;
  // Another config whose `data` replaces the run's (same shapes and
  // classes); empty: the run's test split.
  std::string data_config;
};

struct RunEvaluation {
  int64_t step = 0;
  int64_t samples = 0;
  std::vector<HeadResult> heads;  // aux heads first, the final one last
};

absl::StatusOr<RunEvaluation> EvaluateRun(const EvalOptions& options);

struct PredictOptions {
  RunSource source;
  std::string data_config;  // as EvalOptions
  int exit_block = -1;      // -1: the final output; k: head k
  int64_t first = 0;        // test samples [first, first + count)
  int64_t count = 10;
  // Non-empty: label the samples of this file instead (a .npy file, an
  // image or a folder of images: ReadInputs in services/data.h); `first`
  // and `count` then select among them.
  std::string input;
};

struct Prediction {
  int64_t index = 0;       // in the test split, or in `input`
  std::string name;        // `input`'s name of the sample; empty for the split
  int64_t label = 0;       // argmax of the exit's logits
  std::string label_name;  // the class's name where the data names it
  double probability = 0.0;
  int64_t target = -1;  // -1: unknown (a file's samples)
};

absl::StatusOr<std::vector<Prediction>> Predict(const PredictOptions& options);

struct GenerateOptions {
  RunSource source;
  std::string prompt;
  // Token ids instead of a text prompt, for a model of any vocabulary: the
  // result is then the ids, space-separated.
  std::vector<int64_t> prompt_ids;
  int exit_block = -1;  // -1: the final output; k: head k
  int tokens = 200;
  double temperature = 1.0;  // 0: greedy
  int top_k = 0;             // 0: every token
  uint64_t seed = 0;
};

// The prompt followed by the sampled bytes (or ids). A scripted model is fed
// whole windows of its context, the tokens first and zeros after them: the
// output of a causal model at the last token does not see those.
absl::StatusOr<std::string> Generate(const GenerateOptions& options);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_INFERENCE_H_
