#include "rpc/channel.h"

#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <future>
#include <limits>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "rpc/status.h"

namespace interlock {
namespace {

int ClampBytes(int64_t bytes) {
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(bytes, 4 << 20),
                                            std::numeric_limits<int>::max()));
}

// gRPC 1.51 serves the client callback API from one process-wide completion
// queue, reference-counted by the channels that used it; when the count drops
// to zero it is torn down, and a teardown racing a new channel aborts the
// process ("assertion failed: prior > 0"). One channel that has made a
// callback call and is never destroyed keeps the count above zero.
void PinCallbackQueue() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto* channel = new std::shared_ptr<grpc::Channel>(
        grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
    auto* stub = new grpc::GenericStub(*channel);
    auto* ctx = new grpc::ClientContext;
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(1));
    grpc::Slice empty;
    auto* request = new grpc::ByteBuffer(&empty, 1);
    auto* response = new grpc::ByteBuffer;
    // Fails at once (nothing listens there); the reference stays.
    stub->UnaryCall(ctx, "/interlock.v1.Pin/Pin", grpc::StubOptions(), request,
                    response, [](grpc::Status) {});
  });
}

}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           int64_t max_message_bytes,
                                           const TransportSecurity& security) {
  PinCallbackQueue();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(ClampBytes(max_message_bytes));
  args.SetMaxSendMessageSize(ClampBytes(max_message_bytes));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Fail fast on reconnect instead of backing off for minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  // Distinct channels per peer even for the same address (no sharing of
  // subchannels between the coordinator's control and stream traffic).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      address, ChannelCredentialsFor(security), args,
      ClientAuthInterceptors(security));
}

void ConfigureServerBuilder(grpc::ServerBuilder& builder,
                            int64_t max_message_bytes) {
  builder.SetMaxReceiveMessageSize(ClampBytes(max_message_bytes));
  builder.SetMaxSendMessageSize(ClampBytes(max_message_bytes));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Accept the clients' pings every kKeepaliveTimeMs without calling them
  // abusive.
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
      kKeepaliveTimeMs / 2);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(
    grpc::Service* service, const std::string& host, int port,
    const TransportSecurity& security, int64_t max_message_bytes,
    const std::string& what, int* bound) {
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(builder, max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  const std::string address = GrpcAddress(host, port);
  builder.AddListeningPort(address, ServerCredentialsFor(security), bound);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *bound == 0) {
    return absl::UnavailableError(absl::StrCat(
        what, ": cannot listen on ", address,
        " (the port is in use, or the address is not one of this machine's)"));
  }
  return server;
}

std::string Unbracketed(const std::string& host) {
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

std::string GrpcAddress(const std::string& host, int port) {
  const std::string bare = Unbracketed(host);
  return bare.find(':') == std::string::npos
             ? absl::StrCat(bare, ":", port)
             : absl::StrCat("[", bare, "]:", port);
}

absl::StatusOr<int> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                const std::string& service,
                                absl::Time deadline) {
  if (service.size() > 127) {
    return absl::InvalidArgumentError("health check: service name too long");
  }
  // HealthCheckRequest{string service = 1}; a name under 128 bytes has a
  // one-byte length.
  std::string request;
  if (!service.empty()) {
    request.push_back('\x0a');
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                 &request_buffer, &response_buffer,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  const grpc::Status status = done.get_future().get();
  if (!status.ok()) return FromGrpcStatus(status);
  grpc::Slice reply;
  if (!response_buffer.DumpToSingleSlice(&reply).ok()) {
    return absl::DataLossError("health check: unreadable reply");
  }
  // HealthCheckResponse{ServingStatus status = 1}: field 1, varint; absent
  // means 0 (UNKNOWN).
  const auto* bytes = reinterpret_cast<const char*>(reply.begin());
  return reply.size() >= 2 && bytes[0] == '\x08' ? bytes[1] : 0;
}

}  // namespace interlock
