// NumPy .npy arrays (DataSpec NPY): the header parsed here, the data region
// memory-mapped and viewed by a tensor without a copy. A batch copies only
// its own rows out of the mapping.
//
// The format (numpy.lib.format): the magic "\x93NUMPY", a major and a minor
// version byte, the header's length (2 bytes little-endian in version 1.0,
// 4 bytes in 2.0 and 3.0), then the header: a Python dict literal such as
// {'descr': '<f4', 'fortran_order': False, 'shape': (60000, 784), }, padded
// with spaces and a newline; the raw data follows.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "plan/status_macros.h"
#include "services/data.h"
#include "services/data_internal.h"

namespace interlock {
namespace data_internal {
namespace {

using v1::DataSpec;

constexpr char kNpyMagic[] = "\x93NUMPY";
constexpr size_t kNpyMagicSize = 6;
// Class ids above this are refused (as synthetic_classes is capped).
constexpr int64_t kMaxClasses = int64_t{1} << 20;

// One array of a .npy file: where its data lies in the mapping, what it is.
struct NpyArray {
  std::shared_ptr<const MappedFile> file;
  std::string descr;  // As the header writes it, for messages.
  torch::ScalarType dtype = torch::kFloat;
  std::vector<int64_t> shape;
  torch::Tensor data;  // Views the mapping.
};

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "),
                      shape.size() == 1 ? ",)" : ")");
}

// A tiny reader of the Python literals a .npy header holds: strings,
// True / False, and tuples of integers, in a dict.
class HeaderParser {
 public:
  explicit HeaderParser(std::string text) : text_(std::move(text)) {}

  struct Fields {
    std::string descr;
    bool fortran_order = false;
    std::vector<int64_t> shape;
  };

  absl::StatusOr<Fields> Parse() {
    Fields f;
    bool has_descr = false, has_order = false, has_shape = false;
    if (!Eat('{')) return Error("expected '{'");
    while (!Eat('}')) {
      std::string key;
      if (!String(&key)) return Error("expected a quoted key");
      if (!Eat(':'))
        return Error(absl::StrCat("expected ':' after '", key, "'"));
      if (key == "descr") {
        if (!String(&f.descr)) {
          return Error(
              "'descr' is not a simple dtype string (structured arrays are "
              "not taken)");
        }
        has_descr = true;
      } else if (key == "fortran_order") {
        if (Word("True")) {
          f.fortran_order = true;
        } else if (Word("False")) {
          f.fortran_order = false;
        } else {
          return Error("'fortran_order' is neither True nor False");
        }
        has_order = true;
      } else if (key == "shape") {
        if (!Tuple(&f.shape)) {
          return Error("'shape' is not a tuple of non-negative integers");
        }
        has_shape = true;
      } else {
        return Error(absl::StrCat("unexpected key '", key, "'"));
      }
      if (!Eat(',')) {
        if (!Eat('}')) return Error("expected ',' or '}'");
        break;
      }
    }
    Skip();
    if (pos_ != text_.size()) return Error("text after the closing '}'");
    if (!has_descr || !has_order || !has_shape) {
      return Error("needs the keys 'descr', 'fortran_order' and 'shape'");
    }
    return f;
  }

