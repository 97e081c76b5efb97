// Logging for every binary: glog (LibTorch's own), to stderr only, one line
// per message:
//
//   I1207 15:05:04.123 interlock] resuming from out/checkpoints/step_40 ...
//
// (severity, date, time, program). INFO is what an operator needs (a run
// configured, a worker joined or gone, a recovery and where it resumed);
// WARNING a refusal (a request, a checkpoint, a joiner); ERROR a failure;
// VLOG(1) detail (every Configure, every stream opened or ended).
#ifndef INTERLOCK_SERVICES_LOGGING_H_
#define INTERLOCK_SERVICES_LOGGING_H_

#include <glog/logging.h>

namespace interlock {

// Once, at the start of main. `verbosity`: the VLOG level (--verbosity).
void InitLogging(const char* program, int verbosity);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_LOGGING_H_
