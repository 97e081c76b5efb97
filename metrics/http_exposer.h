// A small HTTP server for Prometheus scrapes: GET /metrics returns the text
// exposition of a registry. We do not use prometheus-cpp's civetweb exposer:
// in processes that load LibTorch, civetweb fails to start its threads.
#ifndef INTERLOCK_METRICS_HTTP_EXPOSER_H_
#define INTERLOCK_METRICS_HTTP_EXPOSER_H_

#include <prometheus/registry.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace interlock {

class HttpExposer {
 public:
  // Listens on host:port (port 0: any free port).
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(
      const std::string& host, int port,
      std::shared_ptr<prometheus::Registry> registry);
  ~HttpExposer();
  int port() const { return port_; }

 private:
  HttpExposer() = default;
  void Serve();
  void Handle(int fd);

  std::shared_ptr<prometheus::Registry> registry_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace interlock

#endif  // INTERLOCK_METRICS_HTTP_EXPOSER_H_
