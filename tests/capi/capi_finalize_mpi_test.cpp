// MPI_Finalize before the engine and the communicator group are closed, under mpirun, as a C
// program that initialises MPI itself does it by mistake (or an exit path's or atexit handler's
// MPI_Finalize does it for it). zinf.h asks for zinf_engine_close, zinf_comm_group_destroy, then
// MPI_Finalize; in the other order MPI_Finalize stops the group's communicator first (an attribute
// on MPI_COMM_SELF, whose delete callback MPI_Finalize runs before anything else), so the process
// goes on: later collectives fail naming MPI_Finalize, the engine closes, and the groups are
// destroyed with ZINF_ABORTED where collectives were lost and ZINF_OK where none were.
//
// Run by ctest under mpirun -np 2 (tests/CMakeLists.txt, `ctest -R capi_finalize_mpi_test`) twice:
// rank 0, whose reduction is in flight, finalises first, or with --peer-finalizes-first rank 1 does
// (rank 0's reduction then fails on rank 1's abort notice before rank 0's own MPI_Finalize). The
// other rank waits a moment before its MPI_Finalize, which makes that order likely, not certain:
// the test passes in either. Each rank's verdict is its exit code, since MPI is gone by the end.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "zinf/zinf.h"

namespace {

bool g_peer_finalizes_first = false;  // --peer-finalizes-first

std::string last_message() { return zinf_last_error_message(); }

constexpr std::size_t kElementCount = 96;

// Seeded values in [-1, 1) (xorshift64), distinct per seed.
std::vector<float> seeded(std::uint64_t seed) {
  std::vector<float> out(kElementCount);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& v : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v = static_cast<float>(x >> 40) * (1.0f / 8388608.0f) - 1.0f;
  }
  return out;
}

std::vector<float> gradient_of(int rank) { return seeded(100 + static_cast<std::uint64_t>(rank)); }

