// Local status helpers: Abseil 20220623 has no RETURN_IF_ERROR macros.
#ifndef INTERLOCK_PLAN_STATUS_MACROS_H_
#define INTERLOCK_PLAN_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define INTERLOCK_CONCAT_INNER_(a, b) a##b
#define INTERLOCK_CONCAT_(a, b) INTERLOCK_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    ::absl::Status _status = (expr);   \
    if (!_status.ok()) return _status; \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(INTERLOCK_CONCAT_(_status_or_, __LINE__), lhs, expr)

#endif  // INTERLOCK_PLAN_STATUS_MACROS_H_
