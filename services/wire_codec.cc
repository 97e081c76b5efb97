#include "services/wire_codec.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/models.h"
#include "services/status_macros.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

class Fp32TensorCodec final : public TensorCodec {
 public:
  absl::string_view name() const override { return "fp32"; }
  void Encode(const torch::Tensor& t, v1::Tensor* out) const override {
    EncodeTensor(t, out);
  }
  absl::StatusOr<torch::Tensor> Decode(
      const v1::Tensor& t, const std::string& what,
      const TensorLimits& limits) const override {
    return DecodeTensor(t, what, limits);
  }
  // Lossless: the receiver gets the same values.
  torch::Tensor Transfer(torch::Tensor t) const override { return t; }
  int64_t MaxEncodedBytes(torch::ScalarType dtype,
                          int64_t elements) const override {
    return elements * static_cast<int64_t>(c10::elementSize(dtype));
  }
};

Phase PhaseFromName(const std::string& name) {
  if (name == "head") return Phase::kHead;
  if (name == "backward") return Phase::kBackward;
  if (name == "optimizer") return Phase::kOptimizer;
  if (name == "input_grad") return Phase::kInputGrad;
  return Phase::kForward;
}

int64_t Elements(int64_t batch, const std::vector<int64_t>& dims) {
  int64_t n = batch;
  for (int64_t d : dims) n *= d;
  return n;
}

}  // namespace

std::shared_ptr<const TensorCodec> Fp32Codec() {
  static const auto* codec = new std::shared_ptr<const TensorCodec>(
      std::make_shared<Fp32TensorCodec>());
  return *codec;
}

absl::StatusOr<WireCodec> WireCodec::ForRun(const v1::RunConfig&) {
  return WireCodec(Fp32Codec(), Fp32Codec());
}

WireCodec::WireCodec(std::shared_ptr<const TensorCodec> activations,
                     std::shared_ptr<const TensorCodec> gradients)
    : activations_(std::move(activations)),
      gradients_(std::move(gradients)),
      targets_(Fp32Codec()) {}

void WireCodec::EncodeForward(const ForwardMsg& m, int microbatches,
                              v1::ForwardData* out) const {
  out->set_step(m.step);
  out->set_microbatch(m.mb);
  out->set_microbatches(microbatches);
  out->set_learning_rate(m.lr);
  out->set_nonfinite(m.nonfinite);
  out->mutable_routes()->Add(m.routes.begin(), m.routes.end());
  EncodeBatch(m.input, m.target, out->mutable_input(), out->mutable_target());
}

absl::StatusOr<ForwardMsg> WireCodec::DecodeForward(
    const v1::ForwardData& d, const std::string& where,
    const TensorLimits& limits) const {
  ForwardMsg m;
  m.step = d.step();
  m.mb = d.microbatch();
  m.lr = d.learning_rate();
  m.nonfinite = d.nonfinite();
  m.routes.assign(d.routes().begin(), d.routes().end());
  RETURN_IF_ERROR(
      DecodeBatch(d.input(), d.target(), where, limits, &m.input, &m.target));
  return m;
}

void WireCodec::EncodeEval(const EvalMsg& m, v1::EvalData* out) const {
  out->set_batch(m.batch);
  out->set_nonfinite(m.nonfinite);
  EncodeBatch(m.input, m.target, out->mutable_input(), out->mutable_target());
}

absl::StatusOr<EvalMsg> WireCodec::DecodeEval(
    const v1::EvalData& d, const std::string& where,
    const TensorLimits& limits) const {
  EvalMsg m;
  m.batch = d.batch();
  m.nonfinite = d.nonfinite();
  RETURN_IF_ERROR(
      DecodeBatch(d.input(), d.target(), where, limits, &m.input, &m.target));
  return m;
}

void WireCodec::EncodeBatch(const torch::Tensor& input,
                            const torch::Tensor& target, v1::Tensor* input_out,
                            v1::Tensor* target_out) const {
  activations_->Encode(input, input_out);
  targets_->Encode(target, target_out);
}

absl::Status WireCodec::DecodeBatch(const v1::Tensor& input,
                                    const v1::Tensor& target,
                                    const std::string& where,
                                    const TensorLimits& limits,
                                    torch::Tensor* input_out,
                                    torch::Tensor* target_out) const {
  ASSIGN_OR_RETURN(*input_out,
                   activations_->Decode(input, where + " input", limits));
  ASSIGN_OR_RETURN(*target_out,
                   targets_->Decode(target, where + " target", limits));
  return absl::OkStatus();
}

