#include "services/state_archive.h"

#include <c10/core/CPUAllocator.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "plan/status_macros.h"

namespace interlock {
namespace {

// Little-endian reads; callers check the bounds first.
uint64_t Le(absl::string_view b, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) {
    v = (v << 8) | static_cast<uint8_t>(b[at + i]);
  }
  return v;
}

constexpr uint32_t kEndOfDirectory = 0x06054b50;
constexpr uint32_t kDirectoryEntry = 0x02014b50;
constexpr uint32_t kLocalHeader = 0x04034b50;
constexpr uint32_t kZip64Locator = 0x07064b50;
constexpr uint32_t kZip64Record = 0x06064b50;
constexpr size_t kLocatorSize = 20;
constexpr size_t kZip64RecordSize = 56;
constexpr size_t kEndSize = 22;
constexpr size_t kEntrySize = 46;
constexpr size_t kLocalSize = 30;

// Walks the pickle: every opcode must be one LibTorch's pickler writes,
// every argument must fit in what is left, and the stack must stay
// balanced. LibTorch's unpickler assumes all of it: TUPLE without a MARK
// reads an empty vector's back() and ends in a bad free.
absl::Status CheckPickle(absl::string_view p, const std::string& what) {
  size_t at = 0;
  uint64_t memo = 0;   // memo slots defined so far (BINPUT numbers them)
  uint64_t depth = 0;  // values on the unpickler's stack
  std::vector<uint64_t> marks;  // stack depth at each open MARK
  auto bad = [&](size_t op_at, const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: pickle opcode 0x%02x at byte %d: %s", what,
                        static_cast<uint8_t>(p[op_at]), op_at, why));
  };
  while (at < p.size()) {
    const size_t op_at = at++;
    const size_t left = p.size() - at;
    // Pops `n` values (never from below the innermost MARK), pushes one.
    auto pop_push = [&](uint64_t n) -> absl::Status {
      const uint64_t floor = marks.empty() ? 0 : marks.back();
      if (depth < floor + n) return bad(op_at, "stack underflow");
      depth = depth - n + 1;
      return absl::OkStatus();
    };
    // Closes the innermost MARK; the values above it are the operands.
    auto close_mark = [&]() -> absl::StatusOr<uint64_t> {
      if (marks.empty()) return bad(op_at, "no MARK");
      const uint64_t m = marks.back();
      marks.pop_back();
      return depth - m;
    };
    auto fixed = [&](size_t n) -> absl::Status {
      if (n > left) return bad(op_at, "argument runs past the end");
      at += n;
      return pop_push(0);
    };
    // A length prefix of `n` bytes, then that many bytes.
    auto counted = [&](int n) -> absl::Status {
      if (static_cast<size_t>(n) > left) {
        return bad(op_at, "length runs past the end");
      }
      const uint64_t len = Le(p, at, n);
      if (len > left - n) {
        return bad(op_at, absl::StrCat("says ", len, " bytes, ", left - n,
                                       " are left"));
      }
      at += n + len;
      return pop_push(0);
    };
    // SETITEMS / APPENDS: the operands go into the container below them.
    auto fill = [&](bool pairs) -> absl::Status {
      absl::StatusOr<uint64_t> n = close_mark();
      if (!n.ok()) return n.status();
      if (pairs && *n % 2 != 0) return bad(op_at, "odd number of items");
      depth -= *n;
      const uint64_t floor = marks.empty() ? 0 : marks.back();
      if (depth < floor + 1) return bad(op_at, "no container");
      return absl::OkStatus();
    };
    absl::Status s;
    switch (static_cast<uint8_t>(p[op_at])) {
      case 0x80:  // PROTO
        if (left < 1 || p[at] != 2) return bad(op_at, "not protocol 2");
        at += 1;
        break;
      case '.':  // STOP
        if (at != p.size()) return bad(op_at, "bytes after STOP");
        if (depth != 1 || !marks.empty()) {
          return bad(op_at, "unbalanced stack at the end");
        }
        return absl::OkStatus();
      case 'c': {  // GLOBAL: "module\nname\n"
        for (int line = 0; line < 2; ++line) {
          const size_t nl = p.find('\n', at);
          if (nl == absl::string_view::npos || nl - at > 256) {
            return bad(op_at, "unterminated or long name");
          }
          at = nl + 1;
        }
        s = pop_push(0);
        break;
      }
      case '(':  // MARK
        marks.push_back(depth);
        break;
      case ')':   // EMPTY_TUPLE
      case ']':   // EMPTY_LIST
      case '}':   // EMPTY_DICT
      case 'N':   // NONE
      case 0x88:  // NEWTRUE
      case 0x89:  // NEWFALSE
        s = pop_push(0);
        break;
      case 'Q':   // BINPERSID
      case 0x85:  // TUPLE1
        s = pop_push(1);
        break;
      case 'R':   // REDUCE
      case 'b':   // BUILD
      case 'a':   // APPEND
      case 0x86:  // TUPLE2
        s = pop_push(2);
        break;
      case 's':   // SETITEM
      case 0x87:  // TUPLE3
        s = pop_push(3);
        break;
      case 't': {  // TUPLE
        absl::StatusOr<uint64_t> n = close_mark();
        if (!n.ok()) return n.status();
        depth = depth - *n + 1;
        break;
      }
      case 'e':  // APPENDS
        s = fill(/*pairs=*/false);
        break;
      case 'u':  // SETITEMS
        s = fill(/*pairs=*/true);
        break;
      case 'K':  // BININT1
        s = fixed(1);
        break;
      case 'M':  // BININT2
        s = fixed(2);
        break;
      case 'J':  // BININT
        s = fixed(4);
        break;
      case 'G':  // BINFLOAT
        s = fixed(8);
        break;
      case 0x8a:  // LONG1: LibTorch reads at most 8 bytes
        if (left < 1 || static_cast<uint8_t>(p[at]) > 8) {
          return bad(op_at, "integer longer than 8 bytes");
        }
        s = counted(1);
        break;
      case 'X':  // BINUNICODE
      case 'B':  // BINBYTES
        s = counted(4);
        break;
      case 0x8c:  // SHORT_BINUNICODE
      case 'C':   // SHORT_BINBYTES
        s = counted(1);
        break;
      case 'q':    // BINPUT
      case 'r': {  // LONG_BINPUT
        const int n = p[op_at] == 'q' ? 1 : 4;
        if (static_cast<size_t>(n) > left) return bad(op_at, "cut short");
        const uint64_t id = Le(p, at, n);
        // The pickler numbers memo slots 0, 1, 2, ...; a larger number
        // would make the unpickler reserve room for all slots up to it.
        if (id > memo) return bad(op_at, absl::StrCat("memo slot ", id));
        if (depth == 0) return bad(op_at, "empty stack");
        if (id == memo) ++memo;
        at += n;
        break;
      }
      case 'h':    // BINGET
      case 'j': {  // LONG_BINGET
        const int n = p[op_at] == 'h' ? 1 : 4;
        if (static_cast<size_t>(n) > left) return bad(op_at, "cut short");
        if (Le(p, at, n) >= memo) return bad(op_at, "undefined memo slot");
        at += n;
        s = pop_push(0);
        break;
      }
      default:
        return bad(op_at, "not written by LibTorch's pickler");
    }
    if (!s.ok()) return s;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": pickle does not end in STOP"));
}

