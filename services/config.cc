#include "services/config.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "plan/status_macros.h"
#include "services/models.h"
#include "services/optim.h"
#include "services/sha256.h"
#include "services/wire_codec.h"

namespace interlock {
namespace {

using interlock::v1::RunConfig;
using interlock::v1::TrainingSpec;

class Collector : public google::protobuf::io::ErrorCollector {
 public:
  explicit Collector(std::string source) : source_(std::move(source)) {}
  void AddError(int line, int column, const std::string& message) override {
    errors_.push_back(
        absl::StrCat(source_, ":", line + 1, ":", column + 1, ": ", message));
  }
  void AddWarning(int line, int column, const std::string& message) override {}
  std::string Joined() const { return absl::StrJoin(errors_, "; "); }

 private:
  std::string source_;
  std::vector<std::string> errors_;
};

}  // namespace

absl::StatusOr<RunConfig> ParseRunConfig(const std::string& text,
                                         const std::string& source_name) {
  RunConfig config;
  google::protobuf::TextFormat::Parser parser;
  Collector collector(source_name);
  parser.RecordErrorsTo(&collector);
  if (!parser.ParseFromString(text, &config)) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid config: ", collector.Joined()));
  }
  return config;
}

absl::StatusOr<RunConfig> LoadRunConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("config file not found: ", path));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseRunConfig(ss.str(), path);
}

void ApplyDefaults(RunConfig& c) {
  auto* t = c.mutable_training();
  if (t->mode() == TrainingSpec::MODE_UNSPECIFIED) {
    t->set_mode(TrainingSpec::INTERLOCK);
  }
  if (t->n() == 0) t->set_n(2);
  if (t->rule() == TrainingSpec::RULE_UNSPECIFIED) {
    t->set_rule(TrainingSpec::FURTHEST);
  }
  if (t->batch_size() == 0) t->set_batch_size(64);
  if (t->microbatches() == 0) t->set_microbatches(1);
  if (t->steps() == 0 && t->epochs() == 0) t->set_epochs(1);
  if (t->eval_batch_size() == 0) t->set_eval_batch_size(256);
  if (t->threads_per_block() == 0) t->set_threads_per_block(1);
  if (c.optimizer().kind() == interlock::v1::OptimizerSpec::KIND_UNSPECIFIED) {
    c.mutable_optimizer()->set_kind(interlock::v1::OptimizerSpec::SGD);
  }
  auto* s = c.mutable_schedule();
  if (s->kind() == interlock::v1::ScheduleSpec::KIND_UNSPECIFIED) {
    s->set_kind(interlock::v1::ScheduleSpec::CONSTANT);
  }
  if (s->lr() == 0) s->set_lr(0.1f);
  // The codecs in one form, so configs compare equal (a checkpoint's and a
  // resume's) exactly when their codecs are: FP32 unset, the int8 block
  // size only where int8 is used, and no wire at all for FP32 both ways,
  // as in configs written before there were codecs.
  using interlock::v1::WireSpec;
  auto* w = c.mutable_wire();
  if (w->activations() == WireSpec::FP32) {
    w->set_activations(WireSpec::CODEC_UNSPECIFIED);
  }
  if (w->gradients() == WireSpec::FP32) {
    w->set_gradients(WireSpec::CODEC_UNSPECIFIED);
  }
  if (w->activations() != WireSpec::INT8_BLOCKWISE &&
      w->gradients() != WireSpec::INT8_BLOCKWISE) {
    w->set_int8_block_size(0);
  } else if (w->int8_block_size() == 0) {
    w->set_int8_block_size(kDefaultInt8BlockSize);
  }
  if (w->activations() == WireSpec::CODEC_UNSPECIFIED &&
      w->gradients() == WireSpec::CODEC_UNSPECIFIED) {
    c.clear_wire();
  }
}

