// A user's own data (DataSpec NPY, TOKEN_FILE, IMAGE_FOLDER): each format
// loads with the right shape, classes and exact batch values; each bad input
// is refused with a message naming the file; a memory-mapped .npy set does
// not grow the process's anonymous memory; and each format trains end to end
// through `interlock train`. Files are written here (.npy, token files) or by
// Debian's python3-numpy and python3-pil (images, numpy's own .npy files).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/config.h"
#include "services/data.h"
#include "services/data_info.h"
#include "services/models.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

namespace fs = std::filesystem;
using interlock::testing::RunCommand;
using v1::DataSpec;

const std::string kCli = INTERLOCK_CLI;

::testing::AssertionResult Contains(absl::string_view text,
                                    absl::string_view part) {
  if (absl::StrContains(text, part)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "\"" << text << "\" does not contain \"" << part << "\"";
}

using interlock::testing::TempDir;

void WriteFile(const std::string& path, const std::string& data) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  ASSERT_TRUE(out.good()) << path;
}

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()),
                     values.size() * sizeof(T));
}

// The preamble and header of a .npy file as numpy writes them: the dict
// padded with spaces and a newline to a multiple of 64 bytes.
std::string NpyHeader(const std::string& descr,
                      const std::vector<int64_t>& shape, int major = 1,
                      bool fortran = false) {
  std::string dims = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) dims += ",";
  std::string dict = absl::StrCat(
      "{'descr': '", descr, "', 'fortran_order': ", fortran ? "True" : "False",
      ", 'shape': (", dims, "), }");
  const size_t preamble = major == 1 ? 10 : 12;
  const size_t total = (preamble + dict.size() + 1 + 63) / 64 * 64;
  dict.append(total - preamble - dict.size() - 1, ' ');
  dict += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  const uint32_t len = static_cast<uint32_t>(dict.size());
  out += static_cast<char>(len & 0xFF);
  out += static_cast<char>((len >> 8) & 0xFF);
  if (major != 1) {
    out += static_cast<char>((len >> 16) & 0xFF);
    out += static_cast<char>((len >> 24) & 0xFF);
  }
  return out + dict;
}

template <typename T>
void WriteNpy(const std::string& path, const std::string& descr,
              const std::vector<int64_t>& shape, const std::vector<T>& values,
              int major = 1) {
  WriteFile(path, NpyHeader(descr, shape, major) + Bytes(values));
}

absl::StatusOr<DataSplits> Load(const DataSpec& spec, int64_t context = 1) {
  return LoadData(spec, context);
}

DataSpec NpySpec(const std::string& dir) {
  DataSpec spec;
  spec.set_kind(DataSpec::NPY);
  spec.set_path(dir);
  return spec;
}

std::vector<float> Floats(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  EXPECT_EQ(c.scalar_type(), torch::kFloat);
  return std::vector<float>(c.data_ptr<float>(),
                            c.data_ptr<float>() + c.numel());
}

std::vector<int64_t> Longs(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  EXPECT_EQ(c.scalar_type(), torch::kLong);
  return std::vector<int64_t>(c.data_ptr<int64_t>(),
                              c.data_ptr<int64_t>() + c.numel());
}

// Runs a Python script with Debian's python3 (numpy, PIL).
void Python(const TempDir& dir, const std::string& script) {
  const std::string file = dir.File("script.py");
  WriteFile(file, script);
  const auto r = RunCommand("/usr/bin/python3 " + file);
  ASSERT_EQ(r.exit_code, 0) << "python3 failed (python3-numpy and "
                               "python3-pil installed? scripts/setup.sh):\n"
                            << r.output;
}

// ---------------------------------------------------------------- NPY

// A small vector set: train 5 x 3 float32, test 2 x 3; targets int64 / int32.
void WriteVectorSet(const TempDir& dir) {
  std::vector<float> train_x(15), test_x(6);
  for (int i = 0; i < 15; ++i) train_x[i] = 0.5f * static_cast<float>(i) - 1;
  for (int i = 0; i < 6; ++i) test_x[i] = 100.0f + static_cast<float>(i);
  WriteNpy(dir.File("train_x.npy"), "<f4", {5, 3}, train_x);
  WriteNpy(dir.File("train_y.npy"), "<i8", {5},
           std::vector<int64_t>{0, 2, 1, 2, 0});
  WriteNpy(dir.File("test_x.npy"), "<f4", {2, 3}, test_x, /*major=*/2);
  WriteNpy(dir.File("test_y.npy"), "<i4", {2}, std::vector<int32_t>{1, 3},
           /*major=*/3);
}

TEST(NpyData, LoadsVectorsWithShapeClassesAndExactBatches) {
  TempDir dir;
  WriteVectorSet(dir);
  auto data = Load(NpySpec(dir.path()));
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_TRUE(data->shape.is_vector);
  EXPECT_FALSE(data->shape.is_text);
  EXPECT_EQ(data->shape.channels, 3);
  EXPECT_EQ(data->shape.height, 1);
  EXPECT_EQ(data->shape.width, 1);
  EXPECT_EQ(data->shape.classes, 4);  // max target 3 (test) + 1
  EXPECT_EQ(data->train->size(), 5);
  EXPECT_EQ(data->test->size(), 2);
  auto [x, y] = data->train->Gather({4, 1});
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(Floats(x),
            (std::vector<float>{5.0f, 5.5f, 6.0f, 0.5f, 1.0f, 1.5f}));
  EXPECT_EQ(Longs(y), (std::vector<int64_t>{0, 2}));
  auto [tx, ty] = data->test->Gather({1});
  EXPECT_EQ(Floats(tx), (std::vector<float>{103, 104, 105}));
  EXPECT_EQ(Longs(ty), (std::vector<int64_t>{3}));
  // Out of range indices throw (LoadData's callers turn that into a status).
  EXPECT_ANY_THROW(data->train->Gather({5}));

  DataSpec capped = NpySpec(dir.path());
  capped.set_max_train(3);
  capped.set_max_test(1);
  capped.set_synthetic_classes(7);
  auto small = Load(capped);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->train->size(), 3);
  EXPECT_EQ(small->test->size(), 1);
  EXPECT_EQ(small->shape.classes, 7);
  EXPECT_ANY_THROW(small->train->Gather({3}));
}