// Where the parts of an archive that passed the zip checks lie in its bytes.
struct ArchiveParts {
  absl::string_view pickle;  // data.pkl
  int64_t version = 0;       // the version record
  // Every entry by its name inside the archive's folder ("data/0", ...).
  std::map<std::string, absl::string_view> records;
};

// The zip checks: where every entry lies, or the first problem. Each way we
// know LibTorch's zip reader (miniz under PyTorchStreamReader) refused an
// archive is refused here too, so that reading the entries ourselves does
// not accept what LibTorch refused.
absl::StatusOr<ArchiveParts> LocateParts(absl::string_view b,
                                         const std::string& what) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", why));
  };
  if (b.size() < kEndSize) return bad("too short for a zip archive");
  // The end-of-directory record: the last one, within its comment's reach.
  size_t end = absl::string_view::npos;
  const size_t lowest =
      b.size() > kEndSize + 0xffff ? b.size() - kEndSize - 0xffff : 0;
  for (size_t i = b.size() - kEndSize + 1; i-- > lowest;) {
    if (Le(b, i, 4) == kEndOfDirectory) {
      end = i;
      break;
    }
  }
  if (end == absl::string_view::npos) return bad("no zip directory");
  uint64_t entries = Le(b, end + 10, 2);
  uint64_t dir_size = Le(b, end + 12, 4);
  uint64_t dir_at = Le(b, end + 16, 4);
  if (Le(b, end + 4, 2) != 0 || Le(b, end + 6, 2) != 0 ||
      Le(b, end + 8, 2) != entries) {
    return bad("multi-part zip archive");
  }
  // LibTorch's writer adds a zip64 record and its locator just before the
  // end record, and its reader then takes the directory from the zip64
  // record: so does this check.
  size_t dir_end = end;
  if (end >= kLocatorSize && Le(b, end - kLocatorSize, 4) == kZip64Locator) {
    const size_t locator = end - kLocatorSize;
    const uint64_t record = Le(b, locator + 8, 8);
    if (Le(b, locator + 4, 4) != 0 || Le(b, locator + 16, 4) != 1 ||
        record > locator || locator - record < kZip64RecordSize ||
        Le(b, record, 4) != kZip64Record ||
        Le(b, record + 4, 8) < kZip64RecordSize - 12) {
      return bad("damaged zip64 record");
    }
    entries = Le(b, record + 32, 8);
    dir_size = Le(b, record + 40, 8);
    dir_at = Le(b, record + 48, 8);
    if (Le(b, record + 16, 4) != 0 || Le(b, record + 20, 4) != 0 ||
        Le(b, record + 24, 8) != entries) {
      return bad("multi-part zip archive");
    }
    dir_end = record;
  }
  if (dir_at > dir_end || dir_size > dir_end - dir_at ||
      entries > dir_size / kEntrySize) {
    return bad("zip directory out of bounds");
  }
  ArchiveParts parts;
  int pickles = 0;
  // LibTorch takes the folder of the first entry as the archive's name;
  // every entry must be in it.
  std::string folder;
  size_t at = dir_at;
  for (uint64_t k = 0; k < entries; ++k) {
    if (at + kEntrySize > dir_at + dir_size ||
        Le(b, at, 4) != kDirectoryEntry) {
      return bad(absl::StrCat("zip directory entry ", k, " is damaged"));
    }
    const uint64_t flags = Le(b, at + 8, 2);
    const uint64_t method = Le(b, at + 10, 2);
    const uint64_t packed = Le(b, at + 20, 4);
    const uint64_t size = Le(b, at + 24, 4);
    const uint64_t name_len = Le(b, at + 28, 2);
    const uint64_t extra_len = Le(b, at + 30, 2);
    const uint64_t comment_len = Le(b, at + 32, 2);
    const uint64_t disk = Le(b, at + 34, 2);
    const uint64_t local = Le(b, at + 42, 4);
    const size_t next = at + kEntrySize + name_len + extra_len + comment_len;
    if (next > dir_at + dir_size) {
      return bad(absl::StrCat("zip directory entry ", k, " is damaged"));
    }
    const std::string name(b.substr(at + kEntrySize, name_len));
    // Names come from the file: escaped and cut short in messages.
    const std::string entry =
        absl::StrCat("zip entry '", absl::CHexEscape(name.substr(0, 64)), "'");
    // Flag bits 0, 6 and 13 mark encryption.
    if (method != 0 || packed != size || (flags & 0x2041) != 0) {
      return bad(entry + " is compressed or encrypted; LibTorch stores");
    }
    // Bit 5: patch data. LibTorch's reader refused it only when reading the
    // entry, after it held the directory, and that refusal leaked (found by
    // fuzz_checkpoint_reader's leak check on the version record).
    if ((flags & 0x20) != 0) return bad(entry + " is marked as patch data");
    if (disk != 0) return bad(entry + " is on another part (multi-part zip)");
    // All ones: the real value is in a zip64 field, which LibTorch's
    // writer uses only past 4 GiB, more than any state may be.
    if (size == 0xffffffff || local == 0xffffffff) {
      return bad(entry + " has zip64 sizes");
    }
    if (local + kLocalSize > dir_at || Le(b, local, 4) != kLocalHeader) {
      return bad(entry + ": local header out of bounds or damaged");
    }
    const uint64_t data_at =
        local + kLocalSize + Le(b, local + 26, 2) + Le(b, local + 28, 2);
    if (data_at + size > dir_at) {
      return bad(entry + ": data out of bounds");
    }
    if (k == 0) {
      const size_t slash = name.find('/');
      if (slash == std::string::npos || slash == 0) {
        return bad(entry + " is not in a folder");
      }
      folder = name.substr(0, slash + 1);
    } else if (!absl::StartsWith(name, folder)) {
      return bad(absl::StrCat(entry, " is not in the folder of the first"));
    }
    const absl::string_view data = b.substr(data_at, size);
    if (name == folder + "data.pkl") {
      ++pickles;
      parts.pickle = data;
    } else if (!parts.records.emplace(name.substr(folder.size()), data)
                    .second) {
      // Which of two entries a reader takes is up to the reader.
      return bad(entry + " appears twice");
    }
    at = next;
  }
  if (pickles != 1) {
    return bad(absl::StrCat(pickles, " data.pkl entries, expected 1"));
  }
  // LibTorch 1.13 reads format versions 1 to 10.
  const auto version = parts.records.find("version");
  if (version == parts.records.end() ||
      !absl::SimpleAtoi(absl::StripAsciiWhitespace(version->second),
                        &parts.version) ||
      parts.version < 1 || parts.version > 10) {
    return bad("no usable version record");
  }
  return parts;
}

}  // namespace

