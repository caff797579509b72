// The TCP bootstrap with real processes on loopback: 2 and 4 ranks receive rank 0's blob; a rank
// that never starts makes the others return kTimeout (never hang); a missing rank 0 times out
// the rest; disagreeing world sizes fail everywhere. Each rank is a fork()ed child that reports
// through its exit code; the parent kills any child still running after a generous bound, so a
// hang fails the test instead of stalling it.
#include "comm/tcp_bootstrap.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/random.hpp"

namespace zinf {
namespace {

using std::chrono::milliseconds;

constexpr int kExitOk = 0;
constexpr int kExitTimeout = 10;
constexpr int kExitOtherError = 11;
constexpr int kExitWrongBlob = 12;
constexpr int kExitInvalid = 13;
constexpr int kExitKilled = -1;

// A port that was free a moment ago: bind port 0, read it back, close.
std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// SplitMix64 directly rather than fill_random_bytes: that one may use oneTBB, whose thread pool
// does not survive fork() into the rank processes.
std::vector<std::byte> make_blob(std::uint64_t seed) {
  std::vector<std::byte> blob(128);  // The size of an ncclUniqueId.
  SplitMix64 rng(seed);
  for (std::byte& b : blob) b = static_cast<std::byte>(rng.next() >> 56);
  return blob;
}

struct RankSpec {
  int rank;
  int world_size;
  milliseconds start_delay{0};
};

// Runs each spec in its own child process; returns rank -> exit code (kExitKilled if it had to
// be killed after `bound`). With `launcher_vars`, each rank reads its place from the variables a
// launcher would set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT = `port`, and these) through
// parse_launch_env, as make_nccl_comm does.
std::map<int, int> run_ranks(const std::vector<RankSpec>& specs, std::uint16_t port,
                             milliseconds timeout, std::uint64_t seed, milliseconds bound,
                             const std::map<std::string, std::string>& launcher_vars = {}) {
  std::map<pid_t, int> children;
  for (const RankSpec& spec : specs) {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::this_thread::sleep_for(spec.start_delay);
      LaunchEnv env;
      env.rank = spec.rank;
      env.world_size = spec.world_size;
      env.local_rank = spec.rank;
      env.master_addr = "127.0.0.1";
      env.master_port = port;
      if (!launcher_vars.empty()) {
        std::map<std::string, std::string> vars = launcher_vars;
        vars["RANK"] = std::to_string(spec.rank);
        vars["WORLD_SIZE"] = std::to_string(spec.world_size);
        vars["MASTER_ADDR"] = "127.0.0.1";
        vars["MASTER_PORT"] = std::to_string(port);
        Result<LaunchEnv> parsed = parse_launch_env([&](const char* name) {
          auto it = vars.find(name);
          return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
        });
        if (!parsed.is_ok()) ::_exit(kExitInvalid);
        env = *parsed;
      }
      const std::vector<std::byte> blob = make_blob(seed);
      const std::vector<std::byte> empty;
      Result<std::vector<std::byte>> got = tcp_broadcast_blob(
          env,
          spec.rank == 0 ? std::span<const std::byte>(blob) : std::span<const std::byte>(empty),
          timeout);
      int code = kExitOk;
      if (!got.is_ok()) {
        std::fprintf(stderr, "rank %d: %s\n", spec.rank, got.status().to_string().c_str());
        code = got.status().code() == Code::kTimeout           ? kExitTimeout
               : got.status().code() == Code::kInvalidArgument ? kExitInvalid
                                                               : kExitOtherError;
      } else if (*got != blob) {
        code = kExitWrongBlob;
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    EXPECT_GT(pid, 0) << "fork failed";
    children[pid] = spec.rank;
  }
  std::map<int, int> codes;
  const auto stop = std::chrono::steady_clock::now() + bound;
  while (!children.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0 && children.count(pid) != 0) {
      codes[children[pid]] = WIFEXITED(status) ? WEXITSTATUS(status) : kExitKilled;
      children.erase(pid);
      continue;
    }
    if (std::chrono::steady_clock::now() > stop) {
      for (const auto& [child, rank] : children) {
        ::kill(child, SIGKILL);
        ::waitpid(child, nullptr, 0);
        codes[rank] = kExitKilled;
      }
      children.clear();
      break;
    }
    std::this_thread::sleep_for(milliseconds(5));
  }
  return codes;
}

class TcpBootstrapWorld : public ::testing::TestWithParam<int> {};

TEST_P(TcpBootstrapWorld, EveryRankGetsRankZerosBlob) {
  const int world = GetParam();
  const std::uint64_t seed = 0x7c9 + static_cast<std::uint64_t>(world);
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::vector<RankSpec> specs;
  // Rank 0 starts last, so the others exercise the connect retry.
  for (int r = world - 1; r >= 0; --r) {
    specs.push_back({r, world, r == 0 ? milliseconds(200) : milliseconds(0)});
  }
  const auto codes = run_ranks(specs, free_port(), milliseconds(10000), seed, milliseconds(30000));
  ASSERT_EQ(codes.size(), static_cast<std::size_t>(world));
  for (const auto& [rank, code] : codes) EXPECT_EQ(code, kExitOk) << "rank " << rank;
}

INSTANTIATE_TEST_SUITE_P(Loopback, TcpBootstrapWorld, ::testing::Values(2, 4));

TEST(TcpBootstrap, RankThatNeverArrivesTimesOutTheOthers) {
  // World of 4, rank 3 never starts.
  const auto began = std::chrono::steady_clock::now();
  const auto codes =
      run_ranks({{0, 4}, {1, 4}, {2, 4}}, free_port(), milliseconds(1500), 3, milliseconds(20000));
  const auto took = std::chrono::steady_clock::now() - began;
  for (int r = 0; r < 3; ++r) EXPECT_EQ(codes.at(r), kExitTimeout) << "rank " << r;
  EXPECT_GE(took, milliseconds(1400));
  EXPECT_LT(took, milliseconds(10000)) << "a timeout of 1.5 s must not take this long";
}

TEST(TcpBootstrap, MissingRankZeroTimesOutTheOthers) {
  const auto codes =
      run_ranks({{1, 3}, {2, 3}}, free_port(), milliseconds(800), 4, milliseconds(20000));
  EXPECT_EQ(codes.at(1), kExitTimeout);
  EXPECT_EQ(codes.at(2), kExitTimeout);
}

TEST(TcpBootstrap, DisagreeingWorldSizeFailsEveryRank) {
  const auto codes =
      run_ranks({{0, 2}, {1, 3}}, free_port(), milliseconds(5000), 5, milliseconds(20000));
  EXPECT_EQ(codes.at(0), kExitInvalid);
  EXPECT_EQ(codes.at(1), kExitInvalid);
}

// Connects to 127.0.0.1:port, retrying until something listens (at most 5 s).
int connect_loopback(std::uint16_t port) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < until) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(port);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
    ::close(fd);
    std::this_thread::sleep_for(milliseconds(10));
  }
  return -1;
}

