// libFuzzer target: the tensor decoder a worker runs on every tensor it
// receives, alone (a Tensor message) and inside a gradient list (UpwardData,
// through the FP32 wire codec), the list read as a worker's stream reads
// it: an UpMessage frame arriving in pieces (services/wire_frame.h), whose
// fields must be what protobuf parses from the same bytes.
// Whatever decodes must round-trip bit for bit.
#include <google/protobuf/stubs/logging.h>

#include <cstring>

#include "proto/worker.pb.h"
#include "services/wire.h"
#include "services/wire_codec.h"
#include "services/wire_frame.h"
#include "tests/fuzz/received.h"

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
    const bool parsed = up.ParseFromArray(data, static_cast<int>(size));
    const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
    auto frame = interlock::ParseUpFrame(interlock::fuzz::Received(
        interlock::fuzz::AsField(1, bytes), 1 + size % 61));
    // The frame parser refuses what protobuf refuses, and reads the same.
    if (frame.ok() &&
        (!parsed || interlock::ToProto(*frame).upward().SerializeAsString() !=
                        up.SerializeAsString())) {
      __builtin_trap();
    }
    if (frame.ok()) {
      auto m = codec->DecodeUpward(*frame, limits);
      if (m.ok()) {
        if (m->grads.size() != static_cast<size_t>(up.gradients_size())) {
          __builtin_trap();
        }
        for (size_t i = 0; i < m->grads.size(); ++i) {
          CheckRoundTrip(up.gradients(static_cast<int>(i)), m->grads[i]);
        }
        interlock::UpFrame again;
        codec->EncodeUpward(*m, &again);
      }
    }
  }
  return 0;
}
