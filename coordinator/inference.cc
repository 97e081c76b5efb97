#include "coordinator/inference.h"

#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/engine_factory.h"
#include "coordinator/evaluation.h"
#include "plan/status_macros.h"
#include "services/config.h"
#include "services/data_info.h"
#include "services/models.h"
#include "services/torch_guard.h"

namespace interlock {
namespace {

// The run's data, or another config's data of the same shapes.
absl::Status UseData(const std::string& data_config, TrainedModel& m) {
  if (data_config.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const v1::RunConfig other, LoadRunConfig(data_config));
  ASSIGN_OR_RETURN(DataSplits data,
                   LoadData(other.data(), TextContext(m.config.model())));
  if (SampleShape(data.shape) != SampleShape(m.data.shape) ||
      data.shape.classes != m.data.shape.classes ||
      data.shape.is_text != m.data.shape.is_text) {
    return absl::InvalidArgumentError(
        absl::StrCat(data_config,
                     ": its data does not have the shape and "
                     "classes the run was trained on"));
  }
  m.data = std::move(data);
  return absl::OkStatus();
}

absl::Status CheckExit(const TrainedModel& m, int exit_block) {
  const int k = static_cast<int>(m.blocks.size());
  if (exit_block < -1 || exit_block >= k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--exit ", exit_block, ": outside [0, ", k, ") (or -1, the final)"));
  }
  if (exit_block >= 0 && exit_block + 1 < k && !m.blocks[exit_block]->head()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--exit ", exit_block, ": block ", exit_block,
                     " has no head (an E2E run trains none)"));
  }
  return absl::OkStatus();
}

// Logits of exit `exit_block` (-1: the final block's output).
torch::Tensor ExitLogits(const TrainedModel& m, int exit_block,
                         torch::Tensor x) {
  torch::NoGradGuard no_grad;
  const int last =
      exit_block < 0 ? static_cast<int>(m.blocks.size()) - 1 : exit_block;
  for (int k = 0; k <= last; ++k) x = m.blocks[k]->block()->forward(x);
  if (last + 1 < static_cast<int>(m.blocks.size())) {
    x = m.blocks[last]->head()->forward(x);
  }
  return x;
}

}  // namespace

absl::StatusOr<RunEvaluation> EvaluateRun(const EvalOptions& o) {
  ASSIGN_OR_RETURN(TrainedModel m, LoadTrainedModel(o.source));
  RETURN_IF_ERROR(UseData(o.data_config, m));
  // The run's own evaluation: the in-process engine holding the
  // checkpoint's state, through every head.
  EngineOptions engine_options;
  ASSIGN_OR_RETURN(ResolvedRun run, ResolveRun(m.config, engine_options, "",
                                               /*measure=*/nullptr));
  ASSIGN_OR_RETURN(auto engine, MakeEngine(run, m.data.shape, engine_options,
                                           /*window=*/0, nullptr));
  const int64_t step = m.checkpoint.manifest.step();
  RETURN_IF_ERROR(engine->engine().LoadState(step, m.checkpoint.blocks));
  RunEvaluation r;
  r.step = step;
  r.samples = m.data.test->size();
  ASSIGN_OR_RETURN(r.heads, EvaluateHeads(engine->engine(), *m.data.test,
                                          m.config.training().eval_batch_size(),
                                          m.data.shape.is_text, nullptr));
  return r;
}

