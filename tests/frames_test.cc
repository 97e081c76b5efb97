// Worker-stream frames (services/wire_frame.h, rpc/frames.h): a sent byte
// buffer's slices are the tensors' own memory and release it only when
// gRPC is done; a received fp32 tensor that arrives in one aligned slice is
// that slice's memory, otherwise one copy; on the wire a frame is exactly
// the protobuf message the codec wrote before frames (so plain protobuf
// peers interoperate); and malformed frames are refused, naming the
// problem.
#include "rpc/frames.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "services/wire_codec.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

const WireCodec& Codec(v1::WireSpec::Codec c) {
  static const auto* codecs = [] {
    auto* m = new std::map<int, WireCodec>;
    for (auto k : {v1::WireSpec::FP32, v1::WireSpec::BF16, v1::WireSpec::FP16,
                   v1::WireSpec::INT8_BLOCKWISE}) {
      auto codec = CodecFor(k, 0);
      m->emplace(k, WireCodec(*codec, *codec));
    }
    return m;
  }();
  return codecs->at(c);
}

ForwardMsg Forward(torch::Tensor input) {
  ForwardMsg m;
  m.step = 4;
  m.mb = 1;
  m.lr = 0.5;
  m.input = std::move(input);
  m.target = torch::tensor({3, 1}, torch::kInt64);
  m.routes = {0, 0};
  return m;
}

std::vector<grpc::Slice> Slices(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> s;
  EXPECT_TRUE(b.Dump(&s).ok());
  return s;
}

