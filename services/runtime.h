// Process-level runtime settings.
#ifndef INTERLOCK_SERVICES_RUNTIME_H_
#define INTERLOCK_SERVICES_RUNTIME_H_

#include <string>
#include <vector>

namespace interlock {

// Limits LibTorch's intra-op pool and OpenBLAS's own pool to `threads` for
// the calling thread (and the process-wide defaults). OpenBLAS keeps a pool of
// its own: without this, two one-thread blocks on two cores fight over four.
void ConfigureThreads(int threads);

// Keeps freed large blocks in the heap instead of returning them to the
// kernel: otherwise activations and gradients are page-faulted in anew every
// step, which measured 50-70% of a small ResNet's step time (BENCHMARKS.md).
void TuneAllocator();

// Command-line flags may be spelled with hyphens (--token-file) as well as
// with Abseil's underscores: rewrites the names (not the values) in `args`
// (a copy of argv) and returns argv-style pointers into it.
std::vector<char*> UnderscoreFlagNames(std::vector<std::string>& args);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_RUNTIME_H_