absl::Status CheckStateArchive(absl::string_view b, const std::string& what) {
  ASSIGN_OR_RETURN(const ArchiveParts parts, LocateParts(b, what));
  return CheckPickle(parts.pickle, what);
}

namespace {

// Version 2: torch::pickle_save of (format, block, step, tensors, optimizer)
// (the zip format of torch.save). Version 1 used torch::serialize archives,
// whose reader compiles the TorchScript type definitions stored in the file
// and crashed on damaged ones (found by fuzz_checkpoint_reader).
constexpr int64_t kStateFormat = 2;

// Archives hold CPU tensors whatever device the block runs on, so any
// process (with or without a GPU) can read them.
c10::IValue NamedToIValue(const std::map<std::string, torch::Tensor>& named) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::TensorType::get());
  // NCHW whatever the block computes in (model.resnet.memory_format): the
  // reader accepts only contiguous tensors, and archives stay layout-free.
  for (const auto& [name, t] : named) {
    d.insert(name, t.detach().cpu().contiguous());
  }
  return d;
}

// The records the unpickler was given, by the address of their copy (a
// later copy at a freed copy's address replaces it): a tensor's storage is
// checked against the record it really holds.
struct GivenRecord {
  std::string name;
  size_t bytes = 0;
};
using GivenRecords = std::map<const void*, GivenRecord>;