TEST(NpyData, LoadsImagesOfBytesAndHalves) {
  TempDir dir;
  // uint8 images (N, 1, 2, 2) scaled to [0, 1]; float16 test images.
  std::vector<uint8_t> train_x = {0, 51, 102, 255, 10, 20, 30, 40};
  WriteNpy(dir.File("train_x.npy"), "|u1", {2, 1, 2, 2}, train_x);
  WriteNpy(dir.File("train_y.npy"), "|u1", {2}, std::vector<uint8_t>{1, 0});
  // 1.0, -2.0, 0.5, 65504 (the largest half) in IEEE half.
  std::vector<uint16_t> test_x = {0x3C00, 0xC000, 0x3800, 0x7BFF};
  WriteNpy(dir.File("test_x.npy"), "<f2", {1, 1, 2, 2}, test_x);
  WriteNpy(dir.File("test_y.npy"), "<i8", {1}, std::vector<int64_t>{1});
  auto data = Load(NpySpec(dir.path()));
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_FALSE(data->shape.is_vector);
  EXPECT_EQ(data->shape.channels, 1);
  EXPECT_EQ(data->shape.height, 2);
  EXPECT_EQ(data->shape.width, 2);
  EXPECT_EQ(data->shape.classes, 2);
  auto [x, y] = data->train->Gather({0});
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{1, 1, 2, 2}));
  EXPECT_EQ(Floats(x),
            (std::vector<float>{0.0f, 51 / 255.0f, 102 / 255.0f, 1.0f}));
  EXPECT_EQ(Longs(y), (std::vector<int64_t>{1}));
  auto [tx, ty] = data->test->Gather({0});
  EXPECT_EQ(Floats(tx), (std::vector<float>{1.0f, -2.0f, 0.5f, 65504.0f}));
  // export.pbtxt says how bytes became inputs: x / 255, mean 0, std 1.
  const DataInfo info = DataInfoOf(NpySpec(dir.path()));
  EXPECT_EQ(info.mean, (std::vector<double>{0.0}));
  EXPECT_EQ(info.std, (std::vector<double>{1.0}));
}

// Files numpy itself writes (np.save), including the ones we refuse.
TEST(NpyData, ReadsWhatNumpyWrites) {
  TempDir dir;
  Python(dir, absl::StrCat(R"py(
import numpy as np
d = ")py",
                           dir.path(), R"py("
rng = np.random.default_rng(0)
np.save(d + "/train_x.npy", rng.standard_normal((7, 2, 3, 4)).astype(np.float32))
np.save(d + "/train_y.npy", np.array([0, 1, 2, 3, 4, 5, 6], dtype=np.int64))
np.save(d + "/test_x.npy", rng.standard_normal((3, 2, 3, 4)).astype(np.float16))
np.save(d + "/test_y.npy", np.array([6, 0, 1], dtype=np.int32))
np.save(d + "/fortran.npy", np.asfortranarray(np.ones((3, 4), np.float32)))
np.save(d + "/big.npy", np.ones((3, 4), dtype=">f4"))
np.save(d + "/f64.npy", np.ones((3, 4), dtype=np.float64))
# The values we expect, as float32 bytes in C order.
np.load(d + "/train_x.npy").astype(np.float32).tofile(d + "/train_x.raw")
np.load(d + "/test_x.npy").astype(np.float32).tofile(d + "/test_x.raw")
)py"));
  auto data = Load(NpySpec(dir.path()));
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->shape.channels, 2);
  EXPECT_EQ(data->shape.height, 3);
  EXPECT_EQ(data->shape.width, 4);
  EXPECT_EQ(data->shape.classes, 7);
  for (const bool train : {true, false}) {
    const Dataset& split = train ? *data->train : *data->test;
    std::vector<int64_t> all(static_cast<size_t>(split.size()));
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    auto [x, y] = split.Gather(all);
    const std::string raw = interlock::testing::ReadFile(
        dir.File(train ? "train_x.raw" : "test_x.raw"));
    std::vector<float> want(raw.size() / sizeof(float));
    std::memcpy(want.data(), raw.data(), raw.size());
    EXPECT_EQ(Floats(x), want) << (train ? "train" : "test");
    EXPECT_EQ(Longs(y), train ? (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6})
                              : (std::vector<int64_t>{6, 0, 1}));
  }
  // numpy's own refused files: the file named, the reason given.
  for (const auto& [file, reason] :
       std::vector<std::pair<std::string, std::string>>{
           {"fortran.npy", "fortran_order is True"},
           {"big.npy", "big-endian"},
           {"f64.npy", "'<f8'"}}) {
    fs::copy_file(dir.File(file), dir.File("train_x.npy"),
                  fs::copy_options::overwrite_existing);
    auto bad = Load(NpySpec(dir.path()));
    ASSERT_FALSE(bad.ok()) << file;
    EXPECT_TRUE(Contains(bad.status().message(), dir.File("train_x.npy")));
    EXPECT_TRUE(Contains(bad.status().message(), reason));
  }
}

