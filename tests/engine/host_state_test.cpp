// HostState (lib/engine/host_state.cpp), offload_optimizer none on a host-accessible device:
// its zero-page moments and gradient accumulator count against the HostDevice's memory limit
// and fail as a Status, naming the tensor and the bytes, when the limit or the kernel refuses
// them; their frozen ranges are advised off transparent huge pages; and a step does not narrow a
// frozen f32 group into the publish buffer again.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/child_process.hpp"
#include "common/sanitizer.hpp"
#include "engine/engine_test_util.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/state_fixture.hpp"

namespace zinf {
namespace {

using engine_test::seeded;
using engine_test::StateFixture;
using engine_test::whole_array;

constexpr auto kChildTimeout = std::chrono::seconds(60);

bool contains(const Status& st, const std::string& text) {
  return st.message().find(text) != std::string_view::npos;
}

std::unique_ptr<Device> limited_device(std::size_t limit_bytes) {
  HostDeviceOptions o;
  o.memory_limit_bytes = limit_bytes;
  return std::move(make_host_device(o)).value();
}

// The master is a device allocation; the two moments and the gradient accumulator are zero pages
// that count against the device's limit as well: 16 bytes an element in all. A limit a byte short
// of each prefix of them fails at create with kResourceExhausted naming the tensor that did not
// fit and its bytes, and gives back what it counted; the limit of all four holds them, and
// closing the state gives every byte back.
TEST(HostStateMemory, ZeroPagesCountAgainstTheHostDeviceLimit) {
  StateFixture f(6'000, 2'000, {.base_frozen = true});
  const std::size_t bytes = f.layout_.partition_elements() * sizeof(float);
  ASSERT_GT(bytes, 0u);
  struct Short {
    std::size_t limit_bytes;
    const char* tensor;
  };
  for (const Short& s : {Short{2 * bytes - 1, "exp_avg"}, Short{3 * bytes - 1, "exp_avg_sq"},
                         Short{4 * bytes - 1, "gradients"}}) {
    std::unique_ptr<Device> device = limited_device(s.limit_bytes);
    Result<std::unique_ptr<OptimizerState>> state = open_host_state(f.context(device.get()));
    ASSERT_FALSE(state.is_ok()) << "limit " << s.limit_bytes << " holds the state";
    EXPECT_EQ(state.status().code(), Code::kResourceExhausted) << state.status().to_string();
    EXPECT_TRUE(contains(state.status(), std::string("optimizer state ") + s.tensor + " "))
        << state.status().to_string();
    EXPECT_TRUE(contains(state.status(), std::to_string(bytes) + " bytes"))
        << state.status().to_string();
    EXPECT_EQ(device->memory_used_bytes(), 0u) << s.tensor;
  }
  std::unique_ptr<Device> device = limited_device(4 * bytes);
  Result<std::unique_ptr<OptimizerState>> state = open_host_state(f.context(device.get()));
  ASSERT_TRUE(state.is_ok()) << state.status().to_string();
  EXPECT_EQ(device->memory_used_bytes(), 4 * bytes);
  MemoryReport report;
  (*state)->add_memory(report);
  EXPECT_EQ(report.device_bytes, 4 * bytes);
  (*state).reset();
  EXPECT_EQ(device->memory_used_bytes(), 0u);
}

// The kernel refusing a zero-page mapping (here: the address space limit, RLIMIT_AS, lowered so
// that the master and the first moment fit and the second does not) fails the create with
// kResourceExhausted naming the tensor and the bytes, rather than ending the process. Run in a
// forked child, whose address space limit the rest of the tests do not share; the child makes
// the fixture itself (a fork copies only the forking thread, so the fixture's threads must start
// after it) and reports the partition's bytes and the status through a pipe. Which of the three
// zero-page tensors (exp_avg, exp_avg_sq, gradients) meets the limit depends on how much of the
// master the allocator finds in memory it already holds, so any of them is accepted.
TEST(HostStateMemory, AMappingTheKernelRefusesIsAStatus) {
  if (test::kThreadSanitizer || test::kAddressSanitizer) {
    GTEST_SKIP() << "limits the address space, which a sanitizer's shadow memory fills";
  }
  const test::ChildEnd child = test::in_child(
      [](int fd) {
        // 16 MiB an array: far more than what the create allocates besides them.
        StateFixture f(std::size_t{3} << 20, std::size_t{1} << 20, {.base_frozen = false});
        const std::size_t bytes = f.layout_.partition_elements() * sizeof(float);
        unsigned long long vm_pages = 0;
        std::FILE* statm = std::fopen("/proc/self/statm", "r");
        if (statm == nullptr || std::fscanf(statm, "%llu", &vm_pages) != 1) return 2;
        std::fclose(statm);
        const std::size_t vm_bytes = vm_pages * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
        // Room for the master and exp_avg, and 4 MiB besides: not for exp_avg_sq.
        rlimit as{};
        as.rlim_cur = as.rlim_max = vm_bytes + 2 * bytes + (std::size_t{4} << 20);
        if (::setrlimit(RLIMIT_AS, &as) != 0) return 3;
        Result<std::unique_ptr<OptimizerState>> state = open_host_state(f.context(nullptr));
        const std::string out =
            std::to_string(bytes) + "|" +
            (state.is_ok() ? std::string("ok")
                           : std::to_string(static_cast<int>(state.status().code())) + "|" +
                                 std::string(state.status().message()));
        const ssize_t written = ::write(fd, out.data(), out.size());
        // Ends here, under the lowered limit, without the fixture's teardown: its outcome is not
        // what the test asks about.
        ::_exit(written == static_cast<ssize_t>(out.size()) ? 0 : 4);
      },
      kChildTimeout);
  const std::string& got = child.output;
  ASSERT_TRUE(child.ended) << "the child did not end within " << kChildTimeout.count()
                           << " s and was killed; it wrote: " << got;
  ASSERT_TRUE(WIFEXITED(child.wstatus)) << "the child ended by signal " << WTERMSIG(child.wstatus);
  ASSERT_EQ(WEXITSTATUS(child.wstatus), 0);
  const std::size_t bar = got.find('|');
  ASSERT_NE(bar, std::string::npos) << got;
  const std::string bytes = got.substr(0, bar);
  const std::string status = got.substr(bar + 1);
  EXPECT_EQ(status.substr(0, status.find('|')),
            std::to_string(static_cast<int>(Code::kResourceExhausted)))
      << got;
  const bool named = status.find("optimizer state exp_avg ") != std::string::npos ||
                     status.find("optimizer state exp_avg_sq ") != std::string::npos ||
                     status.find("optimizer state gradients ") != std::string::npos;
  EXPECT_TRUE(named) << got;
  EXPECT_NE(status.find(bytes + " bytes"), std::string::npos) << got;
}

// The frozen range of both moments and of the gradient accumulator is advised off transparent
// huge pages ("nh" in its mapping's flags), so that with THP "always" the first write into the
// trainable range beside it does not fault in 2 MiB pages over its zeros; the trainable range is
// not advised.
TEST(HostStateMemory, TheFrozenRangesAreAdvisedOffHugePages) {
  const bool advised = engine_test::kernel_advises_no_huge_pages();
  if (HasFailure()) return;  // the probe's mapping was refused: not a reason to skip
  if (!advised) GTEST_SKIP() << engine_test::kNoHugePageAdvice;
  // 8 MiB of frozen elements, 4 MiB of trainable ones an array.
  StateFixture f(std::size_t{2} << 20, std::size_t{1} << 20, {.base_frozen = true});
  Result<std::unique_ptr<OptimizerState>> opened = open_host_state(f.context(nullptr));
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  OptimizerState& state = **opened;
  for (const float* a : {whole_array(state, Piece::kExpAvg), whole_array(state, Piece::kExpAvgSq),
                         static_cast<const float*>(state.grad_target().accumulator)}) {
    engine_test::expect_huge_page_advice(f.layout_, a, /*frozen_advised=*/true);
  }
}

// After a step, the trainable f32 groups are narrowed from the master into the publish buffer
// and written to their shards; a frozen group is neither: no step changes its master, so the
// buffer holds it since place_initial(). The frozen group's buffer is overwritten after the
// first step: the second step leaves it so, while the trainable group's is the new master.
TEST(HostStatePublish, AStepDoesNotNarrowAFrozenGroupAgain) {
  StateFixture f(5'000, 3'000, {.base_frozen = true});
  const Status attached = f.attach_coordinator();
  ASSERT_TRUE(attached.is_ok()) << attached.to_string();
  Result<std::unique_ptr<OptimizerState>> opened = open_host_state(f.context(nullptr));
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  OptimizerState& state = **opened;
  ASSERT_TRUE(state.place_initial().is_ok());

  std::uint32_t frozen = UINT32_MAX, trained = UINT32_MAX;
  for (std::uint32_t g = 0; g < f.layout_.group_count(); ++g) {
    ASSERT_EQ(f.layout_.group(g).dtype, DType::kF32);
    (f.layout_.frozen_group(g) ? frozen : trained) = g;
  }
  ASSERT_NE(frozen, UINT32_MAX);
  ASSERT_NE(trained, UINT32_MAX);
  auto group_bytes = [&](std::uint32_t g) {
    return f.layout_.group(g).shard_element_count * sizeof(float);
  };
  auto master_of = [&](std::uint32_t g) {
    std::vector<float> out(f.layout_.group(g).shard_element_count);
    Status st = state.read_state(Piece::kParams, [&](std::size_t, std::size_t, const float* v) {
      std::memcpy(out.data(), v + f.layout_.offset(g), out.size() * sizeof(float));
      return Status::ok();
    });
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return out;
  };
  auto buffer_of = [&](std::uint32_t g) {
    std::vector<float> out(f.layout_.group(g).shard_element_count);
    std::memcpy(out.data(), f.publisher_.buffer(g), group_bytes(g));
    return out;
  };
  ASSERT_EQ(buffer_of(frozen), master_of(frozen));

  // The trainable group's gradients; the frozen slice of the accumulator stays zero.
  auto step = [&](std::int64_t t) {
    const GradTarget target = state.grad_target();
    ASSERT_FALSE(target.on_device);
    const std::vector<float> g =
        seeded(f.layout_.group(trained).shard_element_count, 100 + t, -1.0f, 1.0f);
    std::memcpy(target.accumulator + f.layout_.offset(trained), g.data(), group_bytes(trained));
    ASSERT_TRUE(state.step(t, 1.0f).is_ok());
    ASSERT_TRUE(state.publish_step().is_ok());
  };
  const std::vector<float> trained_before = master_of(trained);
  step(1);
  EXPECT_NE(master_of(trained), trained_before);
  EXPECT_EQ(buffer_of(trained), master_of(trained));
  EXPECT_EQ(buffer_of(frozen), master_of(frozen));

  const std::vector<float> marker = seeded(f.layout_.group(frozen).shard_element_count, 7, 5, 6);
  std::memcpy(f.publisher_.buffer(frozen), marker.data(), group_bytes(frozen));
  step(2);
  EXPECT_EQ(buffer_of(trained), master_of(trained));
  EXPECT_EQ(buffer_of(frozen), marker) << "the frozen group was narrowed again";
  // The frozen master is the registered values (and the group's padding, zeros), bit for bit.
  std::vector<float> frozen_master = f.values_[0];
  frozen_master.resize(f.layout_.group(frozen).shard_element_count, 0.0f);
  EXPECT_EQ(master_of(frozen), frozen_master);
}

}  // namespace
}  // namespace zinf