TEST(CApiMpiFinalize, FinalizeBeforeCloseFailsTheCollectivesAndTheProcessGoesOn) {
  int rank = -1;
  int world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);

  const std::string json = R"({"zero_optimization": {"stage": 2}, "zinf": {"cpu_threads": 1}})";
  zinf_config_t* config = nullptr;
  ASSERT_EQ(zinf_config_from_json(json.data(), json.size(), &config), ZINF_OK) << last_message();
  zinf_device_t* device = nullptr;
  ASSERT_EQ(zinf_host_device_create(0, 0, &device), ZINF_OK) << last_message();
  // The engine's group, and a second group whose communicator sees no collective at all.
  zinf_comm_group_t* group = nullptr;
  ASSERT_EQ(zinf_mpi_comm_group_create(device, nullptr, 20'000, &group), ZINF_OK) << last_message();
  zinf_comm_group_t* idle_group = nullptr;
  ASSERT_EQ(zinf_mpi_comm_group_create(device, nullptr, 20'000, &idle_group), ZINF_OK)
      << last_message();
  zinf_comm_t* comm = nullptr;
  ASSERT_EQ(zinf_comm_group_get(group, rank, &comm), ZINF_OK) << last_message();

  zinf_env_t env{};
  env.struct_size = sizeof env;
  env.device = device;
  env.comm = comm;
  zinf_engine_t* engine = nullptr;
  ASSERT_EQ(zinf_engine_open(config, &env, &engine), ZINF_OK) << last_message();
  const std::vector<float> initial = seeded(7);
  const std::int64_t shape[1] = {static_cast<std::int64_t>(kElementCount)};
  ASSERT_EQ(
      zinf_engine_register_parameter(engine, "w", "m", shape, 1, ZINF_DTYPE_F32, initial.data()),
      ZINF_OK)
      << last_message();
  ASSERT_EQ(zinf_engine_finalize(engine), ZINF_OK) << last_message();

  // One step on this rank's seeded gradient.
  const std::vector<float> grad = gradient_of(rank);
  const zinf_gradient_t ref = {"w", grad.data(), kElementCount, ZINF_DTYPE_F32};
  ASSERT_EQ(zinf_engine_reduce_gradients(engine, "m", &ref, 1), ZINF_OK) << last_message();
  ASSERT_EQ(zinf_engine_step(engine, nullptr), ZINF_OK) << last_message();
  // AdamW's first step (lr 1e-3, eps 1e-8 and weight_decay 0.01 by default) on the ranks' mean
  // gradient g, in double: w - lr * g / (|g| + eps) - lr * wd * w.
  std::vector<float> after(kElementCount, -7.0f);
  ASSERT_EQ(zinf_engine_read_parameters(engine, "w", after.data(), kElementCount), ZINF_OK)
      << last_message();
  std::vector<double> mean(kElementCount, 0.0);
  for (int r = 0; r < world; ++r) {
    const std::vector<float> g = gradient_of(r);
    for (std::size_t i = 0; i < kElementCount; ++i) mean[i] += g[i] / static_cast<double>(world);
  }
  for (std::size_t i = 0; i < kElementCount; ++i) {
    const double w = initial[i];
    const double expected = w - 1e-3 * mean[i] / (std::fabs(mean[i]) + 1e-8) - 1e-3 * 0.01 * w;
    ASSERT_NEAR(after[i], expected, 1e-6) << "element " << i << " on rank " << rank;
  }

  // Rank 0 starts the next step's gradient reduction, which rank 1 never joins: its reduce-scatter
  // is pending (on its stream, or waiting up to 20 s for rank 1) when MPI_Finalize comes. Both
  // ranks are done with the first step before either finalises (MPI_Finalize tells the other
  // ranks that the communicator stopped).
  if (rank == 0) {
    ASSERT_EQ(zinf_engine_reduce_gradients(engine, "m", &ref, 1), ZINF_OK) << last_message();
  }
  ASSERT_EQ(MPI_Barrier(MPI_COMM_WORLD), MPI_SUCCESS);
  if (rank == (g_peer_finalizes_first ? 0 : 1)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  ASSERT_EQ(MPI_Finalize(), MPI_SUCCESS);
  int finalized = 0;
  MPI_Finalized(&finalized);
  ASSERT_NE(finalized, 0);

  // Rank 0's step fails with the reduction MPI_Finalize cut short (its own or, first, rank 1's);
  // rank 1's reduction is refused.
  // Either way the error names MPI_Finalize, and it is sticky.
  const zinf_code_t code = rank == 0 ? zinf_engine_step(engine, nullptr)
                                     : zinf_engine_reduce_gradients(engine, "m", &ref, 1);
  std::string message = last_message();
  EXPECT_EQ(code, ZINF_ABORTED) << zinf_code_name(code) << ": " << message;
  EXPECT_NE(message.find("MPI_Finalize"), std::string::npos) << message;
  EXPECT_EQ(zinf_engine_step(engine, nullptr), ZINF_ABORTED) << last_message();
  EXPECT_NE(last_message().find("MPI_Finalize"), std::string::npos) << last_message();

  zinf_engine_close(engine);
  // The engine's group lost that step's collectives: destroyed, with ZINF_ABORTED saying so, on
  // both ranks whichever finalised first.
  EXPECT_EQ(zinf_comm_group_destroy(group), ZINF_ABORTED);
  message = last_message();
  EXPECT_NE(message.find("MPI_Finalize"), std::string::npos) << message;
  EXPECT_NE(message.find("collective"), std::string::npos) << message;
  // The idle group lost nothing.
  EXPECT_EQ(zinf_comm_group_destroy(idle_group), ZINF_OK) << last_message();
  EXPECT_EQ(zinf_device_destroy(device), ZINF_OK) << last_message();
  zinf_config_destroy(config);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = MPI_THREAD_SINGLE;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS ||
      provided < MPI_THREAD_MULTIPLE) {
    return 2;
  }
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--peer-finalizes-first") g_peer_finalizes_first = true;
  }
  // The test finalises MPI itself; nothing here may call MPI after it.
  return RUN_ALL_TESTS();
}
