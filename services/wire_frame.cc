#include "services/wire_frame.h"

#include <google/protobuf/io/coded_stream.h>

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;
using google::protobuf::MessageLite;
using google::protobuf::io::CodedOutputStream;

// Protobuf wire types.
constexpr int kVarint = 0;
constexpr int kFixed64 = 1;
constexpr int kLen = 2;
constexpr int kFixed32 = 5;
// Tensor.data and Tensor.scales.
constexpr int kDataField = 3;
constexpr int kScalesField = 6;

uint32_t Tag(int field, int wire_type) {
  return (static_cast<uint32_t>(field) << 3) | wire_type;
}

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

size_t LenFieldBytes(int field, size_t len) {
  return CodedOutputStream::VarintSize32(Tag(field, kLen)) +
         CodedOutputStream::VarintSize64(len) + len;
}

void PutLenHeader(int field, size_t len, std::string* out) {
  PutVarint(Tag(field, kLen), out);
  PutVarint(len, out);
}

// Collects the segments of a message: protobuf text written by the caller,
// and payloads in between.
class SegmentWriter {
 public:
  std::string* text() { return &text_; }
  void Add(const Payload& p) {
    if (p.size() == 0) return;
    Flush();
    segments_.push_back(p);
  }
  std::vector<Payload> Finish() {
    Flush();
    return std::move(segments_);
  }

 private:
  void Flush() {
    if (!text_.empty())
      segments_.push_back(Payload::OfString(std::move(text_)));
    text_.clear();
  }

  std::string text_;
  std::vector<Payload> segments_;
};

// A tensor field of a container message: its number, description and
// value bytes (null: none).
struct TensorRef {
  int field;
  const v1::Tensor* meta;
  const TensorBytes* bytes;
};

size_t TensorWireBytes(const TensorRef& t) {
  size_t n = t.meta->ByteSizeLong();
  if (t.bytes != nullptr) {
    if (t.bytes->data.size() > 0) {
      n += LenFieldBytes(kDataField, t.bytes->data.size());
    }
    if (t.bytes->scales.size() > 0) {
      n += LenFieldBytes(kScalesField, t.bytes->scales.size());
    }
  }
  return n;
}

void WriteTensor(const TensorRef& t, SegmentWriter* w) {
  PutLenHeader(t.field, TensorWireBytes(t), w->text());
  t.meta->AppendToString(w->text());
  if (t.bytes == nullptr) return;
  auto bytes = [&](int field, const Payload& p) {
    if (p.size() == 0) return;
    PutLenHeader(field, p.size(), w->text());
    w->Add(p);
  };
  bytes(kDataField, t.bytes->data);
  bytes(kScalesField, t.bytes->scales);
}

// `outer_rest`, then (unless `container` is 0) that field holding
// `inner_rest` followed by `tensors`. Protobuf readers take fields in any
// order, so the tensors need not sit at their field numbers' places.
std::vector<Payload> Write(const MessageLite& outer_rest, int container,
                           const MessageLite& inner_rest,
                           const std::vector<TensorRef>& tensors) {
  SegmentWriter w;
  outer_rest.AppendToString(w.text());
  if (container != 0) {
    size_t inner = inner_rest.ByteSizeLong();
    for (const TensorRef& t : tensors) {
      inner += LenFieldBytes(t.field, TensorWireBytes(t));
    }
    PutLenHeader(container, inner, w.text());
    inner_rest.AppendToString(w.text());
    for (const TensorRef& t : tensors) WriteTensor(t, &w);
  }
  return w.Finish();
}

const TensorBytes* Slot(const std::vector<TensorBytes>& t, size_t i) {
  return i < t.size() ? &t[i] : nullptr;
}

int64_t Total(const std::vector<Payload>& segments) {
  int64_t n = 0;
  for (const Payload& p : segments) n += static_cast<int64_t>(p.size());
  return n;
}

// `outer_rest` holding a forward or an eval `d` (D: ForwardData or
// EvalData, each with an input and a target) as field `field`.
template <typename D>
std::vector<Payload> WriteBatch(const MessageLite& outer_rest, int field,
                                const D& d,
                                const std::vector<TensorBytes>& bytes) {
  D inner = d;
  inner.clear_input();
  inner.clear_target();
  std::vector<TensorRef> tensors;
  if (d.has_input()) {
    tensors.push_back({D::kInputFieldNumber, &d.input(), Slot(bytes, 0)});
  }
  if (d.has_target()) {
    tensors.push_back({D::kTargetFieldNumber, &d.target(), Slot(bytes, 1)});
  }
  return Write(outer_rest, field, inner, tensors);
}

