// The engine's equivalence test with one process per rank (MpiComm, launched by ctest through
// mpirun at world sizes 2, 3 and 4): stages 1-3 x optimizer state on the device, in host memory
// and on NVMe (a swap directory per rank). After 8 AdamW steps the fp32 masters are
//   - within 1e-6 relative of the plain single-process reference (engine_test_util.cpp), with
//     every gathered device copy checked against it at every step, as tests/engine/
//     equivalence_test.cpp checks LocalComm;
//   - the same bits as LocalComm's run at the same world size (rank 0 runs it, in threads);
//   - the same bits on every rank.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::Reference;
using engine_test::TrainOptions;

int g_rank = 0;
int g_world = 1;

struct Case {
  int stage;
  OffloadDevice optimizer;
};

std::string case_name(const Case& c) {
  return fmt::format("w{}_s{}_opt_{}", g_world, c.stage, offload_device_name(c.optimizer));
}

using Masters = std::vector<std::vector<float>>;

// One rank's run: trains through `comm` and returns the masters every rank reads back.
Result<Masters> train(const Config& config, const Model& model, const TrainOptions& options,
                      const Reference& ref, Device& device, Communicator& comm, int rank) {
  Env env;
  env.device = &device;
  env.comm = &comm;
  ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
  std::vector<StepReport> reports;
  ZINF_RETURN_IF_ERROR(
      engine_test::train_rank(*engine, model, rank, options, &ref.device_per_step, &reports));
  if (reports.size() != static_cast<std::size_t>(options.steps)) {
    return Status::internal(fmt::format("{} step reports", reports.size()));
  }
  Masters finals;
  for (const engine_test::ParamDef& d : model.params) {
    std::vector<float> out(d.element_count());
    ZINF_RETURN_IF_ERROR(engine->read_parameters(d.name, out.data()));
    finals.push_back(std::move(out));
  }
  return finals;
}

class EquivalenceMpi : public ::testing::TestWithParam<Case> {};

TEST_P(EquivalenceMpi, MastersEqualTheReferenceAndLocalCommBitForBit) {
  const Case c = GetParam();
  const std::uint64_t seed =
      1234 + static_cast<std::uint64_t>(g_world) * 10 + static_cast<std::uint64_t>(c.stage);
  if (g_rank == 0) {
    std::printf("case %s seed %llu\n", case_name(c).c_str(),
                static_cast<unsigned long long>(seed));
  }
  // A swap directory per rank, as separate machines would have.
  engine_test::ScratchDir dir(fmt::format("mpi-{}-rank{}", case_name(c), g_rank));
  const Config config = engine_test::small_config(c.stage, c.optimizer, OffloadDevice::kNone,
                                                  dir.path());
  const Model model = engine_test::make_model(DType::kF32, seed);
  TrainOptions options;
  options.steps = 8;  // short: each case also trains on LocalComm, and runs at three world sizes
  // Two micro-batches on odd world sizes, so that accumulation runs in every stage.
  options.micro_batches = g_world % 2 == 1 ? 2 : 1;
  const Reference ref = engine_test::run_reference(config, model, g_world, options);

  HostDeviceOptions device_options;
  device_options.ordinal = g_rank;
  Result<std::unique_ptr<Device>> device = make_host_device(device_options);
  ASSERT_TRUE(device.is_ok()) << device.status().to_string();
  MpiCommOptions comm_options;
  comm_options.timeout = std::chrono::seconds(60);
  Result<std::unique_ptr<Communicator>> comm = make_mpi_comm(*device.value(), comm_options);
  ASSERT_TRUE(comm.is_ok()) << comm.status().to_string();
  TrainOptions rank_options = options;
  rank_options.device = device.value().get();
  Result<Masters> finals =
      train(config, model, rank_options, ref, *device.value(), *comm.value(), g_rank);
  ASSERT_TRUE(finals.is_ok()) << "rank " << g_rank << ": " << finals.status().to_string();
  comm.value().reset();

  double worst = 0.0;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const double d = engine_test::max_rel_diff(finals.value()[p], ref.master[p]);
    worst = std::max(worst, d);
    EXPECT_LE(d, 1e-6) << model.params[p].name;
    // The masters moved: a run that trained nothing would pass trivially.
    EXPECT_GT(engine_test::max_rel_diff(finals.value()[p], model.initial[p]), 1e-3)
        << model.params[p].name;
  }
  // Rank 0's masters reach every rank: the same bits everywhere.
  std::vector<float> flat, rank0;
  for (const std::vector<float>& v : finals.value()) flat.insert(flat.end(), v.begin(), v.end());
  rank0 = flat;
  MPI_Bcast(rank0.data(), static_cast<int>(rank0.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  EXPECT_EQ(std::memcmp(flat.data(), rank0.data(), flat.size() * 4), 0)
      << "rank " << g_rank << " differs from rank 0";

  if (g_rank == 0) {
    std::printf("max relative difference to the reference: %.3g\n", worst);
    // LocalComm at the same world size, in threads of this process: the same bits.
    engine_test::ScratchDir local_dir(fmt::format("mpi-{}-local", case_name(c)));
    const Config local_config = engine_test::small_config(c.stage, c.optimizer,
                                                          OffloadDevice::kNone, local_dir.path());
    engine_test::Ranks ranks = engine_test::make_ranks(g_world);
    std::vector<Masters> local(static_cast<std::size_t>(g_world));
    std::vector<Status> st = engine_test::run_ranks(g_world, [&](int rank) -> Status {
      const auto r = static_cast<std::size_t>(rank);
      TrainOptions o = options;
      o.device = ranks.devices[r].get();
      ZINF_ASSIGN_OR_RETURN(local[r], train(local_config, model, o, ref, *ranks.devices[r],
                                            *ranks.comms[r], rank));
      return Status::ok();
    });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      ASSERT_EQ(local[0][p].size(), finals.value()[p].size());
      EXPECT_EQ(std::memcmp(local[0][p].data(), finals.value()[p].data(),
                            local[0][p].size() * 4),
                0)
          << "MpiComm and LocalComm masters differ in " << model.params[p].name;
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
      out.push_back(Case{stage, opt});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Matrix, EquivalenceMpi, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return fmt::format("s{}_opt_{}", info.param.stage,
                                              offload_device_name(info.param.optimizer));
                         });

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &zinf::g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &zinf::g_world);
  ::testing::InitGoogleTest(&argc, argv);
  const int failed = RUN_ALL_TESTS();
  // The job fails when any rank failed.
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
