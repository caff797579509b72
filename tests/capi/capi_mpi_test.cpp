// The C API under mpirun, one process per rank, as a C program uses it when it leaves MPI to
// zinf: main() does not initialise MPI; zinf_mpi_comm_group_create does. MPI's own calls (made
// once zinf initialised it) are the reference for what the C API reports.
//
// Run by ctest under mpirun (tests/CMakeLists.txt, `ctest -R capi_mpi_test`). The tests run in
// the order written: the last one finalises MPI, so each rank's verdict is its exit code (mpirun
// fails the job when any rank fails) rather than a collective after the tests.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <string>

#include "zinf/zinf.h"

namespace {

std::string last_message() { return zinf_last_error_message(); }

// A program that never called MPI_Init learns its rank through the C API: the group's
// communicator of "this process" (rank -1) and zinf_comm_rank, which agree with MPI's own rank
// and size of MPI_COMM_WORLD.
TEST(CApiMpi, ThisProcesssRankComesFromTheGroupWhenZinfInitialisedMpi) {
  int initialized = 1;
  MPI_Initialized(&initialized);
  ASSERT_EQ(initialized, 0) << "main() must leave MPI to zinf";

  zinf_device_t* device = nullptr;
  ASSERT_EQ(zinf_host_device_create(0, 0, &device), ZINF_OK) << last_message();
  zinf_comm_group_t* group = nullptr;
  ASSERT_EQ(zinf_mpi_comm_group_create(device, nullptr, 20'000, &group), ZINF_OK) << last_message();
  MPI_Initialized(&initialized);
  ASSERT_NE(initialized, 0);
  int mpi_rank = -1;
  int mpi_world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &mpi_world);

  zinf_comm_t* comm = nullptr;
  ASSERT_EQ(zinf_comm_group_get(group, ZINF_RANK_OF_THIS_PROCESS, &comm), ZINF_OK)
      << last_message();
  ASSERT_NE(comm, nullptr);
  int rank = -2;
  int world_size = 0;
  ASSERT_EQ(zinf_comm_rank(comm, &rank, &world_size), ZINF_OK) << last_message();
  EXPECT_EQ(rank, mpi_rank);
  EXPECT_EQ(world_size, mpi_world);
  int group_world = 0;
  ASSERT_EQ(zinf_comm_group_world_size(group, &group_world), ZINF_OK);
  EXPECT_EQ(group_world, mpi_world);

  // The rank, once known, names the same communicator; another process's is refused.
  zinf_comm_t* by_rank = nullptr;
  ASSERT_EQ(zinf_comm_group_get(group, mpi_rank, &by_rank), ZINF_OK) << last_message();
  EXPECT_EQ(by_rank, comm);
  zinf_comm_t* untouched = nullptr;
  EXPECT_EQ(zinf_comm_group_get(group, (mpi_rank + 1) % mpi_world, &untouched),
            mpi_world == 1 ? ZINF_OK : ZINF_INVALID_ARGUMENT);
  if (mpi_world > 1) {
    EXPECT_EQ(untouched, nullptr);
    EXPECT_NE(last_message().find("not this process's"), std::string::npos) << last_message();
  }

  EXPECT_EQ(zinf_comm_group_destroy(group), ZINF_OK) << last_message();
  EXPECT_EQ(zinf_device_destroy(device), ZINF_OK) << last_message();
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // zinf initialised MPI and finalises it at exit (unless a test finalised it).
  return RUN_ALL_TESTS();
}