absl::StatusOr<std::vector<Prediction>> Predict(const PredictOptions& o) {
  ASSIGN_OR_RETURN(TrainedModel m, LoadTrainedModel(o.source));
  RETURN_IF_ERROR(UseData(o.data_config, m));
  RETURN_IF_ERROR(CheckExit(m, o.exit_block));
  if (m.data.shape.is_text) {
    return absl::InvalidArgumentError(
        "predict labels a classifier's inputs; a language model samples "
        "text with `interlock generate`");
  }
  std::vector<std::string> names;  // of the file's samples
  torch::Tensor inputs;
  if (!o.input.empty()) {
    ASSIGN_OR_RETURN(inputs, TorchGuard("predict", [&] {
                       return ReadInputs(o.input, m.config.data(), m.data.shape,
                                         &names);
                     }));
  }
  const int64_t n = o.input.empty() ? m.data.test->size() : inputs.size(0);
  if (o.first < 0 || o.count < 1 || o.first >= n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--first ", o.first, " --count ", o.count, ": ",
        o.input.empty() ? "the test split" : o.input, " has ", n, " samples"));
  }
  std::vector<int64_t> indices;
  for (int64_t i = o.first; i < std::min(n, o.first + o.count); ++i) {
    indices.push_back(i);
  }
  std::vector<std::string> classes = DataInfoOf(m.config.data()).class_names;
  if (classes.empty() && m.config.model().has_scripted()) {
    const auto& declared = m.config.model().scripted().model().class_names();
    classes.assign(declared.begin(), declared.end());
  }
  return TorchGuard("predict",
                    [&]() -> absl::StatusOr<std::vector<Prediction>> {
                      torch::Tensor x, y;
                      if (o.input.empty()) {
                        std::tie(x, y) = m.data.test->Gather(indices);
                      } else {
                        x = inputs.narrow(0, indices.front(),
                                          static_cast<int64_t>(indices.size()));
                      }
                      const torch::Tensor p =
                          torch::softmax(ExitLogits(m, o.exit_block, x), -1);
                      const auto [prob, label] = p.max(-1);
                      std::vector<Prediction> out;
                      for (size_t i = 0; i < indices.size(); ++i) {
                        const int64_t j = static_cast<int64_t>(i);
                        Prediction r;
                        r.index = indices[i];
                        if (!names.empty()) r.name = names[indices[i]];
                        r.label = label[j].item<int64_t>();
                        if (r.label < static_cast<int64_t>(classes.size())) {
                          r.label_name = classes[r.label];
                        }
                        r.probability = prob[j].item<double>();
                        if (y.defined()) r.target = y[j].item<int64_t>();
                        out.push_back(std::move(r));
                      }
                      return out;
                    });
}

absl::StatusOr<std::string> Generate(const GenerateOptions& o) {
  ASSIGN_OR_RETURN(TrainedModel m, LoadTrainedModel(o.source));
  RETURN_IF_ERROR(CheckExit(m, o.exit_block));
  if (!m.data.shape.is_text) {
    return absl::InvalidArgumentError(
        "generate samples a language model; this run trained a classifier "
        "(use `interlock predict`)");
  }
  const bool ids = !o.prompt_ids.empty();
  if (o.prompt.empty() == !ids) {
    return absl::InvalidArgumentError(
        "generate needs one of --prompt (text) and --prompt-ids (token ids)");
  }
  if (o.tokens < 1 || o.temperature < 0 || o.top_k < 0) {
    return absl::InvalidArgumentError(
        "--tokens must be >= 1, --temperature and --top-k >= 0");
  }
  const int64_t context = m.data.shape.context;
  const int64_t vocab = m.data.shape.classes;
  std::vector<int64_t> tokens;
  if (ids) {
    for (int64_t t : o.prompt_ids) {
      if (t < 0 || t >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--prompt-ids: ", t, " is not a token id of this model (0..",
            vocab - 1, ")"));
      }
    }
    tokens = o.prompt_ids;
  } else if (vocab != 256) {
    // Prompts and output are bytes; a token file's ids have no text here.
    return absl::InvalidArgumentError(absl::StrCat(
        "--prompt is text for a byte-level model (vocabulary 256); this one "
        "has ",
        vocab, " tokens: give --prompt-ids"));
  } else {
    for (char c : o.prompt) tokens.push_back(static_cast<unsigned char>(c));
  }
  const bool whole_windows = m.config.model().has_scripted();
  RETURN_IF_ERROR(TorchGuard("generate", [&]() -> absl::Status {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
    for (int i = 0; i < o.tokens; ++i) {
      // The last `context` tokens; the model sees positions 0..n-1.
      const int64_t n =
          std::min<int64_t>(static_cast<int64_t>(tokens.size()), context);
      std::vector<int64_t> window(tokens.end() - n, tokens.end());
      if (whole_windows) window.resize(context, 0);
      torch::Tensor x = torch::tensor(window, torch::kInt64)
                            .view({1, static_cast<int64_t>(window.size())});
      torch::Tensor logits =
          ExitLogits(m, o.exit_block, x).select(1, n - 1).view({vocab});
      int64_t next = 0;
      if (o.temperature == 0) {
        next = logits.argmax().item<int64_t>();
      } else {
        logits = logits / o.temperature;
        if (o.top_k > 0 && o.top_k < vocab) {
          const auto kth = std::get<0>(logits.topk(o.top_k)).min();
          logits = logits.masked_fill(logits < kth, -INFINITY);
        }
        next = torch::multinomial(torch::softmax(logits, -1), 1,
                                  /*replacement=*/false, gen)
                   .item<int64_t>();
      }
      tokens.push_back(next);
    }
    return absl::OkStatus();
  }));
  if (ids) return absl::StrJoin(tokens, " ");
  std::string text;
  for (int64_t t : tokens) text.push_back(static_cast<char>(t));
  return text;
}

}  // namespace interlock
