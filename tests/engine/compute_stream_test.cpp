// Engine::set_compute_stream on opaque HostDevices (not host-accessible, every stream a worker
// thread that runs its queue in order), as a GPU program uses it: each rank queues its reads of
// the gathered parameters and the writing of its gradients on its own compute stream, each behind
// a host function that sleeps, and calls release() and reduce_gradients() at once, with no
// synchronize in between. The engine must order itself by the stream queues: the gathered values
// each step reads and the final fp32 masters must equal the single-process reference (the same
// bits, as the equivalence tests on opaque devices). Right after reduce_gradients() the compute
// stream poisons the gradient buffers (0xff, a NaN), as a program reusing them would.
//
// Negative controls: with each of the engine's waits switched off in turn
// (g_test_skip_caller_stream_waits) the run must differ from the reference: the compute stream's
// wait for the all-gather (gather), the engine's for the compute stream at release() (a reused
// buffer), before it reads the gradients (reduce_gradients) and at step(). The compute stream's
// wait after the gradient read has no control here: only a race decides whether the poisoning
// memset overtakes the read without it (it did in every run tried; see docs/DEVICE_COMM.md).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "base/random.hpp"
#include "common/sanitizer.hpp"
#include "engine_test_util.hpp"
#include "zero/caller_stream.hpp"

