// MpiComm collectives between processes against the same collective done by Open MPI itself
// (MPI_Allgather, MPI_Reduce_scatter_block, MPI_Allreduce on the same buffers: the limit MpiComm
// answers to, since it moves its bytes through the same library) and against memcpy of the same
// bytes, interleaved round by round. Run under mpirun (one process per rank):
//   mpirun --allow-run-as-root --bind-to none -np 2 build/bin/bench_comm_mpi_comm [MiB] [rounds]
// Each round, for each collective: a barrier, MpiComm's collective of `MiB` of f32 per rank on
// HostDevice, a barrier, MPI's own collective of the same bytes (each timed on every rank, the
// slowest rank's time counts), then one memcpy on each rank of the bytes that rank received from
// the others. Rate = bytes received from other ranks per second. Rank 0 prints, for each
// collective, the median rates and the medians of the per-round ratios MpiComm / MPI and
// MpiComm / memcpy. Not a Google Benchmark: every rank must run the same number of rounds, which
// an adaptive iteration count would not guarantee.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "base/random.hpp"
#include "bench/bench_stats.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"

namespace {

using zinf::bench::median;

using Clock = std::chrono::steady_clock;
using zinf::CollectiveKind;

}  // namespace

int main(int argc, char** argv) {
  const std::size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 16;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 15;
  zinf::HostDeviceOptions device_options;
  device_options.poison_allocations = false;
  auto device = zinf::make_host_device(device_options);
  if (!device.is_ok()) return 1;
  auto opened = zinf::make_mpi_comm(*device.value());
  if (!opened.is_ok()) {
    std::fprintf(stderr, "bench_comm_mpi_comm: %s\n", opened.status().to_string().c_str());
    return 1;
  }
  zinf::Communicator& comm = *opened.value();
  const int rank = comm.rank();
  const auto world = static_cast<std::size_t>(comm.world_size());
  const std::size_t elements = mib * (std::size_t{1} << 20) / 4;
  zinf::Device& dev = *device.value();
  auto buffer = [&](std::size_t count, unsigned seed) {
    zinf::DeviceBuffer b = std::move(zinf::DeviceBuffer::allocate(dev, count * 4)).value();
    zinf::fill_uniform(b.as<float>(), count, seed);
    return b;
  };
  zinf::DeviceBuffer send = buffer(elements * world, 17 + static_cast<unsigned>(rank));
  zinf::DeviceBuffer recv = buffer(elements * world, 71 + static_cast<unsigned>(rank));
  std::vector<float> copy_src(elements * (world - 1 == 0 ? 1 : world - 1)),
      copy_dst(copy_src.size());
  zinf::fill_uniform(copy_src.data(), copy_src.size(), 5);
  auto stream = std::move(dev.create_stream("bench")).value();
  auto done = std::move(dev.create_event()).value();

  const CollectiveKind kinds[] = {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter,
                                  CollectiveKind::kAllReduce};
  const char* names[] = {"all_gather", "reduce_scatter", "all_reduce"};
  std::vector<double> rate[3], mpi_rate[3], copy_rate[3], ratio[3], mpi_ratio[3];
  // The slowest rank's seconds for one call of `run` on every rank.
  auto slowest = [&](auto run) -> double {
    if (MPI_Barrier(MPI_COMM_WORLD) != MPI_SUCCESS) return -1.0;
    const auto start = Clock::now();
    if (!run()) return -1.0;
    double mine = std::chrono::duration<double>(Clock::now() - start).count(), most = 0.0;
    if (MPI_Allreduce(&mine, &most, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD) != MPI_SUCCESS) {
      return -1.0;
    }
    return most;
  };
  const int count = static_cast<int>(elements);
  // Bytes each rank receives from the others, for every collective here: (W - 1) * N floats.
  const double received = 4.0 * static_cast<double>(elements) * static_cast<double>(world - 1);
  for (int round = 0; round < rounds; ++round) {
    for (int k = 0; k < 3; ++k) {
      zinf::Collective op;
      op.kind = kinds[k];
      op.send = send.data();
      op.recv = recv.data();
      op.element_count = elements;
      op.op = zinf::ReduceOp::kSum;
      const double seconds = slowest([&] {
        return comm.issue(op, *stream).is_ok() && dev.record(*done, *stream).is_ok() &&
               comm.wait(*done, std::chrono::seconds(60)).is_ok();
      });
      if (seconds < 0) {
        std::fprintf(stderr, "rank %d: %s failed: %s\n", rank, names[k],
                     comm.status().to_string().c_str());
        return 1;
      }
      float* in = send.as<float>();
      float* out = recv.as<float>();
      const double mpi_seconds = slowest([&] {
        switch (kinds[k]) {
          case CollectiveKind::kAllGather:
            return MPI_Allgather(in, count, MPI_FLOAT, out, count, MPI_FLOAT, MPI_COMM_WORLD) ==
                   MPI_SUCCESS;
          case CollectiveKind::kReduceScatter:
            return MPI_Reduce_scatter_block(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) ==
                   MPI_SUCCESS;
          default:
            return MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD) == MPI_SUCCESS;
        }
      });
      if (mpi_seconds < 0) {
        std::fprintf(stderr, "rank %d: MPI's %s failed\n", rank, names[k]);
        return 1;
      }
      const auto copy_start = Clock::now();
      std::memcpy(copy_dst.data(), copy_src.data(), copy_src.size() * 4);
      const double copy_seconds = std::chrono::duration<double>(Clock::now() - copy_start).count();
      rate[k].push_back(received / seconds / 1e9);
      mpi_rate[k].push_back(received / mpi_seconds / 1e9);
      mpi_ratio[k].push_back(mpi_seconds / seconds);
      copy_rate[k].push_back(static_cast<double>(copy_src.size()) * 4 / copy_seconds / 1e9);
      ratio[k].push_back(rate[k].back() / copy_rate[k].back());
    }
  }
  if (rank == 0) {
    std::printf("MpiComm, %zu processes, %zu MiB f32 a rank, %d rounds (medians)\n", world, mib,
                rounds);
    std::printf("%-16s %8s %8s %12s %10s %13s\n", "collective", "GB/s", "MPI GB/s", "memcpy GB/s",
                "ratio/MPI", "ratio/memcpy");
    for (int k = 0; k < 3; ++k) {
      std::printf("%-16s %8.2f %8.2f %12.2f %10.3f %13.3f\n", names[k], median(rate[k]),
                  median(mpi_rate[k]), median(copy_rate[k]), median(mpi_ratio[k]),
                  median(ratio[k]));
    }
  }
  return 0;
}
