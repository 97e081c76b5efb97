// TEMPORARY stand-in until the replicas-core branch is merged.
#ifndef INTERLOCK_COLLECTIVE_GLOO_COLLECTIVE_H_
#define INTERLOCK_COLLECTIVE_GLOO_COLLECTIVE_H_
#include <memory>
#include <string>
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "services/collective.h"
namespace interlock {
struct GlooOptions {
  std::string store_host;
  int store_port = 0;
  std::string prefix;
  int rank = 0;
  int size = 1;
  std::string device_host = "127.0.0.1";
  absl::Duration timeout = absl::Seconds(30);
};
absl::StatusOr<std::shared_ptr<Collective>> ConnectGloo(const GlooOptions&);
class StoreServer {
 public:
  static absl::StatusOr<std::unique_ptr<StoreServer>> Start(
      const std::string& host, int port);
  int port() const { return 0; }
};
}  // namespace interlock
#endif
