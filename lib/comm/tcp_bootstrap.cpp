// TCP bootstrap (see tcp_bootstrap.hpp). Every socket is non-blocking and every wait is a poll()
// bounded by the one deadline of the call, so no step can hang past the timeout.
#include "comm/tcp_bootstrap.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "base/assert.hpp"

namespace zinf {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kMagic = 0x464e495au;  // "ZINF" in little-endian bytes.
constexpr std::uint32_t kVersion = 1;
constexpr std::uint32_t kReplyOk = 0;
constexpr std::uint32_t kReplyTimeout = 1;
constexpr std::uint32_t kReplyMismatch = 2;
// Pause between connection attempts while rank 0 is not listening yet.
constexpr auto kConnectRetry = std::chrono::milliseconds(50);
// How long past its deadline a connected rank waits for rank 0's verdict (see join()).
constexpr auto kVerdictGrace = std::chrono::milliseconds(500);

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<std::int64_t>(left.count(), 1 << 30));
}

// Waits until `fd` is ready for `events`; kTimeout at the deadline.
Status wait_ready(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return Status::ok();
    if (rc == 0) return Status::timeout(fmt::format("{}: timed out", what));
    if (errno != EINTR) return status_from_errno(what, errno);
  }
}

Status send_all(int fd, const void* data, std::size_t bytes, Clock::time_point deadline,
                const char* what) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      bytes -= static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      ZINF_RETURN_IF_ERROR(wait_ready(fd, POLLOUT, deadline, what));
      continue;
    }
    return Status::comm_error(fmt::format("{}: peer hung up ({})", what, std::strerror(errno)), 0);
  }
  return Status::ok();
}

Status recv_all(int fd, void* data, std::size_t bytes, Clock::time_point deadline,
                const char* what) {
  auto* p = static_cast<unsigned char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n > 0) {
      p += n;
      bytes -= static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) return Status::comm_error(fmt::format("{}: peer closed the connection", what));
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      ZINF_RETURN_IF_ERROR(wait_ready(fd, POLLIN, deadline, what));
      continue;
    }
    return Status::comm_error(fmt::format("{}: {}", what, std::strerror(errno)));
  }
  return Status::ok();
}

void put_u32(unsigned char* out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}
std::uint32_t get_u32(const unsigned char* in) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(in[i]) << (8 * i);
  return v;
}

Status set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return status_from_errno("tcp bootstrap: fcntl(O_NONBLOCK)", errno);
  }
  return Status::ok();
}

// A reply to one rank: status, then the payload (blob or message).
Status send_reply(int fd, std::uint32_t status, const void* payload, std::size_t bytes,
                  Clock::time_point deadline) {
  unsigned char header[12];
  put_u32(header, kMagic);
  put_u32(header + 4, status);
  put_u32(header + 8, static_cast<std::uint32_t>(bytes));
  ZINF_RETURN_IF_ERROR(send_all(fd, header, sizeof(header), deadline, "tcp bootstrap: reply"));
  return send_all(fd, payload, bytes, deadline, "tcp bootstrap: reply");
}

// Tells every arrived rank why the exchange failed. Best effort, bounded by a short deadline of
// its own, since the call's deadline may already have passed.
void send_failure(const std::vector<Fd>& peers, std::uint32_t status, const std::string& message) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(500);
  for (const Fd& peer : peers) {
    if (peer.get() >= 0)
      (void)send_reply(peer.get(), status, message.data(), message.size(), deadline);
  }
}

