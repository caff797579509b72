// Engine::write_parameters: rank `root`'s values replace one parameter's fp32 master on every
// rank, whatever the stage and wherever the master lives (device, host memory, NVMe); the other
// parameters keep their masters to the bit, and the gathered device copy shows the new values.
// Bad calls (an unknown name, a module gathered) fail before any collective and leave the engine
// usable. The batch form writes the same bits as the same writes made one by one, in one pass
// over its parameters' groups, and a write updates, writes and all-gathers only the groups it
// names, not those between them (its NVMe reads are those groups' sub-groups, each once); a
// failure on one rank during the pass stops every rank, as a failed write of the new shards does,
// in the same call. With the optimizer state in memory (HostState, DeviceState) and half
// parameters, what the forward gathers after a few writes is each written value rounded by a
// reference rounding, bit for bit, and the initial values elsewhere.
// (python/tests/test_gathered_write.py checks that training goes on from the new values as
// torch does.)
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "engine_test_util.hpp"
#include "io/fault.hpp"

namespace zinf {
namespace {

using engine_test::Model;

struct WriteCase {
  int world;
  int stage;
  OffloadDevice optimizer;
  OffloadDevice params = OffloadDevice::kNone;
  // A GPU-like device (opaque HostDevice): the optimizer state "none" then lives in device memory
  // (DeviceState), read and written through bounded host chunks.
  bool opaque = false;
};

std::string case_name(const WriteCase& c) {
  return fmt::format("w{}_s{}_opt_{}_param_{}{}", c.world, c.stage,
                     offload_device_name(c.optimizer), offload_device_name(c.params),
                     c.opaque ? "_opaque" : "");
}

// Parameter `name` of `module` as the model computes with it (f32), gathered and copied out of
// device memory.
Result<std::vector<float>> gathered_values(Engine& engine, Device& device,
                                           const std::string& module, std::string_view name) {
  ZINF_ASSIGN_OR_RETURN(ScopedGather g, engine.scoped_gather(module));
  ZINF_ASSIGN_OR_RETURN(std::span<const float> view, g.param<float>(name));
  std::vector<float> out(view.size());
  if (device.host_accessible()) {
    std::memcpy(out.data(), view.data(), view.size_bytes());
    return out;
  }
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.create_stream("write test"));
  ZINF_RETURN_IF_ERROR(device.copy_d2h(out.data(), view.data(), view.size_bytes(), *stream));
  ZINF_RETURN_IF_ERROR(device.synchronize(*stream, std::chrono::seconds(30)));
  return out;
}

class WriteParameters : public ::testing::TestWithParam<WriteCase> {};

TEST_P(WriteParameters, ReplacesOneMasterFromTheRoot) {
  const WriteCase c = GetParam();
  engine_test::ScratchDir dir("write_parameters_" + case_name(c));
  const Model model = engine_test::make_model(DType::kF32, 77);
  // The largest parameter, so that it spans several sub-groups and ranks.
  std::size_t target = 0;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].element_count() > model.params[target].element_count()) target = p;
  }
  const std::string& name = model.params[target].name;
  std::vector<float> fresh(model.params[target].element_count());
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  for (float& v : fresh) v = dist(gen);
  const int root = c.world - 1;

  engine_test::Ranks ranks =
      engine_test::make_ranks(c.world, std::chrono::seconds(30), /*jitter_max_us=*/0, c.opaque);
  const auto world = static_cast<std::size_t>(c.world);
  std::vector<std::vector<std::vector<float>>> masters(world);
  std::vector<std::vector<float>> gathered(world);
  std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    ZINF_ASSIGN_OR_RETURN(
        auto engine,
        engine_test::open_finalized(
            ranks, rank, engine_test::small_config(c.stage, c.optimizer, c.params, dir.path()),
            model));
    // Refused before any collective, the engine still usable afterwards.
    Status bad = engine->write_parameters("no.such.parameter", fresh.data(), root);
    if (bad.code() != Code::kNotFound) return Status::internal("unknown name: " + bad.to_string());
    ZINF_RETURN_IF_ERROR(engine->gather(model.params[target].module));
    bad = engine->write_parameters(name, fresh.data(), root);
    if (bad.code() != Code::kFailedPrecondition) {
      return Status::internal("while gathered: " + bad.to_string());
    }
    ZINF_RETURN_IF_ERROR(engine->release(model.params[target].module));
    // Only the root's values count: the others pass null.
    ZINF_RETURN_IF_ERROR(
        engine->write_parameters(name, rank == root ? fresh.data() : nullptr, root));
    for (const auto& def : model.params) {
      std::vector<float> out(def.element_count());
      ZINF_RETURN_IF_ERROR(engine->read_parameters(def.name, out.data()));
      masters[r].push_back(std::move(out));
    }
    ZINF_ASSIGN_OR_RETURN(gathered[r], gathered_values(*engine, *ranks.devices[r],
                                                       model.params[target].module, name));
    return Status::ok();
  });
  for (std::size_t r = 0; r < world; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const std::vector<float>& expected = p == target ? fresh : model.initial[p];
      ASSERT_EQ(0, std::memcmp(masters[r][p].data(), expected.data(), expected.size() * 4))
          << "rank " << r << " parameter " << model.params[p].name;
    }
    ASSERT_EQ(gathered[r], fresh) << "rank " << r;
  }
}

// The batch form: the largest parameter (spanning sub-groups and ranks) and small ones (biases,
// the scalar), named out of layout order.
const std::vector<std::string_view> kBatch = {"head.b", "block0.w", "block1.scale", "embed.w",
                                              "block2.b"};

// Seeded new values for each parameter of the model.
std::vector<std::vector<float>> fresh_values(const Model& model, std::uint32_t seed) {
  std::vector<std::vector<float>> out;
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  for (const auto& def : model.params) {
    std::vector<float> v(def.element_count());
    for (float& x : v) x = dist(gen);
    out.push_back(std::move(v));
  }
  return out;
}

std::size_t param_index(const Model& model, std::string_view name) {
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].name == name) return p;
  }
  ADD_FAILURE() << "no parameter " << name;
  return 0;
}

// Engine::write_parameters' values callback: each parameter's row of `fresh`.
auto values_from(const Model& model, const std::vector<std::vector<float>>& fresh) {
  return [&model, &fresh](std::string_view name, std::span<float> out) {
    std::memcpy(out.data(), fresh[param_index(model, name)].data(), out.size_bytes());
    return Status::ok();
  };
}

enum class Writes { kBatch, kOneByOne, kNone };

// What one rank saw: the masters after two steps, after the writes, and after one more step;
// the gathered values of the written parameters; the names `values` was asked for.
struct RankOutcome {
  std::vector<std::vector<float>> trained, written, stepped;
  std::vector<std::vector<float>> gathered;
  std::vector<std::string> asked;
};

// Two training steps (the moments are not zero), then kBatch's parameters written from the last
// rank in the way `writes` says, then one more step.
std::vector<RankOutcome> train_write_step(const WriteCase& c, Writes writes, const Model& model,
                                          const std::vector<std::vector<float>>& fresh) {
  engine_test::ScratchDir dir(
      fmt::format("write_batch_{}_{}", case_name(c), static_cast<int>(writes)));
  engine_test::Ranks ranks =
      engine_test::make_ranks(c.world, std::chrono::seconds(30), /*jitter_max_us=*/0, c.opaque);
  const int root = c.world - 1;
  std::vector<RankOutcome> out(static_cast<std::size_t>(c.world));
  std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
    RankOutcome& o = out[static_cast<std::size_t>(rank)];
    Env env;
    env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
    env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
    ZINF_ASSIGN_OR_RETURN(
        auto engine,
        Engine::open(engine_test::small_config(c.stage, c.optimizer, c.params, dir.path()), env));
    engine_test::TrainOptions options;
    options.device = env.device;
    options.steps = 2;
    options.check_gathered = false;
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(*engine, model, rank, options, nullptr, nullptr));
    ZINF_ASSIGN_OR_RETURN(o.trained, engine_test::read_masters(*engine, model));
    if (writes == Writes::kBatch) {
      ZINF_RETURN_IF_ERROR(engine->write_parameters(
          kBatch,
          [&](std::string_view name, std::span<float> values) -> Status {
            o.asked.emplace_back(name);
            const std::vector<float>& v = fresh[param_index(model, name)];
            if (values.size() != v.size()) return Status::internal("wrong size asked for");
            std::memcpy(values.data(), v.data(), values.size_bytes());
            return Status::ok();
          },
          root));
    } else if (writes == Writes::kOneByOne) {
      for (std::string_view name : kBatch) {
        ZINF_RETURN_IF_ERROR(engine->write_parameters(
            name, rank == root ? fresh[param_index(model, name)].data() : nullptr, root));
      }
    }
    ZINF_ASSIGN_OR_RETURN(o.written, engine_test::read_masters(*engine, model));
    for (std::string_view name : kBatch) {
      const auto& def = model.params[param_index(model, name)];
      ZINF_ASSIGN_OR_RETURN(std::vector<float> values,
                            gathered_values(*engine, *env.device, def.module, name));
      o.gathered.push_back(std::move(values));
    }
    options.first_step = 3;
    options.steps = 3;
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(*engine, model, rank, options, nullptr, nullptr));
    ZINF_ASSIGN_OR_RETURN(o.stepped, engine_test::read_masters(*engine, model));
    return Status::ok();
  });
  for (std::size_t r = 0; r < st.size(); ++r) {
    EXPECT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
  }
  return out;
}

