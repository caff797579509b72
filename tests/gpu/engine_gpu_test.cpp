// The engine's equivalence test on one GPU: CudaDevice + a world-1 NcclComm (bootstrapped as
// torchrun would, on loopback), the five-module model of tests/engine trained 20 AdamW steps with
// the parameters read from and the gradients handed over in GPU memory, for every stage and
// placement of the optimizer state in host memory or on NVMe (the ZeRO-Infinity case) and of the
// parameters (stage 3), f32 and half dtypes, micro-batches and clipping; and with the state on the
// GPU (offload_optimizer "none": the kernels' Adam, norm and accumulation). The final fp32 masters
// must equal the single-process reference (engine_test_util.cpp; for state on the GPU, the
// reference steps with the kernel's reference Adam) within 1e-6 relative: the same bits are
// expected, as on the CPU (the widening is exact, NCCL's average over one rank is the identity,
// the Adam kernel matches its reference bit for bit), and every gathered parameter must be the
// reference's master rounded to its dtype at every step. An optimizer the GPU cannot step (Lion)
// is refused, naming the key. Without a CUDA device every test skips with the reason.
#include <gtest/gtest.h>

#if defined(ZINF_HAVE_CUDA) && defined(ZINF_HAVE_NCCL)

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "engine/engine_test_util.hpp"
#include "gpu/gpu_util.hpp"
#include "zinf/comm.hpp"
#include "zinf/device.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::Reference;
using engine_test::TrainOptions;

struct GpuCase {
  int stage;
  OffloadDevice optimizer;
  OffloadDevice params;
  DType dtype = DType::kF32;
  int micro_batches = 1;
  double clipping = 0.0;
};

std::string case_name(const GpuCase& c) {
  return fmt::format("s{}_opt_{}_param_{}_{}_mb{}{}", c.stage, offload_device_name(c.optimizer),
                     offload_device_name(c.params), dtype_name(c.dtype), c.micro_batches,
                     c.clipping > 0 ? "_clip" : "");
}

// The GPU and a one-rank NcclComm on it, opened as a user's program does: through the public
// constructors (include/zinf/device.hpp, comm.hpp), from an environment without a launcher.
struct OneGpu {
  std::unique_ptr<Device> device;
  std::unique_ptr<Communicator> comm;
};

Result<OneGpu> open_one_gpu() {
  OneGpu gpu;
  ZINF_ASSIGN_OR_RETURN(gpu.device, make_cuda_device(0));
  NcclCommOptions options;
  options.init_timeout = std::chrono::milliseconds(120000);
  options.cuda_ordinal = 0;
  ZINF_ASSIGN_OR_RETURN(gpu.comm, make_nccl_comm(*gpu.device, options));
  return gpu;
}

class EngineGpu : public ::testing::TestWithParam<GpuCase> {};

TEST_P(EngineGpu, MastersEqualSingleProcessAdamW) {
  ZINF_REQUIRE_CUDA_DEVICE();
  const GpuCase c = GetParam();
  const std::uint64_t seed = 4321 + static_cast<std::uint64_t>(c.stage);
  std::printf("case %s seed %llu\n", case_name(c).c_str(), static_cast<unsigned long long>(seed));
  engine_test::ScratchDir dir("gpu-" + case_name(c));
  Config config = engine_test::small_config(c.stage, c.optimizer, c.params, dir.path());
  config.gradient_clipping = c.clipping;
  const Model model = engine_test::make_model(c.dtype, seed);
  TrainOptions options;
  options.steps = 20;
  options.micro_batches = c.micro_batches;
  if (c.clipping > 0) options.gathered_tolerance = 1e-5;
  options.device_adam = c.optimizer == OffloadDevice::kNone;
  const Reference ref = engine_test::run_reference(config, model, 1, options);

  Result<OneGpu> gpu = open_one_gpu();
  ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
  ASSERT_FALSE(gpu->device->host_accessible());
  Env env;
  env.device = gpu->device.get();
  env.comm = gpu->comm.get();
  std::vector<std::vector<float>> finals;
  std::vector<StepReport> reports;
  {
    Result<std::unique_ptr<Engine>> engine = Engine::open(config, env);
    ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
    options.device = gpu->device.get();
    const Status trained =
        engine_test::train_rank(**engine, model, 0, options, &ref.device_per_step, &reports);
    ASSERT_TRUE(trained.is_ok()) << trained.to_string();
    for (const engine_test::ParamDef& d : model.params) {
      std::vector<float> out(d.element_count());
      const Status read = (*engine)->read_parameters(d.name, out.data());
      ASSERT_TRUE(read.is_ok()) << read.to_string();
      finals.push_back(std::move(out));
    }
  }
  double worst = 0.0;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const double d = engine_test::max_rel_diff(finals[p], ref.master[p]);
    worst = std::max(worst, d);
    // With clipping and the state on the GPU the norm is a float (kernels/sq_norm), and the
    // clipping coefficient differs from the reference's double one in the seventh digit.
    EXPECT_LE(d, options.device_adam && c.clipping > 0 ? 2e-5 : 1e-6) << model.params[p].name;
    // The masters moved: a run that trained nothing would pass the comparison trivially.
    EXPECT_GT(engine_test::max_rel_diff(finals[p], model.initial[p]), 1e-3) << model.params[p].name;
  }
  std::printf("max relative difference to the reference: %.3g\n", worst);
  ASSERT_EQ(reports.size(), 20u);
  EXPECT_FALSE(reports.back().skipped);
  EXPECT_EQ(reports.back().step, 20);
}

