#include "services/data.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/test_util.h"

namespace interlock {
namespace {

using v1::DataSpec;

// Plain gtest (no gmock): checks that `text` contains `part`.
::testing::AssertionResult Contains(const std::string& text,
                                    const std::string& part) {
  if (absl::StrContains(text, part)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "\"" << text << "\" does not contain \"" << part << "\"";
}

using interlock::testing::TempDir;

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  ASSERT_TRUE(out.good()) << path;
}

void WriteGz(const std::string& path, const std::string& data) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  ASSERT_EQ(gzwrite(f, data.data(), static_cast<unsigned>(data.size())),
            static_cast<int>(data.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

std::string BigEndian(uint32_t v) {
  return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                     static_cast<char>(v >> 8), static_cast<char>(v)};
}

// A CIFAR-10 record: label, then 3072 pixels (all `fill` except pixel 0 of
// channel 1, which is `marker`).
std::string CifarRecord(uint8_t label, uint8_t fill, uint8_t marker) {
  std::string rec(1 + 3072, static_cast<char>(fill));
  rec[0] = static_cast<char>(label);
  rec[1 + 1024] = static_cast<char>(marker);
  return rec;
}

TEST(DataTest, FashionMnistLoadsFromDebianPackage) {
  if (access("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz",
             R_OK) != 0) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  DataSpec spec;
  spec.set_kind(DataSpec::FASHION_MNIST);
  auto splits = LoadData(spec, 0);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_FALSE(splits->shape.is_text);
  EXPECT_FALSE(splits->shape.is_vector);
  EXPECT_EQ(splits->shape.channels, 1);
  EXPECT_EQ(splits->shape.height, 28);
  EXPECT_EQ(splits->shape.width, 28);
  EXPECT_EQ(splits->shape.classes, 10);
  EXPECT_EQ(splits->train->size(), 60000);
  EXPECT_EQ(splits->test->size(), 10000);

  auto [x, y] = splits->train->Gather({0, 1, 59999});
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{3, 1, 28, 28}));
  EXPECT_EQ(x.scalar_type(), torch::kFloat);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{3}));
  EXPECT_EQ(y.scalar_type(), torch::kLong);
  // Pixels were bytes, so the values lie in the normalised [0, 1] range.
  EXPECT_NEAR(x.min().item<float>(), -0.2860 / 0.3530, 1e-4);
  EXPECT_LE(x.max().item<float>(), (1 - 0.2860) / 0.3530 + 1e-4);

  std::vector<int64_t> all(10000);
  for (int64_t i = 0; i < 10000; ++i) all[i] = i;
  auto [tx, ty] = splits->test->Gather(all);
  EXPECT_GE(ty.min().item<int64_t>(), 0);
  EXPECT_LE(ty.max().item<int64_t>(), 9);
  // Fashion-MNIST is balanced: 1000 test images per class.
  EXPECT_EQ(ty.eq(3).sum().item<int64_t>(), 1000);
  // The normalisation constants are the data set's statistics.
  EXPECT_NEAR(tx.mean().item<float>(), 0.0, 0.05);
}

TEST(DataTest, FashionMnistCapsSplits) {
  if (access("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz",
             R_OK) != 0) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  DataSpec spec;
  spec.set_kind(DataSpec::FASHION_MNIST);
  spec.set_max_train(100);
  spec.set_max_test(7);
  auto splits = LoadData(spec, 0);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_EQ(splits->train->size(), 100);
  EXPECT_EQ(splits->test->size(), 7);
}

TEST(DataTest, IdxWrongMagicIsRefused) {
  TempDir dir;
  std::string images = BigEndian(1234) + BigEndian(1) + BigEndian(28) +
                       BigEndian(28) + std::string(784, '\0');
  WriteGz(dir.File("train-images-idx3-ubyte.gz"), images);
  DataSpec spec;
  spec.set_kind(DataSpec::FASHION_MNIST);
  spec.set_path(dir.path());
  auto splits = LoadData(spec, 0);
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(std::string(splits.status().message()),
                       "train-images-idx3-ubyte.gz: bad magic 1234, "
                       "expected 2051"));
}