// Where a message keeps tensors: a container field (forward, eval, upward)
// and its tensor fields, each with its slot (-1: repeated, the next slot).
struct TensorField {
  int number;
  int slot;
};
struct Container {
  int number;
  std::vector<TensorField> tensors;
};

// Reads a protobuf encoding from the pieces it arrived in. Positions are
// counted as the bytes still unread, so a region's end is a count.
class Reader {
 public:
  explicit Reader(const Payload& p) : pieces_(p.pieces()), left_(p.size()) {}

  size_t left() const { return left_; }
  size_t position(size_t total) const { return total - left_; }

  bool Byte(uint8_t* b) {
    if (left_ == 0) return false;
    Settle();
    *b = static_cast<uint8_t>(pieces_[piece_][offset_]);
    ++offset_;
    --left_;
    return true;
  }

  // The next `n` bytes (n <= left()), as views of the pieces.
  void Take(size_t n, std::vector<absl::string_view>* out) {
    while (n > 0) {
      Settle();
      const absl::string_view p = pieces_[piece_];
      const size_t k = std::min(n, p.size() - offset_);
      out->push_back(p.substr(offset_, k));
      offset_ += k;
      left_ -= k;
      n -= k;
    }
  }

  void Append(size_t n, std::string* out) {
    std::vector<absl::string_view> views;
    Take(n, &views);
    for (absl::string_view v : views) out->append(v.data(), v.size());
  }

 private:
  // Moves past exhausted pieces (there is a byte left).
  void Settle() {
    while (offset_ == pieces_[piece_].size()) {
      ++piece_;
      offset_ = 0;
    }
  }

  const std::vector<absl::string_view>& pieces_;
  size_t piece_ = 0;
  size_t offset_ = 0;
  size_t left_;
};

// Splits a message into its protobuf text without the tensors' data and
// scales (re-encoded with the lengths adjusted) and those bytes.
class FrameParser {
 public:
  FrameParser(const Payload& bytes, const char* what)
      : reader_(bytes),
        owner_(bytes.owner()),
        total_(bytes.size()),
        what_(what) {}

  absl::Status Message(const std::vector<Container>& containers,
                       std::string* rest, std::vector<TensorBytes>* tensors) {
    bool seen = false;
    while (reader_.left() > 0) {
      uint32_t field = 0;
      int wire_type = 0;
      RETURN_IF_ERROR(Key(0, &field, &wire_type));
      const Container* c = nullptr;
      for (const Container& k : containers) {
        if (k.number == static_cast<int>(field) && wire_type == kLen) c = &k;
      }
      if (c == nullptr) {
        RETURN_IF_ERROR(CopyValue(field, wire_type, 0, rest));
        continue;
      }
      if (seen) {
        return Error(absl::StrCat("field ", field,
                                  " repeats a message field given before"));
      }
      seen = true;
      size_t len = 0;
      RETURN_IF_ERROR(Length(0, &len));
      std::string inner;
      RETURN_IF_ERROR(Fields(*c, reader_.left() - len, &inner, tensors));
      PutLenHeader(c->number, inner.size(), rest);
      rest->append(inner);
    }
    return absl::OkStatus();
  }

  absl::Status Error(const std::string& problem) const {
    return absl::InvalidArgumentError(
        absl::StrCat(what_, ": ", problem, " (at byte ",
                     reader_.position(total_), " of ", total_, ")"));
  }

 private:
  // The fields of container `c`, up to `end` bytes left.
  absl::Status Fields(const Container& c, size_t end, std::string* out,
                      std::vector<TensorBytes>* tensors) {
    int next = 0;  // the next repeated slot
    std::vector<bool> seen;
    while (reader_.left() > end) {
      uint32_t field = 0;
      int wire_type = 0;
      RETURN_IF_ERROR(Key(end, &field, &wire_type));
      const TensorField* t = nullptr;
      for (const TensorField& k : c.tensors) {
        if (k.number == static_cast<int>(field) && wire_type == kLen) t = &k;
      }
      if (t == nullptr) {
        RETURN_IF_ERROR(CopyValue(field, wire_type, end, out));
        continue;
      }
      const size_t slot = t->slot >= 0 ? t->slot : next++;
      if (seen.size() <= slot) seen.resize(slot + 1);
      if (seen[slot]) {
        return Error(absl::StrCat("tensor field ", field, " of field ",
                                  c.number, " given twice"));
      }
      seen[slot] = true;
      size_t len = 0;
      RETURN_IF_ERROR(Length(end, &len));
      std::string meta;
      TensorBytes bytes;
      RETURN_IF_ERROR(Tensor(reader_.left() - len, &meta, &bytes));
      PutLenHeader(field, meta.size(), out);
      out->append(meta);
      if (tensors->size() <= slot) tensors->resize(slot + 1);
      (*tensors)[slot] = std::move(bytes);
    }
    return absl::OkStatus();
  }

