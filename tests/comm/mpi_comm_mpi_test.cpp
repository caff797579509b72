// MpiComm, one process per rank, launched by ctest through mpirun at several world sizes.
//
// Each process knows every rank's input (all are generated from seeds), so it checks its own
// result against the contract written out serially (ranks in order, f32 accumulation, one
// rounding) and against LocalComm run in this process with one thread per rank on the same
// inputs: the same bits. Then the failure modes: a rank that never arrives (the others fail with
// kTimeout naming it, within the timeout, and it learns of the failure), ranks that disagree, an
// abort, a barrier a rank misses, and a communicator the caller passes in.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/random.hpp"
#include "comm/mpi_comm.hpp"
#include "comm_test_util.hpp"
#include "device/device_ops.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/dtype.hpp"
#include "zinf/zinf.h"

namespace zinf {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

int g_rank = 0;
int g_world = 1;

using comm_test::random_data;
using comm_test::serial_reduce;

std::unique_ptr<Device> host_device(int ordinal, bool opaque) {
  HostDeviceOptions options;
  options.ordinal = ordinal;
  options.jitter_max_us = 50;
  options.jitter_seed = 7 + static_cast<std::uint64_t>(ordinal);
  options.opaque = opaque;
  // As a GPU needs for asynchronous copies: every host buffer a copy touches is registered, the
  // communicator's staging copies included.
  options.require_registered_host = opaque;
  Result<std::unique_ptr<Device>> device = make_host_device(options);
  EXPECT_TRUE(device.is_ok()) << device.status().to_string();
  return std::move(device).value();
}

std::unique_ptr<Communicator> mpi_comm(Device& device, milliseconds timeout) {
  MpiCommOptions options;
  options.timeout = timeout;
  Result<std::unique_ptr<Communicator>> comm = make_mpi_comm(device, options);
  EXPECT_TRUE(comm.is_ok()) << comm.status().to_string();
  return std::move(comm).value();
}

// One collective on one rank's device: copies `input` in, issues, copies the result out, waits.
// The buffers outlive the stream (declared first), which waits for its work when destroyed.
struct Run {
  Device& device;
  DeviceBuffer send, recv;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<Event> done;
  Run(Device& d, std::size_t send_bytes, std::size_t recv_bytes) : device(d) {
    send = std::move(DeviceBuffer::allocate(d, send_bytes)).value();
    recv = std::move(DeviceBuffer::allocate(d, recv_bytes)).value();
    stream = std::move(d.create_stream("test")).value();
    done = std::move(d.create_event()).value();
  }
};

enum class Form { kOutOfPlace, kInPlace };

// Runs `kind` on `comm` (rank `rank` of `world`) with this rank's input; returns its output.
Result<std::vector<std::byte>> run_collective(Communicator& comm, CollectiveKind kind,
                                              const std::vector<std::byte>& input,
                                              std::size_t count, DType dtype, ReduceOp op,
                                              Form form, int root,
                                              std::string_view name = "test data") {
  Device& device = comm.device();
  const int rank = comm.rank();
  const auto world = static_cast<std::size_t>(comm.world_size());
  const std::size_t chunk_bytes = count * dtype_bytes(dtype);
  const std::size_t send_bytes =
      kind == CollectiveKind::kReduceScatter ? chunk_bytes * world : chunk_bytes;
  const std::size_t recv_bytes =
      kind == CollectiveKind::kAllGather ? chunk_bytes * world : chunk_bytes;
  const bool in_place = form == Form::kInPlace;
  // The host buffers outlive the stream (declared before it, so destroyed after its thread is
  // joined): a call that fails returns while the copies it queued may still run.
  Result<RegisteredBuffer> host_in = RegisteredBuffer::allocate(device, send_bytes);
  Result<RegisteredBuffer> host_out = RegisteredBuffer::allocate(device, recv_bytes);
  ZINF_RETURN_IF_ERROR(host_in.status());
  ZINF_RETURN_IF_ERROR(host_out.status());
  // In place: one buffer of the larger size, with send or recv at this rank's offset.
  Run run(device, std::max(send_bytes, recv_bytes), recv_bytes);
  auto* base = static_cast<std::byte*>(run.send.data());
  std::byte* send = base;
  std::byte* recv = in_place ? base : static_cast<std::byte*>(run.recv.data());
  if (in_place && kind == CollectiveKind::kAllGather) {
    send = base + static_cast<std::size_t>(rank) * chunk_bytes;
  }
  if (in_place && kind == CollectiveKind::kReduceScatter) {
    recv = base + static_cast<std::size_t>(rank) * chunk_bytes;
  }
  std::memcpy(host_in.value().data(), input.data(), send_bytes);
  ZINF_RETURN_IF_ERROR(device.copy_h2d(send, host_in.value().data(), send_bytes, *run.stream));
  Collective c{kind, send, recv, count, dtype, op, root, name};
  ZINF_RETURN_IF_ERROR(comm.issue(c, *run.stream));
  ZINF_RETURN_IF_ERROR(device.copy_d2h(host_out.value().data(), recv, recv_bytes, *run.stream));
  ZINF_RETURN_IF_ERROR(device.record(*run.done, *run.stream));
  ZINF_RETURN_IF_ERROR(comm.wait(*run.done, std::chrono::seconds(60)));
  return std::vector<std::byte>(host_out.value().data(), host_out.value().data() + recv_bytes);
}

// The same collective on LocalComm: `world` threads of this process, each with its rank's input;
// returns rank `rank`'s output.
std::vector<std::byte> local_comm_output(CollectiveKind kind,
                                         const std::vector<std::vector<std::byte>>& inputs,
                                         std::size_t count, DType dtype, ReduceOp op, Form form,
                                         int root, int rank) {
  const int world = static_cast<int>(inputs.size());
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<Device*> raw;
  for (int r = 0; r < world; ++r) {
    devices.push_back(host_device(r, false));
    raw.push_back(devices.back().get());
  }
  auto comms = std::move(make_local_comm_group(raw)).value();
  std::vector<std::vector<std::byte>> outputs(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      const auto ur = static_cast<std::size_t>(r);
      Result<std::vector<std::byte>> out =
          run_collective(*comms[ur], kind, inputs[ur], count, dtype, op, form, root);
      EXPECT_TRUE(out.is_ok()) << out.status().to_string();
      if (out.is_ok()) outputs[ur] = std::move(out).value();
    });
  }
  for (std::thread& t : threads) t.join();
  comms.clear();
  return outputs[static_cast<std::size_t>(rank)];
}

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAverage, ReduceOp::kMax, ReduceOp::kMin};

