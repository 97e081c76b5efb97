// Worker-stream frames (services/wire_frame.h) as gRPC byte buffers, both
// ways without copying tensor values: a sent buffer's slices reference the
// frame's memory and release it when gRPC is done with them; a received
// frame's tensors reference the received slices.
#ifndef INTERLOCK_RPC_FRAMES_H_
#define INTERLOCK_RPC_FRAMES_H_

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "services/wire_frame.h"

namespace interlock {

// The method the frames travel on (the generated stub's name for it).
inline constexpr char kStreamMethod[] = "/interlock.v1.Worker/Stream";

grpc::ByteBuffer ToByteBuffer(const DownFrame& frame);
grpc::ByteBuffer ToByteBuffer(const UpFrame& frame);

// The frame `buffer` holds (ParseDownFrame, ParseUpFrame); it keeps the
// buffer's slices alive as long as it or a tensor decoded from it needs
// them.
absl::StatusOr<DownFrame> DownFrameOf(const grpc::ByteBuffer& buffer);
absl::StatusOr<UpFrame> UpFrameOf(const grpc::ByteBuffer& buffer);

}  // namespace interlock

#endif  // INTERLOCK_RPC_FRAMES_H_
