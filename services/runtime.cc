#include "services/runtime.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>

namespace interlock {

std::vector<char*> UnderscoreFlagNames(std::vector<std::string>& args) {
  std::vector<char*> out;
  for (auto& a : args) {
    if (a.rfind("--", 0) == 0) {
      for (size_t i = 2; i < a.size() && a[i] != '='; ++i) {
        if (a[i] == '-') a[i] = '_';
      }
    }
    out.push_back(a.data());
  }
  return out;
}

void ConfigureThreads(int threads) {
  if (threads < 1) threads = 1;
  at::set_num_threads(threads);
  // Looked up at run time: LibTorch reaches OpenBLAS through the BLAS
  // alternatives, so the symbol may or may not be there.
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(
          dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(threads);
  }
}

void TuneAllocator() {
  // Both are needed: the mmap threshold alone still trims the heap top, the
  // trim threshold alone still serves large blocks by mmap.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // Larger blocks never get an mmap of their own either: a 32 MiB tensor or
  // message buffer would otherwise get fresh, zeroed pages on every
  // allocation (the wire benchmark measured 60k page faults and 0.03x of raw
  // TCP per 32 MiB exchange; docs/BENCHMARKS.md).
  mallopt(M_MMAP_MAX, 0);
  // One arena: a block's executor thread otherwise gets an arena of its own
  // whose heaps are still handed back and faulted in every step (measured
  // ~80 MB of fresh pages per step in worker 0, BENCHMARKS.md). Our threads
  // are few, so the shared arena's lock costs nothing measurable.
  mallopt(M_ARENA_MAX, 1);
}

}  // namespace interlock