Result<std::vector<std::byte>> serve(const LaunchEnv& env, std::span<const std::byte> blob,
                                     std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::vector<std::byte> result(blob.begin(), blob.end());
  if (env.world_size == 1) return result;

  Fd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) return status_from_errno("tcp bootstrap: socket", errno);
  const int one = 1;
  (void)::setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(bootstrap_port_of(env));
  if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return status_from_errno(
        fmt::format("tcp bootstrap: rank 0 cannot bind port {} ({}; set ZINF_BOOTSTRAP_PORT to "
                    "a free port, the same on every rank)",
                    bootstrap_port_of(env), env.bootstrap_port_from),
        errno);
  }
  if (::listen(listener.get(), env.world_size) != 0) {
    return status_from_errno("tcp bootstrap: listen", errno);
  }
  ZINF_RETURN_IF_ERROR(set_nonblocking(listener.get()));

  std::vector<Fd> peers(static_cast<std::size_t>(env.world_size));  // Index: rank.
  // Connections that have not said hello yet, oldest first, each with the bytes it sent so far.
  // All of them are read at once, so an idle one delays no one.
  struct Pending {
    Fd fd;
    std::array<unsigned char, kTcpHelloBytes> hello{};
    std::size_t got_bytes = 0;
  };
  const std::size_t max_pending =
      static_cast<std::size_t>(env.world_size) + kTcpBootstrapMaxStrangers;
  std::vector<Pending> pending;
  pending.reserve(max_pending + 1);
  std::vector<pollfd> polled;
  polled.reserve(max_pending + 2);
  int arrived = 1;
  while (arrived < env.world_size) {
    polled.clear();
    polled.push_back({listener.get(), POLLIN, 0});
    for (const Pending& p : pending) polled.push_back({p.fd.get(), POLLIN, 0});
    const int rc = ::poll(polled.data(), polled.size(), remaining_ms(deadline));
    if (rc == 0) break;  // the deadline
    if (rc < 0) {
      if (errno == EINTR) continue;
      return status_from_errno("tcp bootstrap: poll", errno);
    }
    // Hellos first: indices into `pending` match polled[1..] until the accepts below.
    for (std::size_t i = 0; i < pending.size(); ++i) {
      if (polled[i + 1].revents == 0) continue;
      Pending& p = pending[i];
      const ssize_t n =
          ::recv(p.fd.get(), p.hello.data() + p.got_bytes, kTcpHelloBytes - p.got_bytes, 0);
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      if (n <= 0) {
        p.fd.reset();  // hung up or failed before its hello: not one of ours
        continue;
      }
      p.got_bytes += static_cast<std::size_t>(n);
      if (p.got_bytes < kTcpHelloBytes) continue;
      Fd conn = std::move(p.fd);
      Result<TcpHello> hello = decode_tcp_hello(p.hello);
      if (!hello.is_ok()) continue;  // Not one of ours (a port scanner, a stale job): drop it.
      const auto rank = static_cast<int>(hello->rank);
      const auto world = static_cast<int>(hello->world_size);
      std::string mismatch;
      if (world != env.world_size) {
        mismatch =
            fmt::format("rank {} says WORLD_SIZE={}, rank 0 says {}", rank, world, env.world_size);
      } else if (rank <= 0 || rank >= env.world_size) {
        mismatch = fmt::format("a peer says RANK={}, outside 1..{}", rank, env.world_size - 1);
      } else if (peers[static_cast<std::size_t>(rank)].get() >= 0) {
        mismatch = fmt::format("two processes say RANK={}", rank);
      }
      if (!mismatch.empty()) {
        peers.push_back(std::move(conn));
        send_failure(peers, kReplyMismatch, mismatch);
        return Status::invalid_argument("tcp bootstrap: " + mismatch);
      }
      peers[static_cast<std::size_t>(rank)] = std::move(conn);
      ++arrived;
    }
    std::erase_if(pending, [](const Pending& p) { return p.fd.get() < 0; });
    if (polled[0].revents == 0) continue;
    for (;;) {  // every connection waiting in the backlog
      Fd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (conn.get() < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return status_from_errno("tcp bootstrap: accept", errno);
      }
      if (pending.size() == max_pending) pending.erase(pending.begin());  // drop the oldest
      pending.push_back(Pending{std::move(conn)});
    }
  }

  if (arrived < env.world_size) {
    std::string missing;
    for (int r = 1; r < env.world_size; ++r) {
      if (peers[static_cast<std::size_t>(r)].get() < 0) {
        missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
      }
    }
    const std::string message =
        fmt::format("rank(s) {} of {} did not reach rank 0 at port {} within {} ms", missing,
                    env.world_size, bootstrap_port_of(env), timeout.count());
    send_failure(peers, kReplyTimeout, message);
    return Status::timeout("tcp bootstrap: " + message);
  }

  for (int r = 1; r < env.world_size; ++r) {
    ZINF_RETURN_IF_ERROR(send_reply(peers[static_cast<std::size_t>(r)].get(), kReplyOk, blob.data(),
                                    blob.size(), deadline)
                             .with_context(fmt::format("sending to rank {}", r)));
  }
  for (int r = 1; r < env.world_size; ++r) {
    unsigned char ack = 0;
    ZINF_RETURN_IF_ERROR(
        recv_all(peers[static_cast<std::size_t>(r)].get(), &ack, 1, deadline, "tcp bootstrap: ack")
            .with_context(fmt::format("rank {}", r)));
  }
  return result;
}

// One connection attempt to rank 0, bounded by the deadline: the connected socket, or why not
// (the caller retries until the deadline, since rank 0 may not be listening yet).
Result<Fd> connect_once(const sockaddr_in& addr, Clock::time_point deadline) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return status_from_errno("tcp bootstrap: socket", errno);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) return status_from_errno("tcp bootstrap: connect", errno);
    ZINF_RETURN_IF_ERROR(wait_ready(fd.get(), POLLOUT, deadline, "tcp bootstrap: connect"));
    int err = 0;
    socklen_t len = sizeof(err);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) return status_from_errno("tcp bootstrap: connect", err);
  }
  const int one = 1;
  (void)::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

