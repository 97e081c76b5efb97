#include "metrics/http_exposer.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace interlock {

absl::StatusOr<std::unique_ptr<HttpExposer>> HttpExposer::Start(
    const std::string& host, int port,
    std::shared_ptr<prometheus::Registry> registry) {
  std::unique_ptr<HttpExposer> e(new HttpExposer());
  e->registry_ = std::move(registry);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(),
                  &hints, &res) != 0 ||
      res == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: cannot resolve '", host, "'"));
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool ok = fd >= 0 && bind(fd, res->ai_addr, res->ai_addrlen) == 0 &&
                  listen(fd, 64) == 0;
  freeaddrinfo(res);
  if (!ok) {
    const std::string why = std::strerror(errno);
    if (fd >= 0) close(fd);
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", host, ":", port, ": ", why));
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  e->port_ = ntohs(addr.ss_family == AF_INET6
                       ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                       : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  e->listen_fd_ = fd;
  e->thread_ = std::thread([p = e.get()] { p->Serve(); });
  return e;
}

HttpExposer::~HttpExposer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) close(listen_fd_);
}

void HttpExposer::Serve() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    // Scrapes are small and rare: one at a time, with a short timeout so a
    // silent client cannot hold the server.
    timeval tv{2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    Handle(fd);
    close(fd);
  }
}

void HttpExposer::Handle(int fd) {
  std::string request;
  char buf[2048];
  while (request.find("\r\n\r\n") == std::string::npos &&
         request.size() < 16384) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) return;
    request.append(buf, n);
  }
  std::string status = "200 OK";
  std::string body;
  std::string type = "text/plain; version=0.0.4; charset=utf-8";
  const size_t sp1 = request.find(' ');
  const size_t sp2 = request.find(' ', sp1 + 1);
  const std::string method = request.substr(0, sp1);
  const std::string path =
      sp1 == std::string::npos ? "" : request.substr(sp1 + 1, sp2 - sp1 - 1);
  if (method != "GET" && method != "HEAD") {
    status = "405 Method Not Allowed";
    body = "only GET\n";
    type = "text/plain";
  } else if (path == "/metrics" || path.rfind("/metrics?", 0) == 0) {
    body = prometheus::TextSerializer().Serialize(registry_->Collect());
  } else {
    status = "404 Not Found";
    body = "see /metrics\n";
    type = "text/plain";
  }
  std::string response = absl::StrCat(
      "HTTP/1.1 ", status, "\r\nContent-Type: ", type,
      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n");
  if (method != "HEAD") response += body;
  size_t sent = 0;
  while (sent < response.size()) {
    const ssize_t n = write(fd, response.data() + sent, response.size() - sent);
    if (n <= 0) return;
    sent += n;
  }
}

}  // namespace interlock
