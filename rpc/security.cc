#include "rpc/security.h"

#include <arpa/inet.h>
#include <grpcpp/support/client_interceptor.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace interlock {
namespace {

absl::StatusOr<std::string> ReadFlagFile(const std::string& flag,
                                         const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("--", flag, ": cannot read ", path));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", path, " is empty"));
  }
  return ss.str();
}

absl::Status NeedsPem(const std::string& flag, const std::string& path,
                      const std::string& text, const char* what) {
  if (text.find(absl::StrCat("-----BEGIN ")) == std::string::npos ||
      text.find(what) == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, ": ", path, " is not a PEM file with a ", what));
  }
  return absl::OkStatus();
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::unique_ptr<BIO, BioFree> MemoryBio(const std::string& text) {
  return std::unique_ptr<BIO, BioFree>(
      BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// Never ask for a passphrase: OpenSSL's default callback would prompt on the
// terminal of a server process.
int NoPassphrase(char*, int, int, void*) { return 0; }

// The first certificate of a PEM text (the leaf of a chain), or null.
std::unique_ptr<X509, X509Free> FirstCertificate(const std::string& pem) {
  auto bio = MemoryBio(pem);
  std::unique_ptr<X509, X509Free> cert(
      bio ? PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr)
          : nullptr);
  ERR_clear_error();
  return cert;
}

// gRPC only finds out at BuildAndStart, with a log line that names neither
// file, that a certificate is unreadable or a key belongs to another
// certificate; check both here so the error names the flags.
absl::Status CheckCertificateAndKey(const SecurityFiles& f,
                                    const std::string& cert_pem,
                                    const std::string& key_pem) {
  auto cert = FirstCertificate(cert_pem);
  if (!cert) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-cert: ", f.tls_cert, " holds no readable PEM certificate"));
  }
  auto bio = MemoryBio(key_pem);
  std::unique_ptr<EVP_PKEY, PkeyFree> key(
      bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr)
          : nullptr);
  ERR_clear_error();
  if (!key) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key: ", f.tls_key,
                     " holds no readable PEM private key (keys with a "
                     "passphrase are not supported)"));
  }
  const bool match = X509_check_private_key(cert.get(), key.get()) == 1;
  ERR_clear_error();
  if (!match) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key: ", f.tls_key, " is not the private key of ",
                     "the certificate in --tls-cert ", f.tls_cert));
  }
  return absl::OkStatus();
}

// Adds the bearer token to the initial metadata of every call. Each call's
// interceptor holds its own copy: a call may outlive its channel's factory.
class BearerInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(std::string value) : value_(std::move(value)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA)) {
      m->GetSendInitialMetadata()->emplace(kAuthorizationKey, value_);
    }
    m->Proceed();
  }

 private:
  const std::string value_;
};

class BearerInterceptorFactory
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(const std::string& token)
      : value_(BearerValue(token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(value_);
  }

 private:
  const std::string value_;
};

}  // namespace

absl::StatusOr<std::string> LoadBearerToken(const std::string& flag,
                                            const std::string& path) {
  auto text = ReadFlagFile(flag, path);
  if (!text.ok()) return text.status();
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": ", path, " holds only white space"));
  }
  for (char c : token) {
    // gRPC metadata and HTTP header values are printable ASCII.
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": ", path,
                       ": the token must be printable ASCII without spaces"));
    }
  }
  return token;
}

absl::StatusOr<TransportSecurity> LoadTransportSecurity(const SecurityFiles& f,
                                                        bool server) {
  TransportSecurity s;
  if (!f.token_file.empty()) {
    auto token = LoadBearerToken("token-file", f.token_file);
    if (!token.ok()) return token.status();
    s.token = *std::move(token);
  }
  if (f.tls_cert.empty() != f.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert and --tls-key go together: give both or neither");
  }
  if (server && !f.tls_ca.empty() && f.tls_cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls-ca on a server needs --tls-cert and --tls-key (mutual TLS)");
  }
  if (!f.tls_cert.empty()) {
    auto cert = ReadFlagFile("tls-cert", f.tls_cert);
    if (!cert.ok()) return cert.status();
    auto key = ReadFlagFile("tls-key", f.tls_key);
    if (!key.ok()) return key.status();
    if (auto st = NeedsPem("tls-cert", f.tls_cert, *cert, "CERTIFICATE");
        !st.ok()) {
      return st;
    }
    if (auto st = NeedsPem("tls-key", f.tls_key, *key, "PRIVATE KEY");
        !st.ok()) {
      return st;
    }
    if (auto st = CheckCertificateAndKey(f, *cert, *key); !st.ok()) return st;
    s.cert_pem = *std::move(cert);
    s.key_pem = *std::move(key);
  }
  if (!f.tls_ca.empty()) {
    auto ca = ReadFlagFile("tls-ca", f.tls_ca);
    if (!ca.ok()) return ca.status();
    if (auto st = NeedsPem("tls-ca", f.tls_ca, *ca, "CERTIFICATE"); !st.ok()) {
      return st;
    }
    if (!FirstCertificate(*ca)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-ca: ", f.tls_ca, " holds no readable PEM certificate"));
    }
    s.ca_pem = *std::move(ca);
  }
  return s;
}

