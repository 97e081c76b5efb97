// Loops compiled twice, for AVX2 and for the baseline, the loader picking
// one (GCC on x86-64): services/codec_kernels.cc and norm_kernels.cc. Their
// loops use only exact IEEE operations and no FMA contraction, so both
// clones compute the same bits.
#ifndef INTERLOCK_SERVICES_VECTOR_CLONES_H_
#define INTERLOCK_SERVICES_VECTOR_CLONES_H_

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define INTERLOCK_VECTOR_CLONES \
  __attribute__((target_clones("avx2", "default")))
#else
#define INTERLOCK_VECTOR_CLONES
#endif

#endif  // INTERLOCK_SERVICES_VECTOR_CLONES_H_
