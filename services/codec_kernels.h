// The per-value loops of the wire codecs, apart from LibTorch so they can be
// compiled for vector units (CMakeLists.txt: -O3, no FMA contraction, an
// AVX2 clone chosen at load time). Every variant computes the same bits:
// only exact IEEE operations (divide, add, min/max, convert), so a sender
// with AVX2 and a receiver without it agree, and Transfer == Decode(Encode).
#ifndef INTERLOCK_SERVICES_CODEC_KERNELS_H_
#define INTERLOCK_SERVICES_CODEC_KERNELS_H_

#include <cstdint>

namespace interlock {

// One block of INT8_BLOCKWISE: returns its scale (absmax / 127; NaN when a
// value is not finite, and then every code is 0) and writes the values'
// codes, round(x / scale) to nearest even within [-127, 127].
float QuantizeInt8Block(const float* x, int64_t n, int8_t* q);

// The receiver's values of one block: code x scale. False (and `out`
// partly written) when a code is -128, which no sender produces.
bool DequantizeInt8Block(const int8_t* q, int64_t n, float scale, float* out);

// Whether all `n` values are finite (none NaN or infinite): the receiver's
// check, run on each stretch of a message just copied (services/wire.cc).
bool AllFiniteFloats(const float* x, int64_t n);
// Whether all `n` values are below `bound` (> 0, Inf allowed) in magnitude,
// NaN never: the trainer's checks of what it sends and receives, one pass
// and no allocation.
bool AllBelowFloats(const float* x, int64_t n, float bound);
// The same for 16-bit floats given as bits, whose exponent is all ones from
// `inf_bits` up (sign apart): 0x7c00 for IEEE half, 0x7f80 for bfloat16.
bool AllFiniteHalves(const uint16_t* x, int64_t n, uint16_t inf_bits);

// `n` bfloat16 values (little-endian bytes at `x`, any alignment) widened
// to float32: each value's bits moved up 16 places, exactly as LibTorch
// converts them, NaN payloads included.
void WidenBf16(const char* x, int64_t n, float* out);
// The same for IEEE half values: finite ones (subnormals included) exactly
// as LibTorch converts them; Inf stays Inf and NaN stays NaN.
void WidenFp16(const char* x, int64_t n, float* out);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_CODEC_KERNELS_H_
