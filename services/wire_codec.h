// The wire codec: the one place engine messages (services/messages.h) become
// the protobuf messages of proto/worker.proto and back, and the one place
// that knows how many bytes a link's messages can take (ARCHITECTURE: wire
// codecs).
//
// A run chooses a TensorCodec per direction (RunConfig.wire): activations
// travel down (with block 0's input data), gradients travel up. Everything
// else in a message is plain fields. FP32 writes each tensor's raw values;
// BF16, FP16 and INT8_BLOCKWISE compress fp32 tensors. The in-process
// engine applies the same Transfer at every block boundary, and Transfer is
// bitwise Decode(Encode(t)), so in-process == cluster whatever the codec.
#ifndef INTERLOCK_SERVICES_WIRE_CODEC_H_
#define INTERLOCK_SERVICES_WIRE_CODEC_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/config.pb.h"
#include "proto/worker.pb.h"
#include "services/data.h"
#include "services/messages.h"
#include "services/wire.h"
#include "services/wire_frame.h"

namespace interlock {

// How one direction's tensors travel. A codec may change fp32 tensors only;
// every other dtype (token ids, targets) travels raw and exactly. Encode
// takes a tensor on any device, Decode gives CPU tensors (the receiving
// block moves them to its device), Transfer keeps the device.
//
// Encode expects values below range() in magnitude: the trainer treats
// larger ones and NaN or infinities as non-finite before anything is sent
// (training.nonfinite_policy). Were one to reach INT8_BLOCKWISE anyway, its
// block gets a NaN scale, which every decoder refuses, and Transfer gives
// NaN values there: never an infinite scale, never silently.
class TensorCodec {
 public:
  virtual ~TensorCodec() = default;
  virtual absl::string_view name() const = 0;
  // `t`'s description into `meta`, its encoded values into `bytes`, which
  // reference the tensor's memory where the codec sends it as it is.
  virtual void EncodeFramed(const torch::Tensor& t, interlock::v1::Tensor* meta,
                            TensorBytes* bytes) const = 0;
  // Decodes `meta` with its values in `bytes` (meta's own data and scales
  // are not read), with at least DecodeTensor's checks (dtype, rank and
  // element caps, byte length); errors are INVALID_ARGUMENT naming `what`.
  // `finite` (may be null): true when decoding found every value finite in
  // its own pass over them, false when the caller still has to check.
  virtual absl::StatusOr<torch::Tensor> DecodeFramed(
      const interlock::v1::Tensor& meta, const TensorBytes& bytes,
      const std::string& what, const TensorLimits& limits,
      bool* finite) const = 0;
  // The same through a plain protobuf Tensor (values in data and scales).
  void Encode(const torch::Tensor& t, interlock::v1::Tensor* out) const;
  absl::StatusOr<torch::Tensor> Decode(const interlock::v1::Tensor& t,
                                       const std::string& what,
                                       const TensorLimits& limits) const;
  // What the receiver gets of `t`: Decode(Encode(t)) in value, without the
  // message where the codec allows (FP32: `t` itself).
  virtual torch::Tensor Transfer(torch::Tensor t) const = 0;
  // The most payload bytes Encode writes for `elements` values of `dtype`
  // (the message's other fields are the caller's margin).
  virtual int64_t MaxEncodedBytes(torch::ScalarType dtype,
                                  int64_t elements) const = 0;
  // Magnitudes the codec carries without overflowing: |x| < range().
  virtual float range() const = 0;
};

// FP32: raw little-endian values of the tensor's own dtype.
std::shared_ptr<const TensorCodec> Fp32Codec();
// The codec `codec` names (CODEC_UNSPECIFIED: FP32); `int8_block_size`
// (0: 256) matters to INT8_BLOCKWISE only. INVALID_ARGUMENT for an unknown
// codec or a block size outside 1..kMaxInt8BlockSize.
absl::StatusOr<std::shared_ptr<const TensorCodec>> CodecFor(
    interlock::v1::WireSpec::Codec codec, int int8_block_size);
inline constexpr int kDefaultInt8BlockSize = 256;
inline constexpr int kMaxInt8BlockSize = 1 << 20;

// TensorCodec::range() of `codec` without building it (infinity for FP32
// and unknown values): what the trainer checks outputs and upstream
// gradients against.
float WireRange(interlock::v1::WireSpec::Codec codec);
// "fp32", "bf16", "fp16", "int8" ("?" for an unknown value).
std::string CodecName(interlock::v1::WireSpec::Codec codec);
// The run's codecs in one word: "bf16" when both directions use the same,
// "bf16:int8" (activations:gradients) otherwise, as `compare --wire` takes
// them. The int8 block size is not part of it.
std::string WireName(const interlock::v1::WireSpec& wire);
// Sets `wire`'s codecs from WireName's form ("fp32", "int8", "bf16:int8"),
// keeping its int8 block size; INVALID_ARGUMENT naming what is wrong.
absl::Status ParseWireName(absl::string_view name,
                           interlock::v1::WireSpec* wire);

class WireCodec {
 public:
  // The codecs `config.wire` chooses for its links (FP32 by default).
  static absl::StatusOr<WireCodec> ForRun(
      const interlock::v1::RunConfig& config);
  WireCodec(std::shared_ptr<const TensorCodec> activations,
            std::shared_ptr<const TensorCodec> gradients);