using engine_test::same_bits;

TEST_P(WriteParameters, BatchWritesAsOneByOneDoes) {
  const WriteCase c = GetParam();
  const Model model = engine_test::make_model(DType::kF32, 78);
  const std::vector<std::vector<float>> fresh = fresh_values(model, 9);
  const std::vector<RankOutcome> batch = train_write_step(c, Writes::kBatch, model, fresh);
  const std::vector<RankOutcome> single = train_write_step(c, Writes::kOneByOne, model, fresh);
  const std::vector<RankOutcome> none = train_write_step(c, Writes::kNone, model, fresh);
  if (HasFailure()) return;
  std::vector<bool> written(model.params.size(), false);
  for (std::string_view name : kBatch) written[param_index(model, name)] = true;
  for (std::size_t r = 0; r < batch.size(); ++r) {
    // The root was asked for each parameter once, the other ranks never.
    std::vector<std::string> asked = batch[r].asked;
    std::sort(asked.begin(), asked.end());
    std::vector<std::string> expected_asked;
    if (static_cast<int>(r) == c.world - 1) expected_asked.assign(kBatch.begin(), kBatch.end());
    std::sort(expected_asked.begin(), expected_asked.end());
    EXPECT_EQ(asked, expected_asked) << "rank " << r;
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const std::string& name = model.params[p].name;
      // The new values where written, the trained master to the bit elsewhere; the same bits
      // as the writes made one by one.
      const std::vector<float>& want = written[p] ? fresh[p] : batch[r].trained[p];
      EXPECT_TRUE(same_bits(batch[r].written[p], want)) << "rank " << r << " " << name;
      EXPECT_TRUE(same_bits(batch[r].written[p], single[r].written[p]))
          << "rank " << r << " " << name;
      // One step on: the same as one by one everywhere (the moments were left alike), and
      // where nothing was written, as the run without writes (those moments were left as they
      // were, and so were the masters).
      EXPECT_TRUE(same_bits(batch[r].stepped[p], single[r].stepped[p]))
          << "rank " << r << " " << name;
      if (!written[p]) {
        EXPECT_TRUE(same_bits(batch[r].stepped[p], none[r].stepped[p]))
            << "rank " << r << " " << name;
      } else {
        EXPECT_FALSE(same_bits(batch[r].stepped[p], none[r].stepped[p]))
            << "rank " << r << " " << name;
      }
    }
    for (std::size_t i = 0; i < kBatch.size(); ++i) {
      EXPECT_EQ(batch[r].gathered[i], fresh[param_index(model, kBatch[i])])
          << "rank " << r << " gathered " << kBatch[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, WriteParameters,
    ::testing::Values(WriteCase{1, 1, OffloadDevice::kNone}, WriteCase{2, 1, OffloadDevice::kHost},
                      WriteCase{2, 2, OffloadDevice::kNvme}, WriteCase{2, 3, OffloadDevice::kNone},
                      WriteCase{2, 3, OffloadDevice::kHost, OffloadDevice::kHost},
                      WriteCase{2, 3, OffloadDevice::kNvme, OffloadDevice::kNvme},
                      WriteCase{2, 3, OffloadDevice::kNone, OffloadDevice::kNone, /*opaque=*/true},
                      WriteCase{4, 2, OffloadDevice::kHost},
                      WriteCase{4, 3, OffloadDevice::kNvme, OffloadDevice::kNvme}),
    [](const ::testing::TestParamInfo<WriteCase>& info) { return case_name(info.param); });

// With a compute stream (Engine::set_compute_stream) on an opaque device, the caller's work
// queued before write_parameters() still reads the old values: at stage 2 every group stays
// gathered, and the call rewrites the gathered copies themselves, so it waits for the work queued
// on the compute stream first, as step() and load_checkpoint() do. Each rank queues a slow read
// of the largest parameter (a host function that sleeps, then the copy), releases the module
// and writes new values at once; the read must see the values from before the call, and a
// gather after it the new ones.
TEST(WriteParametersBatch, WaitsForTheComputeStreamsWorkBeforeItRewritesTheGatheredCopies) {
  const Model model = engine_test::make_model(DType::kF32, 89);
  std::size_t target = 0;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].element_count() > model.params[target].element_count()) target = p;
  }
  const engine_test::ParamDef& def = model.params[target];
  const std::vector<std::vector<float>> fresh = fresh_values(model, 21);
  constexpr int kWorld = 2;
  for (const OffloadDevice optimizer : {OffloadDevice::kNone, OffloadDevice::kHost}) {
    SCOPED_TRACE(offload_device_name(optimizer));
    engine_test::ScratchDir dir(
        fmt::format("write_compute_stream_{}", offload_device_name(optimizer)));
    engine_test::Ranks ranks = engine_test::make_ranks(kWorld, std::chrono::seconds(30),
                                                       /*jitter_max_us=*/0, /*opaque=*/true);
    const Config config = engine_test::small_config(2, optimizer, OffloadDevice::kNone, dir.path());
    std::vector<std::vector<float>> before(kWorld), after(kWorld);
    std::vector<Status> st = engine_test::run_ranks(kWorld, [&](int rank) -> Status {
      const auto r = static_cast<std::size_t>(rank);
      Device& device = *ranks.devices[r];
      // Declared before the engine, so that it outlives it.
      ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Stream> compute, device.create_stream("compute"));
      ZINF_ASSIGN_OR_RETURN(auto engine, engine_test::open_finalized(ranks, rank, config, model));
      ZINF_RETURN_IF_ERROR(engine->set_compute_stream(compute.get()));
      before[r].resize(def.element_count());
      ZINF_RETURN_IF_ERROR(engine->gather(def.module));
      ZINF_ASSIGN_OR_RETURN(TensorView view, engine->parameter(def.name));
      ZINF_RETURN_IF_ERROR(device.launch_host(*compute, [] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        return Status::ok();
      }));
      ZINF_RETURN_IF_ERROR(
          device.copy_d2h(before[r].data(), view.data, before[r].size() * 4, *compute));
      ZINF_RETURN_IF_ERROR(engine->release(def.module));
      Status written = engine->write_parameters(
          def.name, rank == 1 ? fresh[target].data() : nullptr, /*root=*/1);
      ZINF_RETURN_IF_ERROR(device.synchronize(*compute, std::chrono::seconds(30)));
      ZINF_RETURN_IF_ERROR(written);
      ZINF_RETURN_IF_ERROR(engine->set_compute_stream(nullptr));
      ZINF_ASSIGN_OR_RETURN(after[r], gathered_values(*engine, device, def.module, def.name));
      return Status::ok();
    });
    for (std::size_t r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
      EXPECT_EQ(before[r], model.initial[target])
          << "rank " << r << ": the queued read saw values written after it";
      EXPECT_EQ(after[r], fresh[target]) << "rank " << r;
    }
  }
}

