// After the first step, reduce_gradients() and step() of a ZeRO-3 run with the optimizer state
// and the parameters on NVMe allocate nothing: they run on what finalize and the first step
// sized (STYLE.md "Hot paths"). Global operator new is replaced in this test binary to count the
// allocations of every thread (the rank's, the streams', the I/O and optimizer threads) while
// the counter is armed, around those calls of steps 2-5. gather() and release() are counted and
// printed too, not yet asserted (the coordinator still takes gather buffers from a map and holds
// each NVMe shard's staging block in a shared closure).
//
// One rank, on a communicator that copies on the stream: LocalComm allocates per collective
// (names, labels, the gather of send pointers), which is its own matter, not the engine's.
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

// World size 1: every collective is a copy on the stream (an average over one rank is the
// value itself), and nothing is allocated.
class SoloComm final : public Communicator {
 public:
  explicit SoloComm(Device& device) : device_(device) {}
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Device& device() const override { return device_; }
  std::string_view name() const override { return "solo"; }
  Status issue(const Collective& op, Stream& stream) override {
    if (op.send == op.recv || op.element_count == 0) return Status::ok();
    return device_.copy_d2d(op.recv, op.send, op.element_count * dtype_bytes(op.dtype), stream);
  }
  Status group_start() override { return Status::ok(); }
  Status group_end() override { return Status::ok(); }
  Status barrier(std::chrono::milliseconds) override { return Status::ok(); }
  Status wait(Event& event, std::chrono::milliseconds timeout) override {
    return device_.synchronize(event, timeout);
  }
  void abort(Status) override {}
  Status status() const override { return Status::ok(); }

 private:
  Device& device_;
};

void steps_allocate_nothing(DType dtype) {
  // The counter counts: one allocation while armed is seen.
  g_allocations.store(0);
  g_count_allocations.store(true);
  auto* probe = new std::uint64_t(42);
  g_count_allocations.store(false);
  EXPECT_EQ(g_allocations.load(), 1u);
  delete probe;

  constexpr int kSteps = 5;
  engine_test::ScratchDir dir(std::string("hot-path-") + std::string(dtype_name(dtype)));
  const Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNvme, dir.path());
  const engine_test::Model model = engine_test::make_model(dtype, 31);
  HostDeviceOptions options;
  auto device = std::move(make_host_device(options)).value();
  SoloComm comm(*device);
  Env env;
  env.device = device.get();
  env.comm = &comm;
  auto opened = Engine::open(config, env);
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  Engine& engine = **opened;
  ASSERT_TRUE(engine_test::register_model(engine, model).is_ok());
  ASSERT_TRUE(engine.finalize().is_ok());
  // Each module's gradients, seeded, in the parameters' dtype, made before the loop.
  std::mt19937_64 rng(1000);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::vector<std::byte>> grads(model.params.size());
  std::vector<std::vector<GradientRef>> refs(model.modules.size());
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const engine_test::ParamDef& def = model.params[p];
    std::vector<float> values(def.element_count());
    for (float& v : values) v = dist(rng);
    grads[p].resize(values.size() * dtype_bytes(def.dtype));
    if (def.dtype == DType::kF32) {
      std::memcpy(grads[p].data(), values.data(), grads[p].size());
    } else {
      convert_f32_to_bf16(values.data(), reinterpret_cast<std::uint16_t*>(grads[p].data()),
                          values.size());
    }
    for (std::size_t m = 0; m < model.modules.size(); ++m) {
      if (model.modules[m] == def.module) {
        refs[m].push_back({def.name, grads[p].data(), values.size(), def.dtype});
      }
    }
  }
  // Allocations per step of the calls asserted (reduce_gradients, step) and of gather/release.
  std::vector<std::uint64_t> asserted(kSteps + 1, 0), gathers(kSteps + 1, 0);
  std::uint64_t last_step = 0;
  const auto counted = [&](std::vector<std::uint64_t>& into, int step, auto&& call) {
    g_allocations.store(0);
    g_count_allocations.store(step >= 2);
    Status st = call();
    g_count_allocations.store(false);
    into[static_cast<std::size_t>(step)] += g_allocations.load();
    return st;
  };
  for (int step = 1; step <= kSteps; ++step) {
    for (const std::string& m : model.modules) {
      ASSERT_TRUE(counted(gathers, step, [&] { return engine.gather(m); }).is_ok());
      ASSERT_TRUE(counted(gathers, step, [&] { return engine.release(m); }).is_ok());
    }
    for (std::size_t m = model.modules.size(); m-- > 0;) {
      ASSERT_TRUE(counted(gathers, step, [&] { return engine.gather(model.modules[m]); }).is_ok());
      Status st = counted(asserted, step,
                          [&] { return engine.reduce_gradients(model.modules[m], refs[m]); });
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      ASSERT_TRUE(counted(gathers, step, [&] { return engine.release(model.modules[m]); }).is_ok());
    }
    Status st = counted(asserted, step, [&]() -> Status {
      Result<StepReport> report = engine.step();
      if (!report.is_ok()) return report.status();
      last_step = static_cast<std::uint64_t>(report->step);
      return Status::ok();
    });
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  EXPECT_EQ(last_step, static_cast<std::uint64_t>(kSteps));  // no step was skipped
  for (int step = 2; step <= kSteps; ++step) {
    const auto s = static_cast<std::size_t>(step);
    std::printf(
        "%s step %d: %llu allocations in reduce_gradients and step, %llu in gather and "
        "release\n",
        std::string(dtype_name(dtype)).c_str(), step, static_cast<unsigned long long>(asserted[s]),
        static_cast<unsigned long long>(gathers[s]));
    EXPECT_EQ(asserted[s], 0u) << "step " << step;
  }
}

// bf16 parameters: the step's half output streams into the NVMe shards.
TEST(EngineHotPath,
     Stage3NvmeStateAndNvmeBf16ParametersReduceAndStepAllocateNothingAfterTheFirstStep) {
  steps_allocate_nothing(DType::kBF16);
}

// f32 parameters: the new values are narrowed from the master read back from NVMe.
TEST(EngineHotPath,
     Stage3NvmeStateAndNvmeF32ParametersReduceAndStepAllocateNothingAfterTheFirstStep) {
  steps_allocate_nothing(DType::kF32);
}

}  // namespace
}  // namespace zinf