TEST(NpyData, RefusesBadFilesNamingThem) {
  struct Case {
    std::string name;
    std::string file;  // Which file to replace ("" = remove train_y.npy).
    std::string contents;
    std::string fragment;
    absl::StatusCode code;
  };
  const std::string f32 = Bytes(std::vector<float>(15, 1.0f));
  const std::vector<Case> cases = {
      {"truncated data", "train_x.npy",
       NpyHeader("<f4", {5, 3}) + f32.substr(0, 50), "truncated",
       absl::StatusCode::kDataLoss},
      {"truncated header", "train_x.npy",
       NpyHeader("<f4", {5, 3}).substr(0, 40), "truncated",
       absl::StatusCode::kDataLoss},
      {"preamble only", "train_x.npy", std::string("\x93NUMPY\x01\x00", 8),
       "truncated", absl::StatusCode::kDataLoss},
      {"no magic", "train_x.npy", "PK\x03\x04 not numpy at all",
       "not a .npy file", absl::StatusCode::kDataLoss},
      {"version 4", "train_x.npy",
       [] {
         std::string h = NpyHeader("<f4", {5, 3});
         h[6] = 4;
         return h;
       }() +
           f32,
       "format version 4.0", absl::StatusCode::kInvalidArgument},
      {"malformed header", "train_x.npy",
       [] {
         std::string h = NpyHeader("<f4", {5, 3});
         h[h.find("'shape'") + 10] = 'x';
         return h;
       }() +
           f32,
       "malformed header", absl::StatusCode::kDataLoss},
      {"inputs of rank 3", "train_x.npy", NpyHeader("<f4", {5, 3, 1}) + f32,
       "expected (N, F) vectors or (N, C, H, W)",
       absl::StatusCode::kInvalidArgument},
      {"inputs of float64", "train_x.npy", NpyHeader("<f8", {5, 3}) + f32 + f32,
       "'<f8'", absl::StatusCode::kInvalidArgument},
      {"big-endian inputs", "train_x.npy", NpyHeader(">f4", {5, 3}) + f32,
       "big-endian", absl::StatusCode::kInvalidArgument},
      {"fortran order", "train_x.npy",
       NpyHeader("<f4", {5, 3}, 1, /*fortran=*/true) + f32,
       "fortran_order is True", absl::StatusCode::kInvalidArgument},
      {"2-D targets", "train_y.npy",
       NpyHeader("<i8", {5, 1}) + Bytes(std::vector<int64_t>(5, 0)),
       "expected one class id per sample", absl::StatusCode::kInvalidArgument},
      {"float targets", "train_y.npy",
       NpyHeader("<f4", {5}) + Bytes(std::vector<float>(5, 0)),
       "targets of dtype '<f4'", absl::StatusCode::kInvalidArgument},
      {"too few targets", "train_y.npy",
       NpyHeader("<i8", {4}) + Bytes(std::vector<int64_t>(4, 0)),
       "4 targets, but", absl::StatusCode::kInvalidArgument},
      {"negative target", "train_y.npy",
       NpyHeader("<i4", {5}) + Bytes(std::vector<int32_t>{0, 1, -1, 0, 0}),
       "target -1 at index 2", absl::StatusCode::kInvalidArgument},
      {"test samples of another shape", "test_x.npy",
       NpyHeader("<f4", {2, 4}) + Bytes(std::vector<float>(8, 0)),
       "samples of shape (4,), but", absl::StatusCode::kInvalidArgument},
      {"missing targets", "", "", "no such file", absl::StatusCode::kNotFound},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    WriteVectorSet(dir);
    const std::string file = dir.File(c.file.empty() ? "train_y.npy" : c.file);
    if (c.file.empty()) {
      fs::remove(file);
    } else {
      WriteFile(file, c.contents);
    }
    auto data = Load(NpySpec(dir.path()));
    ASSERT_FALSE(data.ok());
    EXPECT_EQ(data.status().code(), c.code) << data.status();
    EXPECT_TRUE(Contains(data.status().message(), file));
    EXPECT_TRUE(Contains(data.status().message(), c.fragment));
  }
  // A target beyond synthetic_classes names its file too.
  TempDir dir;
  WriteVectorSet(dir);
  DataSpec spec = NpySpec(dir.path());
  spec.set_synthetic_classes(3);
  auto data = Load(spec);
  ASSERT_FALSE(data.ok());
  EXPECT_TRUE(Contains(data.status().message(), dir.File("test_y.npy")));
  EXPECT_TRUE(Contains(data.status().message(), "target 3 at index 1"));
  // No folder.
  spec.set_path(dir.File("nowhere"));
  EXPECT_EQ(Load(spec).status().code(), absl::StatusCode::kNotFound);
}

// RssAnon of this process, in bytes (anonymous memory: what a copy of the
// data would take; mapped file pages are RssFile).
int64_t RssAnon() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) {
      return std::strtoll(line.c_str() + 8, nullptr, 10) * 1024;
    }
  }
  return -1;
}

