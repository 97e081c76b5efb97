#include "rpc/grpc_logging.h"

#include <grpc/support/log.h>

#include "services/logging.h"

namespace interlock {
namespace {

void ToGlog(gpr_log_func_args* args) {
  VLOG(1) << "grpc " << gpr_log_severity_string(args->severity) << " "
          << args->file << ":" << args->line << " " << args->message;
}

}  // namespace

void RouteGrpcLogs() { gpr_set_log_function(&ToGlog); }

}  // namespace interlock