// Strangers on rank 0's port before the real rank arrives: one that connects and says nothing
// (a port scanner), one that hangs up at once, one that sends 16 bytes that are not a hello, one
// that sends half a hello and stops. None of them may delay the real rank: both ranks finish
// well before the deadline.
TEST(TcpBootstrap, IdleAndForeignConnectionsDelayNoOne) {
  const std::uint16_t port = free_port();
  const auto timeout = milliseconds(4000);
  LaunchEnv env0{.rank = 0, .world_size = 2, .local_rank = 0, .master_port = port};
  LaunchEnv env1 = env0;
  env1.rank = 1;
  env1.local_rank = 1;
  const std::vector<std::byte> blob = {std::byte{1}, std::byte{2}, std::byte{3}};
  const auto start = std::chrono::steady_clock::now();
  Result<std::vector<std::byte>> got0 = Status::aborted("not run");
  std::thread rank0([&] { got0 = tcp_broadcast_blob(env0, blob, timeout); });

  const int idle = connect_loopback(port);
  ASSERT_GE(idle, 0) << "rank 0 never listened on port " << port;
  const int hangs_up = connect_loopback(port);
  ::close(hangs_up);
  const int garbage = connect_loopback(port);
  const unsigned char junk[16] = {'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T', 'P', '/', '1'};
  ASSERT_EQ(::send(garbage, junk, sizeof(junk), MSG_NOSIGNAL), 16);
  const int half = connect_loopback(port);
  const auto hello = encode_tcp_hello({1, 2});
  ASSERT_EQ(::send(half, hello.data(), 8, MSG_NOSIGNAL), 8);
  std::this_thread::sleep_for(milliseconds(100));  // rank 0 has seen all of them

  Result<std::vector<std::byte>> got1 = tcp_broadcast_blob(env1, {}, timeout);
  rank0.join();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  ::close(idle);
  ::close(garbage);
  ::close(half);
  ASSERT_TRUE(got0.is_ok()) << got0.status().to_string();
  ASSERT_TRUE(got1.is_ok()) << got1.status().to_string();
  EXPECT_EQ(*got1, blob);
  EXPECT_LT(elapsed, milliseconds(2000))
      << "an idle connection stalled the bootstrap for "
      << std::chrono::duration_cast<milliseconds>(elapsed).count() << " ms";
}