TEST(NpyData, LargeFileIsMappedNotRead) {
  const auto start = std::chrono::steady_clock::now();
  TempDir dir;
  // 51200 x 1024 float32: 200 MiB of (sparse) zeros but for the rows we set.
  const int64_t n = 51200, f = 1024;
  const int64_t bytes = n * f * 4;
  const std::string header = NpyHeader("<f4", {n, f});
  {
    const std::string path = dir.File("train_x.npy");
    WriteFile(path, header);
    const int fd = ::open(path.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(header.size() + bytes)), 0);
    // Row 40000 holds 0, 1, 2, ...
    std::vector<float> row(f);
    for (int64_t j = 0; j < f; ++j) row[j] = static_cast<float>(j);
    ASSERT_EQ(::pwrite(fd, row.data(), f * 4,
                       static_cast<off_t>(header.size() + 40000 * f * 4)),
              f * 4);
    ::close(fd);
  }
  std::vector<int64_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = i % 10;
  WriteNpy(dir.File("train_y.npy"), "<i8", {n}, targets);
  WriteNpy(dir.File("test_x.npy"), "<f4", {1, f}, std::vector<float>(f, 2));
  WriteNpy(dir.File("test_y.npy"), "<i8", {1}, std::vector<int64_t>{3});

  const int64_t before = RssAnon();
  ASSERT_GT(before, 0);
  {
    auto data = Load(NpySpec(dir.path()));
    ASSERT_TRUE(data.ok()) << data.status();
    EXPECT_EQ(data->train->size(), n);
    EXPECT_EQ(data->shape.classes, 10);
    for (int b = 0; b < 8; ++b) {
      std::vector<int64_t> idx;
      for (int i = 0; i < 64; ++i) idx.push_back((b * 6151 + i * 797) % n);
      auto [x, y] = data->train->Gather(idx);
      EXPECT_EQ(x.sizes(), (std::vector<int64_t>{64, f}));
      EXPECT_EQ(x.abs().sum().item<float>(), 0.0f);
      EXPECT_EQ(y[5].item<int64_t>(), idx[5] % 10);
    }
    auto [x, y] = data->train->Gather({40000});
    EXPECT_EQ(x[0][1023].item<float>(), 1023.0f);
    EXPECT_EQ(y[0].item<int64_t>(), 0);
    const int64_t grown = RssAnon() - before;
    RecordProperty("rss_anon_growth_bytes", std::to_string(grown));
    EXPECT_LT(grown, int64_t{20} << 20)
        << "RssAnon grew by " << grown << " bytes for a " << bytes
        << "-byte file";
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_LT(seconds, 10.0);
}

// ---------------------------------------------------------------- Tokens

DataSpec TokenSpec(const std::string& path, int64_t vocab) {
  DataSpec spec;
  spec.set_kind(DataSpec::TOKEN_FILE);
  spec.set_path(path);
  spec.set_vocab_size(vocab);
  return spec;
}

TEST(TokenFileData, Uint16WindowsAndTestFraction) {
  TempDir dir;
  std::vector<uint16_t> tokens(100);
  for (int i = 0; i < 100; ++i) tokens[i] = static_cast<uint16_t>(3 * i);
  WriteFile(dir.File("tokens.bin"), Bytes(tokens));
  auto data = Load(TokenSpec(dir.File("tokens.bin"), 300), /*context=*/4);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_TRUE(data->shape.is_text);
  EXPECT_EQ(data->shape.classes, 300);
  EXPECT_EQ(data->shape.context, 4);
  // 0.1 of 100 tokens for test: train 90 tokens -> (90 - 1) / 4 windows.
  EXPECT_EQ(data->train->size(), 22);
  EXPECT_EQ(data->test->size(), 2);
  auto [x, y] = data->train->Gather({1, 21});
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(Longs(x),
            (std::vector<int64_t>{12, 15, 18, 21, 252, 255, 258, 261}));
  EXPECT_EQ(Longs(y),
            (std::vector<int64_t>{15, 18, 21, 24, 255, 258, 261, 264}));
  auto [tx, ty] = data->test->Gather({1});
  EXPECT_EQ(Longs(tx), (std::vector<int64_t>{282, 285, 288, 291}));
  EXPECT_EQ(Longs(ty), (std::vector<int64_t>{285, 288, 291, 294}));
  EXPECT_ANY_THROW(data->train->Gather({22}));

  DataSpec half = TokenSpec(dir.File("tokens.bin"), 300);
  half.set_test_fraction(0.5f);
  half.set_max_train(3);
  auto halves = Load(half, 4);
  ASSERT_TRUE(halves.ok()) << halves.status();
  EXPECT_EQ(halves->train->size(), 3);
  EXPECT_EQ(halves->test->size(), 12);  // (50 - 1) / 4
}

TEST(TokenFileData, Uint32WithATestFile) {
  TempDir dir;
  std::vector<uint32_t> train = {70000, 1, 2, 3, 99999, 5, 6};
  std::vector<uint32_t> test = {7, 8, 9};
  WriteFile(dir.File("train.u32"), Bytes(train));
  WriteFile(dir.File("test.u32"), Bytes(test));
  DataSpec spec = TokenSpec(dir.File("train.u32"), 100000);
  spec.set_token_dtype(DataSpec::UINT32);
  spec.set_test_path(dir.File("test.u32"));
  auto data = Load(spec, /*context=*/2);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->shape.classes, 100000);
  EXPECT_EQ(data->train->size(), 3);
  EXPECT_EQ(data->test->size(), 1);
  auto [x, y] = data->train->Gather({0, 2});
  EXPECT_EQ(Longs(x), (std::vector<int64_t>{70000, 1, 99999, 5}));
  EXPECT_EQ(Longs(y), (std::vector<int64_t>{1, 2, 5, 6}));
  auto [tx, ty] = data->test->Gather({0});
  EXPECT_EQ(Longs(tx), (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(Longs(ty), (std::vector<int64_t>{8, 9}));
}

TEST(TokenFileData, RefusesBadFilesNamingThem) {
  TempDir dir;
  std::vector<uint16_t> tokens(64, 1);
  tokens[37] = 500;
  WriteFile(dir.File("big_token.bin"), Bytes(tokens));
  WriteFile(dir.File("odd.bin"), std::string(9, '\0'));
  WriteFile(dir.File("short.bin"), Bytes(std::vector<uint16_t>(6, 0)));
  WriteFile(dir.File("good.bin"), Bytes(std::vector<uint16_t>(64, 2)));

  auto big = Load(TokenSpec(dir.File("big_token.bin"), 500), 4);
  ASSERT_FALSE(big.ok());
  EXPECT_TRUE(Contains(big.status().message(), dir.File("big_token.bin")));
  EXPECT_TRUE(Contains(big.status().message(),
                       "token 500 at position 37 (of 64 uint16 tokens) is not "
                       "below vocab_size 500"));

  auto odd = Load(TokenSpec(dir.File("odd.bin"), 500), 4);
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(odd.status().message(), dir.File("odd.bin")));
  EXPECT_TRUE(Contains(odd.status().message(), "not a whole number of uint16"));

  DataSpec u32 = TokenSpec(dir.File("short.bin"), 500);
  u32.set_token_dtype(DataSpec::UINT32);  // 12 bytes = 3 uint32 tokens
  auto too_short = Load(u32, 4);
  ASSERT_FALSE(too_short.ok());
  EXPECT_TRUE(Contains(too_short.status().message(), dir.File("short.bin")));
  EXPECT_TRUE(Contains(too_short.status().message(), "too few"));

  DataSpec test_big = TokenSpec(dir.File("good.bin"), 500);
  test_big.set_test_path(dir.File("big_token.bin"));
  auto bad_test = Load(test_big, 4);
  ASSERT_FALSE(bad_test.ok());
  EXPECT_TRUE(Contains(bad_test.status().message(), dir.File("big_token.bin")));

  auto missing = Load(TokenSpec(dir.File("none.bin"), 500), 4);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status().message(), dir.File("none.bin")));

  auto no_vocab = Load(TokenSpec(dir.File("good.bin"), 0), 4);
  EXPECT_TRUE(Contains(no_vocab.status().message(), "vocab_size"));

  DataSpec both = TokenSpec(dir.File("good.bin"), 500);
  both.set_test_path(dir.File("good.bin"));
  both.set_test_fraction(0.2f);
  EXPECT_TRUE(Contains(Load(both, 4).status().message(), "not both"));
  DataSpec whole = TokenSpec(dir.File("good.bin"), 500);
  whole.set_test_fraction(1.0f);
  EXPECT_TRUE(Contains(Load(whole, 4).status().message(), "test_fraction"));
}