void WireCodec::EncodeUpward(const UpwardMsg& m, v1::UpwardData* out) const {
  out->set_step(m.step);
  out->set_microbatch(m.mb);
  out->set_first_entry(m.first_entry);
  out->set_partial(!m.final);
  for (const auto& g : m.grads) gradients_->Encode(g, out->add_gradients());
  for (bool b : m.nonfinite) out->add_nonfinite(b);
  for (const auto& r : m.reports) {
    auto* p = out->add_reports();
    p->set_block(r.block);
    p->set_loss(r.loss);
    p->set_correct(r.correct);
    p->set_count(r.count);
  }
  for (const auto& t : m.timings) {
    auto* p = out->add_timings();
    p->set_block(t.block);
    p->set_phase(PhaseName(t.phase));
    p->set_seconds(t.seconds);
  }
}

absl::StatusOr<UpwardMsg> WireCodec::DecodeUpward(
    const v1::UpwardData& d, const TensorLimits& limits) const {
  UpwardMsg m;
  m.step = d.step();
  m.mb = d.microbatch();
  m.first_entry = d.first_entry();
  m.final = !d.partial();
  for (int i = 0; i < d.gradients_size(); ++i) {
    ASSIGN_OR_RETURN(
        torch::Tensor g,
        gradients_->Decode(d.gradients(i), absl::StrCat("gradients[", i, "]"),
                           limits));
    m.grads.push_back(std::move(g));
  }
  if (d.nonfinite_size() != 0 && d.nonfinite_size() != d.gradients_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(d.nonfinite_size(), " non-finite marks for ",
                     d.gradients_size(), " gradients"));
  }
  m.nonfinite.assign(d.nonfinite().begin(), d.nonfinite().end());
  for (const auto& r : d.reports()) {
    m.reports.push_back({r.block(), r.loss(), r.correct(), r.count()});
  }
  for (const auto& t : d.timings()) {
    m.timings.push_back({t.block(), PhaseFromName(t.phase()), t.seconds()});
  }
  return m;
}

void WireCodec::EncodeStepDone(const StepDone& d, v1::StepDone* out) const {
  out->set_block(d.block);
  out->set_step(d.step);
  out->set_optimizer_seconds(d.timing.seconds);
  out->set_skipped(d.skipped);
  out->set_microbatches(d.microbatches);
}

StepDone WireCodec::DecodeStepDone(const v1::StepDone& d) const {
  StepDone s;
  s.block = d.block();
  s.step = d.step();
  s.timing = {s.block, Phase::kOptimizer, d.optimizer_seconds()};
  s.skipped = d.skipped();
  s.microbatches = d.microbatches();
  return s;
}

void WireCodec::EncodeEvalResult(const EvalReport& r,
                                 v1::EvalResult* out) const {
  out->set_batch(r.batch);
  out->set_block(r.block);
  out->set_has_head(r.has_head);
  if (r.has_head) {
    out->set_loss_sum(r.loss_sum);
    out->set_correct(r.correct);
  }
  out->set_count(r.count);
}

EvalReport WireCodec::DecodeEvalResult(const v1::EvalResult& r) const {
  return {r.batch(),    r.block(),   r.has_head(),
          r.loss_sum(), r.correct(), r.count()};
}

ForwardMsg WireCodec::Transfer(ForwardMsg m) const {
  m.input = activations_->Transfer(std::move(m.input));
  return m;
}

UpwardMsg WireCodec::Transfer(UpwardMsg m) const {
  for (auto& g : m.grads) g = gradients_->Transfer(std::move(g));
  return m;
}

torch::Tensor WireCodec::TransferActivation(torch::Tensor t) const {
  return activations_->Transfer(std::move(t));
}

absl::StatusOr<int64_t> WireCodec::MaxMessageBytes(
    const v1::RunConfig& config, const DataShape& shape) const {
  ASSIGN_OR_RETURN(const int k_blocks, NumBlocks(config.model()));
  ASSIGN_OR_RETURN(auto outs, BlockOutputShapes(config.model(), shape));
  const auto& t = config.training();
  const int64_t b =
      std::max<int64_t>(t.batch_size() / std::max(1, t.microbatches()),
                        std::max(t.eval_batch_size(), t.batch_size()));
  const int64_t targets =
      targets_->MaxEncodedBytes(torch::kInt64, Elements(b, TargetShape(shape)));
  int64_t worst = 0;
  for (int k = 0; k < k_blocks; ++k) {
    const bool tokens = k == 0 && shape.is_text;
    const int64_t in = activations_->MaxEncodedBytes(
        tokens ? torch::kInt64 : torch::kFloat32,
        Elements(b, k == 0 ? SampleShape(shape) : outs[k - 1]));
    // Up to one gradient of the block's output size per list entry.
    const int64_t out =
        gradients_->MaxEncodedBytes(torch::kFloat32, Elements(b, outs[k]));
    worst = std::max(worst, in + targets);
    worst = std::max(worst, out * k_blocks);
  }
  return worst + (1 << 20);
}

}  // namespace interlock