TEST(DataTest, IdxTinyFolderLoadsAndChecksLabels) {
  TempDir dir;
  auto images = [](uint32_t n) {
    std::string s =
        BigEndian(2051) + BigEndian(n) + BigEndian(28) + BigEndian(28);
    for (uint32_t i = 0; i < n; ++i)
      s += std::string(784, static_cast<char>(255));
    return s;
  };
  WriteGz(dir.File("train-images-idx3-ubyte.gz"), images(3));
  WriteGz(dir.File("train-labels-idx1-ubyte.gz"),
          BigEndian(2049) + BigEndian(3) + std::string("\x01\x02\x09", 3));
  WriteGz(dir.File("t10k-images-idx3-ubyte.gz"), images(2));
  WriteGz(dir.File("t10k-labels-idx1-ubyte.gz"),
          BigEndian(2049) + BigEndian(2) + std::string("\x00\x05", 2));
  DataSpec spec;
  spec.set_kind(DataSpec::FASHION_MNIST);
  spec.set_path(dir.path());
  auto splits = LoadData(spec, 0);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_EQ(splits->train->size(), 3);
  EXPECT_EQ(splits->test->size(), 2);
  auto [x, y] = splits->train->Gather({2, 0});
  EXPECT_NEAR(x[0][0][5][7].item<float>(), (1.0 - 0.2860) / 0.3530, 1e-5);
  EXPECT_EQ(y[0].item<int64_t>(), 9);
  EXPECT_EQ(y[1].item<int64_t>(), 1);

  // A label of 10 and a count mismatch are both refused, naming the file.
  WriteGz(dir.File("t10k-labels-idx1-ubyte.gz"),
          BigEndian(2049) + BigEndian(2) + std::string("\x00\x0a", 2));
  auto bad = LoadData(spec, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(Contains(std::string(bad.status().message()),
                       "t10k-labels-idx1-ubyte.gz"));
  EXPECT_TRUE(Contains(std::string(bad.status().message()), "label 10"));

  WriteGz(dir.File("t10k-labels-idx1-ubyte.gz"),
          BigEndian(2049) + BigEndian(3) + std::string("\x00\x01\x02", 3));
  bad = LoadData(spec, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(Contains(std::string(bad.status().message()),
                       "t10k-labels-idx1-ubyte.gz: 3 labels, expected 2"));
}

TEST(DataTest, IdxTruncatedGzipIsRefused) {
  TempDir dir;
  std::string images =
      BigEndian(2051) + BigEndian(50) + BigEndian(28) + BigEndian(28);
  for (int i = 0; i < 50 * 784; ++i) images += static_cast<char>(i * 7);
  WriteGz(dir.File("whole.gz"), images);
  std::ifstream in(dir.File("whole.gz"), std::ios::binary);
  std::string gz((std::istreambuf_iterator<char>(in)),
                 std::istreambuf_iterator<char>());
  WriteFile(dir.File("train-images-idx3-ubyte.gz"),
            gz.substr(0, gz.size() / 2));
  DataSpec spec;
  spec.set_kind(DataSpec::FASHION_MNIST);
  spec.set_path(dir.path());
  auto splits = LoadData(spec, 0);
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(std::string(splits.status().message()),
                       "train-images-idx3-ubyte.gz"));
}

TEST(DataTest, MissingFolderIsNotFound) {
  DataSpec spec;
  spec.set_kind(DataSpec::CIFAR10);
  spec.set_path("/nonexistent/interlock/cifar");
  auto splits = LoadData(spec, 0);
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(std::string(splits.status().message()),
                       "/nonexistent/interlock/cifar"));

  spec.set_kind(DataSpec::FASHION_MNIST);
  splits = LoadData(spec, 0);
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kNotFound);

  TempDir dir;
  spec.set_path(dir.path());
  splits = LoadData(spec, 0);
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(std::string(splits.status().message()),
                       dir.File("train-images-idx3-ubyte.gz")));
}