  // A Tensor's fields up to `end`: data and scales into `bytes`, without
  // copying; the rest into `out`.
  absl::Status Tensor(size_t end, std::string* out, TensorBytes* bytes) {
    bool seen[2] = {false, false};
    while (reader_.left() > end) {
      uint32_t field = 0;
      int wire_type = 0;
      RETURN_IF_ERROR(Key(end, &field, &wire_type));
      const bool data = field == kDataField;
      if (wire_type != kLen || (!data && field != kScalesField)) {
        RETURN_IF_ERROR(CopyValue(field, wire_type, end, out));
        continue;
      }
      if (seen[data ? 0 : 1]) {
        return Error(
            absl::StrCat("tensor ", data ? "data" : "scales", " given twice"));
      }
      seen[data ? 0 : 1] = true;
      size_t len = 0;
      RETURN_IF_ERROR(Length(end, &len));
      std::vector<absl::string_view> pieces;
      reader_.Take(len, &pieces);
      (data ? bytes->data : bytes->scales) = Payload(std::move(pieces), owner_);
    }
    return absl::OkStatus();
  }

  // A varint of at most 10 bytes before `end`, its bytes appended to `raw`
  // when given.
  absl::Status Varint(size_t end, uint64_t* v, std::string* raw = nullptr) {
    *v = 0;
    for (int i = 0; i < 10; ++i) {
      uint8_t b = 0;
      if (reader_.left() <= end || !reader_.Byte(&b)) {
        return Error("truncated varint");
      }
      if (raw != nullptr) raw->push_back(static_cast<char>(b));
      if (i == 9 && b > 1) return Error("varint longer than 64 bits");
      *v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) return absl::OkStatus();
    }
    return Error("varint longer than 10 bytes");
  }

  absl::Status Key(size_t end, uint32_t* field, int* wire_type) {
    uint64_t key = 0;
    std::string raw;
    RETURN_IF_ERROR(Varint(end, &key, &raw));
    // Protobuf reads a key in at most 5 bytes, overlong or not.
    if (raw.size() > 5 || key > 0xffffffffu || (key >> 3) == 0) {
      return Error(absl::StrCat("invalid field key ", key));
    }
    *field = static_cast<uint32_t>(key >> 3);
    *wire_type = static_cast<int>(key & 7);
    return absl::OkStatus();
  }

  // A length that fits in what is left before `end`.
  absl::Status Length(size_t end, size_t* len) {
    uint64_t v = 0;
    RETURN_IF_ERROR(Varint(end, &v));
    if (v > reader_.left() - end) {
      return Error(absl::StrCat("a field of ", v, " bytes where ",
                                reader_.left() - end, " are left"));
    }
    *len = static_cast<size_t>(v);
    return absl::OkStatus();
  }

  // A field other than the ones taken apart, appended as it came (its key
  // re-encoded), for protobuf to parse.
  absl::Status CopyValue(uint32_t field, int wire_type, size_t end,
                         std::string* out) {
    PutVarint(Tag(static_cast<int>(field), wire_type), out);
    size_t n = 0;
    switch (wire_type) {
      case kVarint: {
        uint64_t v = 0;
        return Varint(end, &v, out);
      }
      case kFixed64:
        n = 8;
        break;
      case kFixed32:
        n = 4;
        break;
      case kLen:
        RETURN_IF_ERROR(Length(end, &n));
        PutVarint(n, out);
        break;
      default:
        return Error(absl::StrCat("field ", field, " has wire type ", wire_type,
                                  " (groups are not supported)"));
    }
    if (n > reader_.left() - end) return Error("truncated field");
    reader_.Append(n, out);
    return absl::OkStatus();
  }

  Reader reader_;
  const std::shared_ptr<const void> owner_;
  const size_t total_;
  const char* what_;
};

template <typename M>
absl::StatusOr<Framed<M>> Parse(const Payload& bytes,
                                const std::vector<Container>& containers,
                                const char* what, size_t slots) {
  FrameParser parser(bytes, what);
  Framed<M> frame;
  std::string rest;
  RETURN_IF_ERROR(parser.Message(containers, &rest, &frame.tensors));
  if (!frame.proto.ParseFromString(rest)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a valid ", M::descriptor()->full_name()));
  }
  frame.tensors.resize(std::max(slots, frame.tensors.size()));
  return frame;
}