namespace zinf {
namespace {

constexpr int kSteps = 4;
constexpr int kStreamWorld = 2;

struct RankResult {
  std::vector<std::vector<float>> master;
  std::string mismatch;  // the first gathered value that differed from the reference
};

// One rank's training loop through its compute stream. Returns the engine's errors.
// `compute` outlives the engine.
Status train_on_stream(Engine& engine, Device& device, Stream* compute,
                       const engine_test::Model& model, int rank, const engine_test::Reference& ref,
                       bool slow_reads, int late_gather_ms, RankResult* result) {
  ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
  ZINF_RETURN_IF_ERROR(engine.set_compute_stream(compute));
  const std::size_t count = model.params.size();
  // Host copies of what the compute stream read, and the device gradients it writes.
  std::vector<std::vector<float>> fwd(count), bwd(count), last(count), grad(count);
  std::vector<DeviceBuffer> grad_dev(count);
  for (std::size_t p = 0; p < count; ++p) {
    const std::size_t n = model.params[p].element_count();
    fwd[p].resize(n);
    bwd[p].resize(n);
    last[p].resize(n);
    grad[p].resize(n);
    ZINF_ASSIGN_OR_RETURN(grad_dev[p], DeviceBuffer::allocate(device, n * 4));
  }
  // Whatever happens, the compute stream's work on these ends before they go.
  struct Drain {
    Device& device;
    Stream& stream;
    ~Drain() { (void)device.synchronize(stream, std::chrono::seconds(30)); }
  } drain{device, *compute};
  std::mt19937 rng(static_cast<unsigned>(100 + rank));
  auto slow = [&](bool enabled = true, int extra_us = 0) -> Status {
    if (!enabled) return Status::ok();
    const int us = 300 + static_cast<int>(rng() % 1500) + extra_us;
    return device.launch_host(*compute, [us] {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      return Status::ok();
    });
  };
  auto gather = [&](const std::string& m) {
    if (rank == 1 && late_gather_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(late_gather_ms));
    }
    return engine.gather(m);
  };
  for (int step = 1; step <= kSteps; ++step) {
    for (const std::string& m : model.modules) {
      ZINF_RETURN_IF_ERROR(gather(m));
      for (std::size_t p = 0; p < count; ++p) {
        if (model.params[p].module != m) continue;
        ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(model.params[p].name));
        ZINF_RETURN_IF_ERROR(slow(slow_reads));
        ZINF_RETURN_IF_ERROR(
            device.copy_d2h(fwd[p].data(), view.data, fwd[p].size() * 4, *compute));
      }
      ZINF_RETURN_IF_ERROR(engine.release(m));
    }
    for (auto it = model.modules.rbegin(); it != model.modules.rend(); ++it) {
      ZINF_RETURN_IF_ERROR(gather(*it));
      std::vector<GradientRef> refs;
      for (std::size_t p = 0; p < count; ++p) {
        const engine_test::ParamDef& d = model.params[p];
        if (d.module != *it) continue;
        ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(d.name));
        ZINF_RETURN_IF_ERROR(slow(slow_reads));
        ZINF_RETURN_IF_ERROR(
            device.copy_d2h(bwd[p].data(), view.data, bwd[p].size() * 4, *compute));
        // The backward: gradients from the values just read, written to the device, all queued.
        ZINF_RETURN_IF_ERROR(device.launch_host(*compute, [&, p, step] {
          const std::vector<float> g = engine_test::make_grad(d, bwd[p], rank, step, 0, p);
          std::copy(g.begin(), g.end(), grad[p].begin());  // in place: copy_h2d has its address
          return Status::ok();
        }));
        ZINF_RETURN_IF_ERROR(slow());
        ZINF_RETURN_IF_ERROR(
            device.copy_h2d(grad_dev[p].data(), grad[p].data(), grad[p].size() * 4, *compute));
        refs.push_back({d.name, grad_dev[p].data(), d.element_count(), d.dtype});
      }
      ZINF_RETURN_IF_ERROR(engine.reduce_gradients(*it, refs));
      for (const GradientRef& g : refs) {
        ZINF_RETURN_IF_ERROR(
            device.memset_async(const_cast<void*>(g.data), 0xff, g.element_count * 4, *compute));
      }
      ZINF_RETURN_IF_ERROR(engine.release(*it));
    }
    // One more read of the first module, the last work queued before step(): nothing but
    // step()'s own wait orders it before the step publishes new values.
    ZINF_RETURN_IF_ERROR(engine.gather(model.modules.front()));
    for (std::size_t p = 0; p < count; ++p) {
      if (model.params[p].module != model.modules.front()) continue;
      ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(model.params[p].name));
      // Longer than the step takes to publish.
      ZINF_RETURN_IF_ERROR(slow(true, 30'000));
      ZINF_RETURN_IF_ERROR(
          device.copy_d2h(last[p].data(), view.data, last[p].size() * 4, *compute));
    }
    ZINF_RETURN_IF_ERROR(engine.release(model.modules.front()));
    // step() waits for the compute stream's work before it changes anything.
    ZINF_RETURN_IF_ERROR(engine.step().status());
    // (The engine waited for the compute stream in step(); this wait only matters to the
    // negative control, whose engine does not.)
    ZINF_RETURN_IF_ERROR(device.synchronize(*compute, std::chrono::seconds(30)));
    for (std::size_t p = 0; p < count && result->mismatch.empty(); ++p) {
      const std::vector<float>& want = ref.device_per_step[static_cast<std::size_t>(step - 1)][p];
      const bool first = model.params[p].module == model.modules.front();
      for (const std::vector<float>* got : {&fwd[p], &bwd[p], &last[p]}) {
        if (got == &last[p] && !first) continue;
        if (std::memcmp(got->data(), want.data(), want.size() * 4) != 0) {
          result->mismatch = fmt::format("rank {} step {}: '{}' read {} on the compute stream",
                                         rank, step, model.params[p].name,
                                         got == &fwd[p]   ? "forward"
                                         : got == &bwd[p] ? "backward"
                                                          : "before step()");
        }
      }
    }
  }
  ZINF_RETURN_IF_ERROR(engine.set_compute_stream(nullptr));
  for (const engine_test::ParamDef& d : model.params) {
    std::vector<float> out(d.element_count());
    ZINF_RETURN_IF_ERROR(engine.read_parameters(d.name, out.data()));
    result->master.push_back(std::move(out));
  }
  return Status::ok();
}

struct Case {
  int stage = 3;
  OffloadDevice params = OffloadDevice::kNone;
  // Four modules of one shape, so that a buffer released by one is the next one's gather buffer.
  bool equal_modules = false;
  // The compute stream sleeps before it reads the gathered parameters (else it reads at once).
  bool slow_reads = true;
  // Rank 1 sleeps this long on the host before each gather(), so the all-gathers end late.
  int late_gather_ms = 0;
};