 private:
  absl::Status Error(const std::string& what) const {
    return absl::DataLossError(absl::StrCat("malformed header: ", what,
                                            " at offset ", pos_, " of \"",
                                            text_, "\""));
  }
  void Skip() {
    while (pos_ < text_.size() &&
           std::isspace(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
    }
  }
  bool Eat(char c) {
    Skip();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool Word(const char* word) {
    Skip();
    const size_t n = std::strlen(word);
    if (text_.compare(pos_, n, word) != 0) return false;
    pos_ += n;
    return true;
  }
  bool String(std::string* out) {
    Skip();
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) {
      return false;
    }
    const char quote = text_[pos_];
    const size_t end = text_.find(quote, pos_ + 1);
    if (end == std::string::npos) return false;
    *out = text_.substr(pos_ + 1, end - pos_ - 1);
    pos_ = end + 1;
    return true;
  }
  bool Integer(int64_t* out) {
    Skip();
    const size_t start = pos_;
    int64_t v = 0;
    while (pos_ < text_.size() &&
           std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
      const int digit = text_[pos_] - '0';
      if (v > (std::numeric_limits<int64_t>::max() - digit) / 10) return false;
      v = v * 10 + digit;
      ++pos_;
    }
    if (pos_ == start) return false;
    if (pos_ < text_.size() && text_[pos_] == 'L') ++pos_;  // Python 2.
    *out = v;
    return true;
  }
  bool Tuple(std::vector<int64_t>* out) {
    if (!Eat('(')) return false;
    out->clear();
    while (!Eat(')')) {
      int64_t v = 0;
      if (!Integer(&v)) return false;
      out->push_back(v);
      if (!Eat(',')) return Eat(')');
    }
    return true;
  }

  std::string text_;
  size_t pos_ = 0;
};

uint32_t LittleEndian(const unsigned char* p, int bytes) {
  uint32_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The dtype a descr names, or an error saying why it is not one we take.
absl::StatusOr<torch::ScalarType> DtypeOf(const std::string& descr) {
  if (descr.size() < 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype '", descr, "' is not a simple numeric dtype"));
  }
  const char order = descr[0];
  const std::string type = descr.substr(1);
  const bool one_byte = type == "u1" || type == "i1" || type == "b1";
  if (order == '>' && !one_byte) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype '", descr,
        "' is big-endian; save the array little-endian (a.astype('<", type,
        "'))"));
  }
  if (order != '<' && order != '|' && order != '=' && order != '>') {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype '", descr, "' has no byte order we know"));
  }
  if (type == "f4") return torch::kFloat;
  if (type == "f2") return torch::kHalf;
  if (type == "u1") return torch::kByte;
  if (type == "i8") return torch::kLong;
  if (type == "i4") return torch::kInt;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype '", descr, "' is not one we take"));
}

// Parses the header and maps the file. Errors name the file.
absl::StatusOr<NpyArray> OpenNpy(const std::string& path) {
  ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> file,
                   MappedFile::Open(path));
  const unsigned char* bytes = file->data();
  const size_t size = file->size();
  if (size < kNpyMagicSize ||
      std::memcmp(bytes, kNpyMagic, kNpyMagicSize) != 0) {
    return absl::DataLossError(absl::StrCat(
        path, ": not a .npy file (no \\x93NUMPY magic at the start)"));
  }
  if (size < kNpyMagicSize + 4) {
    return absl::DataLossError(absl::StrFormat(
        "%s: truncated: %d bytes, not even the .npy preamble", path, size));
  }
  const int major = bytes[6];
  const int minor = bytes[7];
  size_t header_start = 0;
  size_t header_len = 0;
  if (major == 1 && minor == 0) {
    header_start = 10;
    header_len = LittleEndian(bytes + 8, 2);
  } else if ((major == 2 || major == 3) && minor == 0) {
    header_start = 12;
    if (size < header_start) {
      return absl::DataLossError(
          absl::StrCat(path, ": truncated inside the .npy preamble"));
    }
    header_len = LittleEndian(bytes + 8, 4);
  } else {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: .npy format version %d.%d, expected 1.0, 2.0 or "
                        "3.0",
                        path, major, minor));
  }
  if (size < header_start + header_len) {
    return absl::DataLossError(absl::StrFormat(
        "%s: truncated: %d bytes, the .npy header alone needs %d", path, size,
        header_start + header_len));
  }
  const std::string header(reinterpret_cast<const char*>(bytes) + header_start,
                           header_len);
  auto fields = HeaderParser(header).Parse();
  if (!fields.ok()) {
    return absl::DataLossError(
        absl::StrCat(path, ": ", fields.status().message()));
  }
  if (fields->fortran_order) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": fortran_order is True; save a C-ordered array "
                     "(np.save(f, np.ascontiguousarray(a)))"));
  }
  auto dtype = DtypeOf(fields->descr);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", dtype.status().message()));
  }
  NpyArray a;
  a.file = file;
  a.descr = fields->descr;
  a.dtype = *dtype;
  a.shape = fields->shape;
  // Overflow-checked: elements * item size must fit the address space.
  const uint64_t item = c10::elementSize(a.dtype);
  uint64_t data_bytes = item;
  for (int64_t d : a.shape) {
    if (d != 0 && data_bytes > static_cast<uint64_t>(
                                   std::numeric_limits<int64_t>::max()) /
                                   static_cast<uint64_t>(d)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": shape ", ShapeText(a.shape), " is too large to address"));
    }
    data_bytes *= static_cast<uint64_t>(d);
  }
  const uint64_t data_start = header_start + header_len;
  if (size - data_start < data_bytes) {
    return absl::DataLossError(absl::StrFormat(
        "%s: truncated: shape %s of '%s' needs %d bytes of data after the "
        "%d-byte header, the file has %d",
        path, ShapeText(a.shape), a.descr, data_bytes, data_start,
        size - data_start));
  }
  if (data_bytes > 0) {
    a.data = MappedTensor(file, bytes + data_start, a.shape, a.dtype);
  } else {
    a.data = torch::empty(a.shape, torch::TensorOptions().dtype(a.dtype));
  }
  return a;
}