std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> cases;
  const OffloadDevice tiers[] = {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme};
  for (int stage = 1; stage <= 3; ++stage) {
    for (OffloadDevice opt : tiers) {
      for (OffloadDevice param : tiers) {
        if (stage != 3 && param != OffloadDevice::kNone) continue;
        cases.push_back({stage, opt, param});
      }
    }
  }
  cases.push_back({1, OffloadDevice::kHost, OffloadDevice::kNone, DType::kBF16, 2});
  cases.push_back({2, OffloadDevice::kNvme, OffloadDevice::kNone, DType::kF16, 2});
  cases.push_back({3, OffloadDevice::kNvme, OffloadDevice::kNvme, DType::kBF16, 1});
  cases.push_back({3, OffloadDevice::kHost, OffloadDevice::kHost, DType::kF32, 2, 0.5});
  cases.push_back({2, OffloadDevice::kNone, OffloadDevice::kNone, DType::kBF16, 2});
  cases.push_back({3, OffloadDevice::kNone, OffloadDevice::kNvme, DType::kF16, 1});
  cases.push_back({1, OffloadDevice::kNone, OffloadDevice::kNone, DType::kF32, 2, 0.5});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(OneGpu, EngineGpu, ::testing::ValuesIn(gpu_cases()),
                         [](const ::testing::TestParamInfo<GpuCase>& info) {
                           return case_name(info.param);
                         });

// The engine ordered by a compute stream that is a caller's cudaStream_t (wrap_cuda_stream
// borrows the handle of a stream the test made): the parameters are read on that stream right
// after gather() returns, which waits for nothing on the host, and the gradients are uploaded
// on it before reduce_gradients(). Every gathered value and the final masters equal the
// reference, at stage 2 and at stage 3 with NVMe shards.
TEST(EngineGpu, ACallersCudaStreamAsTheComputeStream) {
  ZINF_REQUIRE_CUDA_DEVICE();
  for (const GpuCase& c : {GpuCase{2, OffloadDevice::kHost, OffloadDevice::kNone},
                           GpuCase{3, OffloadDevice::kHost, OffloadDevice::kNvme}}) {
    SCOPED_TRACE(case_name(c));
    engine_test::ScratchDir dir("gpu-stream-" + case_name(c));
    const Config config = engine_test::small_config(c.stage, c.optimizer, c.params, dir.path());
    const Model model = engine_test::make_model(DType::kF32, 99);
    TrainOptions options;
    options.steps = 6;
    const Reference ref = engine_test::run_reference(config, model, 1, options);
    Result<OneGpu> gpu = open_one_gpu();
    ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
    Result<std::unique_ptr<Stream>> owner = gpu->device->create_stream("caller's");
    ASSERT_TRUE(owner.is_ok()) << owner.status().to_string();
    Result<std::unique_ptr<Stream>> compute =
        wrap_cuda_stream(*gpu->device, (*owner)->native_handle(), "compute");
    ASSERT_TRUE(compute.is_ok()) << compute.status().to_string();
    Env env;
    env.device = gpu->device.get();
    env.comm = gpu->comm.get();
    Result<std::unique_ptr<Engine>> engine = Engine::open(config, env);
    ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
    options.device = gpu->device.get();
    options.compute_stream = compute->get();
    const Status trained =
        engine_test::train_rank(**engine, model, 0, options, &ref.device_per_step, nullptr);
    ASSERT_TRUE(trained.is_ok()) << trained.to_string();
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      std::vector<float> out(model.params[p].element_count());
      ASSERT_TRUE((*engine)->read_parameters(model.params[p].name, out.data()).is_ok());
      EXPECT_LE(engine_test::max_rel_diff(out, ref.master[p]), 1e-6) << model.params[p].name;
    }
  }
}

TEST(EngineGpuRefusals, AnOptimizerTheGpuCannotStepIsRefusedNamingTheKey) {
  ZINF_REQUIRE_CUDA_DEVICE();
  Result<OneGpu> gpu = open_one_gpu();
  ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
  Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
  config.optimizer.kind = OptimizerKind::kLion;
  Env env;
  env.device = gpu->device.get();
  env.comm = gpu->comm.get();
  Result<std::unique_ptr<Engine>> engine = Engine::open(config, env);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_EQ(engine.status().code(), Code::kUnsupported);
  EXPECT_NE(engine.status().message().find("optimizer.type"), std::string_view::npos)
      << engine.status().to_string();
}

}  // namespace
}  // namespace zinf

#else  // !(ZINF_HAVE_CUDA && ZINF_HAVE_NCCL)

TEST(EngineGpu, NeedsCudaAndNccl) {
  GTEST_SKIP() << "no CUDA device: zinf was built without CUDA or without NCCL";
}

#endif
