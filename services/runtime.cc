#include "services/runtime.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

namespace interlock {

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

}  // namespace interlock