// With the optimizer state on NVMe, the batch is one pass: its names span the partition, so it
// reads exactly what a write of every parameter reads (each sub-group once), at least what one
// write of a single parameter reads, and fewer pieces than writing the same parameters one by
// one, which reads each one's sub-groups again. The reads are counted by a fault injector that
// delays every read piece by nothing.
TEST(WriteParametersBatch, ReadsTheStateFromNvmeOnce) {
  for (const WriteCase& c : {WriteCase{2, 2, OffloadDevice::kNvme},
                             WriteCase{2, 3, OffloadDevice::kNvme, OffloadDevice::kNvme}}) {
    SCOPED_TRACE(case_name(c));
    engine_test::ScratchDir dir("write_batch_reads_" + case_name(c));
    const Model model = engine_test::make_model(DType::kF32, 79);
    const std::vector<std::vector<float>> fresh = fresh_values(model, 10);
    engine_test::Ranks ranks =
        engine_test::make_ranks(c.world, std::chrono::seconds(30), /*jitter_max_us=*/0, c.opaque);
    std::vector<std::uint64_t> one(2), batch(2), singles(2), every(2);
    std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
      const auto r = static_cast<std::size_t>(rank);
      auto faults = engine_test::io_counter(/*reads=*/true);
      ZINF_ASSIGN_OR_RETURN(
          auto engine,
          engine_test::open_finalized(
              ranks, rank, engine_test::small_config(c.stage, c.optimizer, c.params, dir.path()),
              model, faults));
      auto reads = [&] { return faults->counts().latency; };
      auto give = values_from(model, fresh);
      std::uint64_t before = reads();
      ZINF_RETURN_IF_ERROR(
          engine->write_parameters(kBatch[0], fresh[param_index(model, kBatch[0])].data(), 0));
      one[r] = reads() - before;
      before = reads();
      ZINF_RETURN_IF_ERROR(engine->write_parameters(kBatch, give, 0));
      batch[r] = reads() - before;
      before = reads();
      for (std::string_view name : kBatch) {
        ZINF_RETURN_IF_ERROR(
            engine->write_parameters(name, fresh[param_index(model, name)].data(), 0));
      }
      singles[r] = reads() - before;
      std::vector<std::string_view> all;
      for (const auto& def : model.params) all.push_back(def.name);
      before = reads();
      ZINF_RETURN_IF_ERROR(engine->write_parameters(all, give, 0));
      every[r] = reads() - before;
      return Status::ok();
    });
    for (std::size_t r = 0; r < 2; ++r) {
      ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
      EXPECT_GT(one[r], 0u) << "rank " << r;
      EXPECT_EQ(batch[r], every[r]) << "rank " << r;
      EXPECT_GE(batch[r], one[r]) << "rank " << r;
      EXPECT_LT(batch[r], singles[r]) << "rank " << r;
    }
  }
}

// What one write of a cost test cost a rank: NVMe pieces read, pieces written, shard bytes
// written to NVMe, bytes all-gathered.
struct Cost {
  std::uint64_t reads = 0, writes = 0, shard_bytes = 0, gathered_bytes = 0;
};

// One write of a cost test: the parameters named (one name goes through the single-parameter
// call) with their rows of `values`, and the label its cost prints under.
struct CostedWrite {
  std::string label;
  std::vector<std::string_view> names;
  const std::vector<std::vector<float>>* values;
};

// Per rank: each write's cost [rank][write], the masters after the writes [rank][parameter] and
// the gathered values of the parameters `shown` [rank][shown].
struct CostedWrites {
  std::vector<std::vector<Cost>> cost;
  std::vector<std::vector<std::vector<float>>> masters;
  std::vector<std::vector<std::vector<float>>> gathered;
};

// Opens the engine of case `c` on fresh ranks twice, once counting the NVMe pieces read and once
// those written (fault injectors that delay every piece by nothing), makes `writes` in order on
// each rank and records their costs (the engine's counters give the shard and all-gathered
// bytes); the first run then reads the masters and gathers each parameter of `shown`.
void measure_writes(const WriteCase& c, const Model& model, std::size_t sub_group_size,
                    const std::string& dir_name, const std::vector<CostedWrite>& writes,
                    const std::vector<std::string_view>& shown, CostedWrites& out) {
  const auto world = static_cast<std::size_t>(c.world);
  out.cost.assign(world, std::vector<Cost>(writes.size()));
  out.masters.assign(world, {});
  out.gathered.assign(world, {});
  for (const bool reads : {true, false}) {
    engine_test::ScratchDir dir(fmt::format("{}_{}", dir_name, reads));
    engine_test::Ranks ranks = engine_test::make_ranks(c.world, std::chrono::seconds(30));
    Config config = engine_test::small_config(c.stage, c.optimizer, c.params, dir.path());
    config.zero.sub_group_size = sub_group_size;
    std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
      const auto r = static_cast<std::size_t>(rank);
      auto faults = engine_test::io_counter(reads);
      ZINF_ASSIGN_OR_RETURN(auto engine,
                            engine_test::open_finalized(ranks, rank, config, model, faults));
      for (std::size_t k = 0; k < writes.size(); ++k) {
        const CostedWrite& write = writes[k];
        const std::uint64_t pieces = faults->counts().latency;
        const EngineCounters before = engine->counters();
        if (write.names.size() == 1) {
          const std::string_view name = write.names[0];
          ZINF_RETURN_IF_ERROR(
              engine->write_parameters(name, (*write.values)[param_index(model, name)].data(), 0));
        } else {
          ZINF_RETURN_IF_ERROR(
              engine->write_parameters(write.names, values_from(model, *write.values), 0));
        }
        const EngineCounters& after = engine->counters();
        Cost& at = out.cost[r][k];
        (reads ? at.reads : at.writes) = faults->counts().latency - pieces;
        at.shard_bytes = after.param_nvme_write_bytes - before.param_nvme_write_bytes;
        at.gathered_bytes = after.all_gather_bytes - before.all_gather_bytes;
      }
      if (reads) {
        ZINF_ASSIGN_OR_RETURN(out.masters[r], engine_test::read_masters(*engine, model));
        for (std::string_view name : shown) {
          const auto& def = model.params[param_index(model, name)];
          ZINF_RETURN_IF_ERROR(engine->gather(def.module));
          ZINF_ASSIGN_OR_RETURN(TensorView view, engine->parameter(def.name));
          out.gathered[r].push_back(engine_test::widen_view(view));
          ZINF_RETURN_IF_ERROR(engine->release(def.module));
        }
      }
      return Status::ok();
    });
    for (std::size_t r = 0; r < st.size(); ++r) {
      ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
    }
  }
  for (std::size_t r = 0; r < world; ++r) {
    std::string line = fmt::format("rank {}:", r);
    for (std::size_t k = 0; k < writes.size(); ++k) {
      const Cost& at = out.cost[r][k];
      line += fmt::format("{} {}: {} pieces read, {} written, {} shard bytes, {} gathered",
                          k == 0 ? "" : ";", writes[k].label, at.reads, at.writes, at.shard_bytes,
                          at.gathered_bytes);
    }
    std::printf("%s\n", line.c_str());
  }
}

// A write of one small parameter updates only its group's slice of the master: on NVMe it reads
// and writes back only the sub-groups that hold that slice, writes only that group's shard and
// all-gathers only that group again, where a write of every parameter goes over the whole
// partition; and the values after it are those written. Stage 2 (every group stays gathered, the
// shards on the device) and stage 3 with the shards on NVMe, in f32 (narrowed from the master)
// and bf16 (streamed into the shards during the pass), with sub-groups of 128 elements: about
// eleven per rank. Counted by fault injectors that delay every read or written piece by nothing,
// and by the engine's counters.
TEST(WriteParametersBatch, OneParameterCostsItsGroupNotThePartition) {
  using D = OffloadDevice;
  for (const auto& [c, dtype] : {std::pair{WriteCase{2, 2, D::kNvme}, DType::kF32},
                                 std::pair{WriteCase{2, 3, D::kNvme, D::kNvme}, DType::kF32},
                                 std::pair{WriteCase{2, 2, D::kNvme}, DType::kBF16},
                                 std::pair{WriteCase{2, 3, D::kNvme, D::kNvme}, DType::kBF16}}) {
    SCOPED_TRACE(fmt::format("{} {}", case_name(c), dtype_name(dtype)));
    const Model model = engine_test::make_model(dtype, 87);
    const std::vector<std::vector<float>> fresh = fresh_values(model, 17);
    const std::vector<std::vector<float>> fresher = fresh_values(model, 18);
    // Stage 3 keeps block1.scale gathered, in a group of its own: block1.b, whose shard is
    // on NVMe.
    const std::string_view target = c.stage == 2 ? "block1.scale" : "block1.b";
    std::vector<std::string_view> all;
    for (const auto& def : model.params) all.push_back(def.name);
    CostedWrites measured;
    ASSERT_NO_FATAL_FAILURE(measure_writes(
        c, model, 128, fmt::format("write_one_cost_{}_{}", case_name(c), dtype_name(dtype)),
        {CostedWrite{"every parameter", all, &fresh}, CostedWrite{"one", {target}, &fresher}},
        {target}, measured));
    for (std::size_t r = 0; r < 2; ++r) {
      const Cost& whole = measured.cost[r][0];
      const Cost& one = measured.cost[r][1];
      // block1's slice is about 165 elements of the rank's 1350: at most three sub-groups of
      // 128, where the whole partition is at least ten.
      EXPECT_GE(whole.reads, 10u) << "rank " << r;
      EXPECT_GT(one.reads, 0u) << "rank " << r;
      EXPECT_LE(one.reads, 3u) << "rank " << r;
      EXPECT_LE(one.writes, 3u + (c.params == D::kNvme ? 1u : 0u)) << "rank " << r;
      if (c.params == D::kNvme) {
        EXPECT_GT(one.shard_bytes, 0u) << "rank " << r;
        EXPECT_LE(one.shard_bytes * 4, whole.shard_bytes) << "rank " << r;
      }
      EXPECT_LE(one.gathered_bytes * 4, whole.gathered_bytes) << "rank " << r;
      if (c.stage == 2) {
        EXPECT_GT(one.gathered_bytes, 0u) << "rank " << r;
      }
      for (std::size_t p = 0; p < model.params.size(); ++p) {
        const std::vector<float>& want = model.params[p].name == target ? fresher[p] : fresh[p];
        EXPECT_TRUE(same_bits(measured.masters[r][p], want))
            << "rank " << r << " parameter " << model.params[p].name;
      }
      const std::vector<float>& want = fresher[param_index(model, target)];
      // bf16 widens to f32 by its bits in the upper half.
      std::vector<float> rounded = want;
      if (dtype == DType::kBF16) {
        const std::vector<std::uint16_t> half = engine_test::narrow_to_half(want, dtype);
        for (std::size_t i = 0; i < half.size(); ++i) {
          const std::uint32_t bits = std::uint32_t{half[i]} << 16;
          std::memcpy(&rounded[i], &bits, 4);
        }
      }
      EXPECT_TRUE(same_bits(measured.gathered[r][0], rounded)) << "rank " << r;
    }
  }
}

