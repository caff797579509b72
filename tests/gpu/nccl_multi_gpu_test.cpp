// NcclComm across several GPUs, one process a rank as torchrun runs them: the parent test
// starts WORLD_SIZE copies of this binary (fork + exec, so each child initialises CUDA afresh),
// each running one DISABLED_ rank test with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
// MASTER_PORT set, and checks that every rank exits 0. The ranks bootstrap through the TCP
// exchange, then check each collective's data against values computed on the host, and a rank
// whose peer never issues its collective gets kTimeout from wait() instead of hanging.
// Needs two GPUs or more; skips (naming how many it found) otherwise.
#include <gtest/gtest.h>

#if defined(ZINF_HAVE_NCCL)

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "base/random.hpp"
#include "comm/nccl_comm.hpp"
#include "device/cuda_device.hpp"
#include "gpu/gpu_util.hpp"

namespace zinf {
namespace {

using std::chrono::milliseconds;

constexpr std::uint64_t kSeed = 0x6e6363;

// Starts `world` ranks of `child_test` and returns their exit codes (-1: killed at the bound).
std::vector<int> run_ranks(int world, const char* child_test, milliseconds bound) {
  const std::uint16_t port = gpu_test::free_tcp_port();
  std::printf("seed %llu, port %u, %d ranks\n", static_cast<unsigned long long>(kSeed), port,
              world);
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string rank = std::to_string(r), size = std::to_string(world);
      const std::string port_text = std::to_string(port);
      ::setenv("RANK", rank.c_str(), 1);
      ::setenv("LOCAL_RANK", rank.c_str(), 1);
      ::setenv("WORLD_SIZE", size.c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port_text.c_str(), 1);
      const std::string filter = std::string("--gtest_filter=") + child_test;
      char arg0[] = "zinf_gpu_test";
      char arg2[] = "--gtest_also_run_disabled_tests";
      char* argv[] = {arg0, const_cast<char*>(filter.c_str()), arg2, nullptr};
      ::execv("/proc/self/exe", argv);
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes(static_cast<std::size_t>(world), -1);
  std::vector<bool> done(static_cast<std::size_t>(world), false);
  const auto stop = std::chrono::steady_clock::now() + bound;
  int remaining = world;
  while (remaining > 0 && std::chrono::steady_clock::now() < stop) {
    for (int r = 0; r < world; ++r) {
      if (done[static_cast<std::size_t>(r)]) continue;
      int status = 0;
      if (::waitpid(pids[static_cast<std::size_t>(r)], &status, WNOHANG) > 0) {
        codes[static_cast<std::size_t>(r)] = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        done[static_cast<std::size_t>(r)] = true;
        --remaining;
      }
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    if (!done[static_cast<std::size_t>(r)]) {
      ::kill(pids[static_cast<std::size_t>(r)], SIGKILL);
      ::waitpid(pids[static_cast<std::size_t>(r)], nullptr, 0);
    }
  }
  return codes;
}

int gpu_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

TEST(NcclMultiGpu, CollectivesAcrossRanks) {
  ZINF_REQUIRE_CUDA_DEVICE();
  const int gpus = gpu_count();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  const std::vector<int> codes =
      run_ranks(std::min(gpus, 8), "NcclMultiGpuRank.DISABLED_Collectives", milliseconds(180000));
  for (std::size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(NcclMultiGpu, SilentPeerGivesTimeoutNotHang) {
  ZINF_REQUIRE_CUDA_DEVICE();
  const int gpus = gpu_count();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  const std::vector<int> codes =
      run_ranks(2, "NcclMultiGpuRank.DISABLED_SilentPeer", milliseconds(180000));
  for (std::size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

#define ASSERT_OK(expr)                                  \
  do {                                                   \
    const ::zinf::Status zinf_s_ = (expr);               \
    ASSERT_TRUE(zinf_s_.is_ok()) << zinf_s_.to_string(); \
  } while (0)

// Rank r's input: element i of a seeded random vector that every rank can compute.
std::vector<float> rank_input(int rank, std::size_t count) {
  std::vector<float> v(count);
  fill_uniform(v.data(), count, kSeed + static_cast<std::uint64_t>(rank), -1.0f, 1.0f);
  return v;
}

// Run only as a child of the tests above (DISABLED_ keeps it out of normal runs).
TEST(NcclMultiGpuRank, DISABLED_Collectives) {
  Result<LaunchEnv> env = launch_env_from_environment();
  ASSERT_TRUE(env.is_ok()) << env.status().to_string();
  CudaDeviceOptions dev_options;
  dev_options.ordinal = env->local_rank;
  Result<std::unique_ptr<Device>> device = make_cuda_device(dev_options);
  ASSERT_TRUE(device.is_ok()) << device.status().to_string();
  NcclBootstrapOptions options;
  options.init_timeout = milliseconds(120000);
  Result<std::unique_ptr<Communicator>> comm = make_nccl_comm(*env, **device, options);
  ASSERT_TRUE(comm.is_ok()) << comm.status().to_string();
  const int world = env->world_size, rank = env->rank;
  const std::size_t count = 100003;  // per-rank elements
  const std::size_t total = count * static_cast<std::size_t>(world);
  Device& dev = **device;
  Result<std::unique_ptr<Stream>> s = dev.create_stream("collectives");
  Result<std::unique_ptr<Event>> done = dev.create_event();
  Result<DeviceBuffer> big_in = DeviceBuffer::allocate(dev, total * 4);
  Result<DeviceBuffer> big_out = DeviceBuffer::allocate(dev, total * 4);
  Result<DeviceBuffer> small = DeviceBuffer::allocate(dev, count * 4);
  ASSERT_TRUE(s.is_ok() && done.is_ok() && big_in.is_ok() && big_out.is_ok() && small.is_ok());

  // all_reduce (sum) and reduce_scatter (sum) of each rank's `total`-element input.
  const std::vector<float> mine = rank_input(rank, total);
  std::vector<double> sum(total, 0.0);
  for (int r = 0; r < world; ++r) {
    const std::vector<float> x = rank_input(r, total);
    for (std::size_t i = 0; i < total; ++i) sum[i] += x[i];
  }
  ASSERT_OK(dev.copy_h2d(big_in->data(), mine.data(), total * 4, **s));
  ASSERT_OK((*comm)->group_start());
  ASSERT_OK((*comm)->all_reduce(big_in->data(), big_out->data(), total, DType::kF32, ReduceOp::kSum,
                                **s, "all_reduce"));
  ASSERT_OK((*comm)->reduce_scatter(big_in->data(), small->data(), count, DType::kF32,
                                    ReduceOp::kSum, **s, "reduce_scatter"));
  ASSERT_OK((*comm)->group_end());
  std::vector<float> reduced(total), scattered(count);
  ASSERT_OK(dev.copy_d2h(reduced.data(), big_out->data(), total * 4, **s));
  ASSERT_OK(dev.copy_d2h(scattered.data(), small->data(), count * 4, **s));
  ASSERT_OK(dev.record(**done, **s));
  ASSERT_OK((*comm)->wait(**done, milliseconds(60000)));
  const double tol = 1e-5 * world;
  for (std::size_t i = 0; i < total; ++i)
    ASSERT_NEAR(reduced[i], sum[i], tol) << "all_reduce " << i;
  for (std::size_t i = 0; i < count; ++i) {
    ASSERT_NEAR(scattered[i], sum[static_cast<std::size_t>(rank) * count + i], tol)
        << "reduce_scatter " << i;
  }

  // all_gather of each rank's first `count` elements, then broadcast from the last rank.
  ASSERT_OK((*comm)->all_gather(big_in->data(), big_out->data(), count, DType::kF32, **s, "ag"));
  std::vector<float> gathered(total);
  ASSERT_OK(dev.copy_d2h(gathered.data(), big_out->data(), total * 4, **s));
  ASSERT_OK(
      (*comm)->broadcast(big_in->data(), small->data(), count, DType::kF32, world - 1, **s, "bc"));
  std::vector<float> broadcasted(count);
  ASSERT_OK(dev.copy_d2h(broadcasted.data(), small->data(), count * 4, **s));
  ASSERT_OK(dev.record(**done, **s));
  ASSERT_OK((*comm)->wait(**done, milliseconds(60000)));
  for (int r = 0; r < world; ++r) {
    const std::vector<float> x = rank_input(r, total);
    for (std::size_t i = 0; i < count; ++i) {
      ASSERT_EQ(gathered[static_cast<std::size_t>(r) * count + i], x[i]) << "all_gather " << r;
    }
  }
  const std::vector<float> root = rank_input(world - 1, total);
  for (std::size_t i = 0; i < count; ++i) ASSERT_EQ(broadcasted[i], root[i]) << "broadcast " << i;
  ASSERT_OK((*comm)->barrier(milliseconds(60000)));
}

TEST(NcclMultiGpuRank, DISABLED_SilentPeer) {
  Result<LaunchEnv> env = launch_env_from_environment();
  ASSERT_TRUE(env.is_ok()) << env.status().to_string();
  CudaDeviceOptions dev_options;
  dev_options.ordinal = env->local_rank;
  Result<std::unique_ptr<Device>> device = make_cuda_device(dev_options);
  ASSERT_TRUE(device.is_ok()) << device.status().to_string();
  Result<std::unique_ptr<Communicator>> comm = make_nccl_comm(*env, **device);
  ASSERT_TRUE(comm.is_ok()) << comm.status().to_string();
  if (env->rank != 0) {
    // Never issue the collective; stay alive past rank 0's timeout, then leave without tearing
    // the communicator down (its peer has aborted).
    std::this_thread::sleep_for(milliseconds(6000));
    std::fflush(nullptr);
    ::_exit(0);
  }
  Device& dev = **device;
  Result<std::unique_ptr<Stream>> s = dev.create_stream("lonely");
  Result<std::unique_ptr<Event>> done = dev.create_event();
  Result<DeviceBuffer> buf = DeviceBuffer::allocate(dev, 4096);
  ASSERT_TRUE(s.is_ok() && done.is_ok() && buf.is_ok());
  ASSERT_OK(dev.memset_async(buf->data(), 0, 4096, **s));
  ASSERT_OK((*comm)->all_reduce(buf->data(), buf->data(), 1024, DType::kF32, ReduceOp::kSum, **s));
  ASSERT_OK(dev.record(**done, **s));
  const auto began = std::chrono::steady_clock::now();
  Status st = (*comm)->wait(**done, milliseconds(2000));
  EXPECT_EQ(st.code(), Code::kTimeout) << st.to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - began, milliseconds(10000));
  EXPECT_FALSE((*comm)->status().is_ok());
  EXPECT_EQ(
      (*comm)->all_reduce(buf->data(), buf->data(), 1, DType::kF32, ReduceOp::kSum, **s).code(),
      Code::kAborted);
  // The aborted collective's kernel has returned, so the stream drains instead of hanging.
  const Status drained = dev.synchronize(**s, milliseconds(30000));
  EXPECT_NE(drained.code(), Code::kTimeout) << drained.to_string();
}

}  // namespace
}  // namespace zinf

#endif  // ZINF_HAVE_NCCL
