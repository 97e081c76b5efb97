// Tensors and shapes on the wire, raw, with the checks a worker applies to
// everything it receives. Messages go through services/wire_codec.h, which
// builds on these. No gRPC types here.
#ifndef INTERLOCK_SERVICES_WIRE_H_
#define INTERLOCK_SERVICES_WIRE_H_

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "proto/worker.pb.h"
#include "services/data.h"

namespace interlock {

struct TensorLimits {
  int max_rank = 8;
  int64_t max_elements = int64_t{1} << 31;
};

// Bytes that stay where they are (tensor memory, an encoded buffer, the
// buffers a message was received into), in one or more pieces, kept alive
// by `owner`. Without an owner they are borrowed: valid only while the
// caller keeps them, so nothing may keep a reference to them.
class Payload {
 public:
  Payload() = default;
  Payload(std::vector<absl::string_view> pieces,
          std::shared_ptr<const void> owner);
  // The bytes of `t` (contiguous, on the CPU), owned by the tensor.
  static Payload OfTensor(const torch::Tensor& t);
  static Payload OfString(std::string s);
  static Payload Borrowed(absl::string_view s);

  size_t size() const { return size_; }
  const std::vector<absl::string_view>& pieces() const { return pieces_; }
  const std::shared_ptr<const void>& owner() const { return owner_; }
  // Copies all size() bytes to `out`.
  void CopyTo(char* out) const;
  std::string ToString() const;
  // The bytes in one piece: the piece itself when there is one, else
  // gathered into `*storage`.
  absl::string_view Flat(std::string* storage) const;

 private:
  std::vector<absl::string_view> pieces_;
  std::shared_ptr<const void> owner_;
  size_t size_ = 0;
};

// The value bytes of one wire tensor: what Tensor.data and Tensor.scales
// hold in a plain protobuf message (services/wire_frame.h).
struct TensorBytes {
  Payload data;
  Payload scales;
};

// From this size on a tensor is encoded or decoded in two halves, the
// second on a helper thread (when the machine has a second core): one
// core's copy or conversion runs well below what memory can do, and
// starting a thread costs tens of microseconds against the milliseconds of
// a tensor this large.
inline constexpr size_t kTwoThreadCodecBytes = size_t{8} << 20;

// Runs `work(begin, end)` over [0, n): as [0, mid) on this thread and
// [mid, n) on a helper thread, mid a multiple of `align`, when `bytes` (the
// payload the work reads or writes) reach kTwoThreadCodecBytes and the
// machine has a second core; else as one call. True when every call
// returned true. The calls must touch disjoint memory.
bool InTwoHalves(int64_t n, int64_t align, size_t bytes,
                 const std::function<bool(int64_t begin, int64_t end)>& work);

// A tensor of `shape` and `type` holding `bytes` (elements x item size of
// them): the payload's own memory when it is one owned piece aligned for
// `type` (no copy; the tensor keeps the owner), else one copy. With
// `finite`, float32, float16 and bfloat16 values are also checked in that
// same pass (each stretch right after it is copied): *finite is true when
// every value is finite, false when one is not or the type is another (the
// caller checks).
torch::Tensor TensorFromPayload(const Payload& bytes,
                                const std::vector<int64_t>& shape,
                                torch::ScalarType type, bool* finite = nullptr);

// A float32 tensor of `shape` from `bytes` holding its values as `half`
// (kBFloat16 or kHalf; exactly 2 bytes per element, which the caller has
// checked): one pass over them, widening straight from the payload's pieces
// (a value may straddle two), each stretch checked for finiteness right
// after it is written when `finite` is given (as TensorFromPayload).
torch::Tensor HalfPayloadToFloat(const Payload& bytes,
                                 const std::vector<int64_t>& shape,
                                 torch::ScalarType half,
                                 bool* finite = nullptr);

// A tensor (on any device) as a RAW wire tensor: its description in `meta`,
// its values (contiguous, little-endian, from a CPU copy when it is not on
// the CPU) in `bytes`, referencing the tensor's memory.
void EncodeTensor(const torch::Tensor& t, interlock::v1::Tensor* meta,
                  TensorBytes* bytes);
// The same into a plain protobuf Tensor (one copy into `data`).
void EncodeTensor(const torch::Tensor& t, interlock::v1::Tensor* out);

// Decodes a RAW tensor with every check: known dtype, RAW encoding without
// codec fields, rank and element caps, non-negative dimensions,
// element-count overflow, byte length = elements x item size. The values
// come from `bytes` (meta's data and scales are not read). Errors are
// INVALID_ARGUMENT naming `what`. `finite` as for TensorFromPayload.
absl::StatusOr<torch::Tensor> DecodeTensor(const interlock::v1::Tensor& meta,
                                           const TensorBytes& bytes,
                                           const std::string& what,
                                           const TensorLimits& limits = {},
                                           bool* finite = nullptr);
// The same from a plain protobuf Tensor.
absl::StatusOr<torch::Tensor> DecodeTensor(const interlock::v1::Tensor& t,
                                           const std::string& what,
                                           const TensorLimits& limits = {});
// A plain protobuf Tensor's data and scales, borrowed.
TensorBytes BorrowBytes(const interlock::v1::Tensor& t);
// `meta` with `bytes` copied into its data and scales.
void AttachBytes(const TensorBytes& bytes, interlock::v1::Tensor* meta);

// An encoding's name, or its number for an unknown one.
std::string EncodingText(interlock::v1::Tensor::Encoding e);

// The shape checks of DecodeTensor alone (rank and element caps,
// non-negative dimensions, overflow): the shape and its element count.
absl::Status CheckWireShape(const interlock::v1::Tensor& t,
                            const std::string& what, const TensorLimits& limits,
                            std::vector<int64_t>* shape, int64_t* elements);

// Checks dtype and exact shape; INVALID_ARGUMENT naming `what` otherwise.
absl::Status ExpectTensor(const torch::Tensor& t, torch::ScalarType dtype,
                          c10::IntArrayRef shape, const std::string& what);
// Refuses NaN and infinities in a floating-point tensor.
absl::Status ExpectFinite(const torch::Tensor& t, const std::string& what);

void EncodeShape(const DataShape& s, interlock::v1::DataShapeInfo* out);
DataShape DecodeShape(const interlock::v1::DataShapeInfo& s);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_WIRE_H_