TEST(DataTest, CifarNeedsPath) {
  DataSpec spec;
  spec.set_kind(DataSpec::CIFAR100);
  auto splits = LoadData(spec, 0);
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DataTest, Cifar10TinyFolderLoads) {
  TempDir dir;
  WriteFile(dir.File("data_batch_1.bin"),
            CifarRecord(3, 0, 255) + CifarRecord(9, 128, 0));
  WriteFile(dir.File("data_batch_3.bin"), CifarRecord(0, 255, 51));
  WriteFile(dir.File("test_batch.bin"), CifarRecord(7, 10, 10));
  DataSpec spec;
  spec.set_kind(DataSpec::CIFAR10);
  spec.set_path(dir.path());
  auto splits = LoadData(spec, 0);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_EQ(splits->shape.channels, 3);
  EXPECT_EQ(splits->shape.height, 32);
  EXPECT_EQ(splits->shape.width, 32);
  EXPECT_EQ(splits->shape.classes, 10);
  EXPECT_EQ(splits->train->size(), 3);
  EXPECT_EQ(splits->test->size(), 1);

  auto [x, y] = splits->train->Gather({0, 2, 1});
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{3, 3, 32, 32}));
  EXPECT_EQ(y[0].item<int64_t>(), 3);
  EXPECT_EQ(y[1].item<int64_t>(), 0);
  EXPECT_EQ(y[2].item<int64_t>(), 9);
  // Record 0: channel 1 pixel (0, 0) is 255, everything else 0.
  EXPECT_NEAR(x[0][1][0][0].item<float>(), (1.0 - 0.4822) / 0.2435, 1e-5);
  EXPECT_NEAR(x[0][0][0][0].item<float>(), -0.4914 / 0.2470, 1e-5);
  EXPECT_NEAR(x[0][2][31][31].item<float>(), -0.4465 / 0.2616, 1e-5);
  // Record 2 (from data_batch_3.bin): marker 51 = 0.2.
  EXPECT_NEAR(x[1][1][0][0].item<float>(), (0.2 - 0.4822) / 0.2435, 1e-5);
  EXPECT_NEAR(x[1][2][4][9].item<float>(), (1.0 - 0.4465) / 0.2616, 1e-5);

  auto [ex, ey] = splits->test->Gather({});
  EXPECT_EQ(ex.sizes(), (std::vector<int64_t>{0, 3, 32, 32}));
  EXPECT_EQ(ey.numel(), 0);

  spec.set_max_train(2);
  splits = LoadData(spec, 0);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_EQ(splits->train->size(), 2);
}

TEST(DataTest, Cifar10TruncatedFileIsRefused) {
  TempDir dir;
  WriteFile(dir.File("data_batch_1.bin"),
            CifarRecord(1, 0, 0) + CifarRecord(2, 0, 0).substr(0, 100));
  WriteFile(dir.File("test_batch.bin"), CifarRecord(7, 10, 10));
  DataSpec spec;
  spec.set_kind(DataSpec::CIFAR10);
  spec.set_path(dir.path());
  auto splits = LoadData(spec, 0);
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(std::string(splits.status().message()),
                       dir.File("data_batch_1.bin")));
  EXPECT_TRUE(Contains(std::string(splits.status().message()), "3173 bytes"));
}

TEST(DataTest, Cifar10LabelOutOfRangeIsRefused) {
  TempDir dir;
  WriteFile(dir.File("data_batch_1.bin"), CifarRecord(1, 0, 0));
  WriteFile(dir.File("test_batch.bin"),
            CifarRecord(7, 10, 10) + CifarRecord(10, 0, 0));
  DataSpec spec;
  spec.set_kind(DataSpec::CIFAR10);
  spec.set_path(dir.path());
  auto splits = LoadData(spec, 0);
  ASSERT_FALSE(splits.ok());
  EXPECT_TRUE(Contains(std::string(splits.status().message()),
                       dir.File("test_batch.bin")));
  EXPECT_TRUE(Contains(std::string(splits.status().message()), "label 10"));

  // Missing test_batch.bin: NOT_FOUND with the full path.
  std::remove(dir.File("test_batch.bin").c_str());
  splits = LoadData(spec, 0);
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(std::string(splits.status().message()),
                       dir.File("test_batch.bin")));
}

