#include "services/codec_kernels.h"

#include <cstring>

#include "services/vector_clones.h"

namespace interlock {
namespace {

// 1.5 x 2^23: adding it to a value below 2^22 in magnitude leaves a float
// whose unit is 1, so the sum is the value rounded to the nearest integer,
// ties to even (the default rounding mode), and subtracting it back is
// exact. The same result as std::nearbyint, without a library call.
constexpr float kRoundMagic = 12582912.0f;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;

// The largest |x| as bits: for non-negative floats integer order is float
// order, and Inf and NaN lie at and above kInfBits.
INTERLOCK_VECTOR_CLONES uint32_t AbsMaxBits(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof(u));
    u &= kAbsMask;
    m = u > m ? u : m;
  }
  return m;
}

// |x / scale| stays below 255 (scale is absmax / 127 rounded; at worst,
// subnormal, half its value), so the magic rounding is exact and no
// quotient is Inf or NaN. The clamp is on integers so it vectorises.
INTERLOCK_VECTOR_CLONES void Codes(const float* x, int64_t n, float scale,
                                   int8_t* q) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = (x[i] / scale + kRoundMagic) - kRoundMagic;
    int32_t c = static_cast<int32_t>(v);
    c = c < -127 ? -127 : c;
    c = c > 127 ? 127 : c;
    q[i] = static_cast<int8_t>(c);
  }
}

INTERLOCK_VECTOR_CLONES int8_t Values(const int8_t* q, int64_t n, float scale,
                                      float* out) {
  int8_t lowest = 0;
  for (int64_t i = 0; i < n; ++i) {
    lowest = q[i] < lowest ? q[i] : lowest;
    out[i] = static_cast<float>(q[i]) * scale;
  }
  return lowest;
}

INTERLOCK_VECTOR_CLONES uint16_t AbsMaxHalfBits(const uint16_t* x, int64_t n) {
  uint16_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t u = x[i] & 0x7fffu;
    m = u > m ? u : m;
  }
  return m;
}

INTERLOCK_VECTOR_CLONES void WidenBf16Values(const char* x, int64_t n,
                                             float* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, x + 2 * i, sizeof(h));
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    std::memcpy(out + i, &w, sizeof(w));
  }
}

// IEEE half to float, exactly, in integer steps that vectorise: a normal
// value keeps its fraction and has its exponent rebiased by 127 - 15; Inf
// and NaN (exponent all ones) get the float's all-ones exponent, NaN
// payloads kept; a subnormal half (exponent 0) is its fraction times
// 2^-24, a product that is exact in float.
INTERLOCK_VECTOR_CLONES void WidenFp16Values(const char* x, int64_t n,
                                             float* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, x + 2 * i, sizeof(h));
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t rest = h & 0x7fffu;
    // Masks rather than branches, so that the loop vectorises.
    const uint32_t special = 0u - static_cast<uint32_t>(rest >= 0x7c00u);
    const uint32_t subnormal = 0u - static_cast<uint32_t>(rest < 0x0400u);
    const uint32_t w_normal =
        (rest << 13) + (112u << 23) + (special & (112u << 23));
    const float tiny = static_cast<float>(static_cast<int32_t>(rest)) *
                       5.9604644775390625e-8f;  // 2^-24
    uint32_t w_tiny;
    std::memcpy(&w_tiny, &tiny, sizeof(w_tiny));
    const uint32_t w = (w_normal & ~subnormal) | (w_tiny & subnormal) | sign;
    std::memcpy(out + i, &w, sizeof(w));
  }
}

}  // namespace

float QuantizeInt8Block(const float* x, int64_t n, int8_t* q) {
  const uint32_t bits = AbsMaxBits(x, n);
  if (bits >= kInfBits || bits == 0) {
    std::memset(q, 0, static_cast<size_t>(n));
    if (bits == 0) return 0.0f;
    uint32_t nan = 0x7fc00000u;
    float s;
    std::memcpy(&s, &nan, sizeof(s));
    return s;
  }
  float absmax;
  std::memcpy(&absmax, &bits, sizeof(absmax));
  const float scale = absmax / 127.0f;
  // A scale that underflowed to 0 leaves values below 1e-42: they are 0.
  if (!(scale > 0.0f)) {
    std::memset(q, 0, static_cast<size_t>(n));
    return scale;
  }
  Codes(x, n, scale, q);
  return scale;
}

bool DequantizeInt8Block(const int8_t* q, int64_t n, float scale, float* out) {
  return Values(q, n, scale, out) > -128;
}

bool AllFiniteFloats(const float* x, int64_t n) {
  return AbsMaxBits(x, n) < kInfBits;
}

bool AllBelowFloats(const float* x, int64_t n, float bound) {
  uint32_t b;
  std::memcpy(&b, &bound, sizeof(b));
  return AbsMaxBits(x, n) < b;
}

bool AllFiniteHalves(const uint16_t* x, int64_t n, uint16_t inf_bits) {
  return AbsMaxHalfBits(x, n) < inf_bits;
}

void WidenBf16(const char* x, int64_t n, float* out) {
  WidenBf16Values(x, n, out);
}

void WidenFp16(const char* x, int64_t n, float* out) {
  WidenFp16Values(x, n, out);
}

}  // namespace interlock