// A batch of two parameters far apart (the embedding, in the first group, and the head's weight,
// near the last) costs what the two written alone cost, not the groups between them: the NVMe
// pieces read and written, the shard bytes written to NVMe and the bytes all-gathered are the
// sums of the two singles', and fewer than a write of every parameter makes; the masters after
// it are the batch's values for its two and the earlier write's for the rest, and the gathered
// values are those written. Stage 2 and stage 3 with the shards on NVMe, sub-groups of 128
// elements (about eleven per rank), so the two parameters' sub-groups are apart.
TEST(WriteParametersBatch, TwoParametersFarApartCostTheirGroupsAlone) {
  using D = OffloadDevice;
  for (const WriteCase& c : {WriteCase{2, 2, D::kNvme}, WriteCase{2, 3, D::kNvme, D::kNvme}}) {
    SCOPED_TRACE(case_name(c));
    const Model model = engine_test::make_model(DType::kF32, 89);
    const std::vector<std::vector<float>> fresh = fresh_values(model, 21);
    const std::vector<std::vector<float>> fresher = fresh_values(model, 22);
    const std::vector<std::string_view> pair = {"head.w", "embed.w"};  // out of layout order
    std::vector<std::string_view> all;
    for (const auto& def : model.params) all.push_back(def.name);
    CostedWrites measured;
    ASSERT_NO_FATAL_FAILURE(measure_writes(
        c, model, 128, fmt::format("write_far_cost_{}", case_name(c)),
        {CostedWrite{"every parameter", all, &fresh}, CostedWrite{"head.w", {pair[0]}, &fresh},
         CostedWrite{"embed.w", {pair[1]}, &fresh}, CostedWrite{"the two", pair, &fresher}},
        pair, measured));
    for (std::size_t r = 0; r < 2; ++r) {
      const Cost& whole = measured.cost[r][0];
      const Cost& head = measured.cost[r][1];
      const Cost& embed = measured.cost[r][2];
      const Cost& batch = measured.cost[r][3];
      EXPECT_GT(head.reads, 0u) << "rank " << r;
      EXPECT_GT(embed.reads, 0u) << "rank " << r;
      EXPECT_EQ(batch.reads, head.reads + embed.reads) << "rank " << r;
      EXPECT_EQ(batch.writes, head.writes + embed.writes) << "rank " << r;
      EXPECT_EQ(batch.shard_bytes, head.shard_bytes + embed.shard_bytes) << "rank " << r;
      EXPECT_EQ(batch.gathered_bytes, head.gathered_bytes + embed.gathered_bytes) << "rank " << r;
      EXPECT_LT(batch.reads * 2, whole.reads) << "rank " << r;
      EXPECT_LT(batch.writes * 2, whole.writes) << "rank " << r;
      if (c.params == D::kNvme) {
        EXPECT_GT(batch.shard_bytes, 0u) << "rank " << r;
        EXPECT_LT(batch.shard_bytes, whole.shard_bytes) << "rank " << r;
      }
      if (c.stage == 2) {
        EXPECT_GT(batch.gathered_bytes, 0u) << "rank " << r;
      }
      EXPECT_LT(batch.gathered_bytes, whole.gathered_bytes) << "rank " << r;
      for (std::size_t p = 0; p < model.params.size(); ++p) {
        const bool named = std::find(pair.begin(), pair.end(), model.params[p].name) != pair.end();
        EXPECT_TRUE(same_bits(measured.masters[r][p], named ? fresher[p] : fresh[p]))
            << "rank " << r << " parameter " << model.params[p].name;
      }
      for (std::size_t i = 0; i < pair.size(); ++i) {
        EXPECT_TRUE(same_bits(measured.gathered[r][i], fresher[param_index(model, pair[i])]))
            << "rank " << r << " gathered " << pair[i];
      }
    }
  }
}

// Two parameters far apart whose groups' slices lie in one sub-group (one per rank here, as with
// the default sub_group_size) are one ranged update across the groups between them: the
// sub-group is read and written once, as for either parameter alone, not once for each, and only
// the two named groups are rounded, written to their shards and all-gathered: the batch's shard
// bytes and all-gathered bytes are those of the two written alone, not the partition's. The
// masters are those written; the gathered values are the written ones (rounded, with bf16
// parameters), and a parameter between the two (block1.w) gathered afterwards shows its initial
// values. With bf16 parameters the shards are streamed from the pass (publisher.hpp): stage 2
// (shards in device memory, every group gathered: the shard writes do not show there, so it checks
// the reads, the all-gathers and the values only) and stage 3 with the shards on NVMe, where the
// gap module's gather reads its shard back from the drive. With f32 parameters (stage 2, and
// stage 3 with the shards on NVMe, where the shard bytes show the unnamed groups left out) and
// with bf16 ones at stage 3 with the shards in host memory (from the store's half array), the
// shards are published after the pass, the named groups alone.
TEST(WriteParametersBatch, TwoParametersInOneSubGroupRewriteItOnce) {
  using D = OffloadDevice;
  struct Run {
    DType dtype;
    WriteCase c;
  };
  for (const Run& run : {Run{DType::kBF16, WriteCase{2, 2, D::kNvme}},
                         Run{DType::kBF16, WriteCase{2, 3, D::kNvme, D::kNvme}},
                         Run{DType::kF32, WriteCase{2, 2, D::kNvme}},
                         Run{DType::kF32, WriteCase{2, 3, D::kNvme, D::kNvme}},
                         Run{DType::kBF16, WriteCase{2, 3, D::kNvme, D::kHost}}}) {
    const DType dtype = run.dtype;
    const WriteCase& c = run.c;
    SCOPED_TRACE(fmt::format("{}_{}", dtype_name(dtype), case_name(c)));
    const Model model = engine_test::make_model(dtype, 90);
    const std::vector<std::vector<float>> fresh = fresh_values(model, 23);
    const std::vector<std::vector<float>> fresher = fresh_values(model, 24);
    const std::vector<std::string_view> pair = {"embed.w", "head.w"};
    const std::vector<std::string_view> shown = {"embed.w", "head.w", "block1.w"};
    CostedWrites measured;
    ASSERT_NO_FATAL_FAILURE(measure_writes(
        c, model, 1 << 20,
        fmt::format("write_one_sub_group_{}_{}", dtype_name(dtype), case_name(c)),
        {CostedWrite{"embed.w", {pair[0]}, &fresh}, CostedWrite{"head.w", {pair[1]}, &fresh},
         CostedWrite{"the two", pair, &fresher}},
        shown, measured));
    for (std::size_t r = 0; r < 2; ++r) {
      const Cost& embed = measured.cost[r][0];
      const Cost& head = measured.cost[r][1];
      const Cost& batch = measured.cost[r][2];
      // The one sub-group is read once whatever is written.
      EXPECT_GT(embed.reads, 0u) << "rank " << r;
      EXPECT_EQ(head.reads, embed.reads) << "rank " << r;
      EXPECT_EQ(batch.reads, embed.reads) << "rank " << r;
      // Its one write (a piece), and each named group's shard on NVMe once.
      EXPECT_EQ(batch.writes + 1, embed.writes + head.writes) << "rank " << r;
      EXPECT_EQ(batch.shard_bytes, embed.shard_bytes + head.shard_bytes) << "rank " << r;
      if (c.params == D::kNvme) {
        EXPECT_GT(embed.shard_bytes, 0u) << "rank " << r;
        EXPECT_GT(head.shard_bytes, 0u) << "rank " << r;
      } else {
        EXPECT_EQ(embed.writes, 1u) << "rank " << r;
      }
      if (c.stage == 2) {
        EXPECT_GT(embed.gathered_bytes, 0u) << "rank " << r;
      }
      EXPECT_EQ(batch.gathered_bytes, embed.gathered_bytes + head.gathered_bytes) << "rank " << r;
      for (std::size_t p = 0; p < model.params.size(); ++p) {
        const bool named = std::find(pair.begin(), pair.end(), model.params[p].name) != pair.end();
        EXPECT_TRUE(same_bits(measured.masters[r][p], named ? fresher[p] : model.initial[p]))
            << "rank " << r << " parameter " << model.params[p].name;
      }
      for (std::size_t i = 0; i < shown.size(); ++i) {
        const std::size_t p = param_index(model, shown[i]);
        const std::vector<float>& want = i < pair.size() ? fresher[p] : model.initial[p];
        if (dtype == DType::kBF16) {
          // A gathered bf16 value widens exactly, so narrowing it again gives its bits.
          EXPECT_EQ(engine_test::narrow_to_half(measured.gathered[r][i], dtype),
                    engine_test::narrow_to_half(want, dtype))
              << "rank " << r << " gathered " << shown[i];
        } else {
          EXPECT_TRUE(same_bits(measured.gathered[r][i], want))
              << "rank " << r << " gathered " << shown[i];
        }
      }
    }
  }
}

