// Transport security shared by both services: an optional shared bearer
// token checked on every Worker RPC, and optional TLS or mutual TLS.
//
// gRPC C++ 1.51 only sends CallCredentials on secure channels, and its
// AuthMetadataProcessor cannot be attached to insecure server credentials,
// so clients attach the token with a channel interceptor (every call on the
// channel carries it) and servers check it in the service adapter before the
// call reaches the worker core. The health service is not checked: probes
// carry no token.
#ifndef INTERLOCK_RPC_SECURITY_H_
#define INTERLOCK_RPC_SECURITY_H_

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/client_interceptor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace interlock {

struct SecurityFiles {
  std::string token_file;  // --token-file
  std::string tls_cert;    // --tls-cert: this process's certificate chain
  std::string tls_key;     // --tls-key: its private key
  std::string tls_ca;      // --tls-ca: the CA that signs the peers
  bool empty() const {
    return token_file.empty() && tls_cert.empty() && tls_key.empty() &&
           tls_ca.empty();
  }
};

struct TransportSecurity {
  std::string token;  // empty: no token
  std::string cert_pem;
  std::string key_pem;
  std::string ca_pem;
  // Clients speak TLS when they have a CA or a certificate; servers when
  // they have a certificate, and require client certificates signed by the
  // CA when they have one (mutual TLS).
  bool tls() const { return !cert_pem.empty() || !ca_pem.empty(); }
};

// Reads and checks the files named by the flags. `server`: a CA without a
// certificate and key is an error (a server cannot verify clients without
// presenting its own certificate), and so is a key that is not the private
// key of the certificate, or a certificate OpenSSL cannot read. Errors name
// the flag and the file.
absl::StatusOr<TransportSecurity> LoadTransportSecurity(
    const SecurityFiles& files, bool server);

// A bearer token from the file named by --`flag`: its content without
// surrounding white space, printable ASCII without spaces. Errors name the
// flag and the file.
absl::StatusOr<std::string> LoadBearerToken(const std::string& flag,
                                            const std::string& path);

// The flags that hand the same files to a worker process.
std::vector<std::string> SecurityFlags(const SecurityFiles& files);

// Whether a server with these files refuses callers that lack them: it has a
// bearer token, or mutual TLS (a certificate, its key, and the CA client
// certificates must be signed by). TLS without a CA authenticates only the
// server: anyone may still call it.
bool AuthenticatesCallers(const SecurityFiles& files);

// Whether listening on `host` reaches this machine only: 127.0.0.0/8, ::1
// (bracketed or not, also as ::ffff:127.x.y.z), "localhost", or a name every
// address of which is one of those. 0.0.0.0, ::, other addresses, and names
// that resolve elsewhere or not at all are not.
bool IsLoopbackHost(const std::string& host);

// The start-up check of a listener (Secure by default): OK on a loopback
// host, when `authenticated`, or when `insecure` (--insecure) allows it;
// otherwise FAILED_PRECONDITION, one line naming `flag`, the host, what is
// exposed (`what`) and the ways out (`remedy`, e.g. "give it --token_file";
// empty: none but loopback and --insecure).
absl::Status CheckListener(const std::string& flag, const std::string& host,
                           bool authenticated, bool insecure,
                           const std::string& what, const std::string& remedy);

// `bytes` random bytes (OpenSSL's RAND_bytes) as lowercase hex: a bearer
// token for processes this one starts.
absl::StatusOr<std::string> RandomToken(int bytes = 32);

std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(
    const TransportSecurity& security);
// A client's half: the channel's credentials (TLS when configured) and the
// interceptors that put the bearer token on every call.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFor(
    const TransportSecurity& security);
std::vector<
    std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
ClientAuthInterceptors(const TransportSecurity& security);

// The metadata key and the value a client sends.
constexpr char kAuthorizationKey[] = "authorization";
std::string BearerValue(const std::string& token);

// Checks a call's metadata against the token (constant time in the token's
// length). OK when no token is configured. UNAUTHENTICATED otherwise, saying
// whether the token was missing or wrong, never echoing it.
absl::Status CheckBearer(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
    const std::string& token);

}  // namespace interlock

#endif  // INTERLOCK_RPC_SECURITY_H_
