#include "services/norm_kernels.h"

#include <algorithm>

#include "services/vector_clones.h"

namespace interlock {
namespace {

// Channels per tile (the accumulators stay in L1) and rows per float run.
constexpr int64_t kTile = 256;
constexpr int64_t kRun = 32;

// The forward's pre-activation; the backward recomputes it to find where
// the ReLU passed, so both must be this one expression.
inline float Affine(float x, float scale, float shift) {
  return x * scale + shift;
}

inline float Relu(float z) { return z <= 0.0f ? 0.0f : z; }

}  // namespace

INTERLOCK_VECTOR_CLONES void ChannelMoments(const float* x, int64_t rows,
                                            int64_t channels, int64_t c0,
                                            int64_t c1, double* mean,
                                            double* var) {
  for (int64_t t0 = c0; t0 < c1; t0 += kTile) {
    const int64_t n = std::min(kTile, c1 - t0);
    const float* __restrict x0 = x + t0;
    double s[kTile] = {}, q[kTile] = {};
    for (int64_t r0 = 0; r0 < rows; r0 += kRun) {
      float cs[kTile] = {}, cq[kTile] = {};
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
}

INTERLOCK_VECTOR_CLONES void ScaleShiftRelu(const float* x,
                                            const float* residual, int64_t r0,
                                            int64_t r1, int64_t channels,
                                            const float* scale,
                                            const float* shift, float* y) {
  const float* __restrict sc = scale;
  const float* __restrict sh = shift;
  for (int64_t r = r0; r < r1; ++r) {
    const float* __restrict xr = x + r * channels;
    float* __restrict yr = y + r * channels;
    if (residual != nullptr) {
      const float* __restrict rr = residual + r * channels;
      for (int64_t j = 0; j < channels; ++j) {
        yr[j] = Relu(Affine(xr[j], sc[j], sh[j]) + rr[j]);
      }
    } else {
      for (int64_t j = 0; j < channels; ++j) {
        yr[j] = Relu(Affine(xr[j], sc[j], sh[j]));
      }
    }
  }
}

INTERLOCK_VECTOR_CLONES void ReluNormGradSums(
    const float* dy, const float* x, const float* y, const float* scale,
    const float* shift, int64_t rows, int64_t channels, int64_t c0, int64_t c1,
    const float* mean, float* g_out, double* sum_g, double* sum_gx) {
  for (int64_t t0 = c0; t0 < c1; t0 += kTile) {
    const int64_t n = std::min(kTile, c1 - t0);
    const float* __restrict sc = scale + t0;
    const float* __restrict sh = shift + t0;
    const float* __restrict mu = mean + t0;
    double s[kTile] = {}, q[kTile] = {};
    for (int64_t r0 = 0; r0 < rows; r0 += kRun) {
      float cs[kTile] = {}, cq[kTile] = {};
      const int64_t r1 = std::min(rows, r0 + kRun);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t at = r * channels + t0;
        const float* __restrict dyr = dy + at;
        const float* __restrict xr = x + at;
        if (y != nullptr) {
          const float* __restrict yr = y + at;
          float* __restrict gr = g_out != nullptr ? g_out + at : nullptr;
          for (int64_t j = 0; j < n; ++j) {
            const float g = yr[j] <= 0.0f ? 0.0f : dyr[j];
            if (gr != nullptr) gr[j] = g;
            cs[j] += g;
            cq[j] += g * (xr[j] - mu[j]);
          }
        } else {
          for (int64_t j = 0; j < n; ++j) {
            const float g = Affine(xr[j], sc[j], sh[j]) <= 0.0f ? 0.0f : dyr[j];
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
}

INTERLOCK_VECTOR_CLONES void NormInputGrad(
    const float* dy, const float* x, const float* scale, const float* shift,
    int64_t r0, int64_t r1, int64_t channels, const float* mean, const float* a,
    const float* b, const float* k, float* dx) {
  const float* __restrict mu = mean;
  const float* __restrict pa = a;
  const float* __restrict pb = b;
  const float* __restrict pk = k;
  for (int64_t r = r0; r < r1; ++r) {
    const float* __restrict dyr = dy + r * channels;
    const float* __restrict xr = x + r * channels;
    float* __restrict dxr = dx + r * channels;
    if (scale != nullptr) {
      const float* __restrict sc = scale;
      const float* __restrict sh = shift;
      for (int64_t j = 0; j < channels; ++j) {
        const float g = Affine(xr[j], sc[j], sh[j]) <= 0.0f ? 0.0f : dyr[j];
        dxr[j] = g * pa[j] + (xr[j] - mu[j]) * pb[j] + pk[j];
      }
    } else {
      for (int64_t j = 0; j < channels; ++j) {
        dxr[j] = dyr[j] * pa[j] + (xr[j] - mu[j]) * pb[j] + pk[j];
      }
    }
  }
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