// Wherever the state lives (device memory of an opaque device, host memory, the store's host
// arrays), a write of one parameter at stage 2 (every group gathered) all-gathers its group
// alone again, where a write of every parameter all-gathers them all; the masters and the
// gathered values after it are those written.
TEST(WriteParametersBatch, OneParameterGathersItsGroupAlone) {
  using D = OffloadDevice;
  for (const WriteCase& c : {WriteCase{2, 2, D::kNone, D::kNone, /*opaque=*/true},
                             WriteCase{2, 2, D::kNone}, WriteCase{2, 2, D::kHost}}) {
    SCOPED_TRACE(case_name(c));
    const Model model = engine_test::make_model(DType::kF32, 88);
    const std::vector<std::vector<float>> fresh = fresh_values(model, 19);
    const std::vector<std::vector<float>> fresher = fresh_values(model, 20);
    const std::string_view target = "block1.b";
    const std::size_t t = param_index(model, target);
    std::vector<std::string_view> all;
    for (const auto& def : model.params) all.push_back(def.name);
    engine_test::ScratchDir dir("write_one_gathers_" + case_name(c));
    engine_test::Ranks ranks =
        engine_test::make_ranks(c.world, std::chrono::seconds(30), /*jitter_max_us=*/0, c.opaque);
    std::vector<std::uint64_t> whole(2), one(2);
    std::vector<std::vector<std::vector<float>>> masters(2);
    std::vector<std::vector<float>> gathered(2);
    std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
      const auto r = static_cast<std::size_t>(rank);
      ZINF_ASSIGN_OR_RETURN(
          auto engine,
          engine_test::open_finalized(
              ranks, rank, engine_test::small_config(c.stage, c.optimizer, c.params, dir.path()),
              model));
      std::uint64_t before = engine->counters().all_gather_bytes;
      ZINF_RETURN_IF_ERROR(engine->write_parameters(all, values_from(model, fresh), 0));
      whole[r] = engine->counters().all_gather_bytes - before;
      before = engine->counters().all_gather_bytes;
      ZINF_RETURN_IF_ERROR(engine->write_parameters(target, fresher[t].data(), 0));
      one[r] = engine->counters().all_gather_bytes - before;
      ZINF_ASSIGN_OR_RETURN(masters[r], engine_test::read_masters(*engine, model));
      ZINF_ASSIGN_OR_RETURN(
          gathered[r], gathered_values(*engine, *ranks.devices[r], model.params[t].module, target));
      return Status::ok();
    });
    for (std::size_t r = 0; r < 2; ++r) {
      ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
      EXPECT_GT(one[r], 0u) << "rank " << r;
      EXPECT_LE(one[r] * 4, whole[r]) << "rank " << r;
      for (std::size_t p = 0; p < model.params.size(); ++p) {
        EXPECT_TRUE(same_bits(masters[r][p], p == t ? fresher[p] : fresh[p]))
            << "rank " << r << " parameter " << model.params[p].name;
      }
      EXPECT_TRUE(same_bits(gathered[r], fresher[t])) << "rank " << r;
    }
  }
}

// The pass reads the master once: each sub-group is read back, patched and written, and the
// parameters are published from the values as they are written, not from the master read back
// again. With the shards not on NVMe (the only NVMe I/O a write makes is the master's), a batch
// write reads as many pieces as it writes: f32 parameters at stage 2 and 3 (published from the
// values), bf16 at stage 2 (streamed into the device shards during the pass). Counted by fault
// injectors that delay every read piece, or every written piece, by nothing.
TEST(WriteParametersBatch, ReadsTheMasterOnceToWriteIt) {
  for (const auto& [c, dtype] : {std::pair{WriteCase{2, 2, OffloadDevice::kNvme}, DType::kF32},
                                 std::pair{WriteCase{2, 3, OffloadDevice::kNvme}, DType::kF32},
                                 std::pair{WriteCase{2, 2, OffloadDevice::kNvme}, DType::kBF16}}) {
    SCOPED_TRACE(fmt::format("{} {}", case_name(c), dtype_name(dtype)));
    const Model model = engine_test::make_model(dtype, 85);
    const std::vector<std::vector<float>> fresh = fresh_values(model, 15);
    std::vector<std::uint64_t> counted[2] = {std::vector<std::uint64_t>(2),
                                             std::vector<std::uint64_t>(2)};
    for (const bool reads : {true, false}) {
      engine_test::ScratchDir dir(
          fmt::format("write_batch_once_{}_{}_{}", case_name(c), dtype_name(dtype), reads));
      engine_test::Ranks ranks = engine_test::make_ranks(c.world, std::chrono::seconds(30));
      std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
        const auto r = static_cast<std::size_t>(rank);
        auto faults = engine_test::io_counter(reads);
        ZINF_ASSIGN_OR_RETURN(
            auto engine,
            engine_test::open_finalized(
                ranks, rank, engine_test::small_config(c.stage, c.optimizer, c.params, dir.path()),
                model, faults));
        const std::uint64_t before = faults->counts().latency;
        ZINF_RETURN_IF_ERROR(engine->write_parameters(kBatch, values_from(model, fresh), 0));
        counted[reads ? 0 : 1][r] = faults->counts().latency - before;
        return Status::ok();
      });
      for (std::size_t r = 0; r < st.size(); ++r) {
        ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
      }
    }
    for (std::size_t r = 0; r < 2; ++r) {
      EXPECT_GT(counted[1][r], 0u) << "rank " << r;
      EXPECT_EQ(counted[0][r], counted[1][r]) << "rank " << r << ": pieces read, pieces written";
    }
  }
}

// With half parameters the shards are published in each of the state's ways (streamed from the
// pass into shards on NVMe or on the device, or from the store's half array with the shards in
// host memory or the state in host memory): the gathered values after a batch write are the
// masters rounded to bf16, bit for bit.
TEST(WriteParametersBatch, PublishesTheMastersRounded) {
  using D = OffloadDevice;
  for (const WriteCase& c : {WriteCase{2, 3, D::kNvme, D::kNvme}, WriteCase{2, 2, D::kNvme},
                             WriteCase{2, 3, D::kNvme, D::kHost}, WriteCase{2, 2, D::kHost}}) {
    SCOPED_TRACE(case_name(c));
    engine_test::ScratchDir dir("write_batch_half_" + case_name(c));
    const Model model = engine_test::make_model(DType::kBF16, 86);
    const std::vector<std::vector<float>> fresh = fresh_values(model, 16);
    engine_test::Ranks ranks = engine_test::make_ranks(c.world, std::chrono::seconds(30));
    std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
      ZINF_ASSIGN_OR_RETURN(
          auto engine,
          engine_test::open_finalized(
              ranks, rank, engine_test::small_config(c.stage, c.optimizer, c.params, dir.path()),
              model));
      ZINF_RETURN_IF_ERROR(engine->write_parameters(kBatch, values_from(model, fresh), 1));
      for (const auto& def : model.params) {
        std::vector<float> master(def.element_count());
        ZINF_RETURN_IF_ERROR(engine->read_parameters(def.name, master.data()));
        ZINF_ASSIGN_OR_RETURN(ScopedGather g, engine->scoped_gather(def.module));
        ZINF_ASSIGN_OR_RETURN(std::span<const std::uint16_t> view,
                              g.param<std::uint16_t>(def.name));
        const std::vector<std::uint16_t> want = engine_test::narrow_to_half(master, DType::kBF16);
        if (!std::equal(view.begin(), view.end(), want.begin(), want.end())) {
          return Status::internal(
              fmt::format("{}: gathered values are not the master rounded", def.name));
        }
      }
      // The written parameters' masters are the values given.
      for (std::string_view name : kBatch) {
        std::vector<float> master(model.params[param_index(model, name)].element_count());
        ZINF_RETURN_IF_ERROR(engine->read_parameters(name, master.data()));
        if (std::memcmp(master.data(), fresh[param_index(model, name)].data(),
                        master.size() * sizeof(float)) != 0) {
          return Status::internal(fmt::format("{}: the master is not the values written", name));
        }
      }
      return Status::ok();
    });
    for (std::size_t r = 0; r < st.size(); ++r) {
      EXPECT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
    }
  }
}