Result<std::vector<std::byte>> join(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int gai = ::getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &found);
  if (gai != 0 || found == nullptr) {
    return Status::invalid_argument(
        fmt::format("tcp bootstrap: MASTER_ADDR '{}': {}", env.master_addr, ::gai_strerror(gai)));
  }
  sockaddr_in addr{};
  std::memcpy(&addr, found->ai_addr, sizeof(addr));
  ::freeaddrinfo(found);
  addr.sin_port = htons(bootstrap_port_of(env));

  // Rank 0 may start later than this rank: retry refused connections until the deadline.
  Fd conn;
  Status last;
  while (conn.get() < 0) {
    Result<Fd> attempt = connect_once(addr, deadline);
    if (attempt.is_ok()) {
      conn = std::move(attempt).value();
      break;
    }
    last = attempt.status();
    if (remaining_ms(deadline) == 0) {
      return Status::timeout(fmt::format(
          "tcp bootstrap: rank {} could not reach rank 0 at {}:{} ({}) within {} ms (last: {})",
          env.rank, env.master_addr, bootstrap_port_of(env), env.bootstrap_port_from,
          timeout.count(), last.to_string()));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(kConnectRetry, deadline - Clock::now()));
  }

  const auto hello = encode_tcp_hello(
      {static_cast<std::uint32_t>(env.rank), static_cast<std::uint32_t>(env.world_size)});
  ZINF_RETURN_IF_ERROR(
      send_all(conn.get(), hello.data(), hello.size(), deadline, "tcp bootstrap: hello"));

  // Rank 0 gives up at the same deadline and then says which ranks are missing: wait a little
  // past it for that verdict, so this rank can report it too.
  std::array<unsigned char, kTcpReplyHeaderBytes> header{};
  Status got = recv_all(conn.get(), header.data(), header.size(), deadline + kVerdictGrace,
                        "tcp bootstrap: reply");
  if (got.code() == Code::kTimeout) {
    return Status::timeout(
        fmt::format("tcp bootstrap: rank {} reached rank 0 but got no answer within {} ms",
                    env.rank, timeout.count()));
  }
  ZINF_RETURN_IF_ERROR(got);
  ZINF_ASSIGN_OR_RETURN(const TcpReplyHeader reply, decode_tcp_reply_header(header));
  const std::uint32_t status = reply.status;
  std::vector<std::byte> payload(reply.payload_bytes);
  ZINF_RETURN_IF_ERROR(recv_all(conn.get(), payload.data(), payload.size(),
                                deadline + kVerdictGrace, "tcp bootstrap: reply"));
  if (status != kReplyOk) {
    std::string message(reinterpret_cast<const char*>(payload.data()), payload.size());
    message = fmt::format("tcp bootstrap: rank 0 reports: {}", message);
    if (status == kReplyTimeout) return Status::timeout(std::move(message));
    return Status::invalid_argument(std::move(message));
  }
  const unsigned char ack = 1;
  ZINF_RETURN_IF_ERROR(send_all(conn.get(), &ack, 1, deadline, "tcp bootstrap: ack"));
  return payload;
}

}  // namespace

Result<TcpHello> decode_tcp_hello(std::span<const unsigned char> bytes) {
  if (bytes.size() != kTcpHelloBytes || get_u32(bytes.data()) != kMagic ||
      get_u32(bytes.data() + 4) != kVersion) {
    return Status::comm_error("tcp bootstrap: not a hello of this protocol version");
  }
  return TcpHello{get_u32(bytes.data() + 8), get_u32(bytes.data() + 12)};
}

std::array<unsigned char, kTcpHelloBytes> encode_tcp_hello(const TcpHello& hello) {
  std::array<unsigned char, kTcpHelloBytes> out{};
  put_u32(out.data(), kMagic);
  put_u32(out.data() + 4, kVersion);
  put_u32(out.data() + 8, hello.rank);
  put_u32(out.data() + 12, hello.world_size);
  return out;
}

Result<TcpReplyHeader> decode_tcp_reply_header(std::span<const unsigned char> bytes) {
  if (bytes.size() != kTcpReplyHeaderBytes || get_u32(bytes.data()) != kMagic) {
    return Status::comm_error("tcp bootstrap: malformed reply from rank 0");
  }
  TcpReplyHeader header{get_u32(bytes.data() + 4), get_u32(bytes.data() + 8)};
  if (header.status > kReplyMismatch || header.payload_bytes > kTcpBootstrapMaxBlobBytes) {
    return Status::comm_error(
        fmt::format("tcp bootstrap: malformed reply from rank 0 (status {}, {} payload bytes)",
                    header.status, header.payload_bytes));
  }
  return header;
}

