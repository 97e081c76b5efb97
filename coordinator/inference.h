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
};

struct Prediction {
  int64_t index = 0;  // in the test split
  int64_t label = 0;  // argmax of the exit's logits
  double probability = 0.0;
  int64_t target = 0;
};

absl::StatusOr<std::vector<Prediction>> Predict(const PredictOptions& options);

struct GenerateOptions {
  RunSource source;
  std::string prompt;
  int exit_block = -1;  // -1: the final output; k: head k
  int tokens = 200;
  double temperature = 1.0;  // 0: greedy
  int top_k = 0;             // 0: every token
  uint64_t seed = 0;
};

// The prompt followed by the sampled bytes.
absl::StatusOr<std::string> Generate(const GenerateOptions& options);

}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_INFERENCE_H_
