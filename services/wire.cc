#include "services/wire.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "plan/status_macros.h"
#include "services/codec_kernels.h"

namespace interlock {
namespace {

using WireTensor = interlock::v1::Tensor;

bool ToScalarType(WireTensor::DType d, torch::ScalarType* out) {
  switch (d) {
    case WireTensor::FLOAT32:
      *out = torch::kFloat32;
      return true;
    case WireTensor::FLOAT64:
      *out = torch::kFloat64;
      return true;
    case WireTensor::INT64:
      *out = torch::kInt64;
      return true;
    case WireTensor::INT32:
      *out = torch::kInt32;
      return true;
    case WireTensor::UINT8:
      *out = torch::kUInt8;
      return true;
    default:
      return false;
  }
}

WireTensor::DType ToWire(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32:
      return WireTensor::FLOAT32;
    case torch::kFloat64:
      return WireTensor::FLOAT64;
    case torch::kInt64:
      return WireTensor::INT64;
    case torch::kInt32:
      return WireTensor::INT32;
    case torch::kUInt8:
      return WireTensor::UINT8;
    default:
      return WireTensor::DTYPE_UNSPECIFIED;
  }
}

std::string ShapeString(c10::IntArrayRef s) {
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

// Whether the `n` values of `type` at `p` are all finite; nullopt for a
// type this pass does not check (the caller does).
std::optional<bool> AllFinite(const void* p, int64_t n,
                              torch::ScalarType type) {
  switch (type) {
    case torch::kFloat32:
      return AllFiniteFloats(static_cast<const float*>(p), n);
    case torch::kHalf:
      return AllFiniteHalves(static_cast<const uint16_t*>(p), n, 0x7c00);
    case torch::kBFloat16:
      return AllFiniteHalves(static_cast<const uint16_t*>(p), n, 0x7f80);
    default:
      return std::nullopt;
  }
}

// Copies `pieces` to `out` (values of `type`, one AllFinite knows) and says
// whether every value is finite. Each stretch is checked right after its
// copy, while it is still in cache, so the check costs no second pass over
// memory; gRPC's slices may split a value, so the check trails the copy to
// whole values.
bool CopyCheckingFinite(const std::vector<absl::string_view>& pieces,
                        torch::ScalarType type, char* out) {
  constexpr size_t kStretch = size_t{64} << 10;
  const size_t item = c10::elementSize(type);
  size_t copied = 0;   // bytes
  size_t checked = 0;  // values
  bool finite = true;
  for (absl::string_view piece : pieces) {
    for (size_t at = 0; at < piece.size();) {
      const size_t n = std::min(kStretch, piece.size() - at);
      std::memcpy(out + copied, piece.data() + at, n);
      copied += n;
      at += n;
      const size_t whole = copied / item;
      if (finite && whole > checked) {
        finite = *AllFinite(out + checked * item,
                            static_cast<int64_t>(whole - checked), type);
        checked = whole;
      }
    }
  }
  return finite;
}

void CopyPieces(const std::vector<absl::string_view>& pieces, char* out) {
  for (absl::string_view p : pieces) {
    if (p.empty()) continue;
    std::memcpy(out, p.data(), p.size());
    out += p.size();
  }
}

// Widens `pieces`, 16-bit `half` values (a value may straddle two pieces),
// into `out`; with `check`, says whether every value is finite, each
// stretch checked right after it is written.
bool WidenPieces(const std::vector<absl::string_view>& pieces,
                 torch::ScalarType half, bool check, float* out) {
  constexpr int64_t kStretch = int64_t{16} << 10;  // values
  const auto widen_values = half == torch::kBFloat16 ? &WidenBf16 : &WidenFp16;
  int64_t done = 0;  // values written
  bool all_finite = true;
  const auto widen = [&](const char* p, int64_t n) {
    for (int64_t at = 0; at < n; at += kStretch) {
      const int64_t len = std::min(kStretch, n - at);
      widen_values(p + 2 * at, len, out + done);
      if (check && all_finite) all_finite = AllFiniteFloats(out + done, len);
      done += len;
    }
  };
  char straddling[2];
  bool half_value = false;  // straddling[0] holds a value's first byte
  for (absl::string_view piece : pieces) {
    const char* p = piece.data();
    size_t len = piece.size();
    if (half_value && len > 0) {
      straddling[1] = *p++;
      --len;
      half_value = false;
      widen(straddling, 1);
    }
    widen(p, static_cast<int64_t>(len / 2));
    if (len % 2 != 0) {
      straddling[0] = p[len - 1];
      half_value = true;
    }
  }
  return all_finite;
}

// Runs `work(pieces, at)` over the pieces of `bytes` from byte `at` on, in
// one part or, for a large payload, two (InTwoHalves) split at a multiple
// of 64 bytes: of every item size, and a cache line of the output.
template <typename Work>
bool InParts(const Payload& bytes, Work work) {
  if (bytes.size() < kTwoThreadCodecBytes) {
    return work(bytes.pieces(), size_t{0});
  }
  return InTwoHalves(
      static_cast<int64_t>(bytes.size()), 64, bytes.size(),
      [&](int64_t begin, int64_t end) {
        std::vector<absl::string_view> part;
        size_t at = 0;
        for (absl::string_view p : bytes.pieces()) {
          const size_t from = std::max(at, static_cast<size_t>(begin));
          const size_t to = std::min(at + p.size(), static_cast<size_t>(end));
          if (from < to) part.push_back(p.substr(from - at, to - from));
          at += p.size();
        }
        return work(part, static_cast<size_t>(begin));
      });
}

}  // namespace

bool InTwoHalves(int64_t n, int64_t align, size_t bytes,
                 const std::function<bool(int64_t begin, int64_t end)>& work) {
  static const bool two_cores = std::thread::hardware_concurrency() > 1;
  const int64_t mid = n / 2 / align * align;
  if (bytes < kTwoThreadCodecBytes || !two_cores || mid == 0) {
    return work(0, n);
  }
  bool second_ok = true;
  std::thread helper;
  try {
    helper = std::thread([&] { second_ok = work(mid, n); });
  } catch (const std::system_error&) {
    // No thread to be had (a process limit): this thread does both.
    second_ok = work(mid, n);
  }
  const bool first_ok = work(0, mid);
  if (helper.joinable()) helper.join();
  return first_ok && second_ok;
}

Payload::Payload(std::vector<absl::string_view> pieces,
                 std::shared_ptr<const void> owner)
    : pieces_(std::move(pieces)), owner_(std::move(owner)) {
  for (absl::string_view p : pieces_) size_ += p.size();
}

Payload Payload::OfTensor(const torch::Tensor& t) {
  auto owner = std::make_shared<const torch::Tensor>(t);
  const absl::string_view bytes(static_cast<const char*>(t.data_ptr()),
                                t.numel() * t.element_size());
  if (bytes.empty()) return Payload();
  return Payload({bytes}, std::move(owner));
}

Payload Payload::OfString(std::string s) {
  if (s.empty()) return Payload();
  auto owner = std::make_shared<const std::string>(std::move(s));
  return Payload({absl::string_view(*owner)}, owner);
}

Payload Payload::Borrowed(absl::string_view s) {
  if (s.empty()) return Payload();
  return Payload({s}, nullptr);
}

void Payload::CopyTo(char* out) const { CopyPieces(pieces_, out); }

std::string Payload::ToString() const {
  std::string s(size_, '\0');
  CopyTo(s.data());
  return s;
}

absl::string_view Payload::Flat(std::string* storage) const {
  if (pieces_.size() == 1) return pieces_[0];
  *storage = ToString();
  return *storage;
}

torch::Tensor TensorFromPayload(const Payload& bytes,
                                const std::vector<int64_t>& shape,
                                torch::ScalarType type, bool* finite) {
  // Whether this pass checks the values (a float type AllFinite knows).
  const bool check =
      finite != nullptr && AllFinite(nullptr, 0, type).has_value();
  if (finite != nullptr) *finite = false;
  if (bytes.pieces().size() == 1 && bytes.owner() != nullptr &&
      reinterpret_cast<uintptr_t>(bytes.pieces()[0].data()) %
              c10::elementSize(type) ==
          0) {
    // The tensor only reads the bytes; const_cast because from_blob takes
    // writable memory. The deleter holds the owner as long as the storage.
    torch::Tensor t = torch::from_blob(
        const_cast<char*>(bytes.pieces()[0].data()), shape,
        [owner = bytes.owner()](void*) {}, torch::dtype(type));
    if (check) *finite = *AllFinite(t.data_ptr(), t.numel(), type);
    return t;
  }
  torch::Tensor t = torch::empty(shape, torch::dtype(type));
  char* out = static_cast<char*>(t.data_ptr());
  const bool all_finite =
      InParts(bytes, [&](const std::vector<absl::string_view>& p, size_t at) {
        if (!check) {
          CopyPieces(p, out + at);
          return true;
        }
        return CopyCheckingFinite(p, type, out + at);
      });
  if (check) *finite = all_finite;
  return t;
}

torch::Tensor HalfPayloadToFloat(const Payload& bytes,
                                 const std::vector<int64_t>& shape,
                                 torch::ScalarType half, bool* finite) {
  torch::Tensor t = torch::empty(shape, torch::dtype(torch::kFloat32));
  float* out = t.data_ptr<float>();
  const bool all_finite =
      InParts(bytes, [&](const std::vector<absl::string_view>& p, size_t at) {
        return WidenPieces(p, half, finite != nullptr, out + at / 2);
      });
  if (finite != nullptr) *finite = all_finite;
  return t;
}

void EncodeTensor(const torch::Tensor& t_in, WireTensor* meta,
                  TensorBytes* bytes) {
  // x86-64 and aarch64 are little-endian, the wire order.
  const torch::Tensor t = t_in.detach().cpu().contiguous();
  meta->Clear();
  meta->set_dtype(ToWire(t.scalar_type()));
  for (int64_t d : t.sizes()) meta->add_shape(d);
  bytes->data = Payload::OfTensor(t);
  bytes->scales = Payload();
}

void EncodeTensor(const torch::Tensor& t, WireTensor* out) {
  TensorBytes bytes;
  EncodeTensor(t, out, &bytes);
  AttachBytes(bytes, out);
}

TensorBytes BorrowBytes(const WireTensor& t) {
  return {Payload::Borrowed(t.data()), Payload::Borrowed(t.scales())};
}

void AttachBytes(const TensorBytes& bytes, WireTensor* meta) {
  // One copy each, without zero-filling first.
  auto assign = [](const Payload& p, std::string* out) {
    out->clear();
    out->reserve(p.size());
    for (absl::string_view piece : p.pieces()) {
      out->append(piece.data(), piece.size());
    }
  };
  assign(bytes.data, meta->mutable_data());
  assign(bytes.scales, meta->mutable_scales());
}

std::string EncodingText(WireTensor::Encoding e) {
  const std::string& name = WireTensor::Encoding_Name(e);
  return name.empty() ? absl::StrCat(static_cast<int>(e), " (unknown)") : name;
}

absl::Status CheckWireShape(const WireTensor& w, const std::string& what,
                            const TensorLimits& limits,
                            std::vector<int64_t>* shape, int64_t* elements) {
  if (w.shape_size() > limits.max_rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": rank ", w.shape_size(), " exceeds the limit ",
                     limits.max_rank));
  }
  int64_t n = 1;
  shape->clear();
  for (int i = 0; i < w.shape_size(); ++i) {
    const int64_t d = w.shape(i);
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": dimension ", i, " is negative (", d, ")"));
    }
    if (d > 0 && n > limits.max_elements / d) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": element count overflows the limit ", limits.max_elements));
    }
    n *= d;
    shape->push_back(d);
  }
  *elements = n;
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> DecodeTensor(const WireTensor& w,
                                           const std::string& what,
                                           const TensorLimits& limits) {
  return DecodeTensor(w, BorrowBytes(w), what, limits);
}

