// INT8_BLOCKWISE's quantisation and dequantisation (services/codec_kernels)
// against the scalar definition they replace (nearbyint of x / scale per
// value, as the codec did before), side by side in one process on the same
// 32 MiB of normal values in blocks of 256. Also checks that both give the
// same codes. Not run by ctest (docs/BENCHMARKS.md).
//
//   build/tests/bench/interlock_int8_kernels_bench [ROUNDS]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "services/codec_kernels.h"

namespace {

// The definition: scale = absmax / 127, code = nearbyint(x / scale) in
// [-127, 127] (finite blocks only; the benchmark's values are).
float ScalarQuantize(const float* x, int64_t n, int8_t* q) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float scale = absmax / 127.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = scale > 0.0f ? std::nearbyint(x[i] / scale) : 0.0f;
    q[i] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
  }
  return scale;
}

double Ms(std::chrono::steady_clock::time_point a,
          std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 9;
  if (rounds < 1) {
    std::fprintf(stderr, "usage: interlock_int8_kernels_bench [ROUNDS>=1]\n");
    return 2;
  }
  constexpr int64_t kValues = int64_t{8} << 20;  // 32 MiB of fp32
  constexpr int64_t kBlock = 256;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(kValues);
  for (float& v : x) v = normal(rng);
  std::vector<int8_t> a(kValues), b(kValues);
  std::vector<float> scales(kValues / kBlock), out(kValues);
  std::vector<double> scalar, kernel, dequant;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kValues; i += kBlock) {
      ScalarQuantize(x.data() + i, kBlock, a.data() + i);
    }
    auto t1 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kValues; i += kBlock) {
      scales[i / kBlock] =
          interlock::QuantizeInt8Block(x.data() + i, kBlock, b.data() + i);
    }
    auto t2 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kValues; i += kBlock) {
      interlock::DequantizeInt8Block(b.data() + i, kBlock, scales[i / kBlock],
                                     out.data() + i);
    }
    auto t3 = std::chrono::steady_clock::now();
    scalar.push_back(Ms(t0, t1));
    kernel.push_back(Ms(t1, t2));
    dequant.push_back(Ms(t2, t3));
    if (a != b) {
      std::fprintf(stderr, "codes differ from the scalar definition\n");
      return 1;
    }
  }
  const double s = Median(scalar), k = Median(kernel), d = Median(dequant);
  std::printf(
      "32 MiB fp32, blocks of 256, %d rounds, medians: scalar quantise "
      "%.2f ms (%.0f MiB/s), kernel quantise %.2f ms (%.0f MiB/s, %.1fx), "
      "kernel dequantise %.2f ms (%.0f MiB/s); codes identical\n",
      rounds, s, 32e3 / s, k, 32e3 / k, s / k, d, 32e3 / d);
  return 0;
}
