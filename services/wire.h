// Tensors and shapes on the wire, raw, with the checks a worker applies to
// everything it receives. Messages go through services/wire_codec.h, which
// builds on these. No gRPC types here.
#ifndef INTERLOCK_SERVICES_WIRE_H_
#define INTERLOCK_SERVICES_WIRE_H_

#include <torch/torch.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/worker.pb.h"
#include "services/data.h"

namespace interlock {

struct TensorLimits {
  int max_rank = 8;
  int64_t max_elements = int64_t{1} << 31;
};

// Copies a tensor (on any device) into a wire message: contiguous,
// little-endian, from a CPU copy.
void EncodeTensor(const torch::Tensor& t, interlock::v1::Tensor* out);

// Decodes a RAW tensor with every check: known dtype, RAW encoding without
// codec fields, rank and element caps, non-negative dimensions,
// element-count overflow, byte length = elements x item size. Errors are
// INVALID_ARGUMENT naming `what`.
absl::StatusOr<torch::Tensor> DecodeTensor(const interlock::v1::Tensor& t,
                                           const std::string& what,
                                           const TensorLimits& limits = {});

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