std::vector<std::string> SecurityFlags(const SecurityFiles& f) {
  std::vector<std::string> out;
  if (!f.token_file.empty()) out.push_back("--token_file=" + f.token_file);
  if (!f.tls_cert.empty()) out.push_back("--tls_cert=" + f.tls_cert);
  if (!f.tls_key.empty()) out.push_back("--tls_key=" + f.tls_key);
  if (!f.tls_ca.empty()) out.push_back("--tls_ca=" + f.tls_ca);
  return out;
}

bool AuthenticatesCallers(const SecurityFiles& f) {
  return !f.token_file.empty() || (!f.tls_cert.empty() && !f.tls_ca.empty());
}

namespace {

bool LoopbackV4(const in_addr& a) { return (ntohl(a.s_addr) >> 24) == 127; }

bool LoopbackV6(const in6_addr& a) {
  return IN6_IS_ADDR_LOOPBACK(&a) ||
         (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
}

}  // namespace

bool IsLoopbackHost(const std::string& host) {
  std::string bare = host;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  if (absl::EqualsIgnoreCase(bare, "localhost")) return true;
  in_addr v4;
  in6_addr v6;
  if (inet_pton(AF_INET, bare.c_str(), &v4) == 1) return LoopbackV4(v4);
  if (inet_pton(AF_INET6, bare.c_str(), &v6) == 1) return LoopbackV6(v6);
  // A name: the server listens on every address it resolves to.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (bare.empty() || getaddrinfo(bare.c_str(), nullptr, &hints, &res) != 0) {
    return false;
  }
  bool loopback = res != nullptr;
  for (const addrinfo* a = res; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      loopback =
          loopback &&
          LoopbackV4(reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr);
    } else if (a->ai_family == AF_INET6) {
      loopback =
          loopback &&
          LoopbackV6(reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    } else {
      loopback = false;
    }
  }
  freeaddrinfo(res);
  return loopback;
}

absl::Status CheckListener(const std::string& flag, const std::string& host,
                           bool authenticated, bool insecure,
                           const std::string& what, const std::string& remedy) {
  if (authenticated || insecure || IsLoopbackHost(host)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("--", flag, " ", host, " is not a loopback address and ",
                   what, "; ", remedy, remedy.empty() ? "" : ", ",
                   "listen on 127.0.0.1", remedy.empty() ? " " : ", ",
                   "or pass --insecure on a network you "
                   "trust"));
}

absl::StatusOr<std::string> RandomToken(int bytes) {
  std::string raw(static_cast<size_t>(bytes), '\0');
  if (bytes <= 0 ||
      RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), bytes) != 1) {
    return absl::InternalError("no random bytes for a token (RAND_bytes)");
  }
  return absl::BytesToHexString(raw);
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(
    const TransportSecurity& s) {
  if (s.cert_pem.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      s.ca_pem.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = s.ca_pem;
  options.pem_key_cert_pairs.push_back({s.key_pem, s.cert_pem});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFor(
    const TransportSecurity& s) {
  if (!s.tls()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = s.ca_pem;  // empty: the system's roots
  options.pem_private_key = s.key_pem;
  options.pem_cert_chain = s.cert_pem;
  return grpc::SslCredentials(options);
}

std::vector<
    std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
ClientAuthInterceptors(const TransportSecurity& s) {
  std::vector<
      std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
      out;
  if (!s.token.empty()) {
    out.push_back(std::make_unique<BearerInterceptorFactory>(s.token));
  }
  return out;
}

std::string BearerValue(const std::string& token) {
  return absl::StrCat("Bearer ", token);
}

absl::Status CheckBearer(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
    const std::string& token) {
  if (token.empty()) return absl::OkStatus();
  auto it = metadata.find(kAuthorizationKey);
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "missing bearer token (authorization metadata)");
  }
  const std::string expected = BearerValue(token);
  const grpc::string_ref& got = it->second;
  // Compare every byte whatever the first difference, so the time taken
  // does not tell how much of a guess was right.
  unsigned char diff = got.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g =
        i < got.size() ? static_cast<unsigned char>(got.data()[i]) : 0;
    diff |= g ^ static_cast<unsigned char>(expected[i]);
  }
  if (diff != 0) return absl::UnauthenticatedError("wrong bearer token");
  return absl::OkStatus();
}

}  // namespace interlock