  // Down: training micro-batches and evaluation batches, into the forward
  // or eval of `out` (its header is the caller's). `microbatches` is the
  // run's M, which every ForwardData names. Decoding checks the tensors as
  // wire data; the schedule, shapes and values are the receiver's to check.
  // Errors name `where`.
  void EncodeForward(const ForwardMsg& m, int microbatches,
                     DownFrame* out) const;
  absl::StatusOr<ForwardMsg> DecodeForward(const DownFrame& d,
                                           const std::string& where,
                                           const TensorLimits& limits) const;
  void EncodeEval(const EvalMsg& m, DownFrame* out) const;
  absl::StatusOr<EvalMsg> DecodeEval(const DownFrame& d,
                                     const std::string& where,
                                     const TensorLimits& limits) const;

  // Up: gradients, reports and timings; step completions; evaluations.
  void EncodeUpward(const UpwardMsg& m, UpFrame* out) const;
  absl::StatusOr<UpwardMsg> DecodeUpward(const UpFrame& d,
                                         const TensorLimits& limits = {}) const;
  void EncodeStepDone(const StepDone& d, interlock::v1::StepDone* out) const;
  StepDone DecodeStepDone(const interlock::v1::StepDone& d) const;
  void EncodeEvalResult(const EvalReport& r,
                        interlock::v1::EvalResult* out) const;
  EvalReport DecodeEvalResult(const interlock::v1::EvalResult& r) const;

  // What the next block receives of a message crossing a link: the
  // in-process engine applies these at every block boundary.
  ForwardMsg Transfer(ForwardMsg m) const;
  UpwardMsg Transfer(UpwardMsg m) const;
  torch::Tensor TransferActivation(torch::Tensor t) const;

  // The largest message any link of the run carries: a micro-batch's (or
  // an evaluation batch's) input and targets, or the gradient list of the
  // widest block, plus 1 MiB for the other fields. Channels and the
  // workers' receive limits are set from it.
  absl::StatusOr<int64_t> MaxMessageBytes(
      const interlock::v1::RunConfig& config, const DataShape& shape) const;

  const TensorCodec& activations() const { return *activations_; }
  const TensorCodec& gradients() const { return *gradients_; }

 private:
  // A batch's input (activations) and targets, down: slots 0 and 1.
  void EncodeBatch(const torch::Tensor& input, const torch::Tensor& target,
                   interlock::v1::Tensor* input_out,
                   interlock::v1::Tensor* target_out, DownFrame* out) const;
  absl::Status DecodeBatch(const interlock::v1::Tensor& input,
                           const interlock::v1::Tensor& target,
                           const DownFrame& d, const std::string& where,
                           const TensorLimits& limits, torch::Tensor* input_out,
                           torch::Tensor* target_out, bool* input_finite) const;

  std::shared_ptr<const TensorCodec> activations_;
  std::shared_ptr<const TensorCodec> gradients_;
  // Targets are labels: never compressed.
  std::shared_ptr<const TensorCodec> targets_;
};

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_WIRE_CODEC_H_
