// The activation store (lib/engine/activation_store.hpp) on HostDevice with seeded random data:
// every tier gives back the bytes it was given, over several steps (the recorded order's
// read-ahead and the staging blocks reused); the host budget spills to NVMe; misuse is refused
// naming the key; and through the Engine with two ranks, an EIO on one rank's read-back fails
// that rank naming the activation and every other rank at its next collective, without a hang.
#include "engine/activation_store.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "engine_test_util.hpp"
#include "io/fault.hpp"
#include "zinf/engine.hpp"

namespace zinf {
namespace {

constexpr std::uint64_t kSeed = 2026;

std::unique_ptr<Device> host_device() {
  Result<std::unique_ptr<Device>> device = make_host_device();
  EXPECT_TRUE(device.is_ok()) << device.status().to_string();
  return std::move(device).value();
}

DeviceBuffer alloc(Device& device, std::size_t bytes) {
  Result<DeviceBuffer> buffer = DeviceBuffer::allocate(device, bytes);
  EXPECT_TRUE(buffer.is_ok()) << buffer.status().to_string();
  return std::move(buffer).value();
}

// Seeded random bytes for activation `index` of step `step`.
std::vector<std::byte> pattern(std::size_t bytes, int step, int index) {
  SplitMix64 rng(kSeed * 1000003 + std::uint64_t(step) * 131 + std::uint64_t(index));
  std::vector<std::byte> out(bytes);
  for (std::size_t i = 0; i < bytes; ++i) out[i] = std::byte(rng.next() >> 56);
  return out;
}

struct StoreRun {
  ActivationStoreReport report;
  int mismatches = 0;
};

// `steps` forward/backward passes: activations of `sizes` saved in order from device memory, then
// loaded in reverse into other device memory and compared with what was saved.
StoreRun run_store(const ActivationStoreOptions& options, const std::vector<std::size_t>& sizes,
                   int steps) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(kSeed));
  StoreRun run;
  std::unique_ptr<Device> device = host_device();
  Result<std::unique_ptr<ActivationStore>> store = ActivationStore::create(*device, options);
  EXPECT_TRUE(store.is_ok()) << store.status().to_string();
  if (!store.is_ok()) return run;
  std::size_t largest = 0;
  for (std::size_t s : sizes) largest = std::max(largest, s);
  // Two source buffers, alternated as a forward pass would (the store's contract).
  DeviceBuffer source[2] = {alloc(*device, largest), alloc(*device, largest)};
  DeviceBuffer target = alloc(*device, largest);
  for (int step = 0; step < steps; ++step) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::vector<std::byte> data = pattern(sizes[i], step, int(i));
      std::memcpy(source[i % 2].data(), data.data(), sizes[i]);
      Status st = (*store)->save(fmt::format("layer{}", i), source[i % 2].data(), sizes[i]);
      EXPECT_TRUE(st.is_ok()) << st.to_string();
    }
    // The sources are overwritten at once: the store must have its own copies.
    EXPECT_TRUE((*store)->flush().is_ok());
    std::memset(source[0].data(), 0x5a, largest);
    std::memset(source[1].data(), 0xa5, largest);
    for (std::size_t i = sizes.size(); i-- > 0;) {
      std::memset(target.data(), 0, largest);
      Status st = (*store)->load(fmt::format("layer{}", i), target.data());
      EXPECT_TRUE(st.is_ok()) << st.to_string();
      const std::vector<std::byte> data = pattern(sizes[i], step, int(i));
      if (std::memcmp(target.data(), data.data(), sizes[i]) != 0) {
        ++run.mismatches;
        ADD_FAILURE() << "step " << step << ", layer" << i << ": bytes differ";
      }
      EXPECT_EQ((*store)->saved_bytes(fmt::format("layer{}", i)), 0u);
    }
  }
  run.report = (*store)->report();
  return run;
}

