// Worker-stream messages as they travel (ARCHITECTURE: wire codecs): the
// protobuf fields of a DownMessage or UpMessage except its tensors' value bytes
// (Tensor.data and Tensor.scales), which stay where they are: in tensor
// memory or an encoded buffer when sending, in the buffers the message was
// received into when receiving. rpc/ turns a frame's segments into gRPC
// slices that reference that memory, so neither end copies tensor values
// into protobuf `bytes`. On the wire a frame is a plain protobuf message of
// its type, so peers that write or read plain protobuf (tests, other
// clients) interoperate. No gRPC types here.
#ifndef INTERLOCK_SERVICES_WIRE_FRAME_H_
#define INTERLOCK_SERVICES_WIRE_FRAME_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/worker.pb.h"
#include "services/wire.h"

namespace interlock {

// A message whose tensors' data and scales are in `tensors`, never in
// `proto`. Slots: a DownMessage has two, the input (0) and the target (1)
// of its forward or eval; an UpMessage one per gradient of its upward, in
// order. A slot without bytes (or beyond the vector) has none.
template <typename M>
struct Framed {
  M proto;
  std::vector<TensorBytes> tensors;
};
using DownFrame = Framed<interlock::v1::DownMessage>;
using UpFrame = Framed<interlock::v1::UpMessage>;

// The message as it goes on the wire, in order: the protobuf encoding of
// the other fields (owned strings) and the tensors' bytes (as the frame
// holds them). Concatenated they are a protobuf encoding of ToProto(frame).
std::vector<Payload> FrameSegments(const DownFrame& frame);
std::vector<Payload> FrameSegments(const UpFrame& frame);
// The number of bytes FrameSegments gives.
int64_t FrameBytes(const DownFrame& frame);
int64_t FrameBytes(const UpFrame& frame);

// Reads a protobuf-encoded message from `bytes` (the pieces it arrived
// in), its tensors' data and scales referencing those pieces (the frame
// shares `bytes`' owner). Refuses what plain protobuf parsing refuses, and
// a tensor field, a tensor's data or scales, or a DownMessage's forward or
// eval given twice (protobuf would merge them; no sender writes that).
// INVALID_ARGUMENT naming the message and the problem.
absl::StatusOr<DownFrame> ParseDownFrame(const Payload& bytes);
absl::StatusOr<UpFrame> ParseUpFrame(const Payload& bytes);

// Between frames and plain messages (moving the bytes out of the message;
// copying them into it).
DownFrame ToFrame(interlock::v1::DownMessage m);
UpFrame ToFrame(interlock::v1::UpMessage m);
interlock::v1::DownMessage ToProto(const DownFrame& frame);
interlock::v1::UpMessage ToProto(const UpFrame& frame);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_WIRE_FRAME_H_