// The token models take TOKEN_FILE as text; the others refuse it.
TEST(TokenFileData, ModelsTakeItAsText) {
  auto config = ParseRunConfig(
      R"pb(
        model {
          transformer { d_model: 8 layers: 2 heads: 2 context: 6 }
          blocks: 2
          head: "ln_fc"
        }
        data { kind: TOKEN_FILE path: "tokens.bin" vocab_size: 1000 }
        training { batch_size: 4 steps: 1 }
      )pb",
      "tokens.pbtxt");
  ASSERT_TRUE(config.ok()) << config.status();
  ApplyDefaults(*config);
  EXPECT_TRUE(ValidateRunConfig(*config).ok()) << ValidateRunConfig(*config);
  v1::RunConfig no_vocab = *config;
  no_vocab.mutable_data()->clear_vocab_size();
  EXPECT_TRUE(Contains(ValidateRunConfig(no_vocab).message(), "vocab_size"));
  v1::RunConfig mlp = *config;
  mlp.mutable_model()->mutable_mlp()->add_hidden(8);
  EXPECT_FALSE(ValidateRunConfig(mlp).ok());
  v1::RunConfig npy = *config;
  npy.mutable_data()->set_kind(DataSpec::NPY);
  EXPECT_TRUE(Contains(ValidateRunConfig(npy).message(), "TOKEN_FILE"));

  // A scripted language model (its manifest inline) takes token files and
  // refuses class-labelled data, and a scripted classifier the other way.
  // The manifest is checked as a model.pbtxt would be: a valid one.
  v1::ModelSpec lm;
  auto* m = lm.mutable_scripted()->mutable_model();
  m->set_torch_version("1.13.0");
  m->add_input_shape(8);
  m->set_input_dtype("int64");
  m->set_loss(v1::ScriptedModel::TOKENS);
  m->set_classes(1000);
  auto* unit = m->add_units();
  unit->set_file("unit0.pt");
  unit->set_sha256(std::string(64, '0'));
  unit->add_output_shape(8);
  unit->add_output_shape(1000);
  EXPECT_TRUE(CheckModelData(lm, DataSpec::TOKEN_FILE).ok())
      << CheckModelData(lm, DataSpec::TOKEN_FILE);
  EXPECT_FALSE(CheckModelData(lm, DataSpec::NPY).ok());
  m->set_loss(v1::ScriptedModel::CLASSES);
  m->set_input_dtype("float32");
  unit->clear_output_shape();
  unit->add_output_shape(1000);
  EXPECT_TRUE(CheckModelData(lm, DataSpec::NPY).ok());
  EXPECT_TRUE(CheckModelData(lm, DataSpec::IMAGE_FOLDER).ok());
  EXPECT_TRUE(Contains(CheckModelData(lm, DataSpec::TOKEN_FILE).message(),
                       "class-labelled"));
}

// ---------------------------------------------------------------- Images

DataSpec FolderSpec(const std::string& root, std::vector<int32_t> shape) {
  DataSpec spec;
  spec.set_kind(DataSpec::IMAGE_FOLDER);
  spec.set_path(root);
  for (int32_t d : shape) spec.add_synthetic_shape(d);
  return spec;
}

