#include "rpc/frames.h"

#include <grpcpp/support/slice.h>

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"

namespace interlock {
namespace {

// Pieces shorter than this are copied into their slice: cheaper than a
// reference-counted one for the few bytes of a message's header.
constexpr size_t kReferenceFrom = 1024;

void ReleaseOwner(void* owner) {
  delete static_cast<std::shared_ptr<const void>*>(owner);
}

grpc::ByteBuffer FromSegments(const std::vector<Payload>& segments) {
  std::vector<grpc::Slice> slices;
  for (const Payload& p : segments) {
    for (absl::string_view piece : p.pieces()) {
      if (piece.empty()) continue;
      if (piece.size() < kReferenceFrom || p.owner() == nullptr) {
        slices.emplace_back(piece.data(), piece.size());
        continue;
      }
      // gRPC only reads a slice; the callback runs once it has dropped
      // its last reference.
      slices.emplace_back(const_cast<char*>(piece.data()), piece.size(),
                          &ReleaseOwner,
                          new std::shared_ptr<const void>(p.owner()));
    }
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// The received buffer as a payload that owns its slices.
absl::StatusOr<Payload> Received(const grpc::ByteBuffer& buffer) {
  if (!buffer.Valid()) return Payload();  // an empty message
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  const grpc::Status s = buffer.Dump(slices.get());
  if (!s.ok()) {
    return absl::InternalError(
        absl::StrCat("reading a received message: ", s.error_message()));
  }
  std::vector<absl::string_view> pieces;
  pieces.reserve(slices->size());
  for (const grpc::Slice& slice : *slices) {
    pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()),
                        slice.size());
  }
  return Payload(std::move(pieces), std::move(slices));
}

}  // namespace

grpc::ByteBuffer ToByteBuffer(const DownFrame& frame) {
  return FromSegments(FrameSegments(frame));
}

grpc::ByteBuffer ToByteBuffer(const UpFrame& frame) {
  return FromSegments(FrameSegments(frame));
}

absl::StatusOr<DownFrame> DownFrameOf(const grpc::ByteBuffer& buffer) {
  absl::StatusOr<Payload> bytes = Received(buffer);
  if (!bytes.ok()) return bytes.status();
  return ParseDownFrame(*bytes);
}

absl::StatusOr<UpFrame> UpFrameOf(const grpc::ByteBuffer& buffer) {
  absl::StatusOr<Payload> bytes = Received(buffer);
  if (!bytes.ok()) return bytes.status();
  return ParseUpFrame(*bytes);
}

}  // namespace interlock
