#include "services/wire_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "services/codec_kernels.h"
#include "services/models.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

using v1::WireSpec;
constexpr float kInf = std::numeric_limits<float>::infinity();

// The shape and element count of an fp32 tensor in a compressed encoding,
// with the checks every such codec shares: the run's encoding, shape caps.
absl::Status CheckEncoded(const v1::Tensor& w, v1::Tensor::Encoding expected,
                          const std::string& what, const TensorLimits& limits,
                          std::vector<int64_t>* shape, int64_t* elements) {
  if (w.encoding() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": encoding ", EncodingText(w.encoding()),
                     ", the run's codec is ", EncodingText(expected)));
  }
  return CheckWireShape(w, what, limits, shape, elements);
}

void SetEncodedHeader(const torch::Tensor& t, v1::Tensor::Encoding encoding,
                      v1::Tensor* out) {
  out->Clear();
  out->set_dtype(v1::Tensor::FLOAT32);
  for (int64_t d : t.sizes()) out->add_shape(d);
  out->set_encoding(encoding);
}

// A slot's bytes, none when the frame has no such slot.
const TensorBytes& SlotBytes(const std::vector<TensorBytes>& t, size_t i) {
  static const auto* none = new TensorBytes;
  return i < t.size() ? t[i] : *none;
}

class Fp32TensorCodec final : public TensorCodec {
 public:
  absl::string_view name() const override { return "fp32"; }
  void EncodeFramed(const torch::Tensor& t, v1::Tensor* meta,
                    TensorBytes* bytes) const override {
    EncodeTensor(t, meta, bytes);
  }
  absl::StatusOr<torch::Tensor> DecodeFramed(const v1::Tensor& meta,
                                             const TensorBytes& bytes,
                                             const std::string& what,
                                             const TensorLimits& limits,
                                             bool* finite) const override {
    return DecodeTensor(meta, bytes, what, limits, finite);
  }
  // Lossless: the receiver gets the same values.
  torch::Tensor Transfer(torch::Tensor t) const override { return t; }
  int64_t MaxEncodedBytes(torch::ScalarType dtype,
                          int64_t elements) const override {
    return elements * static_cast<int64_t>(c10::elementSize(dtype));
  }
  float range() const override { return kInf; }
};

// bf16 or fp16: LibTorch's conversion (round to nearest even) both when
// encoding and in Transfer, and the exact widening back, so both give the
// receiver the same bits.
class HalfTensorCodec final : public TensorCodec {
 public:
  HalfTensorCodec(const char* name, torch::ScalarType half,
                  v1::Tensor::Encoding encoding, float range)
      : name_(name), half_(half), encoding_(encoding), range_(range) {}
  absl::string_view name() const override { return name_; }
  void EncodeFramed(const torch::Tensor& t, v1::Tensor* meta,
                    TensorBytes* bytes) const override {
    if (t.scalar_type() != torch::kFloat32) {
      return EncodeTensor(t, meta, bytes);
    }
    const torch::Tensor x = t.detach().cpu().contiguous();
    torch::Tensor h = torch::empty(x.sizes(), torch::dtype(half_));
    // LibTorch's conversion, as in Transfer, value by value.
    const torch::Tensor from = x.view(-1), to = h.view(-1);
    InTwoHalves(x.numel(), 32, x.nbytes(), [&](int64_t begin, int64_t end) {
      to.narrow(0, begin, end - begin)
          .copy_(from.narrow(0, begin, end - begin));
      return true;
    });
    SetEncodedHeader(h, encoding_, meta);
    bytes->data = Payload::OfTensor(h);
    bytes->scales = Payload();
  }
  absl::StatusOr<torch::Tensor> DecodeFramed(const v1::Tensor& w,
                                             const TensorBytes& values,
                                             const std::string& what,
                                             const TensorLimits& limits,
                                             bool* finite) const override {
    if (w.dtype() != v1::Tensor::FLOAT32) {
      return DecodeTensor(w, values, what, limits, finite);
    }
    if (finite != nullptr) *finite = false;
    std::vector<int64_t> shape;
    int64_t elements = 0;
    RETURN_IF_ERROR(
        CheckEncoded(w, encoding_, what, limits, &shape, &elements));
    if (w.block_size() != 0 || values.scales.size() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": a ", name_, " tensor with an int8 block size or scales"));
    }
    const int64_t bytes = elements * 2;
    if (static_cast<int64_t>(values.data.size()) != bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", values.data.size(), " data bytes, expected ", bytes, " (",
          elements, " ", name_, " values of 2 bytes)"));
    }
    // Widening straight from the payload's pieces is the one pass over the
    // values, the finiteness check included.
    return HalfPayloadToFloat(values.data, shape, half_, finite);
  }
  torch::Tensor Transfer(torch::Tensor t) const override {
    if (t.scalar_type() != torch::kFloat32) return t;
    return t.detach().to(half_).to(torch::kFloat32);
  }
  int64_t MaxEncodedBytes(torch::ScalarType dtype,
                          int64_t elements) const override {
    if (dtype == torch::kFloat32) return elements * 2;
    return elements * static_cast<int64_t>(c10::elementSize(dtype));
  }
  float range() const override { return range_; }

 private:
  const char* name_;
  torch::ScalarType half_;
  v1::Tensor::Encoding encoding_;
  float range_;
};