TEST(DataTest, Cifar100UsesFineLabel) {
  TempDir dir;
  auto record = [](uint8_t coarse, uint8_t fine) {
    std::string rec(2 + 3072, '\0');
    rec[0] = static_cast<char>(coarse);
    rec[1] = static_cast<char>(fine);
    return rec;
  };
  WriteFile(dir.File("train.bin"), record(19, 99) + record(0, 42));
  WriteFile(dir.File("test.bin"), record(3, 7));
  DataSpec spec;
  spec.set_kind(DataSpec::CIFAR100);
  spec.set_path(dir.path());
  auto splits = LoadData(spec, 0);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_EQ(splits->shape.classes, 100);
  auto [x, y] = splits->train->Gather({0, 1});
  EXPECT_EQ(y[0].item<int64_t>(), 99);
  EXPECT_EQ(y[1].item<int64_t>(), 42);

  WriteFile(dir.File("test.bin"), record(3, 100));
  splits = LoadData(spec, 0);
  ASSERT_FALSE(splits.ok());
  EXPECT_TRUE(Contains(std::string(splits.status().message()), "test.bin"));
}

TEST(DataTest, TextWindowsAreShiftedByOne) {
  TempDir dir;
  std::string text(1000, '\0');
  for (int i = 0; i < 1000; ++i) text[i] = static_cast<char>(i % 251);
  WriteFile(dir.File("t.txt"), text);
  DataSpec spec;
  spec.set_kind(DataSpec::TEXT);
  spec.set_path(dir.File("t.txt"));
  auto splits = LoadData(spec, 4);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_TRUE(splits->shape.is_text);
  EXPECT_EQ(splits->shape.classes, 256);
  EXPECT_EQ(splits->shape.context, 4);
  // Train = bytes [0, 900), test = [950, 1000).
  EXPECT_EQ(splits->train->size(), (900 - 1) / 4);
  EXPECT_EQ(splits->test->size(), (50 - 1) / 4);

  auto [x, y] = splits->train->Gather({0, 2, 223});
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(x.scalar_type(), torch::kLong);
  EXPECT_EQ(y.scalar_type(), torch::kLong);
  const int64_t starts[] = {0, 8, 892};
  for (int r = 0; r < 3; ++r) {
    for (int t = 0; t < 4; ++t) {
      EXPECT_EQ(x[r][t].item<int64_t>(), (starts[r] + t) % 251);
      EXPECT_EQ(y[r][t].item<int64_t>(), (starts[r] + t + 1) % 251);
    }
  }
  auto [tx, ty] = splits->test->Gather({0, 11});
  EXPECT_EQ(tx[0][0].item<int64_t>(), 950 % 251);
  EXPECT_EQ(ty[1][3].item<int64_t>(), (950 + 44 + 4) % 251);
  // Out-of-range indices throw (callers only pass indices below size()).
  EXPECT_ANY_THROW(splits->test->Gather({12}));

  spec.set_max_train(10);
  splits = LoadData(spec, 4);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_EQ(splits->train->size(), 10);
}

TEST(DataTest, TooShortTextIsRefused) {
  TempDir dir;
  WriteFile(dir.File("short.txt"), std::string(30, 'a'));
  DataSpec spec;
  spec.set_kind(DataSpec::TEXT);
  spec.set_path(dir.File("short.txt"));
  auto splits = LoadData(spec, 4);
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      Contains(std::string(splits.status().message()), dir.File("short.txt")));

  EXPECT_EQ(LoadData(spec, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  spec.set_path(dir.File("missing.txt"));
  splits = LoadData(spec, 4);
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(std::string(splits.status().message()),
                       dir.File("missing.txt")));
}

TEST(DataTest, DefaultCorpusLoads) {
  if (access(DefaultTextPath().c_str(), R_OK) != 0) {
    GTEST_SKIP() << DefaultTextPath() << " is missing (run scripts/setup.sh)";
  }
  DataSpec spec;
  spec.set_kind(DataSpec::TEXT);
  auto splits = LoadData(spec, 256);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_GT(splits->train->size(), 10000);
  EXPECT_GT(splits->test->size(), 500);
  auto [x, y] = splits->test->Gather({0, splits->test->size() - 1});
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{2, 256}));
  EXPECT_GE(x.min().item<int64_t>(), 0);
  EXPECT_LE(x.max().item<int64_t>(), 255);
}