// Inputs and targets of one split, read per batch from the mappings.
class NpyDataset : public Dataset {
 public:
  NpyDataset(torch::Tensor inputs, torch::Tensor targets)
      : inputs_(std::move(inputs)), targets_(std::move(targets)) {}

  int64_t size() const override { return inputs_.size(0); }

  std::pair<torch::Tensor, torch::Tensor> Gather(
      const std::vector<int64_t>& indices) const override {
    const torch::Tensor index =
        torch::from_blob(const_cast<int64_t*>(indices.data()),
                         {static_cast<int64_t>(indices.size())}, torch::kLong);
    // index_select checks the bounds and copies only the selected rows.
    torch::Tensor x = inputs_.index_select(0, index);
    if (x.scalar_type() == torch::kByte) {
      x = x.to(torch::kFloat).div_(255.0f);
    } else if (x.scalar_type() != torch::kFloat) {
      x = x.to(torch::kFloat);
    }
    return {x, targets_.index_select(0, index).to(torch::kLong)};
  }

 private:
  torch::Tensor inputs_;
  torch::Tensor targets_;
};

struct NpySplit {
  NpyArray x;
  NpyArray y;
  int64_t min_target = 0;
  int64_t max_target = -1;
  int64_t min_at = 0;  // Index of the first smallest / largest target.
  int64_t max_at = 0;
  std::string x_path, y_path;
};

template <typename T>
void TargetRange(const torch::Tensor& t, NpySplit* s) {
  const T* p = t.data_ptr<T>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(p[i]);
    if (i == 0 || v < s->min_target) {
      s->min_target = v;
      s->min_at = i;
    }
    if (i == 0 || v > s->max_target) {
      s->max_target = v;
      s->max_at = i;
    }
  }
}

absl::StatusOr<NpySplit> OpenSplit(const std::string& dir,
                                   const std::string& name) {
  NpySplit s;
  s.x_path = JoinPath(dir, name + "_x.npy");
  s.y_path = JoinPath(dir, name + "_y.npy");
  ASSIGN_OR_RETURN(s.x, OpenNpy(s.x_path));
  ASSIGN_OR_RETURN(s.y, OpenNpy(s.y_path));
  if (s.x.dtype != torch::kFloat && s.x.dtype != torch::kHalf &&
      s.x.dtype != torch::kByte) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.x_path, ": inputs of dtype '", s.x.descr,
                     "', expected float32 ('<f4'), float16 ('<f2') or uint8 "
                     "('|u1')"));
  }
  if (s.x.shape.size() != 2 && s.x.shape.size() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.x_path, ": inputs of shape ", ShapeText(s.x.shape),
                     ", expected (N, F) vectors or (N, C, H, W) images"));
  }
  for (size_t d = 1; d < s.x.shape.size(); ++d) {
    if (s.x.shape[d] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(s.x_path, ": inputs of shape ", ShapeText(s.x.shape),
                       " have empty samples"));
    }
  }
  if (s.y.dtype != torch::kLong && s.y.dtype != torch::kInt &&
      s.y.dtype != torch::kByte) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.y_path, ": targets of dtype '", s.y.descr,
                     "', expected class ids of int64 ('<i8'), int32 ('<i4') "
                     "or uint8 ('|u1')"));
  }
  if (s.y.shape.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.y_path, ": targets of shape ", ShapeText(s.y.shape),
                     ", expected one class id per sample: (N,)"));
  }
  if (s.y.shape[0] != s.x.shape[0]) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: %d targets, but %s has %d samples", s.y_path,
                        s.y.shape[0], s.x_path, s.x.shape[0]));
  }
  if (s.x.shape[0] == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        s.x_path, ": no samples (shape ", ShapeText(s.x.shape), ")"));
  }
  // One pass over the targets (8 bytes a sample at most).
  switch (s.y.dtype) {
    case torch::kLong:
      TargetRange<int64_t>(s.y.data, &s);
      break;
    case torch::kInt:
      TargetRange<int32_t>(s.y.data, &s);
      break;
    default:
      TargetRange<uint8_t>(s.y.data, &s);
      break;
  }
  if (s.min_target < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: target %d at index %d; class ids must be >= 0",
                        s.y_path, s.min_target, s.min_at));
  }
  return s;
}

}  // namespace