TEST(TcpBootstrapWire, HelloRoundTripsAndForeignBytesAreRefused) {
  const auto bytes = encode_tcp_hello({3, 8});
  // Little-endian u32 fields: "ZINF" magic, version 1, rank 3, world size 8.
  const unsigned char expected[16] = {'Z', 'I', 'N', 'F', 1, 0, 0, 0, 3, 0, 0, 0, 8, 0, 0, 0};
  EXPECT_EQ(std::memcmp(bytes.data(), expected, 16), 0);
  Result<TcpHello> back = decode_tcp_hello(bytes);
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(back->rank, 3u);
  EXPECT_EQ(back->world_size, 8u);
  unsigned char wrong_version[16];
  std::memcpy(wrong_version, expected, 16);
  wrong_version[4] = 2;
  EXPECT_EQ(decode_tcp_hello(wrong_version).status().code(), Code::kCommError);
  EXPECT_EQ(decode_tcp_hello(std::span(expected, 15)).status().code(), Code::kCommError);
  // A reply header announcing more than the largest blob is refused before anything is allocated.
  const unsigned char huge[12] = {'Z', 'I', 'N', 'F', 0, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f};
  EXPECT_EQ(decode_tcp_reply_header(huge).status().code(), Code::kCommError);
  const unsigned char ok[12] = {'Z', 'I', 'N', 'F', 0, 0, 0, 0, 128, 0, 0, 0};
  Result<TcpReplyHeader> header = decode_tcp_reply_header(ok);
  ASSERT_TRUE(header.is_ok());
  EXPECT_EQ(header->payload_bytes, 128u);
}

TEST(TcpBootstrap, WorldOfOneNeedsNoNetwork) {
  LaunchEnv env;
  env.master_port = 1;  // Nothing listens there; nothing must try.
  const std::vector<std::byte> blob = make_blob(6);
  Result<std::vector<std::byte>> got = tcp_broadcast_blob(env, blob, milliseconds(100));
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(*got, blob);
}