// The unpickler builds tensors from the sizes, strides and offsets in the
// file without checking them against their storage, and sizes the storage
// by the element count the pickle names, not by the record it read; check
// both before any value is read. Only metadata is read, so the tensor may
// be on any device.
absl::Status CheckInBounds(const torch::Tensor& t, const GivenRecords& given,
                           const std::string& what) {
  if (!t.defined() || t.layout() != torch::kStrided || t.is_quantized() ||
      !t.has_storage()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a dense tensor"));
  }
  int64_t numel = 1;
  for (const int64_t d : t.sizes()) {
    if (d < 0 || __builtin_mul_overflow(numel, d, &numel)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": invalid sizes ", c10::str(t.sizes())));
    }
  }
  if (!t.is_contiguous() || t.storage_offset() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a contiguous tensor"));
  }
  int64_t end = 0;
  int64_t bytes = 0;
  if (__builtin_add_overflow(t.storage_offset(), numel, &end) ||
      __builtin_mul_overflow(end, static_cast<int64_t>(t.element_size()),
                             &bytes) ||
      bytes > static_cast<int64_t>(t.storage().nbytes())) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", c10::str(t.sizes()), " at offset ", t.storage_offset(),
        " reaches past its storage of ", t.storage().nbytes(), " bytes"));
  }
  const auto record = given.find(t.storage().data());
  const size_t held = record == given.end() ? 0 : record->second.bytes;
  if (t.storage().nbytes() > held) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": its storage claims ", t.storage().nbytes(), " bytes, ",
        record == given.end()
            ? std::string("and the archive gave it none")
            : absl::StrCat("its record '",
                           absl::CHexEscape(record->second.name.substr(0, 64)),
                           "' holds ", held)));
  }
  return absl::OkStatus();
}

// The type tags our writer puts on containers (restore_type_tag). Any other
// text would go to TorchScript's type parser, which an archive has no
// reason to reach.
c10::TypePtr ParseTypeTag(const std::string& text) {
  TORCH_CHECK(text == "Dict[str, Tensor]", "type tag '",
              absl::CHexEscape(text.substr(0, 64)),
              "' is not one a block state archive holds");
  return torch::jit::Unpickler::defaultTypeParser(text);
}