// `x` rounded to nearest, ties to even, in `dtype` (kBF16: 8 significant bits, normal down to
// 2^-126; kF16: 11 significant bits, normal down to 2^-14, subnormal below), worked out from
// the definition rather than by the library's conversions: x's unit in the last place is
// ulp = 2^(max(e, e_min) - (bits - 1)) for e = floor(log2 |x|), x / ulp is exact in double, and
// nearbyint() rounds half to even in the default rounding mode. A value that rounds up into the
// next binade is still exact there. No overflow: |x| <= 2 here.
float reference_round(float x, DType dtype) {
  const int bits = dtype == DType::kBF16 ? 8 : 11;
  const int e_min = dtype == DType::kBF16 ? -126 : -14;
  if (x == 0.0f) return x;
  const double ulp = std::ldexp(1.0, std::max(std::ilogb(x), e_min) - (bits - 1));
  return static_cast<float>(std::nearbyint(static_cast<double>(x) / ulp) * ulp);
}

// A half value's bits widened to f32, decoded from the format rather than by the library: bf16 is
// the upper half of an f32; f16 is a sign, 5 exponent bits (bias 15) and 10 fraction bits,
// (1024 + fraction) * 2^(exponent - 25), or fraction * 2^-24 when the exponent is 0.
float reference_widen(std::uint16_t half, DType dtype) {
  if (dtype == DType::kBF16) {
    const std::uint32_t bits = std::uint32_t{half} << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
  const int exponent = (half >> 10) & 0x1f;
  const int fraction = half & 0x3ff;
  // Infinity or NaN: no value here (written or initial) rounds to one, so any is decoded as a
  // quiet NaN, whose bits no expected value has.
  if (exponent == 0x1f) return std::numeric_limits<float>::quiet_NaN();
  const double magnitude =
      exponent == 0 ? std::ldexp(fraction, -24) : std::ldexp(1024 + fraction, exponent - 25);
  return static_cast<float>((half & 0x8000) != 0 ? -magnitude : magnitude);
}

// Parameter `def` as the forward would see it after gathering its module: its device copy's
// half bits, copied out through the device (an opaque device's memory is not the host's), each
// widened by reference_widen().
Result<std::vector<float>> gathered_half(Engine& engine, Device& device,
                                         const engine_test::ParamDef& def) {
  ZINF_ASSIGN_OR_RETURN(ScopedGather g, engine.scoped_gather(def.module));
  ZINF_ASSIGN_OR_RETURN(std::span<const std::uint16_t> view, g.param<std::uint16_t>(def.name));
  // param<std::uint16_t>() takes bf16 and f16 alike; reference_widen() needs the right one.
  ZINF_ASSIGN_OR_RETURN(TensorView tensor, engine.parameter(def.name));
  if (tensor.dtype != def.dtype || view.size() != def.element_count()) {
    return Status::internal(fmt::format("{}: the device copy is not {} {} elements", def.name,
                                        def.element_count(), dtype_name(def.dtype)));
  }
  std::vector<std::uint16_t> half(view.size());
  ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.create_stream("read shards"));
  ZINF_RETURN_IF_ERROR(device.copy_d2h(half.data(), view.data(), view.size_bytes(), *stream));
  ZINF_RETURN_IF_ERROR(device.synchronize(*stream, std::chrono::seconds(30)));
  ZINF_RETURN_IF_ERROR(g.release());
  std::vector<float> out(half.size());
  for (std::size_t i = 0; i < half.size(); ++i) out[i] = reference_widen(half[i], def.dtype);
  return out;
}

// The optimizer state in memory (offload_optimizer "none"): on a host-accessible device
// (HostState) and on an opaque one (DeviceState). There the shards of a write's named groups are
// written from the state's own buffer in device memory, not NVMe, so the cost tests' shard bytes
// (measure_writes()) cannot see a named group whose shard is left unwritten; the values the
// forward gathers can. Half parameters (bf16, f16), stage 2 (every group stays gathered, the
// written groups all-gathered again) and stage 3 (each module gathered from its shards, small
// parameters persistent), one and two ranks. A single write of one parameter (block1's group
// alone), then a batch that names the embedding, block0's bias, block2's weight and the head's
// bias, out of order (a run of groups with block1's, unnamed, between them): every parameter's
// gathered values must be what was written last, or the initial values where nothing was,
// rounded to the parameter's dtype by reference_round(), bit for bit. Every written parameter
// holds, besides its seeded values, the ties and f16 subnormals of plant_rounding_cases().
struct ShardCase {
  bool opaque;  // DeviceState; else HostState
  DType dtype;
  int stage;
  int world;
};

void PrintTo(const ShardCase& c, std::ostream* os) {
  *os << (c.opaque ? "DeviceState " : "HostState ") << dtype_name(c.dtype) << " stage " << c.stage
      << " world " << c.world;
}

class WriteParametersShards : public ::testing::TestWithParam<ShardCase> {};

// Values whose rounding the seeded ones rarely test (an exact tie among uniform random floats is
// rare), spread over `values` (the first values.size() of them where it is shorter): a library
// that rounded half away from zero, or flushed f16 subnormals, would differ on some.
void plant_rounding_cases(std::vector<float>& values) {
  static const std::array<float, 11> kCases = {
      1.0f + 0x1p-8f,       // bf16 tie between 1 and 1 + 2^-7: down to the even 1
      1.0f + 3 * 0x1p-8f,   // bf16 tie between 1 + 2^-7 and 1 + 2^-6: up to the even 1 + 2^-6
      -(1.0f + 0x1p-8f),    // the first, negative: -1
      1.0f + 0x1p-11f,      // f16 tie between 1 and 1 + 2^-10: down to 1
      1.0f + 3 * 0x1p-11f,  // f16 tie: up to 1 + 2^-9
      0x1p-20f,             // an f16 subnormal (16 * 2^-24), exact
      0x1p-20f + 0x1p-25f,  // an f16 subnormal tie: down to the even 2^-20
      -0x1p-26f,            // below half f16's smallest subnormal: -0
      -0x1p-25f,            // half f16's smallest subnormal, a tie: to the even -0
      1.99999f,             // rounds up into the next binade: 2
      -1.99999f,            // and down: -2
  };
  const std::size_t count = std::min(values.size(), kCases.size());
  for (std::size_t k = 0; k < count; ++k) values[k * values.size() / count] = kCases[k];
}

