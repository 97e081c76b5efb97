// LibTorch reports errors as exceptions; the services report statuses
//. The catch at the model boundary.
#ifndef INTERLOCK_SERVICES_TORCH_GUARD_H_
#define INTERLOCK_SERVICES_TORCH_GUARD_H_

#include <c10/util/Exception.h>

#include <exception>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace interlock {

// Runs `f` (which returns an absl::Status or StatusOr); a LibTorch error or
// any other exception it throws becomes INTERNAL "`what`: message".
template <typename F>
auto TorchGuard(const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(what, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_TORCH_GUARD_H_
