// A small HTTP server for Prometheus scrapes: GET /metrics returns the text
// exposition of a registry. We do not use prometheus-cpp's civetweb exposer:
// in processes that load LibTorch, civetweb fails to start its threads.
#ifndef INTERLOCK_METRICS_HTTP_EXPOSER_H_
#define INTERLOCK_METRICS_HTTP_EXPOSER_H_

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace interlock {

class HttpExposer {
 public:
  // Listens on host:port (port 0: any free port; an address in use is an
  // error). With a non-empty `bearer_token` every request must carry
  // `Authorization: Bearer <token>` (what Prometheus sends for
  // `authorization: {credentials_file: ...}`), or gets 401; refusals are
  // counted in interlock_metrics_refused_scrapes_total.
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(
      const std::string& host, int port,
      std::shared_ptr<prometheus::Registry> registry,
      const std::string& bearer_token = "");
  ~HttpExposer();
  int port() const { return port_; }

 private:
  HttpExposer() = default;
  void Serve();
  void Handle(int fd);
  bool Authorized(const std::string& request) const;

  std::shared_ptr<prometheus::Registry> registry_;
  std::string token_;                       // empty: no authentication
  prometheus::Counter* refused_ = nullptr;  // set with token_
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace interlock

#endif  // INTERLOCK_METRICS_HTTP_EXPOSER_H_
