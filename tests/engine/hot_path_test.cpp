// After the first step, a whole training step of a ZeRO-3 run with the optimizer state and the
// parameters on NVMe allocates nothing: the forward's gathers and releases, the backward's
// gathers, reduce_gradients() and releases, and step() run on what finalize and the first step
// sized (STYLE.md "Hot paths"). Global operator new is replaced in this test binary to count the
// allocations of every thread (the ranks', the streams', the I/O and optimizer threads) while
// the counter is armed: over the whole of steps 2-5 of every rank.
//
// One rank, and two ranks as threads on LocalComm, whose collectives are counted with the rest.
// The ranks meet at a barrier before the counter is armed and again before it is read, so the
// window holds whole steps of both.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/counting_new.hpp"
#include "engine_test_util.hpp"

using zinf::test::g_allocations;
using zinf::test::g_count_allocations;

namespace zinf {
namespace {

constexpr int kHotSteps = 5;

// Each module's gradients for one rank, seeded, in the parameters' dtype, made before the loop.
struct Gradients {
  std::vector<std::vector<std::byte>> bytes;   // per parameter
  std::vector<std::vector<GradientRef>> refs;  // per module
};

Gradients make_gradients(const engine_test::Model& model, int rank) {
  std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(rank));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Gradients out;
  out.bytes.resize(model.params.size());
  out.refs.resize(model.modules.size());
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const engine_test::ParamDef& def = model.params[p];
    std::vector<float> values(def.element_count());
    for (float& v : values) v = dist(rng);
    out.bytes[p].resize(values.size() * dtype_bytes(def.dtype));
    if (def.dtype == DType::kF32) {
      std::memcpy(out.bytes[p].data(), values.data(), out.bytes[p].size());
    } else {
      convert_f32_to_bf16(values.data(), reinterpret_cast<std::uint16_t*>(out.bytes[p].data()),
                          values.size());
    }
    for (std::size_t m = 0; m < model.modules.size(); ++m) {
      if (model.modules[m] == def.module) {
        out.refs[m].push_back({def.name, out.bytes[p].data(), values.size(), def.dtype});
      }
    }
  }
  return out;
}

// One training step of one rank: forward (gather, release per module), backward in reverse
// (gather, reduce_gradients, release), step. Returns the step's number in `step_number`.
Status train_step(Engine& engine, const engine_test::Model& model, const Gradients& grads,
                  std::int64_t* step_number) {
  for (const std::string& m : model.modules) {
    ZINF_RETURN_IF_ERROR(engine.gather(m));
    ZINF_RETURN_IF_ERROR(engine.release(m));
  }
  for (std::size_t m = model.modules.size(); m-- > 0;) {
    ZINF_RETURN_IF_ERROR(engine.gather(model.modules[m]));
    ZINF_RETURN_IF_ERROR(engine.reduce_gradients(model.modules[m], grads.refs[m]));
    ZINF_RETURN_IF_ERROR(engine.release(model.modules[m]));
  }
  Result<StepReport> report = engine.step();
  if (!report.is_ok()) return report.status();
  *step_number = report->step;
  return Status::ok();
}