class MpiCommCollectives : public ::testing::TestWithParam<bool> {};

// Every collective, dtype, reduction and form, against the serial reference and LocalComm. With
// an opaque HostDevice (the parameter) the buffers go through host staging copies, as a
// CudaDevice's do.
TEST_P(MpiCommCollectives, EqualTheSerialReferenceAndLocalCommBitForBit) {
  const bool opaque = GetParam();
  std::unique_ptr<Device> device = host_device(g_rank, opaque);
  std::unique_ptr<Communicator> comm = mpi_comm(*device, std::chrono::seconds(60));
  ASSERT_EQ(comm->rank(), g_rank);
  ASSERT_EQ(comm->world_size(), g_world);
  EXPECT_EQ(comm->name(), fmt::format("mpi rank {} of {}", g_rank, g_world));
  const std::size_t count = 1037;  // divisible by no world size here
  const auto world = static_cast<std::size_t>(g_world);
  const auto rank = static_cast<std::size_t>(g_rank);
  const std::size_t chunk_bytes_f32 = count * 4;
  (void)chunk_bytes_f32;
  std::uint64_t seed = 5000;
  int checked = 0;
  for (DType dtype : kDTypes) {
    const std::size_t chunk_bytes = count * dtype_bytes(dtype);
    for (Form form : {Form::kOutOfPlace, Form::kInPlace}) {
      for (ReduceOp op : kOps) {
        // all_reduce: whole buffers; reduce_scatter: world chunks each.
        std::vector<std::vector<std::byte>> whole, scattered;
        for (std::size_t r = 0; r < world; ++r) {
          whole.push_back(random_data(count, dtype, ++seed));
          scattered.push_back(random_data(count * world, dtype, ++seed));
        }
        const std::vector<std::byte> expected_all = serial_reduce(whole, 0, count, dtype, op);
        const std::vector<std::byte> expected_scatter =
            serial_reduce(scattered, rank * count, count, dtype, op);
        Result<std::vector<std::byte>> all = run_collective(*comm, CollectiveKind::kAllReduce,
                                                            whole[rank], count, dtype, op, form, 0);
        ASSERT_TRUE(all.is_ok()) << all.status().to_string();
        EXPECT_EQ(all.value(), expected_all)
            << "all_reduce " << dtype_name(dtype) << " " << reduce_op_name(op);
        Result<std::vector<std::byte>> scatter = run_collective(
            *comm, CollectiveKind::kReduceScatter, scattered[rank], count, dtype, op, form, 0);
        ASSERT_TRUE(scatter.is_ok()) << scatter.status().to_string();
        EXPECT_EQ(scatter.value(), expected_scatter)
            << "reduce_scatter " << dtype_name(dtype) << " " << reduce_op_name(op);
        // LocalComm with the same inputs gives this rank the same bits (a few combinations: each
        // runs world threads here).
        if (op == ReduceOp::kSum || op == ReduceOp::kAverage) {
          EXPECT_EQ(all.value(), local_comm_output(CollectiveKind::kAllReduce, whole, count, dtype,
                                                   op, form, 0, g_rank));
          EXPECT_EQ(scatter.value(), local_comm_output(CollectiveKind::kReduceScatter, scattered,
                                                       count, dtype, op, form, 0, g_rank));
          checked += 2;
        }
      }
      // all_gather: every rank's piece in rank order; broadcast from each root.
      std::vector<std::vector<std::byte>> pieces;
      std::vector<std::byte> gathered;
      for (std::size_t r = 0; r < world; ++r) {
        pieces.push_back(random_data(count, dtype, ++seed));
        gathered.insert(gathered.end(), pieces.back().begin(), pieces.back().end());
      }
      Result<std::vector<std::byte>> got = run_collective(
          *comm, CollectiveKind::kAllGather, pieces[rank], count, dtype, ReduceOp::kSum, form, 0);
      ASSERT_TRUE(got.is_ok()) << got.status().to_string();
      EXPECT_EQ(got.value(), gathered) << "all_gather " << dtype_name(dtype);
      ASSERT_EQ(gathered.size(), chunk_bytes * world);
      for (int root = 0; root < g_world; ++root) {
        Result<std::vector<std::byte>> cast =
            run_collective(*comm, CollectiveKind::kBroadcast, pieces[rank], count, dtype,
                           ReduceOp::kSum, form, root);
        ASSERT_TRUE(cast.is_ok()) << cast.status().to_string();
        EXPECT_EQ(cast.value(), pieces[static_cast<std::size_t>(root)])
            << "broadcast root " << root;
      }
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_TRUE(comm->barrier(std::chrono::seconds(60)).is_ok());
  EXPECT_TRUE(comm->status().is_ok());
}

INSTANTIATE_TEST_SUITE_P(Devices, MpiCommCollectives, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("opaque_staged") : std::string("host");
                         });

// Waits up to `limit` for `comm` to report an error; returns it (OK when none came).
Status wait_for_error(Communicator& comm, milliseconds limit) {
  const auto end = Clock::now() + limit;
  while (Clock::now() < end) {
    Status st = comm.status();
    if (!st.is_ok()) return st;
    std::this_thread::sleep_for(milliseconds(5));
  }
  return comm.status();
}

// The last rank never issues the collective: every other rank's fails with kTimeout naming it
// and the collective, within the timeout (plus scheduling slack), and the last rank learns of it.
TEST(MpiCommFailures, ARankThatNeverArrivesFailsTheOthersWithinTheTimeout) {
  if (g_world < 2) GTEST_SKIP() << "needs 2 ranks";
  std::unique_ptr<Device> device = host_device(g_rank, false);
  const milliseconds timeout(800);
  std::unique_ptr<Communicator> comm = mpi_comm(*device, timeout);
  const int late = g_world - 1;
  const std::vector<std::byte> input = random_data(64, DType::kF32, 99 + g_rank);
  if (g_rank != late) {
    const auto start = Clock::now();
    Result<std::vector<std::byte>> out =
        run_collective(*comm, CollectiveKind::kAllReduce, input, 64, DType::kF32, ReduceOp::kSum,
                       Form::kOutOfPlace, 0);
    const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
    ASSERT_FALSE(out.is_ok());
    // Rank 0 times out itself; the others may hear rank 0's notice first. Either way the message
    // names the collective and the silent rank.
    const std::string message(out.status().message());
    EXPECT_TRUE(out.status().code() == Code::kTimeout) << out.status().to_string();
    EXPECT_NE(message.find("all_reduce #0 'test data'"), std::string::npos) << message;
    EXPECT_NE(message.find(fmt::format("rank(s) {}", late)), std::string::npos) << message;
    EXPECT_LT(took.count(), timeout.count() + 2000);
    EXPECT_GE(took.count(), timeout.count() - 50);
  } else {
    Status heard = wait_for_error(*comm, timeout + std::chrono::seconds(10));
    EXPECT_EQ(heard.code(), Code::kTimeout) << heard.to_string();
    EXPECT_NE(heard.message().find("failed"), std::string_view::npos) << heard.to_string();
  }
  // Every later call refuses, naming the first error.
  Result<std::vector<std::byte>> later =
      run_collective(*comm, CollectiveKind::kAllGather, input, 64, DType::kF32, ReduceOp::kSum,
                     Form::kOutOfPlace, 0);
  ASSERT_FALSE(later.is_ok());
  EXPECT_EQ(later.status().code(), Code::kAborted) << later.status().to_string();
  MPI_Barrier(MPI_COMM_WORLD);
}

// Rank 0 issues a larger all_gather than the others: the sizes disagree, every rank fails with
// kCommError (or hears of it) rather than corrupting memory.
TEST(MpiCommFailures, RanksThatDisagreeOnTheSizeFailWithCommError) {
  if (g_world < 2) GTEST_SKIP() << "needs 2 ranks";
  std::unique_ptr<Device> device = host_device(g_rank, false);
  std::unique_ptr<Communicator> comm = mpi_comm(*device, std::chrono::seconds(5));
  const std::size_t count = g_rank == 0 ? 96 : 64;
  const std::vector<std::byte> input = random_data(count, DType::kF32, 7 + g_rank);
  Result<std::vector<std::byte>> out =
      run_collective(*comm, CollectiveKind::kAllGather, input, count, DType::kF32, ReduceOp::kSum,
                     Form::kOutOfPlace, 0);
  ASSERT_FALSE(out.is_ok());
  EXPECT_EQ(out.status().code(), Code::kCommError) << out.status().to_string();
  EXPECT_NE(out.status().message().find("all_gather #0"), std::string_view::npos)
      << out.status().to_string();
  MPI_Barrier(MPI_COMM_WORLD);
}

// What one rank issues in RanksThatIssueDifferentCollectivesOfTheSameSizeFailWithCommError.
struct Call {
  CollectiveKind kind;
  std::size_t count;
  DType dtype;
  ReduceOp op;
  int root;
  std::string text;  // as the error names it
  std::string name = "test data";
};

// Rank 0 issues `first`, every other rank `second`: collectives that move the same bytes but
// differ in root, reduction or dtype. Every rank fails with kCommError naming both calls (its own
// check or the notice of a rank whose check came first), instead of returning an answer.
void expect_disagreement(const Call& first, const Call& second) {
  SCOPED_TRACE(first.text + " vs " + second.text);
  std::unique_ptr<Device> device = host_device(g_rank, false);
  std::unique_ptr<Communicator> comm = mpi_comm(*device, std::chrono::seconds(10));
  const Call& mine = g_rank == 0 ? first : second;
  const std::size_t input_count =
      mine.kind == CollectiveKind::kReduceScatter ? mine.count * g_world : mine.count;
  const std::vector<std::byte> input = random_data(input_count, mine.dtype, 41 + g_rank);
  const auto start = Clock::now();
  Result<std::vector<std::byte>> out =
      run_collective(*comm, mine.kind, input, mine.count, mine.dtype, mine.op, Form::kOutOfPlace,
                     mine.root, mine.name);
  ASSERT_FALSE(out.is_ok()) << "rank " << g_rank << " got an answer";
  const std::string message(out.status().message());
  // With more than two ranks, one that issues after another's notice arrived is refused
  // (kAborted carrying that notice); with two, each rank's own call is in before any check.
  const Code code = out.status().code();
  EXPECT_TRUE(code == Code::kCommError || (g_world > 2 && code == Code::kAborted)) << message;
  EXPECT_NE(message.find("ranks disagree"), std::string::npos) << message;
  EXPECT_NE(message.find("issued " + first.text), std::string::npos) << message;
  EXPECT_NE(message.find("issued " + second.text), std::string::npos) << message;
  // Found when the descriptors arrive, not at the timeout.
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiCommFailures, RanksThatIssueDifferentCollectivesOfTheSameSizeFailWithCommError) {
  if (g_world < 2) GTEST_SKIP() << "needs 2 ranks";
  const auto f32 = DType::kF32;
  const auto bf16 = DType::kBF16;
  const auto sum = ReduceOp::kSum;
  const auto max = ReduceOp::kMax;
  // Broadcasts from different roots.
  expect_disagreement({CollectiveKind::kBroadcast, 4, f32, sum, 0, "broadcast of 4 f32 (root 0)"},
                      {CollectiveKind::kBroadcast, 4, f32, sum, 1, "broadcast of 4 f32 (root 1)"});
  // all_reduce with sum on one rank and max on the others.
  expect_disagreement({CollectiveKind::kAllReduce, 4, f32, sum, 0, "all_reduce of 4 f32 (sum)"},
                      {CollectiveKind::kAllReduce, 4, f32, max, 0, "all_reduce of 4 f32 (max)"});
  // 4 f32 against 8 bf16: 16 bytes either way.
  expect_disagreement({CollectiveKind::kAllReduce, 4, f32, sum, 0, "all_reduce of 4 f32 (sum)"},
                      {CollectiveKind::kAllReduce, 8, bf16, sum, 0, "all_reduce of 8 bf16 (sum)"});
  // The same call under other names: gathers of two modules whose shards pad to one size. A
  // name is carried whole up to 40 bytes; past them ranks still disagree by the whole name's
  // hash, and the peer's is shown cut ("...").
  expect_disagreement(
      {CollectiveKind::kAllGather, 4, f32, sum, 0,
       "all_gather of 4 f32 'params group 0 (module 'fc1')'", "params group 0 (module 'fc1')"},
      {CollectiveKind::kAllGather, 4, f32, sum, 0,
       "all_gather of 4 f32 'params group 1 (module 'fc2')'", "params group 1 (module 'fc2')"});
  const std::string stem = "params group 7 (module 'transformer.h.11.mlp.c_";
  expect_disagreement({CollectiveKind::kAllGather, 4, f32, sum, 0,
                       "all_gather of 4 f32 '" + stem.substr(0, 40) + "...'", stem + "fc')"},
                      {CollectiveKind::kAllGather, 4, f32, sum, 0,
                       "all_gather of 4 f32 '" + stem.substr(0, 40) + "...'", stem + "proj')"});
  // Another kind of the same size: all_gather of 4 f32 against all_reduce of 4 f32 on two ranks.
  if (g_world == 2) {
    expect_disagreement({CollectiveKind::kAllGather, 2, f32, sum, 0, "all_gather of 2 f32"},
                        {CollectiveKind::kAllReduce, 2, f32, sum, 0, "all_reduce of 2 f32 (sum)"});
  }
}

// Issues a collective of no elements with null buffers (legal at count 0) and waits for it.
Status run_empty_collective(Communicator& comm, CollectiveKind kind, int root) {
  Device& device = comm.device();
  Result<std::unique_ptr<Stream>> stream = device.create_stream("empty");
  Result<std::unique_ptr<Event>> done = device.create_event();
  ZINF_RETURN_IF_ERROR(stream.status());
  ZINF_RETURN_IF_ERROR(done.status());
  Collective c{kind, nullptr, nullptr, 0, DType::kF32, ReduceOp::kSum, root, "empty"};
  ZINF_RETURN_IF_ERROR(comm.issue(c, *stream.value()));
  ZINF_RETURN_IF_ERROR(device.record(*done.value(), *stream.value()));
  return comm.wait(*done.value(), std::chrono::seconds(60));
}

// A collective of no elements on every rank returns ok at once, on a host device and through the
// staging path, and the collectives after it still match.
TEST_P(MpiCommCollectives, ACollectiveOfNoElementsOnEveryRankSucceeds) {
  std::unique_ptr<Device> device = host_device(g_rank, GetParam());
  std::unique_ptr<Communicator> comm = mpi_comm(*device, std::chrono::seconds(10));
  const auto start = Clock::now();
  for (CollectiveKind kind : {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter,
                              CollectiveKind::kAllReduce, CollectiveKind::kBroadcast}) {
    Status st = run_empty_collective(*comm, kind, g_world - 1);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  // Then a collective with data: each rank's value + 1 summed.
  std::vector<std::byte> input(4);
  const float mine = static_cast<float>(g_rank + 1);
  std::memcpy(input.data(), &mine, 4);
  Result<std::vector<std::byte>> out =
      run_collective(*comm, CollectiveKind::kAllReduce, input, 1, DType::kF32, ReduceOp::kSum,
                     Form::kOutOfPlace, 0);
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  float got = 0;
  std::memcpy(&got, out.value().data(), 4);
  EXPECT_EQ(got, static_cast<float>(g_world * (g_world + 1) / 2));
  MPI_Barrier(MPI_COMM_WORLD);
}

// Rank 0 issues an all_reduce of 0 f32, the others of 4 f32: every rank fails with kCommError
// naming both calls (with more than two ranks, or kAborted carrying a peer's notice), found when
// the descriptors arrive, not at the timeout.
TEST(MpiCommFailures, RanksThatDisagreeOnNoElementsAgainstSomeFailWithCommError) {
  if (g_world < 2) GTEST_SKIP() << "needs 2 ranks";
  std::unique_ptr<Device> device = host_device(g_rank, false);
  const milliseconds timeout(10'000);
  std::unique_ptr<Communicator> comm = mpi_comm(*device, timeout);
  const auto start = Clock::now();
  Status st;
  if (g_rank == 0) {
    st = run_empty_collective(*comm, CollectiveKind::kAllReduce, 0);
  } else {
    const std::vector<std::byte> input = random_data(4, DType::kF32, 17 + g_rank);
    st = run_collective(*comm, CollectiveKind::kAllReduce, input, 4, DType::kF32, ReduceOp::kSum,
                        Form::kOutOfPlace, 0)
             .status();
  }
  ASSERT_FALSE(st.is_ok()) << "rank " << g_rank << " got an answer";
  const std::string message(st.message());
  EXPECT_TRUE(st.code() == Code::kCommError || (g_world > 2 && st.code() == Code::kAborted))
      << st.to_string();
  EXPECT_NE(message.find("ranks disagree"), std::string::npos) << message;
  EXPECT_NE(message.find("issued all_reduce of 0 f32 (sum)"), std::string::npos) << message;
  EXPECT_NE(message.find("issued all_reduce of 4 f32 (sum)"), std::string::npos) << message;
  EXPECT_LT(Clock::now() - start, timeout / 2);
  MPI_Barrier(MPI_COMM_WORLD);
}

// Rank 0 broadcasts 4 f32 from root 0, rank 1 expects 8 bf16 from root 0: the same 16 bytes.
// Rank 1 fails with kCommError and its buffer keeps what it held: none of rank 0's data is let in
// before rank 0's descriptor was received and compared.
TEST(MpiCommFailures, APeersDataWaitsUntilItsDescriptorAgrees) {
  if (g_world != 2) GTEST_SKIP() << "needs exactly 2 ranks";
  std::unique_ptr<Device> device = host_device(g_rank, false);
  std::unique_ptr<Communicator> comm = mpi_comm(*device, std::chrono::seconds(10));
  const DType dtype = g_rank == 0 ? DType::kF32 : DType::kBF16;
  const std::size_t count = g_rank == 0 ? 4 : 8;
  const std::vector<std::byte> before = random_data(count, dtype, 61 + g_rank);
  zinf::Run run(*device, 16, 16);
  std::memcpy(run.send.data(), before.data(), 16);
  std::memcpy(run.recv.data(), before.data(), 16);
  Collective c{CollectiveKind::kBroadcast,
               run.send.data(),
               run.recv.data(),
               count,
               dtype,
               ReduceOp::kSum,
               0,
               "b"};
  ASSERT_TRUE(comm->issue(c, *run.stream).is_ok());
  ASSERT_TRUE(device->record(*run.done, *run.stream).is_ok());
  Status st = comm->wait(*run.done, std::chrono::seconds(10));
  EXPECT_EQ(st.code(), Code::kCommError) << st.to_string();
  run.stream.reset();
  if (g_rank == 1) {
    EXPECT_EQ(std::memcmp(run.recv.data(), before.data(), 16), 0)
        << "rank 0's data reached the buffer of a collective that disagreed";
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// abort() on rank 0 while the others wait in a collective: theirs fails with kAborted naming
// rank 0 and the reason, well before the timeout.
TEST(MpiCommFailures, AnAbortReachesTheOtherRanksCollectives) {
  if (g_world < 2) GTEST_SKIP() << "needs 2 ranks";
  std::unique_ptr<Device> device = host_device(g_rank, false);
  std::unique_ptr<Communicator> comm = mpi_comm(*device, std::chrono::seconds(30));
  const std::vector<std::byte> input = random_data(32, DType::kF32, 3 + g_rank);
  if (g_rank == 0) {
    std::this_thread::sleep_for(milliseconds(200));
    comm->abort(Status::aborted("rank 0 gives up: test"));
  } else {
    const auto start = Clock::now();
    Result<std::vector<std::byte>> out =
        run_collective(*comm, CollectiveKind::kBroadcast, input, 32, DType::kF32, ReduceOp::kSum,
                       Form::kOutOfPlace, 0);
    ASSERT_FALSE(out.is_ok());
    EXPECT_EQ(out.status().code(), Code::kAborted) << out.status().to_string();
    EXPECT_NE(out.status().message().find("rank 0 failed: rank 0 gives up: test"),
              std::string_view::npos)
        << out.status().to_string();
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiCommFailures, ABarrierARankMissesTimesOutNamingIt) {
  if (g_world < 2) GTEST_SKIP() << "needs 2 ranks";
  std::unique_ptr<Device> device = host_device(g_rank, false);
  std::unique_ptr<Communicator> comm = mpi_comm(*device, std::chrono::seconds(30));
  ASSERT_TRUE(comm->barrier(std::chrono::seconds(30)).is_ok());
  if (g_rank == 0) {
    Status st = comm->barrier(milliseconds(500));
    EXPECT_EQ(st.code(), Code::kTimeout) << st.to_string();
    EXPECT_NE(st.message().find("barrier #1"), std::string_view::npos) << st.to_string();
    EXPECT_NE(st.message().find(fmt::format("rank(s) {}", g_world - 1)), std::string_view::npos)
        << st.to_string();
  } else if (g_rank != g_world - 1) {
    Status st = comm->barrier(std::chrono::seconds(10));
    EXPECT_FALSE(st.is_ok());
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Opening is collective (the communicator is duplicated): a rank that comes late past the
// timeout makes the others' make_mpi_comm return kTimeout at the timeout, not wait for it. The
// late rank still opens, so that every rank makes the same collective calls on MPI_COMM_WORLD.
TEST(MpiCommFailures, OpeningWithALateRankTimesOut) {
  if (g_world < 2) GTEST_SKIP() << "needs 2 ranks";
  std::unique_ptr<Device> device = host_device(g_rank, false);
  const milliseconds timeout(1000);
  MpiCommOptions options;
  options.timeout = timeout;
  if (g_rank == 1) {
    std::this_thread::sleep_for(timeout * 5 / 2);
    options.timeout = std::chrono::seconds(10);
    Result<std::unique_ptr<Communicator>> late = make_mpi_comm(*device, options);
    (void)late;
  } else {
    const auto start = Clock::now();
    Result<std::unique_ptr<Communicator>> comm = make_mpi_comm(*device, options);
    const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
    ASSERT_FALSE(comm.is_ok());
    const std::string message(comm.status().message());
    EXPECT_EQ(comm.status().code(), Code::kTimeout) << message;
    EXPECT_NE(message.find(fmt::format("not every rank of the {} joined within 1000 ms", g_world)),
              std::string::npos)
        << message;
    EXPECT_GE(took.count(), timeout.count() - 50);
    EXPECT_LT(took.count(), timeout.count() + 1000);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Where the launcher gives no local rank, mpi_world_of_process counts the ranks on this host
// from their host names (all ranks of this test share one host); a rank that comes late past the
// timeout makes the others' return kTimeout instead of waiting. Both launchers' variables are
// taken away for it (Open MPI's, and MPI_LOCALRANKID of MPICH's Hydra and Intel MPI).
TEST(MpiWorld, LocalRankFromHostNamesWithADeadline) {
  const char* const kLocalRankVariables[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"};
  std::vector<std::pair<const char*, std::string>> saved;
  for (const char* name : kLocalRankVariables) {
    const char* value = std::getenv(name);
    if (value != nullptr) saved.emplace_back(name, value);
    unsetenv(name);
  }
  Result<MpiWorld> world = mpi_world_of_process(std::chrono::seconds(20));
  ASSERT_TRUE(world.is_ok()) << world.status().to_string();
  EXPECT_EQ(world->rank, g_rank);
  EXPECT_EQ(world->world_size, g_world);
  EXPECT_EQ(world->local_rank, g_rank);
  if (g_world >= 2) {
    const milliseconds timeout(1000);
    if (g_rank == 1) std::this_thread::sleep_for(timeout * 5 / 2);
    const auto start = Clock::now();
    Result<MpiWorld> late = mpi_world_of_process(g_rank == 1 ? std::chrono::seconds(10) : timeout);
    const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
    if (g_rank != 1) {
      ASSERT_FALSE(late.is_ok());
      EXPECT_EQ(late.status().code(), Code::kTimeout) << late.status().to_string();
      EXPECT_NE(late.status().message().find("gathering the host names"), std::string_view::npos)
          << late.status().to_string();
      EXPECT_LT(took.count(), timeout.count() + 1000);
    }
  }
  for (const auto& [name, value] : saved) setenv(name, value.c_str(), 1);
  if (!saved.empty()) {
    // The launcher's figure, when it gives one, needs no collective: no rank waits.
    Result<MpiWorld> given = mpi_world_of_process(milliseconds(1));
    ASSERT_TRUE(given.is_ok()) << given.status().to_string();
    EXPECT_EQ(given->local_rank, std::atoi(saved.front().second.c_str()));
  }
  // A launcher's figure that is no local rank of this world is refused naming the variable (it
  // was read with atoi: "x" became local rank 0, "-1" a negative one).
  for (const std::string& bad :
       {std::string("x"), std::string("-1"), std::string("1x"), std::to_string(g_world)}) {
    SCOPED_TRACE(bad);
    const char* name = kLocalRankVariables[0];
    const char* before = std::getenv(name);
    const std::string kept = before != nullptr ? before : "";
    setenv(name, bad.c_str(), 1);
    Result<MpiWorld> refused = mpi_world_of_process(milliseconds(1));
    if (before != nullptr) {
      setenv(name, kept.c_str(), 1);
    } else {
      unsetenv(name);
    }
    ASSERT_FALSE(refused.is_ok());
    EXPECT_EQ(refused.status().code(), Code::kInvalidArgument) << refused.status().to_string();
    EXPECT_NE(refused.status().message().find(std::string(name) + "='" + bad + "'"),
              std::string_view::npos)
        << refused.status().to_string();
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// A communicator of the caller's: the ranks are its ranks, and collectives stay inside it.
TEST(MpiCommCallers, OpensOnACommunicatorThePassedIn) {
  MPI_Comm halves = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, g_rank % 2, g_rank, &halves), MPI_SUCCESS);
  int sub_rank = 0, sub_size = 0;
  MPI_Comm_rank(halves, &sub_rank);
  MPI_Comm_size(halves, &sub_size);
  std::unique_ptr<Device> device = host_device(g_rank, false);
  Result<std::unique_ptr<Communicator>> comm = make_mpi_comm(&halves, *device);
  ASSERT_TRUE(comm.is_ok()) << comm.status().to_string();
  EXPECT_EQ(comm.value()->rank(), sub_rank);
  EXPECT_EQ(comm.value()->world_size(), sub_size);
  // Each half sums its members' world ranks + 1.
  std::vector<std::byte> input(4);
  const float mine = static_cast<float>(g_rank + 1);
  std::memcpy(input.data(), &mine, 4);
  Result<std::vector<std::byte>> out =
      run_collective(*comm.value(), CollectiveKind::kAllReduce, input, 1, DType::kF32,
                     ReduceOp::kSum, Form::kOutOfPlace, 0);
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  float expected = 0;
  for (int r = g_rank % 2; r < g_world; r += 2) expected += static_cast<float>(r + 1);
  float got = 0;
  std::memcpy(&got, out.value().data(), 4);
  EXPECT_EQ(got, expected);
  comm.value().reset();
  MPI_Comm_free(&halves);
  EXPECT_EQ(make_mpi_comm(nullptr, *device).status().code(), Code::kInvalidArgument);
}

// The C API's MPI group: this process's rank, the job's world size; other ranks refused.
TEST(MpiCommCApi, AGroupHoldsThisProcesssRank) {
  zinf_device_t* device = nullptr;
  ASSERT_EQ(zinf_host_device_create(g_rank, 0, &device), ZINF_OK) << zinf_last_error_message();
  zinf_comm_group_t* group = nullptr;
  ASSERT_EQ(zinf_mpi_comm_group_create(device, nullptr, 30'000, &group), ZINF_OK)
      << zinf_last_error_message();
  int world = 0;
  ASSERT_EQ(zinf_comm_group_world_size(group, &world), ZINF_OK);
  EXPECT_EQ(world, g_world);
  zinf_comm_t* comm = nullptr;
  ASSERT_EQ(zinf_comm_group_get(group, g_rank, &comm), ZINF_OK) << zinf_last_error_message();
  int rank = -1, size = 0;
  ASSERT_EQ(zinf_comm_rank(comm, &rank, &size), ZINF_OK);
  EXPECT_EQ(rank, g_rank);
  EXPECT_EQ(size, g_world);
  if (g_world > 1) {
    EXPECT_EQ(zinf_comm_group_get(group, (g_rank + 1) % g_world, &comm), ZINF_INVALID_ARGUMENT);
    EXPECT_NE(std::string(zinf_last_error_message()).find("not this process's"), std::string::npos)
        << zinf_last_error_message();
  }
  // The device is in use until the group goes.
  EXPECT_EQ(zinf_device_destroy(device), ZINF_FAILED_PRECONDITION);
  EXPECT_EQ(zinf_comm_group_destroy(group), ZINF_OK);
  EXPECT_EQ(zinf_device_destroy(device), ZINF_OK);
}

}  // namespace
}  // namespace zinf

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &zinf::g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &zinf::g_world);
  ::testing::InitGoogleTest(&argc, argv);
  // Only rank 0 prints the progress; every rank prints its failures (gtest's own lines).
  if (zinf::g_rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    (void)listeners;
  }
  std::printf("mpi rank %d of %d\n", zinf::g_rank, zinf::g_world);
  const int failed = RUN_ALL_TESTS();
  // Every rank's verdict: the job fails when any rank failed.
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
