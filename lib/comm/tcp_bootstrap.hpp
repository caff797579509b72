// TCP bootstrap: hands one small opaque blob (the 128-byte ncclUniqueId) from rank 0 to every
// rank of a job, using the environment a launcher such as torchrun sets.
//
// Rank 0 listens on the bootstrap port; every other rank connects to MASTER_ADDR and that port
// (retrying while rank 0 is not up yet) and says hello with its rank and world size. Once all
// WORLD_SIZE - 1 ranks have arrived, rank 0 sends the blob to each and waits for each to
// acknowledge it, so a successful return on rank 0 means every rank holds the blob. Rank 0 reads
// the hellos of all connections at once, so a connection that never says hello (a port scanner,
// a stale job) delays no one; at most world_size + kTcpBootstrapMaxStrangers connections wait for
// their hello at a time, the oldest is dropped beyond that. If a rank
// never arrives, rank 0 gives up at the deadline, tells the ranks that did arrive, and all of
// them return kTimeout naming the missing ranks; a rank that cannot reach rank 0 returns
// kTimeout at its own deadline. Nothing waits past the timeout, except that a connected rank
// waits up to 0.5 s more for rank 0's verdict.
//
// Protocol (little-endian u32 fields): hello = "ZINF" magic, version, rank, world_size;
// reply = magic, status (0 ok, 1 timeout, 2 mismatch), payload_bytes, payload (the blob on
// success, the error message otherwise); ack = one byte. IPv4 only.
//
// Thread-safety: free functions; each call uses its own sockets.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zinf/status.hpp"

namespace zinf {

// Where this process sits in the job, as torchrun describes it.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;
  // The port rank 0 listens on for tcp_broadcast_blob; 0: master_port.
  std::uint16_t bootstrap_port = 0;
  // Where bootstrap_port came from, for errors: "ZINF_BOOTSTRAP_PORT=29600",
  // "MASTER_PORT+1 (MASTER_PORT=29500 is torchrun's store)" or "MASTER_PORT".
  std::string bootstrap_port_from = "MASTER_PORT";
};

// The port tcp_broadcast_blob uses for `env`: bootstrap_port, or master_port when that is 0.
std::uint16_t bootstrap_port_of(const LaunchEnv& env);

// Reads RANK, WORLD_SIZE, LOCAL_RANK (defaults to RANK when unset), MASTER_ADDR and MASTER_PORT
// through `lookup` (nullopt for an unset variable), and picks the bootstrap port:
//   ZINF_BOOTSTRAP_PORT when set;
//   under torchrun (TORCHELASTIC_RUN_ID or TORCHELASTIC_USE_AGENT_STORE set) MASTER_PORT + 1:
//     MASTER_PORT is torch's own TCPStore's, which torchrun's agent already listens on
//     (TORCHELASTIC_USE_AGENT_STORE=True) or rank 0's init_process_group will;
//   otherwise MASTER_PORT.
// Returns kInvalidArgument naming the variable that is missing or malformed, or when RANK is not
// in [0, WORLD_SIZE).
Result<LaunchEnv> parse_launch_env(
    const std::function<std::optional<std::string>(const char* name)>& lookup);
// parse_launch_env over the process environment (getenv).
Result<LaunchEnv> launch_env_from_environment();
// A launcher variable's integer value: kInvalidArgument naming `name` and its text when it is
// missing or empty, not a whole decimal integer, or outside [lo, hi].
Result<int> parse_env_int(const char* name, const std::optional<std::string>& text, int lo, int hi);

// The largest blob tcp_broadcast_blob carries; bounds what a rank allocates for a peer's reply.
constexpr std::size_t kTcpBootstrapMaxBlobBytes = std::size_t{1} << 20;
// Connections rank 0 holds, beyond the ranks it expects, while they have not said hello.
constexpr std::size_t kTcpBootstrapMaxStrangers = 16;

// The wire messages (see the protocol above), decoded from exactly their bytes; exposed for the
// tests and the fuzz target.
constexpr std::size_t kTcpHelloBytes = 16;
constexpr std::size_t kTcpReplyHeaderBytes = 12;
struct TcpHello {
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
};
struct TcpReplyHeader {
  std::uint32_t status = 0;  // 0 ok, 1 timeout, 2 mismatch
  std::uint32_t payload_bytes = 0;
};
// kCommError when `bytes` is not a hello of this protocol version (wrong size, magic or version).
Result<TcpHello> decode_tcp_hello(std::span<const unsigned char> bytes);
std::array<unsigned char, kTcpHelloBytes> encode_tcp_hello(const TcpHello& hello);
// kCommError for a wrong size, magic, an unknown status or a payload over
// kTcpBootstrapMaxBlobBytes.
Result<TcpReplyHeader> decode_tcp_reply_header(std::span<const unsigned char> bytes);

// On rank 0 sends `blob` to every other rank and returns a copy of it; on the other ranks
// ignores `blob` and returns what rank 0 sent. Every rank must call it with the same
// world_size, master address and port. Errors: kTimeout when some rank did not arrive (or rank
// 0 did not answer) within `timeout`; kInvalidArgument for a world size or rank that disagrees
// with rank 0's, or a blob over kTcpBootstrapMaxBlobBytes; kIoError for socket errors (binding a
// port in use, say); kCommError for a peer that breaks the protocol or hangs up.
Result<std::vector<std::byte>> tcp_broadcast_blob(const LaunchEnv& env,
                                                  std::span<const std::byte> blob,
                                                  std::chrono::milliseconds timeout);

}  // namespace zinf