TEST_P(WriteParametersShards, TheNamedGroupsShardsHoldTheWrittenValuesRounded) {
  const ShardCase c = GetParam();
  const Model model = engine_test::make_model(c.dtype, 91);
  std::vector<std::vector<float>> first = fresh_values(model, 25);
  std::vector<std::vector<float>> second = fresh_values(model, 26);
  const std::string_view single = "block1.w";
  const std::vector<std::string_view> batch = {"head.b", "block2.w", "embed.w", "block0.b"};
  plant_rounding_cases(first[param_index(model, single)]);
  for (std::string_view name : batch) plant_rounding_cases(second[param_index(model, name)]);
  // What each parameter holds at the end: its initial values, or what was written last.
  std::vector<std::vector<float>> expect = model.initial;
  expect[param_index(model, single)] = first[param_index(model, single)];
  for (std::string_view name : batch)
    expect[param_index(model, name)] = second[param_index(model, name)];
  for (std::vector<float>& values : expect) {
    for (float& v : values) v = reference_round(v, c.dtype);
  }

  engine_test::ScratchDir dir(
      fmt::format("write_shards_{}_{}_s{}_w{}", c.opaque, dtype_name(c.dtype), c.stage, c.world));
  engine_test::Ranks ranks =
      engine_test::make_ranks(c.world, std::chrono::seconds(30), /*jitter_max_us=*/0, c.opaque);
  const auto world = static_cast<std::size_t>(c.world);
  std::vector<std::vector<std::vector<float>>> gathered(world);
  std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    const Config config =
        engine_test::small_config(c.stage, OffloadDevice::kNone, OffloadDevice::kNone, dir.path());
    ZINF_ASSIGN_OR_RETURN(auto engine, engine_test::open_finalized(ranks, rank, config, model));
    ZINF_RETURN_IF_ERROR(
        engine->write_parameters(single, first[param_index(model, single)].data(), 0));
    ZINF_RETURN_IF_ERROR(engine->write_parameters(batch, values_from(model, second), 0));
    for (const auto& def : model.params) {
      ZINF_ASSIGN_OR_RETURN(std::vector<float> values,
                            gathered_half(*engine, *ranks.devices[r], def));
      gathered[r].push_back(std::move(values));
    }
    return Status::ok();
  });
  for (std::size_t r = 0; r < world; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      EXPECT_TRUE(same_bits(gathered[r][p], expect[p]))
          << "rank " << r << " parameter " << model.params[p].name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    InMemoryHomes, WriteParametersShards,
    ::testing::Values(ShardCase{false, DType::kBF16, 2, 1}, ShardCase{false, DType::kF16, 3, 1},
                      ShardCase{false, DType::kBF16, 2, 2}, ShardCase{false, DType::kF16, 2, 2},
                      ShardCase{false, DType::kBF16, 3, 2}, ShardCase{false, DType::kF16, 3, 2},
                      ShardCase{true, DType::kF16, 2, 1}, ShardCase{true, DType::kBF16, 3, 1},
                      ShardCase{true, DType::kBF16, 2, 2}, ShardCase{true, DType::kF16, 2, 2},
                      ShardCase{true, DType::kBF16, 3, 2}, ShardCase{true, DType::kF16, 3, 2}),
    [](const ::testing::TestParamInfo<ShardCase>& info) {
      return fmt::format("{}_{}_stage{}_world{}", info.param.opaque ? "device_state" : "host_state",
                         dtype_name(info.param.dtype), info.param.stage, info.param.world);
    });

// The batch's errors: those each rank finds alone come before any collective and leave the engine
// usable; those found together fail every rank at once; a failure of `values` during the pass
// fails every rank, and stays.
TEST(WriteParametersBatch, RefusesBadCallsAndFailsTogether) {
  engine_test::ScratchDir dir("write_batch_errors");
  const Model model = engine_test::make_model(DType::kF32, 80);
  const std::vector<std::vector<float>> fresh = fresh_values(model, 11);
  constexpr int kWorld = 2;
  const int root = 1;
  engine_test::Ranks ranks = engine_test::make_ranks(kWorld);
  std::vector<std::vector<std::string>> seen(kWorld);  // each check's outcome, in order
  std::vector<Status> st = engine_test::run_ranks(kWorld, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    auto note = [&](const Status& s) { seen[r].push_back(s.to_string()); };
    ZINF_ASSIGN_OR_RETURN(
        auto engine,
        engine_test::open_finalized(
            ranks, rank,
            engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path()),
            model));
    auto give = values_from(model, fresh);
    const std::vector<std::string_view> unknown = {"head.b", "no.such.parameter"};
    note(engine->write_parameters(unknown, give, root));
    const std::vector<std::string_view> twice = {"head.b", "block0.w", "head.b"};
    note(engine->write_parameters(twice, give, root));
    note(engine->write_parameters(kBatch, give, kWorld));
    ZINF_RETURN_IF_ERROR(engine->gather("block0"));
    note(engine->write_parameters(kBatch, give, root));
    ZINF_RETURN_IF_ERROR(engine->release("block0"));
    note(engine->write_parameters(kBatch, rank == root ? ParameterValues() : give, root));
    // The ranks name different parameters.
    const std::vector<std::string_view> other = {rank == 0 ? "head.b" : "embed.w"};
    note(engine->write_parameters(other, give, root));
    // A call refused on one rank only (rank 0 names a parameter there is none of): the other
    // rank is told at once instead of waiting in the first broadcast.
    const std::vector<std::string_view> one_unknown = {rank == 0 ? "no.such" : "head.b"};
    note(engine->write_parameters(one_unknown, give, root));
    note(engine->write_parameters(std::span<const std::string_view>(), give, root));
    // None of those changed anything, and the engine takes a good batch.
    ZINF_ASSIGN_OR_RETURN(auto masters, engine_test::read_masters(*engine, model));
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      if (!same_bits(masters[p], model.initial[p])) {
        return Status::internal("changed by a refused call: " + model.params[p].name);
      }
    }
    ZINF_RETURN_IF_ERROR(engine->write_parameters(kBatch, give, root));
    // `values` fails on the root at its third parameter (in layout order): every rank fails,
    // and the error stays.
    int calls = 0;
    note(engine->write_parameters(
        kBatch,
        [&](std::string_view name, std::span<float> out) -> Status {
          if (++calls == 3) return Status::io_error("staging file unreadable");
          return give(name, out);
        },
        root));
    std::vector<float> out(model.params[0].element_count());
    note(engine->read_parameters(model.params[0].name, out.data()));
    return Status::ok();
  });
  for (int r = 0; r < kWorld; ++r) {
    const auto& s = seen[static_cast<std::size_t>(r)];
    ASSERT_TRUE(st[static_cast<std::size_t>(r)].is_ok())
        << "rank " << r << ": " << st[static_cast<std::size_t>(r)].to_string();
    ASSERT_EQ(s.size(), 10u);
    EXPECT_EQ(s[0], "not_found: write_parameters('no.such.parameter'): unknown parameter");
    EXPECT_EQ(s[1],
              "invalid_argument: write_parameters('head.b'): the parameter is named twice (at 0 "
              "and 2)");
    EXPECT_EQ(s[2],
              "invalid_argument: write_parameters('head.b' and 4 more): root 2 is not a rank of 2");
    EXPECT_THAT(
        s[3], ::testing::StartsWith("failed_precondition: write_parameters('head.b' and 4 more)"));
    if (r == root) {
      EXPECT_EQ(s[4],
                "invalid_argument: write_parameters('head.b' and 4 more): values is null on "
                "the root");
    } else {
      EXPECT_EQ(s[4],
                "aborted: write_parameters('head.b' and 4 more): rank 1 failed "
                "(invalid_argument); see its error");
    }
    EXPECT_THAT(s[5], ::testing::StartsWith("invalid_argument: write_parameters('"));
    EXPECT_THAT(s[5], ::testing::HasSubstr("rank 1 passed other names or another root"));
    if (r == 0) {
      EXPECT_EQ(s[6], "not_found: write_parameters('no.such'): unknown parameter");
    } else {
      EXPECT_EQ(s[6],
                "aborted: write_parameters('head.b'): rank 0 failed (not_found); see its error");
    }
    EXPECT_EQ(s[7], "ok");
    if (r == root) {
      EXPECT_THAT(s[8], ::testing::StartsWith("io_error: write_parameters('"));
      EXPECT_THAT(s[8], ::testing::HasSubstr("'): values: staging file unreadable"));
    } else {
      EXPECT_THAT(s[8], ::testing::StartsWith("aborted: write_parameters('"));
      EXPECT_THAT(s[8], ::testing::HasSubstr("rank 1 failed (io_error)"));
    }
    EXPECT_EQ(s[9], s[8]);  // sticky
  }
}

// A rank whose pass fails (an NVMe read error on rank 0) stops the other rank at the next
// parameter: it fails at once with kAborted naming rank 0, instead of waiting in a broadcast
// until the collective timeout.
TEST(WriteParametersBatch, AnIoErrorOnOneRankStopsEveryRank) {
  engine_test::ScratchDir dir("write_batch_io_error");
  const Model model = engine_test::make_model(DType::kF32, 81);
  const std::vector<std::vector<float>> fresh = fresh_values(model, 12);
  constexpr int kWorld = 2;
  const auto timeout = std::chrono::seconds(5);
  engine_test::Ranks ranks = engine_test::make_ranks(kWorld, timeout);
  Config config =
      engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
  config.collective_timeout_ms = 5000;
  std::vector<Status> written(kWorld);
  std::vector<Status> st = engine_test::run_ranks(kWorld, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    auto faults = engine_test::failing_io(/*reads=*/true);
    ZINF_ASSIGN_OR_RETURN(auto engine,
                          engine_test::open_finalized(ranks, rank, config, model, faults));
    faults->set_enabled(rank == 0);
    const auto start = std::chrono::steady_clock::now();
    written[r] = engine->write_parameters(kBatch, values_from(model, fresh),
                                          /*root=*/1);
    if (std::chrono::steady_clock::now() - start > timeout / 2) {
      return Status::internal("the failure was not passed on: the rank waited");
    }
    return Status::ok();
  });
  for (std::size_t r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
  }
  EXPECT_EQ(written[0].code(), Code::kIoError) << written[0].to_string();
  EXPECT_EQ(written[1].code(), Code::kAborted) << written[1].to_string();
  EXPECT_THAT(written[1].message(), ::testing::HasSubstr("rank 0 failed (io_error)"));
}