// A socket listening on `port` on every address, as torchrun's agent store listens on
// MASTER_PORT; -1 when the port is taken.
int listen_on(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(port);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 8) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A port held by a listener (as torchrun's store holds MASTER_PORT) whose next port is free.
struct HeldPort {
  std::uint16_t port = 0;
  int fd = -1;
  HeldPort() {
    for (int attempt = 0; attempt < 20 && fd < 0; ++attempt) {
      port = free_port();
      if (port == 65535) continue;
      fd = listen_on(port);
      const int next = listen_on(static_cast<std::uint16_t>(port + 1));
      if (next < 0 && fd >= 0) {
        ::close(fd);
        fd = -1;
      }
      if (next >= 0) ::close(next);
    }
    EXPECT_GE(fd, 0) << "no port with a free successor";
  }
  ~HeldPort() {
    if (fd >= 0) ::close(fd);
  }
};

// Under torchrun, torch's store already listens on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True:
// the agent's): the bootstrap takes MASTER_PORT+1, and 2 ranks exchange the blob beside it.
TEST(TcpBootstrap, UnderTorchrunRankZeroListensBesideTheStoreOnMasterPort) {
  HeldPort store;
  const std::map<int, int> codes =
      run_ranks({{0, 2}, {1, 2}}, store.port, milliseconds(5000), 41, milliseconds(20000),
                {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RUN_ID", "none"}});
  EXPECT_EQ(codes.at(0), kExitOk);
  EXPECT_EQ(codes.at(1), kExitOk);
}

// ZINF_BOOTSTRAP_PORT picks the port, under torchrun or not.
TEST(TcpBootstrap, ZinfBootstrapPortChoosesThePort) {
  HeldPort store;
  // MASTER_PORT+1 taken too: only the chosen port works.
  const int next = listen_on(static_cast<std::uint16_t>(store.port + 1));
  ASSERT_GE(next, 0);
  const std::uint16_t own = free_port();
  const std::map<int, int> codes = run_ranks(
      {{0, 2}, {1, 2}}, store.port, milliseconds(5000), 43, milliseconds(20000),
      {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"ZINF_BOOTSTRAP_PORT", std::to_string(own)}});
  ::close(next);
  EXPECT_EQ(codes.at(0), kExitOk);
  EXPECT_EQ(codes.at(1), kExitOk);
}

// A bootstrap port in use is kIoError naming the port, where it came from and the variable that
// picks another.
TEST(TcpBootstrap, APortInUseIsNamedWithTheVariableThatMovesIt) {
  HeldPort store;
  const int next = listen_on(static_cast<std::uint16_t>(store.port + 1));
  ASSERT_GE(next, 0);
  const std::map<std::string, std::string> vars = {{"RANK", "0"},
                                                   {"WORLD_SIZE", "2"},
                                                   {"MASTER_ADDR", "127.0.0.1"},
                                                   {"MASTER_PORT", std::to_string(store.port)},
                                                   {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  Result<LaunchEnv> env = parse_launch_env([&](const char* name) {
    auto it = vars.find(name);
    return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
  });
  ASSERT_TRUE(env.is_ok()) << env.status().to_string();
  const std::vector<std::byte> blob = make_blob(5);
  Result<std::vector<std::byte>> got = tcp_broadcast_blob(*env, blob, milliseconds(2000));
  ::close(next);
  ASSERT_FALSE(got.is_ok());
  const std::string message(got.status().message());
  EXPECT_EQ(got.status().code(), Code::kIoError) << message;
  EXPECT_NE(message.find(fmt::format("cannot bind port {} (MASTER_PORT+1 (MASTER_PORT={} is",
                                     store.port + 1, store.port)),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("set ZINF_BOOTSTRAP_PORT"), std::string::npos) << message;
}

// Run by RealTorchrunRanksExchangeTheBlob as each of torchrun's ranks (ZINF_TCP_TORCHRUN_RANK
// set): the environment is torchrun's own; the blob must arrive.
TEST(TcpBootstrap, TorchrunRank) {
  if (std::getenv("ZINF_TCP_TORCHRUN_RANK") == nullptr) {
    GTEST_SKIP() << "a rank of RealTorchrunRanksExchangeTheBlob";
  }
  Result<LaunchEnv> env = launch_env_from_environment();
  ASSERT_TRUE(env.is_ok()) << env.status().to_string();
  const std::vector<std::byte> blob = make_blob(77);
  Result<std::vector<std::byte>> got = tcp_broadcast_blob(*env, blob, milliseconds(20000));
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_EQ(*got, blob);
}

// Under a real torchrun, whose agent store listens on MASTER_PORT: two ranks (this test program,
// started by torchrun --no-python) exchange the blob. Needs torchrun: ZINF_TORCHRUN (its path)
// or `torchrun` on PATH; skipped naming them otherwise.
TEST(TcpBootstrap, RealTorchrunRanksExchangeTheBlob) {
  std::string torchrun;
  if (const char* given = std::getenv("ZINF_TORCHRUN"); given != nullptr) {
    torchrun = given;
  } else if (std::system("command -v torchrun > /dev/null 2>&1") == 0) {
    torchrun = "torchrun";
  } else {
    GTEST_SKIP() << "no torchrun: set ZINF_TORCHRUN to its path or put it on PATH";
  }
  char self[4096] = {};
  const ssize_t length = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(length, 0);
  const std::string command = "ZINF_TCP_TORCHRUN_RANK=1 timeout 120 " + torchrun +
                              " --nproc_per_node 2 --no-python " +
                              std::string(self, static_cast<std::size_t>(length)) +
                              " --gtest_filter=TcpBootstrap.TorchrunRank 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char chunk[4096];
  while (std::fgets(chunk, sizeof(chunk), pipe) != nullptr) output += chunk;
  const int status = ::pclose(pipe);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
  // Both ranks ran the test rather than skipping it.
  std::size_t passed = 0;
  for (std::size_t at = output.find("[  PASSED  ] 1 test"); at != std::string::npos;
       at = output.find("[  PASSED  ] 1 test", at + 1)) {
    ++passed;
  }
  EXPECT_EQ(passed, 2u) << output;
  EXPECT_EQ(output.find("SKIPPED"), std::string::npos) << output;
}

TEST(LaunchEnv, ParsesTorchrunVariables) {
  std::map<std::string, std::string> vars = {{"RANK", "3"},
                                             {"WORLD_SIZE", "8"},
                                             {"LOCAL_RANK", "1"},
                                             {"MASTER_ADDR", "10.0.0.7"},
                                             {"MASTER_PORT", "29501"}};
  auto lookup = [&](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
  Result<LaunchEnv> env = parse_launch_env(lookup);
  ASSERT_TRUE(env.is_ok()) << env.status().to_string();
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "10.0.0.7");
  EXPECT_EQ(env->master_port, 29501);
  // No torchrun variables: the bootstrap listens on MASTER_PORT itself.
  EXPECT_EQ(bootstrap_port_of(*env), 29501);
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env = parse_launch_env(lookup);
  ASSERT_TRUE(env.is_ok()) << env.status().to_string();
  EXPECT_EQ(bootstrap_port_of(*env), 29502);
  vars["ZINF_BOOTSTRAP_PORT"] = "40000";
  env = parse_launch_env(lookup);
  ASSERT_TRUE(env.is_ok()) << env.status().to_string();
  EXPECT_EQ(bootstrap_port_of(*env), 40000);
  EXPECT_EQ(env->bootstrap_port_from, "ZINF_BOOTSTRAP_PORT=40000");
  vars["ZINF_BOOTSTRAP_PORT"] = "0";
  env = parse_launch_env(lookup);
  ASSERT_FALSE(env.is_ok());
  EXPECT_NE(env.status().message().find("ZINF_BOOTSTRAP_PORT"), std::string_view::npos);
  vars.erase("ZINF_BOOTSTRAP_PORT");
  vars.erase("TORCHELASTIC_USE_AGENT_STORE");

  vars.erase("LOCAL_RANK");
  env = parse_launch_env(lookup);
  ASSERT_TRUE(env.is_ok());
  EXPECT_EQ(env->local_rank, 3) << "LOCAL_RANK defaults to RANK";

  vars["RANK"] = "8";
  env = parse_launch_env(lookup);
  ASSERT_FALSE(env.is_ok());
  EXPECT_EQ(env.status().code(), Code::kInvalidArgument);
  EXPECT_NE(env.status().message().find("RANK"), std::string_view::npos);

  vars["RANK"] = "2";
  vars["MASTER_PORT"] = "http";
  env = parse_launch_env(lookup);
  ASSERT_FALSE(env.is_ok());
  EXPECT_NE(env.status().message().find("MASTER_PORT"), std::string_view::npos);

  vars.erase("MASTER_ADDR");
  vars["MASTER_PORT"] = "1234";
  env = parse_launch_env(lookup);
  ASSERT_FALSE(env.is_ok());
  EXPECT_NE(env.status().message().find("MASTER_ADDR"), std::string_view::npos);
}

}  // namespace
}  // namespace zinf
