// Training-mode BatchNorm fused with the ReLU after it (and the residual sum
// before that ReLU) on channels-last float tensors: the per-value loops,
// apart from LibTorch so they can be compiled for vector units like the
// codecs' (CMakeLists.txt: -O3, no FMA contraction, an AVX2 clone). A tensor
// is `rows` = N*H*W rows of `channels` values. Vectors run across channels
// and every channel is summed row after row, so each channel's result is the
// same whatever the vector width or the split into channel ranges: the bits
// do not depend on the machine or the thread count. The LibTorch glue is in
// services/resnet.cc.
#ifndef INTERLOCK_SERVICES_NORM_KERNELS_H_
#define INTERLOCK_SERVICES_NORM_KERNELS_H_

#include <cstdint>

namespace interlock {

// Channels [c0, c1) of x: the mean and the biased variance over the rows,
// summed in float over short runs of rows (after subtracting the first row,
// so a large mean does not cancel the variance away) and in double across
// runs. rows >= 1.
void ChannelMoments(const float* x, int64_t rows, int64_t channels, int64_t c0,
                    int64_t c1, double* mean, double* var);

// Rows [r0, r1): y = relu(x * scale + shift (+ residual)), per channel;
// residual may be null. relu(z) is 0 where z <= 0 and z elsewhere, NaN
// included, as LibTorch's.
void ScaleShiftRelu(const float* x, const float* residual, int64_t r0,
                    int64_t r1, int64_t channels, const float* scale,
                    const float* shift, float* y);

// Channels [c0, c1) of the backward pass's sums: g = dy where the forward's
// ReLU passed and 0 where it did not; sum_g = sum of g and sum_gx = sum of
// g * (x - mean) over the rows. Where the ReLU passed is read from `y` (the
// forward's output) when given, else recomputed as x * scale + shift > 0,
// the forward's own expression. `g_out` (may be null; used only with `y`)
// receives g: the gradient of a residual summed before the ReLU. Where the
// output had two uses, `dy2` (else null) is the second one's gradient and dy
// above stands for dy + dy2.
void ReluNormGradSums(const float* dy, const float* dy2, const float* x,
                      const float* y, const float* scale, const float* shift,
                      int64_t rows, int64_t channels, int64_t c0, int64_t c1,
                      const float* mean, float* g_out, double* sum_g,
                      double* sum_gx);

// Rows [r0, r1) of the input gradient, dx = g * a + (x - mean) * b + k per
// channel, where g is dy masked as above when `scale` is given and dy
// itself when it is null (dy then already is g); dy2 as above.
void NormInputGrad(const float* dy, const float* dy2, const float* x,
                   const float* scale, const float* shift, int64_t r0,
                   int64_t r1, int64_t channels, const float* mean,
                   const float* a, const float* b, const float* k, float* dx);

// ATen 1.13's update of running statistics (batch_norm_cpu_update_stats
// _template) with factor m: mean blended in float, the unbiased variance
// blended in double, both stored as float. The fused layer and the
// replicas' replay of captured statistics (services/replication.cc) both
// use it, so a capture with m = 1 is the batch's statistics exactly.
void BlendRunningStats(float m, const float* mean, const float* var,
                       int64_t channels, float* running_mean,
                       float* running_var);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_NORM_KERNELS_H_
