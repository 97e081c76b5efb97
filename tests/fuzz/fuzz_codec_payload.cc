// libFuzzer target: the compressed wire codecs' payload decoders (BF16,
// FP16, INT8_BLOCKWISE), as a worker of a run with that codec runs them on
// every tensor and gradient list it receives. The first byte picks the
// codec and int8 block size, the rest is parsed as a Tensor and as an
// UpwardData, and read as a worker's stream reads them (services/
// wire_frame.h): the Tensor as the input of a forward, the UpwardData as
// an UpMessage's, each frame arriving in pieces, so that the values reach
// the decoder split as gRPC slices split them. Whatever decodes must be an fp32
// tensor of the declared shape (finite for int8, whose scales are checked),
// re-encode to exactly MaxEncodedBytes, and give bitwise the same in Transfer
// as through a message: the in-process == cluster contract.
#include <google/protobuf/stubs/logging.h>

#include <cstring>
#include <memory>
#include <vector>

#include "proto/worker.pb.h"
#include "services/wire.h"
#include "services/wire_codec.h"
#include "services/wire_frame.h"
#include "tests/fuzz/received.h"

namespace {

namespace v1 = interlock::v1;

struct Choice {
  v1::WireSpec::Codec codec;
  int block_size;
};
constexpr Choice kChoices[] = {{v1::WireSpec::BF16, 0},
                               {v1::WireSpec::FP16, 0},
                               {v1::WireSpec::INT8_BLOCKWISE, 256},
                               {v1::WireSpec::INT8_BLOCKWISE, 1},
                               {v1::WireSpec::INT8_BLOCKWISE, 7}};
constexpr size_t kNumChoices = sizeof(kChoices) / sizeof(kChoices[0]);

const std::vector<std::shared_ptr<const interlock::TensorCodec>>& Codecs() {
  static const auto* codecs = [] {
    auto* out = new std::vector<std::shared_ptr<const interlock::TensorCodec>>;
    for (const Choice& c : kChoices) {
      out->push_back(*interlock::CodecFor(c.codec, c.block_size));
    }
    return out;
  }();
  return *codecs;
}

bool Bitwise(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         (a.nbytes() == 0 ||  // data_ptr() may be null then
          std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0);
}

// The checks on one decoded tensor `t` of wire tensor `w`.
void Check(const interlock::TensorCodec& codec, v1::WireSpec::Codec kind,
           const v1::Tensor& w, const torch::Tensor& t) {
  if (t.dim() != w.shape_size()) __builtin_trap();
  for (int i = 0; i < w.shape_size(); ++i) {
    if (t.size(i) != w.shape(i)) __builtin_trap();
  }
  if (w.dtype() != v1::Tensor::FLOAT32) return;  // raw: fuzz_tensor_decoder
  if (t.scalar_type() != torch::kFloat32 || !t.is_contiguous()) {
    __builtin_trap();
  }
  if (kind == v1::WireSpec::INT8_BLOCKWISE &&
      !torch::isfinite(t).all().item<bool>()) {
    __builtin_trap();
  }
  // Values the sender may send (what the trainer lets through) take the
  // same path in process as over the wire, and the bytes are the bound.
  if (!torch::isfinite(t).all().item<bool>() ||
      !(t.abs() < codec.range()).all().item<bool>()) {
    return;
  }
  v1::Tensor again;
  codec.Encode(t, &again);
  if (static_cast<int64_t>(again.data().size() + again.scales().size()) !=
      codec.MaxEncodedBytes(torch::kFloat32, t.numel())) {
    __builtin_trap();
  }
  auto back = codec.Decode(again, "again", {});
  if (!back.ok() || !Bitwise(*back, codec.Transfer(t))) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Inputs that fail to parse are expected; their log lines are noise.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t pick = data[0] % kNumChoices;
  const interlock::TensorCodec& codec = *Codecs()[pick];
  const v1::WireSpec::Codec kind = kChoices[pick].codec;
  ++data;
  --size;
  // Small enough that a fuzzer's shapes stay cheap; the caps themselves are
  // fuzz_tensor_decoder's.
  interlock::TensorLimits limits;
  limits.max_elements = 1 << 20;
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  const size_t piece = 1 + size % 29;
  {
    v1::Tensor w;
    if (w.ParseFromArray(data, static_cast<int>(size))) {
      auto t = codec.Decode(w, "fuzz", limits);
      if (t.ok()) Check(codec, kind, w, *t);
    }
    auto frame = interlock::ParseDownFrame(interlock::fuzz::Received(
        interlock::fuzz::AsField(2, interlock::fuzz::AsField(5, bytes)),
        piece));
    if (frame.ok()) {
      const v1::Tensor& meta = frame->proto.forward().input();
      bool finite = false;
      auto t =
          codec.DecodeFramed(meta, frame->tensors[0], "fuzz", limits, &finite);
      if (t.ok()) Check(codec, kind, meta, *t);
      // The decoder's own finiteness pass never vouches for a NaN or Inf.
      if (t.ok() && finite && !torch::isfinite(*t).all().item<bool>()) {
        __builtin_trap();
      }
    }
  }
  {
    auto frame = interlock::ParseUpFrame(
        interlock::fuzz::Received(interlock::fuzz::AsField(1, bytes), piece));
    if (frame.ok()) {
      const v1::UpwardData& up = frame->proto.upward();
      const interlock::WireCodec wire(interlock::Fp32Codec(), Codecs()[pick]);
      auto m = wire.DecodeUpward(*frame, limits);
      if (m.ok()) {
        if (m->grads.size() != static_cast<size_t>(up.gradients_size())) {
          __builtin_trap();
        }
        for (size_t i = 0; i < m->grads.size(); ++i) {
          Check(codec, kind, up.gradients(static_cast<int>(i)), m->grads[i]);
          if (m->grads_finite &&
              !torch::isfinite(m->grads[i]).all().item<bool>()) {
            __builtin_trap();
          }
        }
        interlock::UpFrame again;
        wire.EncodeUpward(*m, &again);
      }
    }
  }
  return 0;
}
