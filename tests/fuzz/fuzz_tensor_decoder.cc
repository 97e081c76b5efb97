// libFuzzer target: the tensor decoder a worker runs on every tensor it
// receives, alone (a Tensor message) and inside a gradient list (UpwardData,
// through the FP32 wire codec).
// Whatever decodes must round-trip bit for bit.
#include <google/protobuf/stubs/logging.h>

#include <cstring>

#include "proto/worker.pb.h"
#include "services/wire.h"
#include "services/wire_codec.h"

namespace {

void CheckRoundTrip(const interlock::v1::Tensor& wire, const torch::Tensor& t) {
  interlock::v1::Tensor again;
  interlock::EncodeTensor(t, &again);
  if (again.dtype() != wire.dtype() || again.data() != wire.data() ||
      again.shape_size() != wire.shape_size()) {
    __builtin_trap();
  }
  for (int i = 0; i < wire.shape_size(); ++i) {
    if (again.shape(i) != wire.shape(i)) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Inputs that fail to parse are expected; their log lines are noise.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  interlock::TensorLimits limits;
  static const auto* codec =
      new interlock::WireCodec(interlock::Fp32Codec(), interlock::Fp32Codec());
  {
    interlock::v1::Tensor wire;
    if (wire.ParseFromArray(data, static_cast<int>(size))) {
      auto t = interlock::DecodeTensor(wire, "fuzz", limits);
      if (t.ok()) {
        CheckRoundTrip(wire, *t);
        (void)interlock::ExpectFinite(*t, "fuzz");
        (void)interlock::ExpectTensor(*t, torch::kFloat32, {2, 3}, "fuzz");
      }
    }
  }
  {
    interlock::v1::UpwardData up;
    if (up.ParseFromArray(data, static_cast<int>(size))) {
      auto m = codec->DecodeUpward(up, limits);
      if (m.ok()) {
        if (m->grads.size() != static_cast<size_t>(up.gradients_size())) {
          __builtin_trap();
        }
        for (size_t i = 0; i < m->grads.size(); ++i) {
          CheckRoundTrip(up.gradients(static_cast<int>(i)), m->grads[i]);
        }
        interlock::v1::UpwardData again;
        codec->EncodeUpward(*m, &again);
      }
    }
  }
  return 0;
}