std::string ModelFingerprint(const RunConfig& config) {
  RunConfig c = config;
  ApplyDefaults(c);
  std::string bytes;
  google::protobuf::io::StringOutputStream raw(&bytes);
  google::protobuf::io::CodedOutputStream out(&raw);
  // Deterministic: map fields (none today) would otherwise be unordered.
  out.SetSerializationDeterministic(true);
  c.model().SerializeToCodedStream(&out);
  out.Trim();
  return Sha256Hex(bytes.data(), bytes.size());
}

absl::Status CheckLearningRate(double lr, const std::string& what) {
  if (!std::isfinite(lr) || lr < 0 || lr > kMaxLearningRate) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": learning rate ", lr,
                     " is not a finite number in [0, ", kMaxLearningRate, "]"));
  }
  return absl::OkStatus();
}

namespace {

// Every rate the schedule can produce must be one a block accepts: checked
// here, before any step, rather than failing in LibTorch mid-run.
absl::Status ValidateSchedule(const interlock::v1::ScheduleSpec& s) {
  using interlock::v1::ScheduleSpec;
  RETURN_IF_ERROR(CheckLearningRate(s.lr(), "schedule.lr"));
  if (!std::isfinite(s.gamma()) || s.gamma() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("schedule.gamma: ", s.gamma(),
                     " is not a finite number > 0 (0: the default 0.1)"));
  }
  if (!std::isfinite(s.min_lr())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule.min_lr: ", s.min_lr(), " is not a finite number"));
  }
  if (s.warmup_steps() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule.warmup_steps: ", s.warmup_steps(), " must not be negative"));
  }
  switch (s.kind()) {
    case ScheduleSpec::MULTISTEP: {
      // The rate changes only at milestones: the rate from each one on.
      std::vector<int64_t> milestones(s.milestones().begin(),
                                      s.milestones().end());
      std::sort(milestones.begin(), milestones.end());
      for (size_t j = 0; j < milestones.size(); ++j) {
        RETURN_IF_ERROR(CheckLearningRate(
            LearningRateAt(s, milestones[j], /*total_steps=*/0),
            absl::StrCat("schedule.gamma: ", s.gamma(),
                         " makes the rate from step ", milestones[j],
                         " (milestone ", j + 1, ")")));
      }
      break;
    }
    case ScheduleSpec::COSINE:
      // Warm-up climbs to lr, then the cosine goes from lr to min_lr.
      RETURN_IF_ERROR(CheckLearningRate(s.min_lr(), "schedule.min_lr"));
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateRunConfig(const RunConfig& c) {
  const auto& t = c.training();
  ASSIGN_OR_RETURN(int k, NumBlocks(c.model()));
  if (k < 1) {
    return absl::InvalidArgumentError("model: needs at least one block");
  }
  if (t.mode() == TrainingSpec::INTERLOCK && (t.n() < 1 || t.n() > k)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "training.n: ", t.n(), " is outside 1..K (K = ", k, " blocks)"));
  }
  if (t.batch_size() <= 0) {
    return absl::InvalidArgumentError("training.batch_size: must be > 0");
  }
  if (t.microbatches() <= 0 || t.batch_size() % t.microbatches() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "training.microbatches: ", t.microbatches(),
        " must be > 0 and divide training.batch_size ", t.batch_size()));
  }
  if (t.steps() < 0 || t.epochs() < 0) {
    return absl::InvalidArgumentError(
        "training.steps / training.epochs: must not be negative");
  }
  if (t.threads_per_block() < 0 || t.threads_per_block() > 256) {
    return absl::InvalidArgumentError(
        "training.threads_per_block: must be in 1..256");
  }
  for (float v : c.data().inline_inputs()) {
    if (!std::isfinite(v)) {
      return absl::InvalidArgumentError(
          "data.inline_inputs: NaN and infinite values are not data");
    }
  }
  RETURN_IF_ERROR(ValidateSchedule(c.schedule()));
  for (const auto& [field, codec] :
       {std::make_pair("wire.activations", c.wire().activations()),
        std::make_pair("wire.gradients", c.wire().gradients())}) {
    auto built = CodecFor(codec, c.wire().int8_block_size());
    if (!built.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", built.status().message()));
    }
  }
  if (!c.model().has_scale()) {
    RETURN_IF_ERROR(CheckModelData(c.model(), c.data().kind()));
  }
  using interlock::v1::DataSpec;
  const DataSpec& data = c.data();
  if (data.kind() == DataSpec::NPY || data.kind() == DataSpec::TOKEN_FILE ||
      data.kind() == DataSpec::IMAGE_FOLDER) {
    if (data.path().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data.path: ", DataSpec::Kind_Name(data.kind()),
          " data needs the path of its ",
          data.kind() == DataSpec::TOKEN_FILE ? "file" : "folder"));
    }
  }
  if (data.kind() == DataSpec::TOKEN_FILE && data.vocab_size() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.vocab_size: ", data.vocab_size(),
                     "; TOKEN_FILE data needs the number of token ids"));
  }
  if (data.kind() == DataSpec::IMAGE_FOLDER) {
    const auto& sh = data.synthetic_shape();
    if (sh.size() != 3 || (sh[0] != 1 && sh[0] != 3) || sh[1] < 1 ||
        sh[2] < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data.synthetic_shape: [", absl::StrJoin(sh, ","),
          "]; IMAGE_FOLDER data needs [C, H, W] with C 1 (grey) or 3 (RGB)"));
    }
  }
  // The shape and classes of NPY and IMAGE_FOLDER data are in its files,
  // which a worker does not have: the model is checked against them when
  // the coordinator builds it on the loaded data, still before training.
  if (data.kind() == DataSpec::NPY || data.kind() == DataSpec::IMAGE_FOLDER) {
    return absl::OkStatus();
  }
  // Partition and head strings are checked by building the model on a
  // stand-in shape of the configured data kind (cheap for our sizes).
  DataShape shape;
  switch (c.data().kind()) {
    case DataSpec::TEXT:
    case DataSpec::SYNTHETIC_TEXT:
    case DataSpec::TOKEN_FILE:
      shape.is_text = true;
      shape.classes =
          c.data().kind() == DataSpec::TOKEN_FILE ? c.data().vocab_size() : 256;
      shape.context = TextContext(c.model());
      break;
    case DataSpec::CIFAR10:
    case DataSpec::CIFAR100:
      shape.channels = 3;
      shape.height = shape.width = 32;
      shape.classes = c.data().kind() == DataSpec::CIFAR10 ? 10 : 100;
      break;
    case DataSpec::SYNTHETIC_IMAGES:
    case DataSpec::SYNTHETIC_VECTORS:
    case DataSpec::INLINE: {
      const auto& sh = c.data().synthetic_shape();
      shape.is_vector = sh.size() <= 1;
      shape.channels = sh.size() > 0 ? sh[0] : 3;
      shape.height = sh.size() > 1 ? sh[1] : 1;
      shape.width = sh.size() > 2 ? sh[2] : 1;
      if (c.data().kind() == DataSpec::SYNTHETIC_IMAGES && sh.empty()) {
        shape.is_vector = false;
        shape.height = shape.width = 32;
      }
      shape.classes =
          c.data().synthetic_classes() > 0 ? c.data().synthetic_classes() : 10;
      break;
    }
    default:
      shape.channels = 1;
      shape.height = shape.width = 28;
      shape.classes = 10;
  }
  if (!c.model().has_scale()) {
    // "auto" is cut later, from measured costs; any cut into K blocks checks
    // that K fits the model and that the head fits every cut.
    interlock::v1::ModelSpec model = c.model();
    if (model.partition() == kAutoPartition) model.clear_partition();
    auto built = BuildModel(
        model, shape, t.mode() != TrainingSpec::E2E && k > 1, 0, kCheckOnly);
    if (!built.ok()) return built.status();
  }
  return absl::OkStatus();
}

}  // namespace interlock