// Sizes that are not multiples of anything: several staging chunks, partial swap blocks.
const std::vector<std::size_t> kSizes = {300'001, 65'536, 4'097, 200'000, 131'072, 77};

ActivationStoreOptions nvme_options(const std::string& dir) {
  ActivationStoreOptions o;
  o.offload = true;
  o.host_bytes = 0;
  o.nvme_dir = dir;
  o.nvme_bytes = 4 << 20;
  o.aio_block_bytes = 64 << 10;
  o.staging_bytes = 128 << 10;
  o.staging_count = 3;
  return o;
}

TEST(ActivationStore, DeviceCopiesComeBackAndAreCountedOnTheDevice) {
  ActivationStoreOptions o;  // offload false: device copies
  const StoreRun run = run_store(o, kSizes, 3);
  EXPECT_EQ(run.mismatches, 0);
  std::uint64_t total = 0;
  for (std::size_t s : kSizes) total += s;
  EXPECT_EQ(run.report.device_bytes, 0u);  // every copy freed at its load
  EXPECT_EQ(run.report.device_bytes_peak, total);
  EXPECT_EQ(run.report.host_bytes, 0u);
  EXPECT_EQ(run.report.saves, 3 * kSizes.size());
  EXPECT_EQ(run.report.loads, 3 * kSizes.size());
}

TEST(ActivationStore, HostArenaRoundTripKeepsTheDeviceFree) {
  ActivationStoreOptions o;
  o.offload = true;
  o.host_bytes = 1 << 20;
  const StoreRun run = run_store(o, kSizes, 3);
  EXPECT_EQ(run.mismatches, 0);
  EXPECT_EQ(run.report.device_bytes_peak, 0u);
  EXPECT_GE(run.report.host_used_bytes_peak, 300'001u + 65'536 + 4'097 + 200'000 + 131'072 + 77);
  EXPECT_EQ(run.report.nvme_write_bytes, 0u);
}

TEST(ActivationStore, NvmeRoundTripReadsAheadFromTheSecondStep) {
  engine_test::ScratchDir dir("activation_nvme");
  const StoreRun run = run_store(nvme_options(dir.path()), kSizes, 3);
  EXPECT_EQ(run.mismatches, 0);
  EXPECT_EQ(run.report.device_bytes_peak, 0u);
  EXPECT_GT(run.report.nvme_write_bytes, 0u);
  EXPECT_GT(run.report.nvme_read_bytes, 0u);
  // The last saved chunks are still staged when the backward starts, and later ones are read
  // ahead in the recorded order: most chunks are found ready.
  EXPECT_GT(run.report.prefetch_hits, 3u * 3u);
  // The swap file goes with the store.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(ActivationStore, HostBudgetSpillsToNvme) {
  engine_test::ScratchDir dir("activation_spill");
  ActivationStoreOptions o = nvme_options(dir.path());
  o.host_bytes = 400'000;  // the first activation fits, then the arena is full
  const StoreRun run = run_store(o, kSizes, 2);
  EXPECT_EQ(run.mismatches, 0);
  EXPECT_LE(run.report.host_used_bytes_peak, 400'000u);
  EXPECT_GT(run.report.host_used_bytes_peak, 300'000u);
  EXPECT_GT(run.report.nvme_write_bytes, 0u);
  EXPECT_GT(run.report.nvme_bytes, 0u);
}

TEST(ActivationStore, OutOfOrderLoadsGiveTheRightBytes) {
  engine_test::ScratchDir dir("activation_order");
  std::unique_ptr<Device> device = host_device();
  ActivationStoreOptions o = nvme_options(dir.path());
  o.host_bytes = 100'000;
  auto store = std::move(ActivationStore::create(*device, o)).value();
  DeviceBuffer a = alloc(*device, 300'001);
  DeviceBuffer b = alloc(*device, 300'001);
  for (int step = 0; step < 2; ++step) {
    for (int i = 0; i < 4; ++i) {
      const std::size_t bytes = i % 2 == 0 ? 300'001 : 50'000;
      const std::vector<std::byte> data = pattern(bytes, step, i);
      DeviceBuffer& src = i % 2 == 0 ? a : b;
      ASSERT_TRUE(store->flush().is_ok());
      std::memcpy(src.data(), data.data(), bytes);
      ASSERT_TRUE(store->save(fmt::format("k{}", i), src.data(), bytes).is_ok());
    }
    for (int i : {1, 3, 0, 2}) {
      const std::size_t bytes = i % 2 == 0 ? 300'001 : 50'000;
      Status st = store->load(fmt::format("k{}", i), a.data());
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      EXPECT_EQ(std::memcmp(a.data(), pattern(bytes, step, i).data(), bytes), 0) << "k" << i;
    }
  }
}

TEST(ActivationStore, MisuseIsRefusedNamingTheKey) {
  std::unique_ptr<Device> device = host_device();
  ActivationStoreOptions o;
  o.offload = true;
  o.host_bytes = 4096;
  auto store = std::move(ActivationStore::create(*device, o)).value();
  DeviceBuffer buf = alloc(*device, 8192);
  ASSERT_TRUE(store->save("x", buf.data(), 1000).is_ok());
  Status twice = store->save("x", buf.data(), 1000);
  EXPECT_EQ(twice.code(), Code::kFailedPrecondition);
  EXPECT_NE(twice.message().find("'x'"), std::string_view::npos) << twice.to_string();
  Status missing = store->load("y", buf.data());
  EXPECT_EQ(missing.code(), Code::kNotFound);
  EXPECT_NE(missing.message().find("'y'"), std::string_view::npos) << missing.to_string();
  Status big = store->save("big", buf.data(), 8192);
  EXPECT_EQ(big.code(), Code::kResourceExhausted);
  EXPECT_NE(big.message().find("'big'"), std::string_view::npos) << big.to_string();
  EXPECT_NE(big.message().find("zinf.activation_host_bytes"), std::string_view::npos);
  // None of these is sticky: the store still works.
  ASSERT_TRUE(store->load("x", buf.data()).is_ok());

  // A key that went to NVMe keeps its extent: a larger tensor under it is refused, nothing else.
  engine_test::ScratchDir dir("activation_misuse");
  auto nvme = std::move(ActivationStore::create(*device, nvme_options(dir.path()))).value();
  ASSERT_TRUE(nvme->save("k", buf.data(), 4096).is_ok());
  ASSERT_TRUE(nvme->load("k", buf.data()).is_ok());
  Status grown = nvme->save("k", buf.data(), 8192);
  EXPECT_EQ(grown.code(), Code::kInvalidArgument);
  EXPECT_NE(grown.message().find("'k'"), std::string_view::npos) << grown.to_string();
  EXPECT_EQ(nvme->saved_bytes("k"), 0u);
  Status again = nvme->save("k", buf.data(), 4000);
  EXPECT_TRUE(again.is_ok()) << again.to_string();
  EXPECT_TRUE(nvme->load("k", buf.data()).is_ok());
}

// A pointer the device does not own (host memory, or device memory shorter than the bytes asked
// for) is refused by the device's copy before anything is copied. On every tier the refusal names
// the key, gives back what the call reserved (the device allocation, the arena space) and is not
// sticky; a refused load keeps the checkpoint, which a load into device memory then returns.
TEST(ActivationStore, RefusedCopiesChangeNothing) {
  std::printf("seed %llu\n", static_cast<unsigned long long>(kSeed));
  engine_test::ScratchDir dir("activation_refused");
  // Three NVMe staging chunks of 128 KiB; the arena holds one checkpoint, not two.
  const std::size_t bytes = 300'001;
  const std::size_t short_bytes = 150'000;  // the second chunk's copy is the one refused
  struct Tier {
    const char* name;
    ActivationStoreOptions options;
  };
  ActivationStoreOptions on_device;
  ActivationStoreOptions in_arena;
  in_arena.offload = true;
  in_arena.host_bytes = bytes;
  std::vector<Tier> tiers = {
      {"device", on_device}, {"arena", in_arena}, {"nvme", nvme_options(dir.path())}};
  for (const Tier& tier : tiers) {
    SCOPED_TRACE(tier.name);
    std::unique_ptr<Device> device = host_device();
    auto store = std::move(ActivationStore::create(*device, tier.options)).value();
    DeviceBuffer src = alloc(*device, bytes);
    DeviceBuffer dst = alloc(*device, bytes);
    DeviceBuffer short_buf = alloc(*device, short_bytes);
    std::vector<std::byte> host = pattern(bytes, 9, 0);
    const std::vector<std::byte> host_before = host;
    const std::size_t used_before = device->memory_used_bytes();

    // Saves from memory the device refuses to copy from.
    for (const auto& [key, from] : {std::pair<std::string, const void*>{"from.host", host.data()},
                                    {"from.short", short_buf.data()}}) {
      Status st = store->save(key, from, bytes);
      EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
      EXPECT_NE(st.message().find("'" + key + "'"), std::string_view::npos) << st.to_string();
      EXPECT_EQ(store->saved_bytes(key), 0u);
      EXPECT_EQ(device->memory_used_bytes(), used_before);
    }
    EXPECT_EQ(store->report().device_bytes, 0u);
    EXPECT_EQ(store->report().device_bytes_peak, 0u);
    EXPECT_EQ(store->report().saves, 0u);
    Status flushed = store->flush();
    EXPECT_TRUE(flushed.is_ok()) << flushed.to_string();

    // Another key from device memory: saved (in the arena's only place) and loaded back.
    const std::vector<std::byte> good = pattern(bytes, 9, 1);
    std::memcpy(src.data(), good.data(), bytes);
    Status saved = store->save("good", src.data(), bytes);
    ASSERT_TRUE(saved.is_ok()) << saved.to_string();
    ASSERT_TRUE(store->flush().is_ok());
    std::memset(src.data(), 0x5a, bytes);
    Status loaded = store->load("good", dst.data());
    ASSERT_TRUE(loaded.is_ok()) << loaded.to_string();
    EXPECT_EQ(std::memcmp(dst.data(), good.data(), bytes), 0);

    // Loads into memory the device refuses to copy to keep the checkpoint.
    const std::vector<std::byte> kept = pattern(bytes, 9, 2);
    std::memcpy(src.data(), kept.data(), bytes);
    ASSERT_TRUE(store->save("kept", src.data(), bytes).is_ok());
    ASSERT_TRUE(store->flush().is_ok());
    std::memset(src.data(), 0xa5, bytes);
    for (void* into : {static_cast<void*>(host.data()), short_buf.data()}) {
      Status st = store->load("kept", into);
      EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
      EXPECT_NE(st.message().find("'kept'"), std::string_view::npos) << st.to_string();
      EXPECT_EQ(store->saved_bytes("kept"), bytes);
    }
    EXPECT_EQ(host, host_before);
    std::memset(dst.data(), 0, bytes);
    loaded = store->load("kept", dst.data());
    ASSERT_TRUE(loaded.is_ok()) << loaded.to_string();
    EXPECT_EQ(std::memcmp(dst.data(), kept.data(), bytes), 0);
    EXPECT_EQ(store->saved_bytes("kept"), 0u);

    EXPECT_EQ(device->memory_used_bytes(), used_before);
    const ActivationStoreReport report = store->report();
    EXPECT_EQ(report.device_bytes, 0u);
    EXPECT_EQ(report.device_bytes_peak, tier.options.offload ? 0u : bytes);
    EXPECT_EQ(report.saves, 2u);
    EXPECT_EQ(report.loads, 2u);
    EXPECT_TRUE(store->flush().is_ok());
  }
}

// Two ranks through the Engine, the checkpoints on NVMe; rank 0's drive fails every read. Rank 0's
// load fails with io_error naming the activation; rank 1, whose load succeeded, fails at its next
// collective with rank 0's error, at once (the collective timeout is 30 s).
TEST(EngineActivations, EioOnReadBackFailsEveryRankNamingTheActivation) {
  engine_test::ScratchDir dir("activation_eio");
  Config config = engine_test::small_config(3, OffloadDevice::kNone, OffloadDevice::kNone, "");
  config.activations.cpu_checkpointing = true;
  config.activations.host_bytes = 0;
  config.activations.nvme_path = dir.path();
  config.activations.nvme_bytes = 8 << 20;
  const engine_test::Model model = engine_test::make_model(DType::kF32, 7);
  engine_test::Ranks ranks = engine_test::make_ranks(2, std::chrono::seconds(30));
  FaultSpec spec;
  spec.seed = kSeed;
  spec.eio_rate = 1.0;
  spec.writes = false;
  std::printf("fault seed %llu\n", static_cast<unsigned long long>(spec.seed));
  auto faults = std::make_shared<FaultInjector>(spec);
  Status load_status[2], later_status[2];
  double seconds[2] = {0, 0};
  std::vector<Status> results = engine_test::run_ranks(2, [&](int rank) -> Status {
    Env env;
    env.device = ranks.devices[std::size_t(rank)].get();
    env.comm = ranks.comms[std::size_t(rank)].get();
    if (rank == 0) env.io_faults = faults;
    ZINF_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::open(config, env));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
    ZINF_RETURN_IF_ERROR(engine->finalize());
    // Six checkpoints of 1 MiB through the four staging blocks: the first ones are written out
    // and their blocks reused, so loading block0.input must read it back from the drive.
    const std::size_t bytes = 1 << 20;
    ZINF_ASSIGN_OR_RETURN(DeviceBuffer a, DeviceBuffer::allocate(*env.device, bytes));
    ZINF_ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::allocate(*env.device, bytes));
    for (int i = 0; i < 6; ++i) {
      DeviceBuffer& src = i % 2 == 0 ? a : b;
      ZINF_RETURN_IF_ERROR(engine->flush_activations());
      const std::vector<std::byte> data = pattern(bytes, rank, i);
      std::memcpy(src.data(), data.data(), bytes);
      ZINF_RETURN_IF_ERROR(
          engine->save_activation(fmt::format("block{}.input", i), src.data(), bytes));
    }
    const auto start = std::chrono::steady_clock::now();
    Status st = engine->load_activation("block0.input", a.data());
    load_status[rank] = st;
    std::vector<float> out(model.params[0].element_count());
    later_status[rank] = engine->read_parameters(model.params[0].name, out.data());
    seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return Status::ok();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(results[std::size_t(r)].is_ok()) << results[std::size_t(r)].to_string();
    EXPECT_LT(seconds[r], 10.0) << "rank " << r;
    std::printf("rank %d: load %s; later %s (%.2f s)\n", r, load_status[r].to_string().c_str(),
                later_status[r].to_string().c_str(), seconds[r]);
  }
  EXPECT_GT(faults->counts().eio, 0u);
  EXPECT_EQ(load_status[0].code(), Code::kIoError) << load_status[0].to_string();
  EXPECT_NE(load_status[0].message().find("block0.input"), std::string_view::npos)
      << load_status[0].to_string();
  EXPECT_EQ(load_status[0].sys_code(), EIO) << load_status[0].to_string();
  EXPECT_FALSE(later_status[0].is_ok());
  EXPECT_NE(later_status[0].message().find("block0.input"), std::string_view::npos)
      << later_status[0].to_string();
  EXPECT_TRUE(load_status[1].is_ok()) << load_status[1].to_string();
  EXPECT_FALSE(later_status[1].is_ok());
  EXPECT_NE(later_status[1].message().find("block0.input"), std::string_view::npos)
      << later_status[1].to_string();
  EXPECT_NE(later_status[1].message().find("rank 0"), std::string_view::npos)
      << later_status[1].to_string();
}

}  // namespace
}  // namespace zinf
