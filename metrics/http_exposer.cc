#include "metrics/http_exposer.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "prometheus/text_serializer.h"

namespace interlock {
namespace {

// Compares every byte whatever the first difference, so the time taken does
// not tell how much of a guess was right.
bool SameSecret(absl::string_view got, const std::string& expected) {
  unsigned char diff = got.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g =
        i < got.size() ? static_cast<unsigned char>(got[i]) : 0;
    diff |= g ^ static_cast<unsigned char>(expected[i]);
  }
  return diff == 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExposer>> HttpExposer::Start(
    const std::string& host, int port,
    std::shared_ptr<prometheus::Registry> registry,
    const std::string& bearer_token) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: port ", port, " is not in 0..65535"));
  }
  std::unique_ptr<HttpExposer> e(new HttpExposer());
  e->registry_ = std::move(registry);
  e->token_ = bearer_token;
  if (!e->token_.empty()) {
    e->refused_ = &prometheus::BuildCounter()
                       .Name("interlock_metrics_refused_scrapes_total")
                       .Help(
                           "Requests to the metrics endpoint refused for a "
                           "missing or wrong bearer token")
                       .Register(*e->registry_)
                       .Add({});
  }
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
  // SO_REUSEADDR only skips TIME_WAIT after a restart: Linux still refuses
  // a port another socket listens on (no SO_REUSEPORT here).
  const int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool ok = fd >= 0 && bind(fd, res->ai_addr, res->ai_addrlen) == 0 &&
                  listen(fd, 64) == 0;
  const int error = errno;
  freeaddrinfo(res);
  if (!ok) {
    const std::string why = std::strerror(error);
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
  std::string extra_headers;
  const size_t sp1 = request.find(' ');
  const size_t sp2 = request.find(' ', sp1 + 1);
  const std::string method = request.substr(0, sp1);
  const std::string path =
      sp1 == std::string::npos ? "" : request.substr(sp1 + 1, sp2 - sp1 - 1);
  if (!token_.empty() && !Authorized(request)) {
    refused_->Increment();
    status = "401 Unauthorized";
    body = "missing or wrong bearer token\n";
    type = "text/plain";
    extra_headers = "WWW-Authenticate: Bearer realm=\"metrics\"\r\n";
  } else if (method != "GET" && method != "HEAD") {
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
  std::string response =
      absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                   "\r\nContent-Length: ", body.size(), "\r\n", extra_headers,
                   "Connection: close\r\n\r\n");
  if (method != "HEAD") response += body;
  size_t sent = 0;
  while (sent < response.size()) {
    // MSG_NOSIGNAL: a scraper that hangs up early must not raise SIGPIPE,
    // which would end the whole process.
    const ssize_t n =
        send(fd, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += n;
  }
}

// The first Authorization header must be "Bearer <token>" (scheme and
// header name case-insensitive, RFC 7235).
bool HttpExposer::Authorized(const std::string& request) const {
  const size_t end = request.find("\r\n\r\n");
  absl::string_view headers(request);
  headers = headers.substr(0, end);
  size_t at = headers.find("\r\n");
  while (at != absl::string_view::npos) {
    const size_t start = at + 2;
    at = headers.find("\r\n", start);
    const absl::string_view line = headers.substr(
        start,
        at == absl::string_view::npos ? absl::string_view::npos : at - start);
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos) continue;
    if (!absl::EqualsIgnoreCase(
            absl::StripAsciiWhitespace(line.substr(0, colon)),
            "authorization")) {
      continue;
    }
    const absl::string_view value =
        absl::StripAsciiWhitespace(line.substr(colon + 1));
    const size_t space = value.find(' ');
    if (space == absl::string_view::npos ||
        !absl::EqualsIgnoreCase(value.substr(0, space), "bearer")) {
      return false;
    }
    return SameSecret(absl::StripAsciiWhitespace(value.substr(space + 1)),
                      token_);
  }
  return false;
}

}  // namespace interlock