// ROOT/{train,test}/{cat,dog}: 4x4 images in several PNG and JPEG flavours;
// expected.bin holds what PIL's convert("RGB") gives for the exact ones.
void WriteImageFolder(const TempDir& dir) {
  Python(dir, absl::StrCat(R"py(
import os
import numpy as np
from PIL import Image
root = ")py",
                           dir.path(), R"py(/images"
def save(split, cls, name, img, **kw):
    os.makedirs(os.path.join(root, split, cls), exist_ok=True)
    img.save(os.path.join(root, split, cls, name), **kw)
px = np.arange(48, dtype=np.uint8).reshape(4, 4, 3) * 5
rgb = Image.fromarray(px, "RGB")
save("train", "cat", "a.png", rgb)
grey = Image.fromarray((np.arange(16, dtype=np.uint8) * 16).reshape(4, 4), "L")
save("train", "cat", "b.PNG", grey)
rgba = Image.fromarray(np.dstack([px, np.full((4, 4), 7, np.uint8)]), "RGBA")
save("train", "dog", "c.png", rgba)
pal = rgb.convert("P", palette=Image.ADAPTIVE, colors=16)
pal.info["transparency"] = 0
save("train", "dog", "d.png", pal, transparency=0)
save("train", "dog", "e.jpg", Image.new("RGB", (4, 4), (200, 30, 90)), quality=100)
# Not images: left out.
open(os.path.join(root, "train", "dog", "notes.txt"), "w").write("x")
save("test", "cat", "f.jpeg", Image.new("L", (4, 4), 77), quality=100)
save("test", "dog", "g.png", Image.fromarray(np.full((8, 4, 3), 120, np.uint8), "RGB"))
expected = [np.asarray(im.convert("RGB")).transpose(2, 0, 1)
            for im in (rgb, grey, rgba, pal)]
np.stack(expected).astype(np.uint8).tofile(root + "/../expected.bin")
np.asarray(rgb.convert("L")).astype(np.uint8).tofile(root + "/../grey.bin")
)py"));
}

TEST(ImageFolderData, LoadsClassesShapesAndExactPixels) {
  TempDir dir;
  WriteImageFolder(dir);
  auto data = Load(FolderSpec(dir.File("images"), {3, 4, 4}));
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_FALSE(data->shape.is_vector);
  EXPECT_EQ(data->shape.channels, 3);
  EXPECT_EQ(data->shape.height, 4);
  EXPECT_EQ(data->shape.width, 4);
  EXPECT_EQ(data->shape.classes, 2);
  EXPECT_EQ(data->train->size(), 5);
  EXPECT_EQ(data->test->size(), 2);
  // Class by class (cat, dog), file names sorted within a class.
  auto [x, y] = data->train->Gather({0, 1, 2, 3, 4});
  EXPECT_EQ(Longs(y), (std::vector<int64_t>{0, 0, 1, 1, 1}));
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{5, 3, 4, 4}));
  const std::string expected =
      interlock::testing::ReadFile(dir.File("expected.bin"));
  ASSERT_EQ(expected.size(), 4u * 48u);
  std::vector<float> want;
  for (char c : expected) want.push_back(static_cast<uint8_t>(c) / 255.0f);
  const std::vector<float> got = Floats(x.narrow(0, 0, 4));
  EXPECT_EQ(got, want);
  // A JPEG of one colour decodes to (about) that colour.
  const torch::Tensor jpeg = x[4] * 255;
  EXPECT_NEAR(jpeg[0].mean().item<float>(), 200, 2);
  EXPECT_NEAR(jpeg[1].mean().item<float>(), 30, 2);
  EXPECT_NEAR(jpeg[2].mean().item<float>(), 90, 2);
  // Test split: a grey JPEG repeated into RGB; an 8x4 image centre-cropped
  // to 4x4 of one colour.
  auto [tx, ty] = data->test->Gather({0, 1});
  EXPECT_EQ(Longs(ty), (std::vector<int64_t>{0, 1}));
  EXPECT_NEAR((tx[0] * 255).min().item<float>(), 77, 1);
  EXPECT_NEAR((tx[0] * 255).max().item<float>(), 77, 1);
  EXPECT_EQ(Floats(tx[1]), std::vector<float>(48, 120 / 255.0f));

  // One channel: PIL's convert("L") of the RGB image, exactly.
  auto grey = Load(FolderSpec(dir.File("images"), {1, 4, 4}));
  ASSERT_TRUE(grey.ok()) << grey.status();
  auto [gx, gy] = grey->train->Gather({0});
  EXPECT_EQ(gx.sizes(), (std::vector<int64_t>{1, 1, 4, 4}));
  std::vector<float> want_grey;
  for (char c : interlock::testing::ReadFile(dir.File("grey.bin"))) {
    want_grey.push_back(static_cast<uint8_t>(c) / 255.0f);
  }
  EXPECT_EQ(Floats(gx), want_grey);

  // export.pbtxt's class names and [0, 1] scaling.
  const DataInfo info = DataInfoOf(FolderSpec(dir.File("images"), {3, 4, 4}));
  EXPECT_EQ(info.class_names, (std::vector<std::string>{"cat", "dog"}));
  EXPECT_EQ(info.mean, (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(info.std, (std::vector<double>{1, 1, 1}));
}

TEST(ImageFolderData, CropsAndResizesLikePil) {
  TempDir dir;
  // A 12x6 (w x h) gradient: cropped to its middle 6x6 and shrunk to 3x3;
  // PIL's resize (antialiased bilinear) of the same crop, for comparison.
  Python(dir, absl::StrCat(R"py(
import os
import numpy as np
from PIL import Image
root = ")py",
                           dir.path(), R"py(/images"
for split in ("train", "test"):
    os.makedirs(os.path.join(root, split, "only"))
y, x = np.mgrid[0:6, 0:12]
img = Image.fromarray(((x * 20 + y * 9) % 256).astype(np.uint8), "L")
img.save(os.path.join(root, "train", "only", "wide.png"))
img.save(os.path.join(root, "test", "only", "wide.png"))
want = img.crop((3, 0, 9, 6)).resize((3, 3), Image.BILINEAR)
np.asarray(want).astype(np.uint8).tofile(root + "/../want.bin")
)py"));
  auto data = Load(FolderSpec(dir.File("images"), {1, 3, 3}));
  ASSERT_TRUE(data.ok()) << data.status();
  auto [x, y] = data->train->Gather({0});
  const std::string want = interlock::testing::ReadFile(dir.File("want.bin"));
  ASSERT_EQ(want.size(), 9u);
  const std::vector<float> got = Floats(x);
  for (size_t i = 0; i < 9; ++i) {
    EXPECT_NEAR(got[i] * 255, static_cast<uint8_t>(want[i]), 2) << i;
  }
}

TEST(ImageFolderData, RefusesBadFoldersAndImagesNamingThem) {
  TempDir dir;
  WriteImageFolder(dir);
  const std::string root = dir.File("images");
  auto expect_refused = [&](const std::string& what, const std::string& path,
                            const std::string& fragment,
                            std::vector<int32_t> shape = {3, 4, 4}) {
    SCOPED_TRACE(what);
    auto data = Load(FolderSpec(root, shape));
    ASSERT_FALSE(data.ok());
    EXPECT_TRUE(Contains(data.status().message(), path));
    EXPECT_TRUE(Contains(data.status().message(), fragment));
  };
  // Unreadable images: garbage, a truncated PNG, a truncated JPEG.
  const std::string bad = root + "/train/dog/zz.png";
  WriteFile(bad, "definitely not an image");
  expect_refused("garbage", bad, "not a PNG or JPEG");
  const std::string png =
      interlock::testing::ReadFile(root + "/train/cat/a.png");
  WriteFile(bad, png.substr(0, png.size() - 20));
  expect_refused("truncated PNG", bad, "cannot decode PNG");
  const std::string jpg =
      interlock::testing::ReadFile(root + "/train/dog/e.jpg");
  const std::string bad_jpg = root + "/train/dog/zz.jpg";
  fs::remove(bad);
  WriteFile(bad_jpg, jpg.substr(0, jpg.size() / 2));
  expect_refused("truncated JPEG", bad_jpg, "cannot decode JPEG");
  fs::remove(bad_jpg);
  // An empty class folder (files that are not images do not count).
  fs::create_directories(root + "/train/emu");
  fs::create_directories(root + "/test/emu");
  WriteFile(root + "/train/emu/readme.txt", "no images here");
  expect_refused("empty class", root + "/train/emu",
                 "class folder without images");
  fs::remove_all(root + "/train/emu");
  // Test classes that differ from train's.
  expect_refused("other test classes", root + "/test", "expected those of");
  fs::remove_all(root + "/test/emu");
  // The configured shape.
  expect_refused("no shape", "synthetic_shape", "[C, H, W]", {});
  expect_refused("four channels", "synthetic_shape", "[C, H, W]", {4, 4, 4});
  // No classes at all; no test folder.
  fs::remove_all(root + "/train");
  fs::create_directories(root + "/train");
  expect_refused("no classes", root + "/train", "no class folders");
  fs::remove_all(root + "/test");
  fs::remove_all(root + "/train");
  fs::create_directories(root + "/train/cat");
  WriteFile(root + "/train/cat/a.png", png);
  expect_refused("no test folder", root + "/test", "no such folder");
}

// Inputs to label from a file (`interlock predict --input`): an image, a
// folder of images and a .npy array come out exactly as the data set's own
// samples, normalised as it is; a wrong shape, dtype or file kind is
// refused naming the file.
TEST(InputsFromAFile, AreTheDataSetsOwnSamplesAndBadOnesAreRefused) {
  TempDir dir;
  WriteImageFolder(dir);
  const DataSpec spec = FolderSpec(dir.File("images"), {3, 4, 4});
  auto data = Load(spec);
  ASSERT_TRUE(data.ok()) << data.status();
  std::vector<std::string> names;
  auto one = ReadInputs(dir.File("images/test/dog/g.png"), spec, data->shape,
                        &names);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(names, std::vector<std::string>{"g.png"});
  EXPECT_EQ(Floats(*one), Floats(data->test->Gather({1}).first));
  auto folder =
      ReadInputs(dir.File("images/train/cat"), spec, data->shape, &names);
  ASSERT_TRUE(folder.ok()) << folder.status();
  EXPECT_EQ(names, (std::vector<std::string>{"a.png", "b.PNG"}));
  EXPECT_EQ(Floats(*folder), Floats(data->train->Gather({0, 1}).first));

  // Fashion-MNIST's shape and normalisation from bytes in a .npy file: one
  // sample without its batch dimension.
  DataSpec fmnist;
  fmnist.set_kind(DataSpec::FASHION_MNIST);
  DataShape shape;
  shape.channels = 1;
  shape.height = shape.width = 28;
  shape.classes = 10;
  std::vector<uint8_t> pixels(784);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = i % 251;
  WriteNpy(dir.File("one.npy"), "|u1", {1, 28, 28}, pixels);
  auto npy = ReadInputs(dir.File("one.npy"), fmnist, shape, &names);
  ASSERT_TRUE(npy.ok()) << npy.status();
  EXPECT_EQ(names, std::vector<std::string>{dir.File("one.npy") + "[0]"});
  const torch::Tensor want =
      torch::tensor(std::vector<float>(pixels.begin(), pixels.end()))
          .div_(255.0f)
          .sub_(0.2860f)
          .div_(0.3530f)
          .view({1, 1, 28, 28});
  EXPECT_EQ(Floats(*npy), Floats(want));

  auto refused = [&](const std::string& path, const std::string& fragment) {
    auto r = ReadInputs(path, fmnist, shape, &names);
    ASSERT_FALSE(r.ok()) << path;
    EXPECT_TRUE(Contains(r.status().message(), path)) << r.status();
    EXPECT_TRUE(Contains(r.status().message(), fragment)) << r.status();
  };
  WriteNpy(dir.File("wide.npy"), "|u1", {1, 28, 27},
           std::vector<uint8_t>(28 * 27));
  refused(dir.File("wide.npy"), "expected (1, 28, 28)");
  WriteNpy(dir.File("ints.npy"), "<i8", {1, 1, 28, 28},
           std::vector<int64_t>(784));
  refused(dir.File("ints.npy"), "expected float32, float16 or uint8");
  WriteFile(dir.File("notes.txt"), "x");
  refused(dir.File("notes.txt"), "expected a .npy file, an image");
  refused(dir.File("missing.png"), "missing.png");
  WriteFile(dir.File("bad.png"), "not a png");
  refused(dir.File("bad.png"), "not a PNG or JPEG");
}

// ---------------------------------------------------------------- End to end

// `interlock train` on each format: a few steps and a test evaluation.
std::string Train(const TempDir& dir, const std::string& config) {
  const std::string path = dir.File("run.pbtxt");
  WriteFile(path, config);
  const auto r = RunCommand(kCli + " train --quiet --config " + path +
                            " --out " + dir.File("out"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.output;
}

TEST(DataFormatsTrain, NpyMlp) {
  TempDir dir;
  const int64_t n = 64, f = 6;
  std::vector<float> x(n * f);
  std::vector<int64_t> y(n);
  for (int64_t i = 0; i < n; ++i) {
    y[i] = i % 3;
    for (int64_t j = 0; j < f; ++j) {
      x[i * f + j] = static_cast<float>((j == y[i] ? 2.0 : 0.0) + 0.01 * i);
    }
  }
  WriteNpy(dir.File("data/train_x.npy"), "<f4", {n, f}, x);
  WriteNpy(dir.File("data/train_y.npy"), "<i8", {n}, y);
  WriteNpy(dir.File("data/test_x.npy"), "<f4", {n, f}, x);
  WriteNpy(dir.File("data/test_y.npy"), "<i8", {n}, y);
  const std::string out = Train(
      dir,
      absl::StrCat(
          R"pb(
            name: "npy_mlp"
            model {
              mlp { hidden: [ 16, 16 ] }
              blocks: 2
              head: "fc"
            }
            data { kind: NPY path: ")pb",
          dir.File("data"),
          R"pb(" }
               optimizer { kind: SGD momentum: 0.9 }
               schedule { kind: CONSTANT lr: 0.05 }
               training { mode: INTERLOCK n: 1 batch_size: 16 steps: 3 seed: 1 }
          )pb"));
  EXPECT_TRUE(Contains(out, "final head: accuracy")) << out;
  EXPECT_TRUE(
      Contains(interlock::testing::ReadFile(dir.File("out/summary.json")),
               "\"digest\""));
}

TEST(DataFormatsTrain, TokenFileTransformer) {
  TempDir dir;
  std::vector<uint16_t> tokens(2000);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<uint16_t>((i * 7) % 50);
  }
  WriteFile(dir.File("tokens.bin"), Bytes(tokens));
  const std::string out = Train(
      dir,
      absl::StrCat(
          R"pb(
            name: "token_transformer"
            model {
              transformer { d_model: 16 layers: 2 heads: 2 context: 8 }
              blocks: 2
              head: "ln_fc"
            }
            data { kind: TOKEN_FILE path: ")pb",
          dir.File("tokens.bin"),
          R"pb(" vocab_size: 50 max_test: 16 }
               optimizer { kind: ADAMW }
               schedule { kind: CONSTANT lr: 0.003 }
               training { mode: INTERLOCK n: 2 batch_size: 8 steps: 3 seed: 1 }
          )pb"));
  EXPECT_TRUE(Contains(out, "perplexity")) << out;
}

TEST(DataFormatsTrain, ImageFolderResNet) {
  TempDir dir;
  Python(dir, absl::StrCat(R"py(
import os
import numpy as np
from PIL import Image
root = ")py",
                           dir.path(), R"py(/images"
rng = np.random.default_rng(1)
for split, count in (("train", 12), ("test", 4)):
    for k, cls in enumerate(("circle", "square", "stripe")):
        os.makedirs(os.path.join(root, split, cls))
        for i in range(count):
            px = rng.integers(0, 256, (10, 14, 3), dtype=np.uint8)
            px[:, :, k] = 255
            Image.fromarray(px, "RGB").save(
                os.path.join(root, split, cls, "%02d.%s" % (i, "png" if i % 2 else "jpg")))
)py"));
  const std::string out = Train(
      dir,
      absl::StrCat(
          R"pb(
            name: "folder_resnet"
            model {
              resnet { architecture: "8,1/8,1" }
              partition: "2,rest"
              head: "gbpl_fc"
            }
            data { kind: IMAGE_FOLDER path: ")pb",
          dir.File("images"),
          R"pb(" synthetic_shape: [ 3, 8, 8 ] }
               optimizer { kind: SGD momentum: 0.9 }
               schedule { kind: CONSTANT lr: 0.05 }
               training { mode: INTERLOCK n: 2 batch_size: 12 steps: 3 seed: 1 }
          )pb"));
  EXPECT_TRUE(Contains(out, "final head: accuracy")) << out;
  // A missing folder stops the run before training, naming it.
  const std::string path = dir.File("bad.pbtxt");
  WriteFile(path, absl::StrCat(R"pb(
                                 model {
                                   mlp { hidden: 8 }
                                   blocks: 2
                                   head: "fc"
                                 }
                                 data { kind: IMAGE_FOLDER path: ")pb",
                               dir.File("nowhere"),
                               R"pb(" synthetic_shape: [ 3, 8, 8 ] }
                                    training { batch_size: 4 steps: 1 }
                               )pb"));
  const auto r = RunCommand(kCli + " train --quiet --config " + path);
  interlock::testing::ExpectOneLineError(r, "missing folder",
                                         dir.File("nowhere"));
}

}  // namespace
}  // namespace interlock