TEST(DataTest, DefaultTextPathFollowsEnvironment) {
  const char* old = std::getenv("INTERLOCK_DATA_DIR");
  std::string saved = old != nullptr ? old : "";
  setenv("INTERLOCK_DATA_DIR", "/some/dir", 1);
  EXPECT_EQ(DefaultTextPath(), "/some/dir/kjv.txt");
  unsetenv("INTERLOCK_DATA_DIR");
  EXPECT_TRUE(Contains(DefaultTextPath(), ".cache/data/kjv.txt"));
  if (old != nullptr) setenv("INTERLOCK_DATA_DIR", saved.c_str(), 1);
}

TEST(DataTest, SyntheticImagesAreDeterministicAndLeaveGlobalRngAlone) {
  DataSpec spec;
  spec.set_kind(DataSpec::SYNTHETIC_IMAGES);
  torch::manual_seed(123);
  const torch::Tensor expected = torch::rand({4});
  torch::manual_seed(123);
  auto a = LoadData(spec, 0);
  const torch::Tensor after = torch::rand({4});
  EXPECT_TRUE(torch::equal(expected, after));

  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->shape.channels, 3);
  EXPECT_EQ(a->shape.height, 32);
  EXPECT_EQ(a->shape.width, 32);
  EXPECT_EQ(a->shape.classes, 10);
  EXPECT_EQ(a->train->size(), 512);
  EXPECT_EQ(a->test->size(), 128);
  auto b = LoadData(spec, 0);
  ASSERT_TRUE(b.ok());
  auto [xa, ya] = a->test->Gather({0, 5, 127});
  auto [xb, yb] = b->test->Gather({0, 5, 127});
  EXPECT_EQ(xa.sizes(), (std::vector<int64_t>{3, 3, 32, 32}));
  EXPECT_TRUE(torch::equal(xa, xb));
  EXPECT_TRUE(torch::equal(ya, yb));
  std::vector<int64_t> all(512);
  for (int i = 0; i < 512; ++i) all[i] = i;
  auto [x, y] = a->train->Gather(all);
  EXPECT_GE(y.min().item<int64_t>(), 0);
  EXPECT_LE(y.max().item<int64_t>(), 9);
  EXPECT_GT(torch::bincount(y).gt(0).sum().item<int64_t>(), 5);
}

TEST(DataTest, SyntheticImagesAreLearnableByNearestMean) {
  DataSpec spec;
  spec.set_kind(DataSpec::SYNTHETIC_VECTORS);
  spec.add_synthetic_shape(16);
  spec.set_synthetic_classes(4);
  spec.set_synthetic_train(400);
  spec.set_synthetic_test(100);
  auto splits = LoadData(spec, 0);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_TRUE(splits->shape.is_vector);
  EXPECT_EQ(splits->shape.channels, 16);
  EXPECT_EQ(splits->shape.height, 1);
  EXPECT_EQ(splits->shape.width, 1);
  std::vector<int64_t> train(400), test(100);
  for (int i = 0; i < 400; ++i) train[i] = i;
  for (int i = 0; i < 100; ++i) test[i] = i;
  auto [x, y] = splits->train->Gather(train);
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{400, 16}));
  auto [tx, ty] = splits->test->Gather(test);
  std::vector<torch::Tensor> means;
  for (int c = 0; c < 4; ++c) means.push_back(x.index({y == c}).mean(0));
  const torch::Tensor m = torch::stack(means);               // [4, 16]
  const torch::Tensor pred = torch::cdist(tx, m).argmin(1);  // [100]
  EXPECT_GT(pred.eq(ty).to(torch::kFloat).mean().item<float>(), 0.9);
}

