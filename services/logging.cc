#include "services/logging.h"

#include <cstdio>
#include <string>

namespace interlock {
namespace {

void Prefix(std::ostream& s, const google::LogMessageInfo& l, void* data) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%c%02d%02d %02d:%02d:%02d.%03d ",
                l.severity[0], l.time.month() + 1, l.time.day(), l.time.hour(),
                l.time.min(), l.time.sec(),
                static_cast<int>(l.time.usec() / 1000));
  s << buf << static_cast<const std::string*>(data)->c_str() << "]";
}

}  // namespace

void InitLogging(const char* program, int verbosity) {
  // No log files (glog's default): a container's stderr is its log.
  FLAGS_logtostderr = true;
  FLAGS_v = verbosity;
  if (google::IsGoogleLoggingInitialized()) return;
  static const std::string* name = new std::string(program);
  google::InitGoogleLogging(program, &Prefix, const_cast<std::string*>(name));
}

}  // namespace interlock