// An I/O error anywhere in the pass (a read of the master, read ahead or not, or a write) on
// rank 0 fails the call on every rank (rank 0 with the error, the other with kAborted naming it),
// and the failure stays; a pass that meets no error writes the values. Seeded faults on rank 0's
// reads or writes, with two and three pool blocks (the pass reads ahead with three).
TEST(WriteParametersBatch, AnIoErrorMidwayFailsEveryRankAndStays) {
  const Model model = engine_test::make_model(DType::kF32, 87);
  const std::vector<std::vector<float>> fresh = fresh_values(model, 17);
  constexpr int kWorld = 2;
  int failed = 0, passed = 0;
  for (const std::size_t buffer_count : {2, 3}) {
    for (const bool reads : {true, false}) {
      for (std::uint64_t seed = 1; seed <= 4; ++seed) {
        const std::string label =
            fmt::format("blocks {} {} seed {}", buffer_count, reads ? "reads" : "writes", seed);
        SCOPED_TRACE(label);
        engine_test::ScratchDir dir("write_batch_midway");
        engine_test::Ranks ranks = engine_test::make_ranks(kWorld, std::chrono::seconds(10));
        Config config =
            engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
        config.zero.offload_optimizer.buffer_count = buffer_count;
        config.collective_timeout_ms = 10000;
        std::vector<Status> written(kWorld), again(kWorld);
        std::vector<std::uint64_t> errors(kWorld);
        std::vector<std::vector<std::vector<float>>> masters(kWorld);
        std::vector<Status> st = engine_test::run_ranks(kWorld, [&](int rank) -> Status {
          const auto r = static_cast<std::size_t>(rank);
          FaultSpec spec;
          spec.seed = seed;
          spec.eio_rate = 0.25;
          spec.reads = reads;
          spec.writes = !reads;
          auto faults = std::make_shared<FaultInjector>(spec);
          faults->set_enabled(false);
          ZINF_ASSIGN_OR_RETURN(auto engine,
                                engine_test::open_finalized(ranks, rank, config, model, faults));
          auto give = values_from(model, fresh);
          faults->set_enabled(rank == 0);
          written[r] = engine->write_parameters(kBatch, give, /*root=*/1);
          faults->set_enabled(false);
          errors[r] = faults->counts().eio;
          if (!written[r].is_ok()) {
            again[r] = engine->write_parameters(kBatch, give, /*root=*/1);
            return Status::ok();
          }
          ZINF_ASSIGN_OR_RETURN(masters[r], engine_test::read_masters(*engine, model));
          return Status::ok();
        });
        for (std::size_t r = 0; r < kWorld; ++r) {
          ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
        }
        if (errors[0] == 0) {
          ++passed;
          for (std::size_t r = 0; r < kWorld; ++r) {
            ASSERT_TRUE(written[r].is_ok()) << "rank " << r << ": " << written[r].to_string();
            for (std::string_view name : kBatch) {
              EXPECT_EQ(masters[r][param_index(model, name)], fresh[param_index(model, name)])
                  << "rank " << r << ": " << name;
            }
          }
          continue;
        }
        ++failed;
        EXPECT_EQ(written[0].code(), Code::kIoError) << written[0].to_string();
        EXPECT_EQ(written[1].code(), Code::kAborted) << written[1].to_string();
        EXPECT_THAT(written[1].message(), ::testing::HasSubstr("rank 0 failed (io_error)"));
        for (std::size_t r = 0; r < kWorld; ++r) {
          EXPECT_EQ(again[r].to_string(), written[r].to_string()) << "rank " << r << ": sticky";
        }
      }
    }
  }
  std::printf("write_parameters midway faults: %d calls failed, %d met no error\n", failed, passed);
  EXPECT_GT(failed, 0);
}

// The new shards are written before the last agreement (stage 3, the shards on NVMe; the state
// in host memory, in HostState's memory or on an opaque device: the pass writes nothing to NVMe),
// and the persistent groups are all-gathered only after every rank agreed that its shards are
// written. A write error there on rank 0 fails the call on both ranks: rank 0 with the error,
// naming the shard's swap extent, the other with kAborted naming rank 0, at once rather than at
// the collective timeout, also without persistent groups (no all-gather follows the writes, so
// the other rank returned OK before). Both engines stay failed, since their shards disagree; the
// communicator is not aborted.
TEST(WriteParametersBatch, AShardWriteErrorFailsEveryRankInTheSameCall) {
  using D = OffloadDevice;
  const WriteCase cases[] = {WriteCase{2, 3, D::kNone, D::kNvme},
                             WriteCase{2, 3, D::kHost, D::kNvme},
                             WriteCase{2, 3, D::kNone, D::kNvme, /*opaque=*/true}};
  for (const WriteCase& c : cases) {
    for (const bool none_persistent : {false, true}) {
      const std::string label =
          fmt::format("{}{}", case_name(c), none_persistent ? "_none_persistent" : "");
      SCOPED_TRACE(label);
      engine_test::ScratchDir dir("write_batch_shard_error_" + label);
      const Model model = engine_test::make_model(DType::kF32, 88);
      const std::vector<std::vector<float>> fresh = fresh_values(model, 18);
      const auto timeout = std::chrono::seconds(6);
      engine_test::Ranks ranks = engine_test::make_ranks(c.world, timeout, 0, c.opaque);
      Config config = engine_test::small_config(c.stage, c.optimizer, c.params, dir.path());
      config.collective_timeout_ms = 6000;
      if (none_persistent) config.zero.stage3_param_persistence_threshold = 0;
      std::vector<Status> written(2), next(2), again(2);
      std::vector<std::uint64_t> errors(2);
      std::vector<double> seconds(2);
      std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
        const auto r = static_cast<std::size_t>(rank);
        auto faults = engine_test::failing_io(/*reads=*/false);
        ZINF_ASSIGN_OR_RETURN(auto engine,
                              engine_test::open_finalized(ranks, rank, config, model, faults));
        faults->set_enabled(rank == 0);
        const auto start = std::chrono::steady_clock::now();
        written[r] = engine->write_parameters(kBatch, values_from(model, fresh), /*root=*/1);
        seconds[r] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        faults->set_enabled(false);
        errors[r] = faults->counts().eio;
        std::vector<float> out(model.params[0].element_count());
        next[r] = engine->read_parameters(model.params[0].name, out.data());
        again[r] = engine->write_parameters(kBatch, values_from(model, fresh), /*root=*/1);
        return Status::ok();
      });
      for (std::size_t r = 0; r < 2; ++r) {
        ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
      }
      ASSERT_GT(errors[0], 0u) << "no shard write failed";
      EXPECT_EQ(errors[1], 0u);
      EXPECT_EQ(written[0].code(), Code::kIoError) << written[0].to_string();
      // The call, and the swap extent of the shard that failed.
      EXPECT_THAT(written[0].message(), ::testing::HasSubstr("write_parameters('head.b' and 4"));
      EXPECT_THAT(written[0].message(), ::testing::HasSubstr("swap extent rank0/param/group"));
      EXPECT_EQ(written[1].code(), Code::kAborted) << written[1].to_string();
      EXPECT_THAT(written[1].message(), ::testing::HasSubstr("rank 0 failed (io_error)"));
      for (std::size_t r = 0; r < 2; ++r) {
        EXPECT_LT(seconds[r], 3.0) << "rank " << r << " waited for the collective timeout";
        EXPECT_EQ(next[r].to_string(), written[r].to_string()) << "rank " << r << ": sticky";
        EXPECT_EQ(again[r].to_string(), written[r].to_string()) << "rank " << r << ": sticky";
        EXPECT_TRUE(ranks.comms[r]->status().is_ok())
            << "rank " << r << ": " << ranks.comms[r]->status().to_string();
      }
    }
  }
}

}  // namespace
}  // namespace zinf