absl::StatusOr<DataSplits> LoadNpy(const DataSpec& spec) {
  if (spec.path().empty()) {
    return absl::InvalidArgumentError(
        "NPY needs data.path: the folder of train_x.npy, train_y.npy, "
        "test_x.npy and test_y.npy");
  }
  const std::string& dir = spec.path();
  RETURN_IF_ERROR(CheckExists(dir, /*want_dir=*/true));
  ASSIGN_OR_RETURN(NpySplit train, OpenSplit(dir, "train"));
  ASSIGN_OR_RETURN(NpySplit test, OpenSplit(dir, "test"));
  const std::vector<int64_t> sample(train.x.shape.begin() + 1,
                                    train.x.shape.end());
  const std::vector<int64_t> test_sample(test.x.shape.begin() + 1,
                                         test.x.shape.end());
  if (sample != test_sample) {
    return absl::InvalidArgumentError(
        absl::StrCat(test.x_path, ": samples of shape ", ShapeText(test_sample),
                     ", but ", train.x_path, "'s are ", ShapeText(sample)));
  }

  int64_t classes = spec.synthetic_classes();
  if (classes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NPY: synthetic_classes ", classes, " must not be negative"));
  }
  for (const NpySplit* s : {&train, &test}) {
    if (classes > 0 && s->max_target >= classes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: target %d at index %d, expected 0..%d (synthetic_classes %d)",
          s->y_path, s->max_target, s->max_at, classes - 1, classes));
    }
    if (s->max_target >= kMaxClasses) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: target %d at index %d; at most %d classes are taken", s->y_path,
          s->max_target, s->max_at, kMaxClasses));
    }
  }
  if (classes == 0) {
    classes = std::max(train.max_target, test.max_target) + 1;
  }

  DataSplits splits;
  splits.shape.classes = classes;
  if (sample.size() == 1) {
    splits.shape.is_vector = true;
    splits.shape.channels = sample[0];
    splits.shape.height = splits.shape.width = 1;
  } else {
    splits.shape.channels = sample[0];
    splits.shape.height = sample[1];
    splits.shape.width = sample[2];
  }
  auto make = [](const NpySplit& s, int64_t cap) {
    const int64_t kept = Capped(s.x.shape[0], cap);
    return std::make_unique<NpyDataset>(s.x.data.narrow(0, 0, kept),
                                        s.y.data.narrow(0, 0, kept));
  };
  splits.train = make(train, spec.max_train());
  splits.test = make(test, spec.max_test());
  return splits;
}

absl::StatusOr<torch::Tensor> ReadNpyInputs(
    const std::string& path, const std::vector<int64_t>& sample) {
  ASSIGN_OR_RETURN(NpyArray a, OpenNpy(path));
  std::vector<int64_t> rows = a.shape;
  if (rows == sample) rows.insert(rows.begin(), 1);  // one sample
  if (rows.size() != sample.size() + 1 ||
      !std::equal(sample.begin(), sample.end(), rows.begin() + 1) ||
      rows[0] < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": shape ", ShapeText(a.shape), ", expected ", ShapeText(sample),
        " (one sample) or [N, ", absl::StrJoin(sample, ", "), "] with N >= 1"));
  }
  if (a.dtype != torch::kFloat && a.dtype != torch::kHalf &&
      a.dtype != torch::kByte) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": dtype '", a.descr,
                     "', expected float32, float16 or uint8 inputs"));
  }
  torch::Tensor x = a.data.reshape(rows);
  if (x.scalar_type() == torch::kByte) {
    return x.to(torch::kFloat).div_(255.0f);  // as NpyDataset
  }
  return x.to(torch::kFloat).clone();  // off the mapping
}

bool NpyInputsAreBytes(const std::string& dir, int64_t* channels) {
  auto x = OpenNpy(JoinPath(dir, "train_x.npy"));
  if (!x.ok() || x->dtype != torch::kByte || x->shape.size() < 2) return false;
  *channels = x->shape[1];
  return true;
}

}  // namespace data_internal
}  // namespace interlock