std::string Flat(const grpc::ByteBuffer& b) {
  std::string out;
  for (const grpc::Slice& s : Slices(b)) {
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

bool Bitwise(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         (a.nbytes() == 0 ||  // data_ptr() may be null then
          std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0);
}

// A slice over `bytes` without copying, counting its releases.
grpc::Slice Borrowed(const char* bytes, size_t n, int* released) {
  return grpc::Slice(
      const_cast<char*>(bytes), n, [](void* p) { ++*static_cast<int*>(p); },
      released);
}

TEST(Frames, SentSlicesAreTheTensorsMemory) {
  const torch::Tensor x = torch::randn({64, 1024});
  DownFrame f;
  f.proto.mutable_header()->set_run_id("r");
  Codec(v1::WireSpec::FP32).EncodeForward(Forward(x), 2, &f);
  const grpc::ByteBuffer b = ToByteBuffer(f);
  bool found = false;
  for (const grpc::Slice& s : Slices(b)) {
    if (s.begin() == static_cast<const uint8_t*>(x.data_ptr()) &&
        s.size() == x.nbytes()) {
      found = true;
    }
  }
  EXPECT_TRUE(found) << "no slice is the activation's memory";
  EXPECT_EQ(b.Length(), static_cast<size_t>(FrameBytes(f)));
}

TEST(Frames, SlicesKeepTheirOwnerUntilGrpcDropsThem) {
  auto released = std::make_shared<bool>(false);
  std::string* values = new std::string(4096, 'x');
  std::shared_ptr<const void> owner(values, [released](const std::string* s) {
    *released = true;
    delete s;
  });
  UpFrame f;
  f.proto.mutable_upward()->add_gradients()->set_dtype(v1::Tensor::UINT8);
  f.proto.mutable_upward()->mutable_gradients(0)->add_shape(4096);
  f.tensors.push_back({Payload({*values}, owner), Payload()});
  owner.reset();
  auto b = std::make_unique<grpc::ByteBuffer>(ToByteBuffer(f));
  f = UpFrame();
  EXPECT_FALSE(*released) << "the buffer still references the values";
  b.reset();
  EXPECT_TRUE(*released);
}

TEST(Frames, OnTheWireTheyAreTheProtobufMessages) {
  for (auto c :
       {v1::WireSpec::FP32, v1::WireSpec::BF16, v1::WireSpec::INT8_BLOCKWISE}) {
    SCOPED_TRACE(CodecName(c));
    const TensorCodec& codec = Codec(c).activations();
    const ForwardMsg m = Forward(torch::randn({2, 3, 5}));
    DownFrame f;
    f.proto.mutable_header()->set_run_id("run");
    f.proto.mutable_header()->set_generation(3);
    Codec(c).EncodeForward(m, 2, &f);
    // What the codec wrote into plain protobuf messages before frames.
    v1::DownMessage want;
    want.mutable_header()->set_run_id("run");
    want.mutable_header()->set_generation(3);
    v1::ForwardData* d = want.mutable_forward();
    d->set_step(4);
    d->set_microbatch(1);
    d->set_microbatches(2);
    d->set_learning_rate(0.5);
    d->add_routes(0);
    d->add_routes(0);
    codec.Encode(m.input, d->mutable_input());
    EncodeTensor(m.target, d->mutable_target());
    v1::DownMessage got;
    ASSERT_TRUE(got.ParseFromString(Flat(ToByteBuffer(f))));
    EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());

    // And a plain protobuf message reads as a frame.
    const std::string plain = want.SerializeAsString();
    grpc::Slice one(plain.data(), plain.size());
    auto back = DownFrameOf(grpc::ByteBuffer(&one, 1));
    ASSERT_TRUE(back.ok()) << back.status();
    auto fwd = Codec(c).DecodeForward(*back, "fwd", {});
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    EXPECT_TRUE(Bitwise(fwd->input, codec.Transfer(m.input)));
    EXPECT_TRUE(Bitwise(fwd->target, m.target));
    EXPECT_EQ(fwd->routes, m.routes);

    UpwardMsg u;
    u.step = 2;
    u.grads = {torch::randn({2, 7}), torch::randn({2, 7})};
    u.nonfinite = {false, true};
    UpFrame uf;
    Codec(c).EncodeUpward(u, &uf);
    v1::UpMessage up;
    ASSERT_TRUE(up.ParseFromString(Flat(ToByteBuffer(uf))));
    EXPECT_EQ(up.SerializeAsString(), ToProto(uf).SerializeAsString());
    ASSERT_EQ(up.upward().gradients_size(), 2);
    v1::Tensor g1;
    codec.Encode(u.grads[1], &g1);
    EXPECT_EQ(up.upward().gradients(1).SerializeAsString(),
              g1.SerializeAsString());
  }
}

// `wire` in borrowed slices of 97 bytes, so that values split across them
// at every offset.
grpc::ByteBuffer InOddSlices(const std::string& wire, int* released) {
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i < wire.size(); i += 97) {
    slices.push_back(Borrowed(wire.data() + i,
                              std::min<size_t>(97, wire.size() - i), released));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// `u` encoded with codec `c` into `*wire` and received in odd slices.
absl::StatusOr<UpFrame> SentInOddSlices(v1::WireSpec::Codec c,
                                        const UpwardMsg& u, std::string* wire,
                                        int* released) {
  UpFrame uf;
  Codec(c).EncodeUpward(u, &uf);
  *wire = Flat(ToByteBuffer(uf));
  return UpFrameOf(InOddSlices(*wire, released));
}

// Gradients `grads` sent with codec `c` in odd slices, as decoded.
absl::StatusOr<UpwardMsg> DecodedFromOddSlices(
    v1::WireSpec::Codec c, std::vector<torch::Tensor> grads) {
  UpwardMsg u;
  u.grads = std::move(grads);
  std::string wire;
  int released = 0;
  auto frame = SentInOddSlices(c, u, &wire, &released);
  if (!frame.ok()) return frame.status();
  return Codec(c).DecodeUpward(*frame);
}

TEST(Frames, AnAlignedSliceBacksTheDecodedTensor) {
  // Checked for finiteness in place, the one pass over the values.
  for (bool poisoned : {false, true}) {
    SCOPED_TRACE(poisoned ? "with a NaN" : "finite");
    torch::Tensor x = torch::randn({16, 64});
    if (poisoned) x[7][3] = std::numeric_limits<float>::quiet_NaN();
    DownFrame f;
    Codec(v1::WireSpec::FP32).EncodeForward(Forward(x), 2, &f);
    const std::string wire = Flat(ToByteBuffer(f));
    const size_t at = wire.find(
        std::string(static_cast<const char*>(x.data_ptr()), x.nbytes()));
    ASSERT_NE(at, std::string::npos);
    // Place the message so that the values start 4-byte aligned.
    std::vector<char> memory(wire.size() + 8);
    char* start = memory.data();
    while (reinterpret_cast<uintptr_t>(start + at) % 4 != 0) ++start;
    std::memcpy(start, wire.data(), wire.size());
    int released = 0;
    torch::Tensor input;
    {
      grpc::Slice slice = Borrowed(start, wire.size(), &released);
      auto frame = DownFrameOf(grpc::ByteBuffer(&slice, 1));
      ASSERT_TRUE(frame.ok()) << frame.status();
      auto m = Codec(v1::WireSpec::FP32).DecodeForward(*frame, "fwd", {});
      ASSERT_TRUE(m.ok()) << m.status();
      input = m->input;
      EXPECT_EQ(m->input_finite, !poisoned);
    }
    EXPECT_EQ(input.data_ptr(), static_cast<void*>(start + at));
    EXPECT_TRUE(Bitwise(input, x));
    EXPECT_EQ(released, 0) << "the tensor holds the slice";
    input = torch::Tensor();
    EXPECT_EQ(released, 1);
  }
}

TEST(Frames, SplitSlicesDecodeWithOneCopy) {
  for (auto c : {v1::WireSpec::FP32, v1::WireSpec::BF16, v1::WireSpec::FP16,
                 v1::WireSpec::INT8_BLOCKWISE}) {
    SCOPED_TRACE(CodecName(c));
    const torch::Tensor g = torch::randn({3, 333});
    UpwardMsg u;
    u.grads = {g, g * 2};
    std::string wire;
    int released = 0;
    auto frame = SentInOddSlices(c, u, &wire, &released);
    ASSERT_TRUE(frame.ok()) << frame.status();
    auto m = Codec(c).DecodeUpward(*frame);
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_EQ(m->grads.size(), 2u);
    const auto& codec = Codec(c).gradients();
    EXPECT_TRUE(Bitwise(m->grads[0], codec.Transfer(g)));
    EXPECT_TRUE(Bitwise(m->grads[1], codec.Transfer(g * 2)));
    const char* p = static_cast<const char*>(m->grads[0].data_ptr());
    EXPECT_FALSE(p >= wire.data() && p < wire.data() + wire.size());
    *frame = UpFrame();
    EXPECT_GT(released, 0) << "a copied tensor does not hold the slices";
  }
}

TEST(Frames, DecodingChecksFinitenessInTheCopyingPass) {
  // All values finite, a NaN at each of 50 values in a row (200 bytes: some
  // straddle two slices, whatever the header's length), an Inf as the very
  // last value: the decoder vouches for the first case only.
  const torch::Tensor g = torch::randn({3, 333});
  std::vector<int> cases = {-1, 998};
  for (int i = 20; i < 70; ++i) cases.push_back(i);
  for (auto c : {v1::WireSpec::FP32, v1::WireSpec::BF16, v1::WireSpec::FP16,
                 v1::WireSpec::INT8_BLOCKWISE}) {
    for (int bad : cases) {
      SCOPED_TRACE(CodecName(c) + " bad value " + std::to_string(bad));
      torch::Tensor x = g.clone();
      if (bad >= 0) {
        x.view({-1})[bad] = bad == 998
                                ? std::numeric_limits<float>::infinity()
                                : std::numeric_limits<float>::quiet_NaN();
      }
      auto m = DecodedFromOddSlices(c, {g, x});
      if (c == v1::WireSpec::INT8_BLOCKWISE && bad >= 0) {
        // A non-finite value gives its block a NaN scale, which no
        // decoder takes.
        EXPECT_FALSE(m.ok());
        continue;
      }
      ASSERT_TRUE(m.ok()) << m.status();
      EXPECT_TRUE(Bitwise(m->grads[1], Codec(c).gradients().Transfer(x)));
      EXPECT_EQ(m->grads_finite, bad < 0);
    }
  }
}

// Tensors from kTwoThreadCodecBytes on encode and decode in two halves on
// two threads: the values at and around the split, and the checks of each
// half, come out as in one pass (Transfer is one pass).
TEST(Frames, LargePayloadsDecodeInTwoPartsAsInOne) {
  for (auto c : {v1::WireSpec::FP32, v1::WireSpec::BF16, v1::WireSpec::FP16,
                 v1::WireSpec::INT8_BLOCKWISE}) {
    const bool int8 = c == v1::WireSpec::INT8_BLOCKWISE;
    // Bytes per value on the wire; int8's codes alone reach the size.
    const int64_t item = c == v1::WireSpec::FP32 ? 4 : int8 ? 1 : 2;
    const int64_t n = static_cast<int64_t>(kTwoThreadCodecBytes) / item + 999;
    // The first value of the second half (int8: a whole number of blocks).
    const int64_t split =
        int8 ? n / 2 / 256 * 256 : n * item / 2 / 64 * 64 / item;
    const torch::Tensor g = torch::randn({n});
    for (int64_t bad :
         {int64_t{-1}, int64_t{0}, split - 1, split, split + 1, n - 1}) {
      SCOPED_TRACE(CodecName(c) + " bad value " + std::to_string(bad));
      torch::Tensor x = g.clone();
      if (bad >= 0) x[bad] = std::numeric_limits<float>::quiet_NaN();
      auto m = DecodedFromOddSlices(c, {x});
      if (int8 && bad >= 0) {
        // The NaN makes its block's scale NaN, which the decoder names.
        ASSERT_FALSE(m.ok());
        EXPECT_NE(m.status().message().find(
                      "scale " + std::to_string(bad / 256) + " is nan"),
                  std::string::npos)
            << m.status();
        continue;
      }
      ASSERT_TRUE(m.ok()) << m.status();
      EXPECT_TRUE(Bitwise(m->grads[0], Codec(c).gradients().Transfer(x)));
      EXPECT_EQ(m->grads_finite, bad < 0);
    }
  }
  // A bad block in each half: the first is the one reported, as a single
  // pass in order would.
  const int64_t n = static_cast<int64_t>(kTwoThreadCodecBytes) + 999;
  torch::Tensor x = torch::randn({n});
  x[n - 1] = std::numeric_limits<float>::quiet_NaN();
  x[300] = std::numeric_limits<float>::quiet_NaN();
  auto m = DecodedFromOddSlices(v1::WireSpec::INT8_BLOCKWISE, {x});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("scale 1 is nan"), std::string::npos)
      << m.status();
}

TEST(Frames, MalformedFramesAreRefused) {
  DownFrame f;
  Codec(v1::WireSpec::FP32).EncodeForward(Forward(torch::randn({2, 3})), 2, &f);
  const std::string wire = Flat(ToByteBuffer(f));
  auto refused = [](const std::string& bytes, const std::string& why) {
    auto r = ParseDownFrame(Payload::Borrowed(bytes));
    ASSERT_FALSE(r.ok()) << why;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status();
  };
  refused(wire.substr(0, wire.size() - 3), "down message: a field of");
  refused(wire + wire, "repeats a message field");
  refused(std::string("\x08\x80", 2), "truncated varint");
  refused(std::string("\x0b", 1), "groups are not supported");
  refused(std::string("\x00\x01", 2), "invalid field key");

  // A tensor giving its data twice: protobuf would keep the last.
  v1::DownMessage m;
  m.mutable_forward()->mutable_input()->set_data("abcd");
  std::string twice = m.SerializeAsString();
  // forward { input { data } } with the data field written again.
  const std::string data_field("\x1a\x04wxyz", 6);
  v1::Tensor t;
  t.set_data("abcd");
  const std::string tensor = t.SerializeAsString() + data_field;
  const std::string input =
      std::string("\x2a") + static_cast<char>(tensor.size()) + tensor;
  twice = std::string("\x12") + static_cast<char>(input.size()) + input;
  refused(twice, "tensor data given twice");
  // The header alone must still parse as protobuf: a bad string is not.
  v1::DownMessage bad_utf8;
  std::string run = "\xff\xfe";
  bad_utf8.mutable_header()->set_run_id(run);
  refused(bad_utf8.SerializePartialAsString(), "not a valid");
}

}  // namespace
}  // namespace interlock