// With `compute_stream`, each rank's engine orders itself with a compute stream of its own
// (Engine::set_compute_stream): the events it records and waits on allocate nothing either.
void steps_allocate_nothing(DType dtype, int world, bool compute_stream = false) {
  // The counter counts: one allocation while armed is seen.
  g_allocations.store(0);
  g_count_allocations.store(true);
  auto* probe = new std::uint64_t(42);
  g_count_allocations.store(false);
  EXPECT_EQ(g_allocations.load(), 1u);
  delete probe;

  engine_test::ScratchDir dir("hot-path-" + std::string(dtype_name(dtype)) + "-world" +
                              std::to_string(world) + (compute_stream ? "-stream" : ""));
  const Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNvme, dir.path());
  const engine_test::Model model = engine_test::make_model(dtype, 31);
  engine_test::Ranks ranks = engine_test::make_ranks(world);
  std::vector<Gradients> grads;
  for (int r = 0; r < world; ++r) grads.push_back(make_gradients(model, r));
  // Allocations of all ranks, per step; the last step number each rank's report gave.
  std::vector<std::uint64_t> allocations(kHotSteps + 1, 0);
  std::vector<std::int64_t> last_step(static_cast<std::size_t>(world), 0);
  std::vector<Status> st = engine_test::run_ranks(world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Communicator& comm = *ranks.comms[r];
    Env env;
    env.device = ranks.devices[r].get();
    env.comm = &comm;
    std::unique_ptr<Stream> compute;  // outlives the engine
    if (compute_stream) {
      ZINF_ASSIGN_OR_RETURN(compute, env.device->create_stream("compute"));
    }
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
    ZINF_RETURN_IF_ERROR(engine->set_compute_stream(compute.get()));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
    ZINF_RETURN_IF_ERROR(engine->finalize());
    for (int step = 1; step <= kHotSteps; ++step) {
      const bool counted = step >= 2;
      ZINF_RETURN_IF_ERROR(comm.barrier());
      if (counted && rank == 0) {
        g_allocations.store(0);
        g_count_allocations.store(true);
      }
      // The counter is armed before any rank starts the step.
      ZINF_RETURN_IF_ERROR(comm.barrier());
      ZINF_RETURN_IF_ERROR(train_step(*engine, model, grads[r], &last_step[r]));
      // Every rank has finished the step before the counter is read.
      ZINF_RETURN_IF_ERROR(comm.barrier());
      if (counted && rank == 0) {
        g_count_allocations.store(false);
        allocations[static_cast<std::size_t>(step)] = g_allocations.load();
      }
    }
    return Status::ok();
  });
  g_count_allocations.store(false);
  for (int r = 0; r < world; ++r) {
    const auto u = static_cast<std::size_t>(r);
    ASSERT_TRUE(st[u].is_ok()) << "rank " << r << ": " << st[u].to_string();
    EXPECT_EQ(last_step[u], kHotSteps) << "rank " << r << ": a step was skipped";
  }
  for (int step = 2; step <= kHotSteps; ++step) {
    const auto s = static_cast<std::size_t>(step);
    std::printf(
        "%s, world %d%s, step %d: %llu allocations (gathers, releases, reduce_gradients, "
        "step; all ranks and threads)\n",
        std::string(dtype_name(dtype)).c_str(), world, compute_stream ? ", compute stream" : "",
        step, static_cast<unsigned long long>(allocations[s]));
    EXPECT_EQ(allocations[s], 0u) << "step " << step;
  }
}

// bf16 parameters: the step's half output streams into the NVMe shards.
TEST(EngineHotPath, Stage3NvmeStateAndNvmeBf16ParametersStepsAllocateNothingAfterTheFirst) {
  steps_allocate_nothing(DType::kBF16, 1);
}

// f32 parameters: the new values are narrowed from the master read back from NVMe.
TEST(EngineHotPath, Stage3NvmeStateAndNvmeF32ParametersStepsAllocateNothingAfterTheFirst) {
  steps_allocate_nothing(DType::kF32, 1);
}

// Two ranks: the all-gathers and reduce-scatters cross ranks through LocalComm.
TEST(EngineHotPath, TwoRanksStage3NvmeStateAndNvmeBf16ParametersStepsAllocateNothingAfterTheFirst) {
  steps_allocate_nothing(DType::kBF16, 2);
}

TEST(EngineHotPath, TwoRanksStage3NvmeStateAndNvmeF32ParametersStepsAllocateNothingAfterTheFirst) {
  steps_allocate_nothing(DType::kF32, 2);
}

TEST(EngineHotPath, TwoRanksWithAComputeStreamStepsAllocateNothingAfterTheFirst) {
  steps_allocate_nothing(DType::kBF16, 2, /*compute_stream=*/true);
}

}  // namespace
}  // namespace zinf
