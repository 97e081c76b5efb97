// Process-level runtime settings.
#ifndef INTERLOCK_SERVICES_RUNTIME_H_
#define INTERLOCK_SERVICES_RUNTIME_H_

namespace interlock {

// Limits LibTorch's intra-op pool and OpenBLAS's own pool to `threads` for
// the calling thread (and the process-wide defaults). OpenBLAS keeps a pool of
// its own: without this, two one-thread blocks on two cores fight over four.
void ConfigureThreads(int threads);

// Keeps freed large blocks in the heap instead of returning them to the
// kernel: otherwise activations and gradients are page-faulted in anew every
// step, which measured 50-70% of a small ResNet's step time (BENCHMARKS.md).
void TuneAllocator();

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_RUNTIME_H_