Result<int> parse_env_int(const char* name, const std::optional<std::string>& text, int lo,
                          int hi) {
  if (!text.has_value() || text->empty()) {
    return Status::invalid_argument(fmt::format("environment variable {} is not set", name));
  }
  int value = 0;
  const char* end = text->data() + text->size();
  const auto [ptr, ec] = std::from_chars(text->data(), end, value);
  if (ec != std::errc() || ptr != end || value < lo || value > hi) {
    return Status::invalid_argument(fmt::format(
        "environment variable {}='{}' is not an integer in [{}, {}]", name, *text, lo, hi));
  }
  return value;
}

Result<LaunchEnv> parse_launch_env(
    const std::function<std::optional<std::string>(const char* name)>& lookup) {
  LaunchEnv env;
  ZINF_ASSIGN_OR_RETURN(env.world_size,
                        parse_env_int("WORLD_SIZE", lookup("WORLD_SIZE"), 1, 1 << 20));
  ZINF_ASSIGN_OR_RETURN(env.rank, parse_env_int("RANK", lookup("RANK"), 0, env.world_size - 1));
  const std::optional<std::string> local = lookup("LOCAL_RANK");
  if (local.has_value()) {
    ZINF_ASSIGN_OR_RETURN(env.local_rank, parse_env_int("LOCAL_RANK", local, 0, 1 << 20));
  } else {
    env.local_rank = env.rank;
  }
  const std::optional<std::string> addr = lookup("MASTER_ADDR");
  if (!addr.has_value() || addr->empty()) {
    return Status::invalid_argument("environment variable MASTER_ADDR is not set");
  }
  env.master_addr = *addr;
  ZINF_ASSIGN_OR_RETURN(const int port,
                        parse_env_int("MASTER_PORT", lookup("MASTER_PORT"), 1, 65535));
  env.master_port = static_cast<std::uint16_t>(port);
  const std::optional<std::string> own = lookup("ZINF_BOOTSTRAP_PORT");
  if (own.has_value()) {
    ZINF_ASSIGN_OR_RETURN(const int bootstrap, parse_env_int("ZINF_BOOTSTRAP_PORT", own, 1, 65535));
    env.bootstrap_port = static_cast<std::uint16_t>(bootstrap);
    env.bootstrap_port_from = fmt::format("ZINF_BOOTSTRAP_PORT={}", bootstrap);
  } else if (lookup("TORCHELASTIC_RUN_ID").has_value() ||
             lookup("TORCHELASTIC_USE_AGENT_STORE").has_value()) {
    // torchrun: MASTER_PORT is torch's TCPStore's (the agent's, or rank 0's
    // init_process_group's), so binding it fails or takes it from torch.
    if (port == 65535) {
      return Status::invalid_argument(
          "tcp bootstrap: under torchrun the bootstrap listens on MASTER_PORT+1, and "
          "MASTER_PORT=65535 leaves none; set ZINF_BOOTSTRAP_PORT");
    }
    env.bootstrap_port = static_cast<std::uint16_t>(port + 1);
    env.bootstrap_port_from =
        fmt::format("MASTER_PORT+1 (MASTER_PORT={} is torchrun's store)", port);
  } else {
    env.bootstrap_port = env.master_port;
    env.bootstrap_port_from = "MASTER_PORT";
  }
  return env;
}

std::uint16_t bootstrap_port_of(const LaunchEnv& env) {
  return env.bootstrap_port != 0 ? env.bootstrap_port : env.master_port;
}

Result<LaunchEnv> launch_env_from_environment() {
  return parse_launch_env([](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

Result<std::vector<std::byte>> tcp_broadcast_blob(const LaunchEnv& env,
                                                  std::span<const std::byte> blob,
                                                  std::chrono::milliseconds timeout) {
  if (env.world_size < 1 || env.rank < 0 || env.rank >= env.world_size) {
    return Status::invalid_argument(
        fmt::format("tcp bootstrap: rank {} is not in a world of {}", env.rank, env.world_size));
  }
  if (env.rank == 0) {
    if (blob.size() > kTcpBootstrapMaxBlobBytes) {
      return Status::invalid_argument(fmt::format("tcp bootstrap: a blob of {} bytes is over {}",
                                                  blob.size(), kTcpBootstrapMaxBlobBytes));
    }
    return serve(env, blob, timeout);
  }
  return join(env, timeout);
}

}  // namespace zinf