// The input and target of a DownMessage's forward or eval (null where
// absent).
std::pair<v1::Tensor*, v1::Tensor*> DownTensors(v1::DownMessage* m) {
  std::pair<v1::Tensor*, v1::Tensor*> t{nullptr, nullptr};
  if (m->has_forward()) {
    v1::ForwardData* d = m->mutable_forward();
    if (d->has_input()) t.first = d->mutable_input();
    if (d->has_target()) t.second = d->mutable_target();
  } else if (m->has_eval()) {
    v1::EvalData* d = m->mutable_eval();
    if (d->has_input()) t.first = d->mutable_input();
    if (d->has_target()) t.second = d->mutable_target();
  }
  return t;
}

TensorBytes TakeBytes(v1::Tensor* t) {
  TensorBytes b{Payload::OfString(std::move(*t->mutable_data())),
                Payload::OfString(std::move(*t->mutable_scales()))};
  t->clear_data();
  t->clear_scales();
  return b;
}

}  // namespace

std::vector<Payload> FrameSegments(const DownFrame& f) {
  v1::DownMessage outer = f.proto;
  outer.clear_kind();
  if (f.proto.has_forward()) {
    return WriteBatch(outer, v1::DownMessage::kForwardFieldNumber,
                      f.proto.forward(), f.tensors);
  }
  if (f.proto.has_eval()) {
    return WriteBatch(outer, v1::DownMessage::kEvalFieldNumber, f.proto.eval(),
                      f.tensors);
  }
  return Write(outer, 0, outer, {});
}

std::vector<Payload> FrameSegments(const UpFrame& f) {
  v1::UpMessage outer = f.proto;
  outer.clear_kind();
  if (!f.proto.has_upward()) return Write(outer, 0, outer, {});
  const v1::UpwardData& d = f.proto.upward();
  v1::UpwardData inner = d;
  inner.clear_gradients();
  std::vector<TensorRef> tensors;
  for (int i = 0; i < d.gradients_size(); ++i) {
    tensors.push_back({v1::UpwardData::kGradientsFieldNumber, &d.gradients(i),
                       Slot(f.tensors, i)});
  }
  return Write(outer, v1::UpMessage::kUpwardFieldNumber, inner, tensors);
}

int64_t FrameBytes(const DownFrame& frame) {
  return Total(FrameSegments(frame));
}

int64_t FrameBytes(const UpFrame& frame) { return Total(FrameSegments(frame)); }

absl::StatusOr<DownFrame> ParseDownFrame(const Payload& bytes) {
  static const auto* containers =
      new std::vector<Container>{{v1::DownMessage::kForwardFieldNumber,
                                  {{v1::ForwardData::kInputFieldNumber, 0},
                                   {v1::ForwardData::kTargetFieldNumber, 1}}},
                                 {v1::DownMessage::kEvalFieldNumber,
                                  {{v1::EvalData::kInputFieldNumber, 0},
                                   {v1::EvalData::kTargetFieldNumber, 1}}}};
  return Parse<v1::DownMessage>(bytes, *containers, "down message", 2);
}

absl::StatusOr<UpFrame> ParseUpFrame(const Payload& bytes) {
  static const auto* containers = new std::vector<Container>{
      {v1::UpMessage::kUpwardFieldNumber,
       {{v1::UpwardData::kGradientsFieldNumber, -1}}}};
  return Parse<v1::UpMessage>(bytes, *containers, "up message", 0);
}

DownFrame ToFrame(v1::DownMessage m) {
  DownFrame f;
  f.proto = std::move(m);
  f.tensors.resize(2);
  auto [input, target] = DownTensors(&f.proto);
  if (input != nullptr) f.tensors[0] = TakeBytes(input);
  if (target != nullptr) f.tensors[1] = TakeBytes(target);
  return f;
}

UpFrame ToFrame(v1::UpMessage m) {
  UpFrame f;
  f.proto = std::move(m);
  if (!f.proto.has_upward()) return f;
  auto* grads = f.proto.mutable_upward()->mutable_gradients();
  for (v1::Tensor& g : *grads) f.tensors.push_back(TakeBytes(&g));
  return f;
}

v1::DownMessage ToProto(const DownFrame& frame) {
  v1::DownMessage m = frame.proto;
  auto [input, target] = DownTensors(&m);
  if (input != nullptr && !frame.tensors.empty()) {
    AttachBytes(frame.tensors[0], input);
  }
  if (target != nullptr && frame.tensors.size() > 1) {
    AttachBytes(frame.tensors[1], target);
  }
  return m;
}

v1::UpMessage ToProto(const UpFrame& frame) {
  v1::UpMessage m = frame.proto;
  if (!m.has_upward()) return m;
  auto* grads = m.mutable_upward()->mutable_gradients();
  for (int i = 0;
       i < grads->size() && i < static_cast<int>(frame.tensors.size()); ++i) {
    AttachBytes(frame.tensors[i], grads->Mutable(i));
  }
  return m;
}

}  // namespace interlock
