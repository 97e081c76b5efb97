#include "services/norm_kernels.h"

#include <algorithm>

#include "services/vector_clones.h"

namespace interlock {
namespace {

// Channels per tile (the accumulators stay in L1) and rows per float run.
constexpr int64_t kTile = 256;
constexpr int64_t kRun = 32;

// The loops below are templates on their width (the tile's or the row's
// channel count) for the widths our models have, 0 standing for any other:
// a width known at compile time unrolls the per-row loop into whole vectors
// and keeps short accumulators in registers, and restrict-qualified
// parameters spare the per-row aliasing checks (the fused backward of a
// ResNet step took 0.77x the time, docs/BENCHMARKS.md). Every instantiation
// performs the same operations in the same order per value, so the bits do
// not depend on which one runs (tests/fused_norm_test.cc). Inlined into the
// exported functions, so that their AVX2 clone compiles them for AVX2. Width 16
// only for the backward's loops: the forward's two ran three times slower with
// it (GCC 12, 65536 rows).
#define INTERLOCK_ALWAYS_INLINE inline __attribute__((always_inline))
#define INTERLOCK_WIDTH_CASES(CALL) \
  case 32:                          \
    CALL(32);                       \
    break;                          \
  case 64:                          \
    CALL(64);                       \
    break;                          \
  case 128:                         \
    CALL(128);                      \
    break;                          \
  default:                          \
    CALL(0);

// The forward's pre-activation; the backward recomputes it to find where
// the ReLU passed, so both must be this one expression.
INTERLOCK_ALWAYS_INLINE float Affine(float x, float scale, float shift) {
  return x * scale + shift;
}

INTERLOCK_ALWAYS_INLINE float Relu(float z) { return z <= 0.0f ? 0.0f : z; }

// The gradient reaching the output: dy, or dy + dy2 where the output had two
// uses (autograd's own sum of the two, bit for bit: one float addition).
// Under the ReLU's condition GCC vectorises the addition only with
// -fno-trapping-math (services/CMakeLists.txt); without it these loops ran
// 2-6x slower.
template <bool kTwo>
INTERLOCK_ALWAYS_INLINE float OutGrad(const float* __restrict dy,
                                      const float* __restrict dy2, int64_t j) {
  return kTwo ? dy[j] + dy2[j] : dy[j];
}

template <int64_t kN>
INTERLOCK_ALWAYS_INLINE void MomentsTile(const float* __restrict x,
                                         int64_t rows, int64_t channels,
                                         int64_t t0, int64_t n_any,
                                         double* __restrict mean,
                                         double* __restrict var) {
  constexpr int64_t kMax = kN > 0 ? kN : kTile;
  const int64_t n = kN > 0 ? kN : n_any;
  const float* __restrict x0 = x + t0;
  double s[kMax] = {}, q[kMax] = {};
  for (int64_t r0 = 0; r0 < rows; r0 += kRun) {
    float cs[kMax] = {}, cq[kMax] = {};
    const int64_t r1 = std::min(rows, r0 + kRun);
    for (int64_t r = r0; r < r1; ++r) {
      const float* __restrict xr = x + r * channels + t0;
      for (int64_t j = 0; j < n; ++j) {
        const float d = xr[j] - x0[j];
        cs[j] += d;
        cq[j] += d * d;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      s[j] += cs[j];
      q[j] += cq[j];
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const double m = s[j] / static_cast<double>(rows);
    const double v = q[j] / static_cast<double>(rows) - m * m;
    mean[t0 + j] = static_cast<double>(x0[j]) + m;
    var[t0 + j] = v > 0 ? v : 0;
  }
}

template <int64_t kC>
INTERLOCK_ALWAYS_INLINE void ScaleShiftReluRows(
    const float* __restrict x, const float* __restrict residual, int64_t r0,
    int64_t r1, int64_t c_any, const float* __restrict sc,
    const float* __restrict sh, float* __restrict y) {
  const int64_t c = kC > 0 ? kC : c_any;
  for (int64_t r = r0; r < r1; ++r) {
    const float* __restrict xr = x + r * c;
    float* __restrict yr = y + r * c;
    if (residual != nullptr) {
      const float* __restrict rr = residual + r * c;
      for (int64_t j = 0; j < c; ++j) {
        yr[j] = Relu(Affine(xr[j], sc[j], sh[j]) + rr[j]);
      }
    } else {
      for (int64_t j = 0; j < c; ++j) {
        yr[j] = Relu(Affine(xr[j], sc[j], sh[j]));
      }
    }
  }
}

template <int64_t kN, bool kTwo>
INTERLOCK_ALWAYS_INLINE void GradSumsTile(
    const float* __restrict dy, const float* __restrict dy2,
    const float* __restrict x, const float* __restrict y,
    const float* __restrict sc, const float* __restrict sh, int64_t rows,
    int64_t channels, int64_t t0, int64_t n_any, const float* __restrict mu,
    float* __restrict g_out, double* __restrict sum_g,
    double* __restrict sum_gx) {
  constexpr int64_t kMax = kN > 0 ? kN : kTile;
  const int64_t n = kN > 0 ? kN : n_any;
  double s[kMax] = {}, q[kMax] = {};
  for (int64_t r0 = 0; r0 < rows; r0 += kRun) {
    float cs[kMax] = {}, cq[kMax] = {};
    const int64_t r1 = std::min(rows, r0 + kRun);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t at = r * channels + t0;
      const float* __restrict dyr = dy + at;
      const float* __restrict dy2r = kTwo ? dy2 + at : nullptr;
      const float* __restrict xr = x + at;
      if (y != nullptr) {
        const float* __restrict yr = y + at;
        if (g_out != nullptr) {
          float* __restrict gr = g_out + at;
          for (int64_t j = 0; j < n; ++j) {
            const float d = OutGrad<kTwo>(dyr, dy2r, j);
            const float g = yr[j] <= 0.0f ? 0.0f : d;
            gr[j] = g;
            cs[j] += g;
            cq[j] += g * (xr[j] - mu[j]);
          }
        } else {
          for (int64_t j = 0; j < n; ++j) {
            const float d = OutGrad<kTwo>(dyr, dy2r, j);
            const float g = yr[j] <= 0.0f ? 0.0f : d;
            cs[j] += g;
            cq[j] += g * (xr[j] - mu[j]);
          }
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const float d = OutGrad<kTwo>(dyr, dy2r, j);
          const float g = Affine(xr[j], sc[j], sh[j]) <= 0.0f ? 0.0f : d;
          cs[j] += g;
          cq[j] += g * (xr[j] - mu[j]);
        }
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      s[j] += cs[j];
      q[j] += cq[j];
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    sum_g[t0 + j] = s[j];
    sum_gx[t0 + j] = q[j];
  }
}

template <int64_t kC, bool kTwo>
INTERLOCK_ALWAYS_INLINE void InputGradRows(
    const float* __restrict dy, const float* __restrict dy2,
    const float* __restrict x, const float* __restrict sc,
    const float* __restrict sh, int64_t r0, int64_t r1, int64_t c_any,
    const float* __restrict mu, const float* __restrict pa,
    const float* __restrict pb, const float* __restrict pk,
    float* __restrict dx) {
  const int64_t c = kC > 0 ? kC : c_any;
  for (int64_t r = r0; r < r1; ++r) {
    const float* __restrict dyr = dy + r * c;
    const float* __restrict dy2r = kTwo ? dy2 + r * c : nullptr;
    const float* __restrict xr = x + r * c;
    float* __restrict dxr = dx + r * c;
    if (sc != nullptr) {
      for (int64_t j = 0; j < c; ++j) {
        const float d = OutGrad<kTwo>(dyr, dy2r, j);
        const float g = Affine(xr[j], sc[j], sh[j]) <= 0.0f ? 0.0f : d;
        dxr[j] = g * pa[j] + (xr[j] - mu[j]) * pb[j] + pk[j];
      }
    } else {
      for (int64_t j = 0; j < c; ++j) {
        dxr[j] = OutGrad<kTwo>(dyr, dy2r, j) * pa[j] + (xr[j] - mu[j]) * pb[j] +
                 pk[j];
      }
    }
  }
}

}  // namespace

INTERLOCK_VECTOR_CLONES void ChannelMoments(const float* x, int64_t rows,
                                            int64_t channels, int64_t c0,
                                            int64_t c1, double* mean,
                                            double* var) {
  for (int64_t t0 = c0; t0 < c1; t0 += kTile) {
    const int64_t n = std::min(kTile, c1 - t0);
#define INTERLOCK_CALL(w) MomentsTile<w>(x, rows, channels, t0, n, mean, var)
    switch (n) { INTERLOCK_WIDTH_CASES(INTERLOCK_CALL) }
#undef INTERLOCK_CALL
  }
}

INTERLOCK_VECTOR_CLONES void ScaleShiftRelu(const float* x,
                                            const float* residual, int64_t r0,
                                            int64_t r1, int64_t channels,
                                            const float* scale,
                                            const float* shift, float* y) {
#define INTERLOCK_CALL(w) \
  ScaleShiftReluRows<w>(x, residual, r0, r1, channels, scale, shift, y)
  switch (channels) { INTERLOCK_WIDTH_CASES(INTERLOCK_CALL) }
#undef INTERLOCK_CALL
}

INTERLOCK_VECTOR_CLONES void ReluNormGradSums(
    const float* dy, const float* dy2, const float* x, const float* y,
    const float* scale, const float* shift, int64_t rows, int64_t channels,
    int64_t c0, int64_t c1, const float* mean, float* g_out, double* sum_g,
    double* sum_gx) {
  for (int64_t t0 = c0; t0 < c1; t0 += kTile) {
    const int64_t n = std::min(kTile, c1 - t0);
#define INTERLOCK_CALL(w)                                                     \
  if (dy2 != nullptr) {                                                       \
    GradSumsTile<w, true>(dy, dy2, x, y, scale + t0, shift + t0, rows,        \
                          channels, t0, n, mean + t0, g_out, sum_g, sum_gx);  \
  } else {                                                                    \
    GradSumsTile<w, false>(dy, dy2, x, y, scale + t0, shift + t0, rows,       \
                           channels, t0, n, mean + t0, g_out, sum_g, sum_gx); \
  }
    switch (n) {
      case 16:
        INTERLOCK_CALL(16);
        break;
        INTERLOCK_WIDTH_CASES(INTERLOCK_CALL)
    }
#undef INTERLOCK_CALL
  }
}

INTERLOCK_VECTOR_CLONES void NormInputGrad(const float* dy, const float* dy2,
                                           const float* x, const float* scale,
                                           const float* shift, int64_t r0,
                                           int64_t r1, int64_t channels,
                                           const float* mean, const float* a,
                                           const float* b, const float* k,
                                           float* dx) {
#define INTERLOCK_CALL(w)                                                     \
  if (dy2 != nullptr) {                                                       \
    InputGradRows<w, true>(dy, dy2, x, scale, shift, r0, r1, channels, mean,  \
                           a, b, k, dx);                                      \
  } else {                                                                    \
    InputGradRows<w, false>(dy, dy2, x, scale, shift, r0, r1, channels, mean, \
                            a, b, k, dx);                                     \
  }
  switch (channels) {
    case 16:
      INTERLOCK_CALL(16);
      break;
      INTERLOCK_WIDTH_CASES(INTERLOCK_CALL)
  }
#undef INTERLOCK_CALL
}

void BlendRunningStats(float m, const float* mean, const float* var,
                       int64_t channels, float* running_mean,
                       float* running_var) {
  for (int64_t c = 0; c < channels; ++c) {
    running_mean[c] = m * mean[c] + (1 - m) * running_mean[c];
    running_var[c] = static_cast<float>(static_cast<double>(m) *
                                            static_cast<double>(var[c]) +
                                        (1 - m) * running_var[c]);
  }
}

}  // namespace interlock