// Four modules "l0".."l3" of the same shapes (a partitioned weight and a persistent bias each).
engine_test::Model equal_model(std::uint64_t seed) {
  engine_test::Model m;
  for (int l = 0; l < 4; ++l) {
    const std::string name = fmt::format("l{}", l);
    m.modules.push_back(name);
    m.params.push_back({name + ".w", name, {23, 19}, DType::kF32});
    m.params.push_back({name + ".b", name, {19}, DType::kF32});
  }
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    std::vector<float> v(m.params[p].element_count());
    fill_uniform(v.data(), v.size(), seed + p, -1.0f, 1.0f);
    m.initial.push_back(std::move(v));
  }
  return m;
}

// Runs body(rank, engine, device, compute) on one thread per rank: each rank an opaque HostDevice
// (streams jittered by up to `jitter_max_us`), a LocalComm, a compute stream, and an engine
// opened from `config` (after the stream, so the stream outlives it). Returns each rank's Status.
std::vector<Status> run_on_compute_streams(
    const Config& config, int jitter_max_us,
    const std::function<Status(int, Engine&, Device&, Stream&)>& body) {
  engine_test::Ranks ranks = engine_test::make_ranks(kStreamWorld, std::chrono::seconds(30),
                                                     jitter_max_us, /*opaque=*/true);
  return engine_test::run_ranks(kStreamWorld, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Env env;
    env.device = ranks.devices[r].get();
    env.comm = ranks.comms[r].get();
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Stream> compute, env.device->create_stream("compute"));
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
    return body(rank, *engine, *env.device, *compute);
  });
}

// Runs the case; returns whether every rank matched the reference (gathered values and masters),
// and the first difference in `why`.
bool run_case(const Case& c, std::string* why) {
  engine_test::ScratchDir dir(fmt::format("compute_stream_s{}_{}", c.stage, c.equal_modules));
  const Config config =
      engine_test::small_config(c.stage, OffloadDevice::kHost, c.params, dir.path());
  const engine_test::Model model =
      c.equal_modules ? equal_model(55) : engine_test::make_model(DType::kF32, 77);
  engine_test::TrainOptions options;
  options.steps = kSteps;
  const engine_test::Reference ref =
      engine_test::run_reference(config, model, kStreamWorld, options);
  std::vector<RankResult> results(kStreamWorld);
  std::vector<Status> st = run_on_compute_streams(
      config, /*jitter_max_us=*/200,
      [&](int rank, Engine& engine, Device& device, Stream& compute) {
        return train_on_stream(engine, device, &compute, model, rank, ref, c.slow_reads,
                               c.late_gather_ms, &results[static_cast<std::size_t>(rank)]);
      });
  for (int r = 0; r < kStreamWorld; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    if (!st[ur].is_ok()) {
      *why = fmt::format("rank {}: {}", r, st[ur].to_string());
      return false;
    }
    if (!results[ur].mismatch.empty()) {
      *why = results[ur].mismatch;
      return false;
    }
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      if (std::memcmp(results[ur].master[p].data(), ref.master[p].data(),
                      ref.master[p].size() * 4) != 0) {
        *why = fmt::format("rank {}: master of '{}' differs from the reference (max rel {})", r,
                           model.params[p].name,
                           engine_test::max_rel_diff(results[ur].master[p], ref.master[p]));
        return false;
      }
    }
  }
  return true;
}

TEST(ComputeStream, Stage3OrdersByTheStreamQueues) {
  std::string why;
  EXPECT_TRUE(run_case({3, OffloadDevice::kNone}, &why)) << why;
}

TEST(ComputeStream, Stage3NvmeShardsOrdersByTheStreamQueues) {
  std::string why;
  EXPECT_TRUE(run_case({3, OffloadDevice::kNvme}, &why)) << why;
}

TEST(ComputeStream, Stage3ReusedBuffersOrdersByTheStreamQueues) {
  std::string why;
  EXPECT_TRUE(run_case({3, OffloadDevice::kNone, /*equal_modules=*/true}, &why)) << why;
  EXPECT_TRUE(run_case({3, OffloadDevice::kNone, true, /*slow_reads=*/false}, &why)) << why;
  EXPECT_TRUE(run_case({3, OffloadDevice::kNone, true, false, /*late_gather_ms=*/3}, &why)) << why;
}

TEST(ComputeStream, Stage2OrdersByTheStreamQueues) {
  std::string why;
  EXPECT_TRUE(run_case({2, OffloadDevice::kNone}, &why)) << why;
}

