// The rendezvous store over gRPC (the Rendezvous service of
// proto/worker.proto): the coordinator serves its KeyValueStore with the
// run's token and TLS, and a worker's reduction group reaches it through a
// RendezvousClient. It replaces LibTorch's TCPStore, which can neither
// choose its address nor authenticate a caller.
#ifndef INTERLOCK_RPC_RENDEZVOUS_H_
#define INTERLOCK_RPC_RENDEZVOUS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/worker.grpc.pb.h"
#include "rpc/security.h"
#include "services/key_value_store.h"

namespace interlock {

// A store served on `host`:`port` (0: a free port). Every call must carry
// `security.token` when it has one; TLS (mutual with a CA) as the
// security's certificates say. Destroying it ends every call at once, so a
// member held in a rendezvous for a peer that died fails now.
class RendezvousServer {
 public:
  static absl::StatusOr<std::unique_ptr<RendezvousServer>> Start(
      const std::string& host, int port, const TransportSecurity& security);
  ~RendezvousServer();
  int port() const { return port_; }
  // Calls refused for a missing or wrong token.
  int64_t refused() const;

 private:
  class Service;
  RendezvousServer() = default;
  KeyValueStore store_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// The store at `address` ("host:port"), each call bounded by `deadline`
// from its start. Errors name the store and the call.
class RendezvousClient : public KeyValueClient {
 public:
  RendezvousClient(const std::string& address,
                   const TransportSecurity& security,
                   absl::Duration deadline = absl::Seconds(10));

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::optional<std::string>> Get(
      const std::string& key) override;
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t amount) override;
  absl::StatusOr<std::string> CompareSet(const std::string& key,
                                         const std::string& expected,
                                         const std::string& desired) override;
  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override;
  absl::StatusOr<bool> Delete(const std::string& key) override;
  absl::StatusOr<int64_t> NumKeys() override;

 private:
  absl::StatusOr<interlock::v1::StoreResponse> Call(
      const interlock::v1::StoreRequest& request);

  const std::string address_;
  const absl::Duration deadline_;
  std::mutex mu_;
  std::string store_id_;  // of the first answer
  std::unique_ptr<interlock::v1::Rendezvous::Stub> stub_;
};

}  // namespace interlock

#endif  // INTERLOCK_RPC_RENDEZVOUS_H_