// INT8_BLOCKWISE (services/codec_kernels.h): codes round(x / scale) in
// [-127, 127] with scale = absmax / 127; -128 is refused from a peer.
// No scale of a value below kInt8Range exceeds 2^120, and 127 times any
// scale up to 2^120 is finite: a decoded value is never infinite.
constexpr float kInt8Range = 0x1p126f;
constexpr float kMaxScale = 0x1p120f;

class Int8BlockwiseCodec final : public TensorCodec {
 public:
  explicit Int8BlockwiseCodec(int block_size) : block_(block_size) {}
  absl::string_view name() const override { return "int8"; }
  void EncodeFramed(const torch::Tensor& t, v1::Tensor* meta,
                    TensorBytes* bytes) const override {
    if (t.scalar_type() != torch::kFloat32) {
      return EncodeTensor(t, meta, bytes);
    }
    const torch::Tensor x = t.detach().cpu().contiguous();
    SetEncodedHeader(x, v1::Tensor::INT8_BLOCKWISE, meta);
    meta->set_block_size(block_);
    const int64_t n = x.numel();
    std::string data(n, '\0');
    std::string scales(Blocks(n) * sizeof(float), '\0');
    const float* v = x.data_ptr<float>();
    auto* q = reinterpret_cast<int8_t*>(data.data());
    InTwoHalves(n, block_, x.nbytes(), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i += block_) {
        const float s =
            QuantizeInt8Block(v + i, std::min<int64_t>(block_, end - i), q + i);
        std::memcpy(scales.data() + i / block_ * sizeof(float), &s,
                    sizeof(float));
      }
      return true;
    });
    bytes->data = Payload::OfString(std::move(data));
    bytes->scales = Payload::OfString(std::move(scales));
  }
  absl::StatusOr<torch::Tensor> DecodeFramed(const v1::Tensor& w,
                                             const TensorBytes& values,
                                             const std::string& what,
                                             const TensorLimits& limits,
                                             bool* finite) const override {
    if (w.dtype() != v1::Tensor::FLOAT32) {
      return DecodeTensor(w, values, what, limits, finite);
    }
    if (finite != nullptr) *finite = false;
    std::vector<int64_t> shape;
    int64_t n = 0;
    RETURN_IF_ERROR(
        CheckEncoded(w, v1::Tensor::INT8_BLOCKWISE, what, limits, &shape, &n));
    if (w.block_size() != block_) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": int8 block size ", w.block_size(),
                       ", the run's wire.int8_block_size is ", block_));
    }
    if (static_cast<int64_t>(values.data.size()) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", values.data.size(), " data bytes, expected ",
                       n, " (one int8 per value)"));
    }
    const int64_t blocks = Blocks(n);
    if (static_cast<int64_t>(values.scales.size()) !=
        blocks * static_cast<int64_t>(sizeof(float))) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", values.scales.size(), " scale bytes, expected ",
          blocks * sizeof(float), " (", blocks, " fp32 scales for ", n,
          " values in blocks of ", block_, ")"));
    }
    // Codes and scales in one piece each: gathered only when they arrived
    // in several.
    std::string data_storage, scales_storage;
    const absl::string_view data = values.data.Flat(&data_storage);
    const absl::string_view scales = values.scales.Flat(&scales_storage);
    torch::Tensor t = torch::empty(shape, torch::dtype(torch::kFloat32));
    float* out = t.data_ptr<float>();
    const auto* q = reinterpret_cast<const int8_t*>(data.data());
    // Each half stops at its first bad scale or code; the first half's
    // error is the one reported, as one pass in order would.
    absl::Status half_status[2];
    InTwoHalves(n, block_, data.size(), [&](int64_t begin, int64_t end) {
      absl::Status& status = half_status[begin == 0 ? 0 : 1];
      for (int64_t i = begin; i < end; i += block_) {
        const int64_t b = i / block_;
        float s;
        std::memcpy(&s, scales.data() + b * sizeof(float), sizeof(float));
        // Also refuses NaN: every comparison with it is false.
        if (!(s >= 0.0f && s <= kMaxScale)) {
          status = absl::InvalidArgumentError(absl::StrCat(
              what, ": scale ", b, " is ", s,
              ", expected a finite value in [0, ", kMaxScale, "]"));
          return false;
        }
        const int64_t len = std::min<int64_t>(block_, end - i);
        if (!DequantizeInt8Block(q + i, len, s, out + i)) {
          const int64_t j = std::find(q + i, q + i + len, -128) - q;
          status = absl::InvalidArgumentError(
              absl::StrCat(what, ": value ", j, " is ", static_cast<int>(q[j]),
                           ", outside [-127, 127]"));
          return false;
        }
      }
      return true;
    });
    RETURN_IF_ERROR(half_status[0]);
    RETURN_IF_ERROR(half_status[1]);
    // Valid codes times scales up to kMaxScale: every value is finite.
    if (finite != nullptr) *finite = true;
    return t;
  }
  torch::Tensor Transfer(torch::Tensor t) const override {
    if (t.scalar_type() != torch::kFloat32) return t;
    const torch::Tensor x = t.detach().cpu().contiguous();
    torch::Tensor y = torch::empty_like(x);
    const int64_t n = x.numel();
    const float* v = x.data_ptr<float>();
    float* out = y.data_ptr<float>();
    std::vector<int8_t> q(std::min<int64_t>(block_, n));
    for (int64_t i = 0; i < n; i += block_) {
      const int64_t len = std::min<int64_t>(block_, n - i);
      const float s = QuantizeInt8Block(v + i, len, q.data());
      DequantizeInt8Block(q.data(), len, s, out + i);
    }
    return y.to(t.device());
  }
  int64_t MaxEncodedBytes(torch::ScalarType dtype,
                          int64_t elements) const override {
    if (dtype == torch::kFloat32) {
      return elements + Blocks(elements) * static_cast<int64_t>(sizeof(float));
    }
    return elements * static_cast<int64_t>(c10::elementSize(dtype));
  }
  float range() const override { return kInt8Range; }

 private:
  int64_t Blocks(int64_t n) const { return (n + block_ - 1) / block_; }
  const int block_;
};