// The equivalence tests' loop (engine_test::train_rank) with a compute stream, as the GPU test
// runs it: reads and uploads on that stream, every gathered value and the masters as the
// reference's, at stage 3 with bf16 parameters and the state and shards on NVMe.
TEST(ComputeStream, TheEquivalenceLoopOnAComputeStream) {
  engine_test::ScratchDir dir("compute_stream_loop");
  const Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNvme, dir.path());
  const engine_test::Model model = engine_test::make_model(DType::kBF16, 5);
  engine_test::TrainOptions options;
  options.steps = 4;
  const engine_test::Reference ref =
      engine_test::run_reference(config, model, kStreamWorld, options);
  std::vector<std::vector<std::vector<float>>> finals(kStreamWorld);
  std::vector<Status> st = run_on_compute_streams(
      config, /*jitter_max_us=*/100,
      [&](int rank, Engine& engine, Device& device, Stream& compute) -> Status {
        engine_test::TrainOptions rank_options = options;
        rank_options.device = &device;
        rank_options.compute_stream = &compute;
        ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, model, rank, rank_options,
                                                     &ref.device_per_step, nullptr));
        std::vector<std::vector<float>>& mine = finals[static_cast<std::size_t>(rank)];
        for (const engine_test::ParamDef& d : model.params) {
          mine.emplace_back(d.element_count());
          ZINF_RETURN_IF_ERROR(engine.read_parameters(d.name, mine.back().data()));
        }
        return Status::ok();
      });
  for (int r = 0; r < kStreamWorld; ++r) {
    const auto u = static_cast<std::size_t>(r);
    ASSERT_TRUE(st[u].is_ok()) << "rank " << r << ": " << st[u].to_string();
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      EXPECT_EQ(std::memcmp(finals[u][p].data(), ref.master[p].data(), ref.master[p].size() * 4), 0)
          << "rank " << r << ": " << model.params[p].name;
    }
  }
}

// Negative controls: without one of the engine's waits the compute stream's slow work loses a
// race the waits decide, and the run differs from the reference.
struct SkipWaits {
  explicit SkipWaits(unsigned waits) { g_test_skip_caller_stream_waits = waits; }
  ~SkipWaits() { g_test_skip_caller_stream_waits = 0; }
};

// Each control makes a data race on purpose (a stream reads a buffer while another writes it),
// which a ThreadSanitizer build rightly reports and fails on: there they skip.
class ComputeStreamControl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::kThreadSanitizer) GTEST_SKIP() << "races on purpose, which ThreadSanitizer reports";
  }
};

// gather(): the compute stream reads at once, before rank 1 has joined the all-gather.
TEST_F(ComputeStreamControl, WithoutTheGatherWaitTheReadsComeTooEarly) {
  SkipWaits skip(kSkipGatherReady);
  std::string why;
  EXPECT_FALSE(run_case({3, OffloadDevice::kNone, true, /*slow_reads=*/false,
                         /*late_gather_ms=*/3},
                        &why));
  std::printf("without the gather wait: %s\n", why.c_str());
}

// release(): the next module's gather overwrites the buffer before the forward read it.
TEST_F(ComputeStreamControl, WithoutTheReleaseWaitAReusedBufferIsOverwritten) {
  SkipWaits skip(kSkipRelease);
  std::string why;
  EXPECT_FALSE(run_case({3, OffloadDevice::kNone, /*equal_modules=*/true}, &why));
  std::printf("without the release wait: %s\n", why.c_str());
}

// reduce_gradients(): the gradients are read before the backward wrote them.
TEST_F(ComputeStreamControl, WithoutTheWaitBeforeTheReadStaleGradientsAreReduced) {
  SkipWaits skip(kSkipBeforeRead);
  std::string why;
  EXPECT_FALSE(run_case({2, OffloadDevice::kNone}, &why));
  std::printf("without the wait before the gradient read: %s\n", why.c_str());
}

// step(): the step publishes new parameters while the compute stream still reads the old ones.
TEST_F(ComputeStreamControl, WithoutTheStepsWaitTheReadsSeeTheNextStep) {
  SkipWaits skip(kSkipHostWait);
  std::string why;
  EXPECT_FALSE(run_case({2, OffloadDevice::kNone}, &why));
  std::printf("without the step's wait: %s\n", why.c_str());
}

}  // namespace
}  // namespace zinf