absl::StatusOr<torch::Tensor> DecodeTensor(const WireTensor& w,
                                           const TensorBytes& values,
                                           const std::string& what,
                                           const TensorLimits& limits,
                                           bool* finite) {
  if (finite != nullptr) *finite = false;
  torch::ScalarType type;
  if (!ToScalarType(w.dtype(), &type)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": unknown dtype ", static_cast<int>(w.dtype())));
  }
  if (w.encoding() != WireTensor::RAW) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": encoding ", EncodingText(w.encoding()), ", expected RAW"));
  }
  if (w.block_size() != 0 || values.scales.size() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a RAW tensor with a block size or scales"));
  }
  std::vector<int64_t> shape;
  int64_t elements = 0;
  RETURN_IF_ERROR(CheckWireShape(w, what, limits, &shape, &elements));
  const int64_t item = static_cast<int64_t>(c10::elementSize(type));
  const int64_t bytes = elements * item;
  if (static_cast<int64_t>(values.data.size()) != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", values.data.size(), " data bytes, expected ",
                     bytes, " (", elements, " elements of ", item, " bytes)"));
  }
  return TensorFromPayload(values.data, shape, type, finite);
}

absl::Status ExpectTensor(const torch::Tensor& t, torch::ScalarType dtype,
                          c10::IntArrayRef shape, const std::string& what) {
  if (t.scalar_type() != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": dtype ", c10::toString(t.scalar_type()),
                     ", expected ", c10::toString(dtype)));
  }
  if (t.dim() != static_cast<int64_t>(shape.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": rank ", t.dim(), " (shape ",
                     ShapeString(t.sizes()), "), expected rank ", shape.size(),
                     " (shape ", ShapeString(shape), ")"));
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (t.size(i) != shape[i]) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": dimension ", i, " is ", t.size(i), ", expected ", shape[i],
          " (shape ", ShapeString(t.sizes()), " vs ", ShapeString(shape), ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ExpectFinite(const torch::Tensor& t, const std::string& what) {
  // A sum over the tensor is NaN or infinite whenever an element is, and
  // costs one pass without full-size temporaries; only when the sum is not
  // finite (a NaN, an infinity, or finite values overflowing it) is every
  // element checked.
  if (t.is_floating_point() && t.numel() > 0 &&
      !std::isfinite(t.sum().item<double>()) &&
      !torch::isfinite(t).all().item<bool>()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": contains NaN or infinite values"));
  }
  return absl::OkStatus();
}

void EncodeShape(const DataShape& s, interlock::v1::DataShapeInfo* out) {
  out->set_is_text(s.is_text);
  out->set_is_vector(s.is_vector);
  out->set_channels(s.channels);
  out->set_height(s.height);
  out->set_width(s.width);
  out->set_classes(s.classes);
  out->set_context(s.context);
}

DataShape DecodeShape(const interlock::v1::DataShapeInfo& s) {
  DataShape d;
  d.is_text = s.is_text();
  d.is_vector = s.is_vector();
  d.channels = s.channels();
  d.height = s.height();
  d.width = s.width();
  d.classes = s.classes();
  d.context = s.context();
  return d;
}

}  // namespace interlock