// bf16's largest value is (2 - 2^-7) * 2^127; from halfway to 2^128 on,
// rounding to nearest even gives infinity. Likewise fp16's 65504 and 65520.
constexpr float kBf16Range = 0x1.ffp127f;
constexpr float kFp16Range = 65520.0f;

Phase PhaseFromName(const std::string& name) {
  if (name == "head") return Phase::kHead;
  if (name == "backward") return Phase::kBackward;
  if (name == "optimizer") return Phase::kOptimizer;
  if (name == "input_grad") return Phase::kInputGrad;
  if (name == "param_pass") return Phase::kParamPass;
  if (name == "shared_pass") return Phase::kSharedPass;
  if (name == "input_pass") return Phase::kInputPass;
  return Phase::kForward;
}

int64_t Elements(int64_t batch, const std::vector<int64_t>& dims) {
  int64_t n = batch;
  for (int64_t d : dims) n *= d;
  return n;
}

}  // namespace

void TensorCodec::Encode(const torch::Tensor& t, v1::Tensor* out) const {
  TensorBytes bytes;
  EncodeFramed(t, out, &bytes);
  AttachBytes(bytes, out);
}

absl::StatusOr<torch::Tensor> TensorCodec::Decode(
    const v1::Tensor& t, const std::string& what,
    const TensorLimits& limits) const {
  return DecodeFramed(t, BorrowBytes(t), what, limits, nullptr);
}

