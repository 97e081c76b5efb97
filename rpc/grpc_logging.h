// gRPC's own log lines, routed into our log (services/logging.h) at VLOG(1):
// every failure gRPC logs also reaches us as a call's status or a server
// that did not start, which we report once, in our words, naming the flag
// or peer. `--verbosity 1` shows gRPC's lines too.
#ifndef INTERLOCK_RPC_GRPC_LOGGING_H_
#define INTERLOCK_RPC_GRPC_LOGGING_H_

namespace interlock {

// Once, at the start of main, after InitLogging.
void RouteGrpcLogs();

}  // namespace interlock

#endif  // INTERLOCK_RPC_GRPC_LOGGING_H_