TEST(DataTest, SyntheticShapeIsValidated) {
  DataSpec spec;
  spec.set_kind(DataSpec::SYNTHETIC_IMAGES);
  spec.add_synthetic_shape(3);
  spec.add_synthetic_shape(32);
  EXPECT_EQ(LoadData(spec, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  spec.add_synthetic_shape(-1);
  EXPECT_EQ(LoadData(spec, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  spec.clear_synthetic_shape();
  spec.add_synthetic_shape(1);
  spec.add_synthetic_shape(8);
  spec.add_synthetic_shape(8);
  spec.set_max_test(3);
  auto splits = LoadData(spec, 0);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_EQ(splits->shape.channels, 1);
  EXPECT_EQ(splits->test->size(), 3);

  DataSpec none;
  EXPECT_EQ(LoadData(none, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DataTest, SyntheticTextIsDeterministicText) {
  DataSpec spec;
  spec.set_kind(DataSpec::SYNTHETIC_TEXT);
  auto a = LoadData(spec, 32);
  auto b = LoadData(spec, 32);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(a->shape.is_text);
  EXPECT_EQ(a->shape.context, 32);
  const int64_t len = 64 * 1024;
  EXPECT_EQ(a->train->size(), (len * 9 / 10 - 1) / 32);
  EXPECT_EQ(a->test->size(), (len - len * 95 / 100 - 1) / 32);
  auto [xa, ya] = a->train->Gather({0, 7, 100});
  auto [xb, yb] = b->train->Gather({0, 7, 100});
  EXPECT_TRUE(torch::equal(xa, xb));
  EXPECT_TRUE(torch::equal(ya, yb));
  EXPECT_TRUE(torch::equal(
      xa.index({torch::indexing::Slice(), torch::indexing::Slice(1, 32)}),
      ya.index({torch::indexing::Slice(), torch::indexing::Slice(0, 31)})));
  // A large context still leaves test windows.
  auto big = LoadData(spec, 4096);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_GE(big->test->size(), 1);
}

TEST(DataTest, InlineRowsAreBothSplits) {
  DataSpec spec;
  spec.set_kind(DataSpec::INLINE);
  spec.add_synthetic_shape(2);
  spec.set_synthetic_classes(2);
  for (float v : {1.0f, 0.5f, -3.0f, 4.0f}) spec.add_inline_inputs(v);
  spec.add_inline_targets(1);
  spec.add_inline_targets(0);
  auto splits = LoadData(spec, 0);
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_TRUE(splits->shape.is_vector);
  EXPECT_EQ(splits->shape.channels, 2);
  EXPECT_EQ(splits->shape.classes, 2);
  EXPECT_EQ(splits->train->size(), 2);
  EXPECT_EQ(splits->test->size(), 2);
  auto [x, y] = splits->test->Gather({1, 0});
  EXPECT_TRUE(
      torch::equal(x, torch::tensor({-3.0f, 4.0f, 1.0f, 0.5f}).view({2, 2})));
  EXPECT_TRUE(torch::equal(y, torch::tensor({int64_t{0}, int64_t{1}})));

  spec.add_inline_inputs(7);  // 5 values for 2 rows of 2.
  EXPECT_EQ(LoadData(spec, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  spec.mutable_inline_inputs()->RemoveLast();
  spec.set_inline_targets(0, 2);  // Only classes 0..1.
  EXPECT_EQ(LoadData(spec, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DataTest, EpochPermutationIsDeterministicPermutation) {
  const auto p = EpochPermutation(1000, 42, 0);
  ASSERT_EQ(p.size(), 1000u);
  const std::set<int64_t> seen(p.begin(), p.end());
  EXPECT_EQ(seen.size(), 1000u);
  EXPECT_EQ(*seen.begin(), 0);
  EXPECT_EQ(*seen.rbegin(), 999);
  EXPECT_EQ(p, EpochPermutation(1000, 42, 0));
  EXPECT_NE(p, EpochPermutation(1000, 42, 1));
  EXPECT_NE(p, EpochPermutation(1000, 43, 0));
  EXPECT_TRUE(EpochPermutation(0, 1, 0).empty());
  EXPECT_EQ(EpochPermutation(1, 1, 5), std::vector<int64_t>{0});
  // Not the identity.
  int fixed = 0;
  for (int64_t i = 0; i < 1000; ++i) fixed += p[i] == i;
  EXPECT_LT(fixed, 20);
}

}  // namespace
}  // namespace interlock