std::shared_ptr<const TensorCodec> Fp32Codec() {
  static const auto* codec = new std::shared_ptr<const TensorCodec>(
      std::make_shared<Fp32TensorCodec>());
  return *codec;
}

absl::StatusOr<std::shared_ptr<const TensorCodec>> CodecFor(
    WireSpec::Codec codec, int int8_block_size) {
  switch (codec) {
    case WireSpec::CODEC_UNSPECIFIED:
    case WireSpec::FP32:
      return Fp32Codec();
    case WireSpec::BF16:
      return std::make_shared<HalfTensorCodec>("bf16", torch::kBFloat16,
                                               v1::Tensor::BF16, kBf16Range);
    case WireSpec::FP16:
      return std::make_shared<HalfTensorCodec>("fp16", torch::kHalf,
                                               v1::Tensor::FP16, kFp16Range);
    case WireSpec::INT8_BLOCKWISE: {
      const int b =
          int8_block_size == 0 ? kDefaultInt8BlockSize : int8_block_size;
      if (b < 1 || b > kMaxInt8BlockSize) {
        return absl::InvalidArgumentError(absl::StrCat(
            "wire.int8_block_size: ", int8_block_size, " is outside 1..",
            kMaxInt8BlockSize, " (0: ", kDefaultInt8BlockSize, ")"));
      }
      return std::make_shared<Int8BlockwiseCodec>(b);
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown codec ", static_cast<int>(codec)));
  }
}

float WireRange(WireSpec::Codec codec) {
  switch (codec) {
    case WireSpec::BF16:
      return kBf16Range;
    case WireSpec::FP16:
      return kFp16Range;
    case WireSpec::INT8_BLOCKWISE:
      return kInt8Range;
    default:
      return kInf;
  }
}

std::string CodecName(WireSpec::Codec codec) {
  switch (codec) {
    case WireSpec::CODEC_UNSPECIFIED:
    case WireSpec::FP32:
      return "fp32";
    case WireSpec::BF16:
      return "bf16";
    case WireSpec::FP16:
      return "fp16";
    case WireSpec::INT8_BLOCKWISE:
      return "int8";
    default:
      return "?";
  }
}

std::string WireName(const WireSpec& wire) {
  const std::string a = CodecName(wire.activations());
  const std::string g = CodecName(wire.gradients());
  return a == g ? a : absl::StrCat(a, ":", g);
}

absl::Status ParseWireName(absl::string_view name, WireSpec* wire) {
  auto one = [&](absl::string_view word, WireSpec::Codec* out) -> absl::Status {
    for (WireSpec::Codec c : {WireSpec::FP32, WireSpec::BF16, WireSpec::FP16,
                              WireSpec::INT8_BLOCKWISE}) {
      if (word == CodecName(c)) {
        *out = c;
        return absl::OkStatus();
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("wire codec \"", word,
                     "\": expected fp32, bf16, fp16 or int8, or "
                     "ACTIVATIONS:GRADIENTS such as bf16:int8"));
  };
  const size_t colon = name.find(':');
  WireSpec::Codec a = WireSpec::FP32, g = WireSpec::FP32;
  RETURN_IF_ERROR(one(name.substr(0, colon), &a));
  if (colon == absl::string_view::npos) {
    g = a;
  } else {
    RETURN_IF_ERROR(one(name.substr(colon + 1), &g));
  }
  wire->set_activations(a);
  wire->set_gradients(g);
  return absl::OkStatus();
}

absl::StatusOr<WireCodec> WireCodec::ForRun(const v1::RunConfig& config) {
  const WireSpec& w = config.wire();
  ASSIGN_OR_RETURN(auto activations,
                   CodecFor(w.activations(), w.int8_block_size()));
  ASSIGN_OR_RETURN(auto gradients,
                   CodecFor(w.gradients(), w.int8_block_size()));
  return WireCodec(std::move(activations), std::move(gradients));
}

WireCodec::WireCodec(std::shared_ptr<const TensorCodec> activations,
                     std::shared_ptr<const TensorCodec> gradients)
    : activations_(std::move(activations)),
      gradients_(std::move(gradients)),
      targets_(Fp32Codec()) {}

void WireCodec::EncodeForward(const ForwardMsg& m, int microbatches,
                              DownFrame* out) const {
  v1::ForwardData* f = out->proto.mutable_forward();
  f->set_step(m.step);
  f->set_microbatch(m.mb);
  f->set_microbatches(microbatches);
  f->set_learning_rate(m.lr);
  f->set_nonfinite(m.nonfinite);
  f->mutable_routes()->Add(m.routes.begin(), m.routes.end());
  EncodeBatch(m.input, m.target, f->mutable_input(), f->mutable_target(), out);
}

absl::StatusOr<ForwardMsg> WireCodec::DecodeForward(
    const DownFrame& frame, const std::string& where,
    const TensorLimits& limits) const {
  const v1::ForwardData& d = frame.proto.forward();
  ForwardMsg m;
  m.step = d.step();
  m.mb = d.microbatch();
  m.lr = d.learning_rate();
  m.nonfinite = d.nonfinite();
  m.routes.assign(d.routes().begin(), d.routes().end());
  RETURN_IF_ERROR(DecodeBatch(d.input(), d.target(), frame, where, limits,
                              &m.input, &m.target, &m.input_finite));
  return m;
}

void WireCodec::EncodeEval(const EvalMsg& m, DownFrame* out) const {
  v1::EvalData* e = out->proto.mutable_eval();
  e->set_batch(m.batch);
  e->set_nonfinite(m.nonfinite);
  EncodeBatch(m.input, m.target, e->mutable_input(), e->mutable_target(), out);
}

absl::StatusOr<EvalMsg> WireCodec::DecodeEval(
    const DownFrame& frame, const std::string& where,
    const TensorLimits& limits) const {
  const v1::EvalData& d = frame.proto.eval();
  EvalMsg m;
  m.batch = d.batch();
  m.nonfinite = d.nonfinite();
  RETURN_IF_ERROR(DecodeBatch(d.input(), d.target(), frame, where, limits,
                              &m.input, &m.target, &m.input_finite));
  return m;
}

void WireCodec::EncodeBatch(const torch::Tensor& input,
                            const torch::Tensor& target, v1::Tensor* input_out,
                            v1::Tensor* target_out, DownFrame* out) const {
  out->tensors.resize(2);
  activations_->EncodeFramed(input, input_out, &out->tensors[0]);
  targets_->EncodeFramed(target, target_out, &out->tensors[1]);
}

absl::Status WireCodec::DecodeBatch(
    const v1::Tensor& input, const v1::Tensor& target, const DownFrame& frame,
    const std::string& where, const TensorLimits& limits,
    torch::Tensor* input_out, torch::Tensor* target_out,
    bool* input_finite) const {
  ASSIGN_OR_RETURN(*input_out, activations_->DecodeFramed(
                                   input, SlotBytes(frame.tensors, 0),
                                   where + " input", limits, input_finite));
  ASSIGN_OR_RETURN(*target_out,
                   targets_->DecodeFramed(target, SlotBytes(frame.tensors, 1),
                                          where + " target", limits, nullptr));
  return absl::OkStatus();
}

void WireCodec::EncodeUpward(const UpwardMsg& m, UpFrame* frame) const {
  v1::UpwardData* out = frame->proto.mutable_upward();
  out->set_step(m.step);
  out->set_microbatch(m.mb);
  out->set_first_entry(m.first_entry);
  out->set_partial(!m.final);
  for (const auto& g : m.grads) {
    frame->tensors.emplace_back();
    gradients_->EncodeFramed(g, out->add_gradients(), &frame->tensors.back());
  }
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
    const UpFrame& frame, const TensorLimits& limits) const {
  const v1::UpwardData& d = frame.proto.upward();
  UpwardMsg m;
  m.step = d.step();
  m.mb = d.microbatch();
  m.first_entry = d.first_entry();
  m.final = !d.partial();
  m.grads_finite = true;
  for (int i = 0; i < d.gradients_size(); ++i) {
    bool finite = false;
    ASSIGN_OR_RETURN(torch::Tensor g,
                     gradients_->DecodeFramed(
                         d.gradients(i), SlotBytes(frame.tensors, i),
                         absl::StrCat("gradients[", i, "]"), limits, &finite));
    m.grads_finite = m.grads_finite && finite;
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