// What torch::pickle_load does, over the entries LocateParts found and
// never through LibTorch's zip reader, which leaks when it refuses an
// archive (its constructor throws past its own cleanup; found by
// fuzz_checkpoint_reader's leak check). Plain values and tensors only (no
// class resolver, so an archive naming any other type is refused), all read
// onto the CPU whatever device the file names (the trainer copies them to
// its own). Each record is copied, as LibTorch's reader copied it, at most
// once: a pickle naming one record many times cannot multiply its size.
c10::IValue Unpickle(const ArchiveParts& parts, GivenRecords* given) {
  size_t at = 0;
  auto read = [&parts, &at](char* buf, size_t n) -> size_t {
    n = std::min(n, parts.pickle.size() - at);
    if (n == 0) return 0;
    std::memcpy(buf, parts.pickle.data() + at, n);
    at += n;
    return n;
  };
  std::set<std::string> read_once;
  auto read_record = [&parts, given,
                      &read_once](const std::string& key) -> at::DataPtr {
    const std::string name = "data/" + key;
    const auto it = parts.records.find(name);
    TORCH_CHECK(it != parts.records.end(), "no record '",
                absl::CHexEscape(name.substr(0, 64)), "' in the archive");
    TORCH_CHECK(read_once.insert(name).second, "record '",
                absl::CHexEscape(name.substr(0, 64)), "' is read twice");
    at::DataPtr data = c10::GetCPUAllocator()->allocate(it->second.size());
    if (!it->second.empty()) {
      std::memcpy(data.get(), it->second.data(), it->second.size());
      (*given)[data.get()] = {name, it->second.size()};
    }
    return data;
  };
  torch::jit::Unpickler unpickler(read, /*type_resolver=*/nullptr,
                                  /*obj_loader=*/nullptr, read_record,
                                  /*device=*/c10::Device(c10::kCPU),
                                  /*use_storage_device=*/false, ParseTypeTag);
  unpickler.set_version(parts.version);
  return unpickler.parse_ivalue();
}

absl::StatusOr<std::map<std::string, torch::Tensor>> NamedFromIValue(
    const c10::IValue& v, const GivenRecords& given, const std::string& what) {
  if (!v.isGenericDict()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a dictionary of tensors"));
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& e : v.toGenericDict()) {
    if (!e.key().isString() || !e.value().isTensor()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": an entry is not a name and a tensor"));
    }
    const std::string name = e.key().toStringRef();
    const torch::Tensor& t = e.value().toTensor();
    RETURN_IF_ERROR(
        CheckInBounds(t, given, absl::StrCat(what, " '", name, "'")));
    out[name] = t;
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> EncodeBlockState(const BlockStateRecord& record) {
  try {
    const std::vector<char> bytes =
        torch::pickle_save(c10::ivalue::Tuple::create(
            {c10::IValue(kStateFormat), c10::IValue(record.block),
             c10::IValue(record.step), NamedToIValue(record.tensors),
             NamedToIValue(record.optimizer)}));
    return std::string(bytes.begin(), bytes.end());
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(
        "block ", record.block, " state: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<BlockStateRecord> DecodeBlockState(const std::string& bytes,
                                                  const std::string& what) {
  ASSIGN_OR_RETURN(const ArchiveParts parts, LocateParts(bytes, what));
  RETURN_IF_ERROR(CheckPickle(parts.pickle, what));
  try {
    GivenRecords given;
    const c10::IValue v = Unpickle(parts, &given);
    // A copy: gcc's bounds check misreads the tuple's inline storage.
    const std::vector<c10::IValue> e = v.isTuple()
                                           ? v.toTupleRef().elements().vec()
                                           : std::vector<c10::IValue>();
    if (e.size() != 5 || !e[0].isInt() || !e[1].isInt() || !e[2].isInt()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": not a block state archive"));
    }
    if (e[0].toInt() != kStateFormat) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": archive format ", e[0].toInt(), ", expected ",
                       kStateFormat));
    }
    BlockStateRecord record;
    record.block = e[1].toInt();
    record.step = e[2].toInt();
    if (record.step < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the archive is of step ", record.step));
    }
    ASSIGN_OR_RETURN(record.tensors, NamedFromIValue(e[3], given, what));
    ASSIGN_OR_RETURN(record.optimizer,
                     NamedFromIValue(e[4], given, what + " (optimizer)"));
    return record;
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", e.what_without_backtrace()));
  }
}

}  // namespace interlock
