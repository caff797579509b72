// A frozen run's fp32 master kept as its half copy alone in device memory (DeviceOptimizer,
// offload_optimizer "none" on a device that is not host-accessible: device_optimizer.hpp), on an
// opaque HostDevice that runs the kernels' scalar references. A partition whose master the half
// dtype holds exactly (every element rounded to bf16 first, as a base weight loaded from bf16
// is): the frozen runs of the bf16 groups keep no master (the device bytes drop by 4 an element,
// less the alignment of the packed master, worked out by hand below), the f32 group's frozen run
// keeps its own, and the master, moments and half copies read back, through steps, are the bits
// of an optimizer told of no frozen run (which keeps every master and steps every run). A
// checkpoint read back and written into a fresh optimizer reads back the same bytes and keeps it
// half-only; a value the half dtype does not hold, written into a frozen run, and non-zero
// moments written into one, give the master back, with the values written.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "device/device_ops.hpp"
#include "engine/device_frozen_half_only_test_util.hpp"
#include "engine/device_optimizer.hpp"
#include "engine/device_optimizer_test_util.hpp"
#include "engine/engine_test_util.hpp"
#include "tier/state_store.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using device_optimizer_test::DeviceOptimizerFrozen;
using device_optimizer_test::DeviceOptimizerFrozenSteps;
using device_optimizer_test::FaultDeviceTest;
using device_optimizer_test::frozen_count;
using device_optimizer_test::frozen_elements;
using device_optimizer_test::frozen_flags;
using device_optimizer_test::kDefaultPartition;
using device_optimizer_test::kFrozenGroupElements;
using device_optimizer_test::kPartition;
using device_optimizer_test::kTimeout;
using device_optimizer_test::make_packed;
using device_optimizer_test::rounded_to_half;
using engine_test::seeded;

// kDefaultPartition's frozen runs of its bf16 groups: [1024, 2048), [4000, 6003),
// [9003, 11'003) and [13'006, 14'011). Its frozen run of the f32 group, [6003, 7603), keeps its
// master.
constexpr std::size_t kHalfOnlyElements = 1024 + 2003 + 2000 + 1005;
// The packed master: [0, 1024) at 0; [2048, 4000) after the gap at 1024 (congruent to 2048
// modulo 16), ending at 2976; [6003, 9003) (the f32 group's two runs, one after the other) at
// 2979 (2976 rounded up to 16, plus 6003 mod 16 = 3), ending at 5979; [11'003, 13'006) at 5995
// (5984 plus 11'003 mod 16 = 11), ending at 7998: 7998 elements, the 7979 kept and 3 + 16 to
// align them.
constexpr std::size_t kMasterAlignment = 3 + 16;

// Seeded values in [-1, 1) rounded to bf16 (each x then equals widen(narrow(x))).
std::vector<float> exact_bf16(std::uint64_t seed) {
  return rounded_to_half(seeded(kPartition, seed, -1.0f, 1.0f), DType::kBF16);
}

// The fixture's optimizers over a master bf16 holds exactly: packed_ (told of the frozen runs)
// keeps the bf16 groups' frozen runs half-only, full_ (told of none) keeps every master.
class DeviceFrozenHalfOnly : public DeviceOptimizerFrozenSteps {
 protected:
  void SetUp() override {
    master_ = exact_bf16(8301);
    DeviceOptimizerFrozenSteps::SetUp();
  }
  // An optimizer told of the frozen runs over `master`.
  std::unique_ptr<DeviceOptimizer> make(const std::vector<float>& master) {
    return std::move(make_packed(*device_, partition_, master)).value();
  }
  void expect_frozen_master(DeviceOptimizer& o, const std::vector<float>& expected) {
    const std::vector<float> m = read(o, 0);
    const std::vector<bool> frozen = frozen_elements();
    for (std::size_t e = 0; e < kPartition; ++e) {
      if (!frozen[e]) continue;
      ASSERT_EQ(std::memcmp(&m[e], &expected[e], 4), 0) << "element " << e;
    }
  }
};

// The bf16 frozen runs take no master: 4 bytes an element less than the same partition over a
// master bf16 does not hold (whose frozen runs keep theirs), but for the packed master's
// alignment; the f32 frozen run keeps its master. Three steps give the full optimizer's bits.
TEST_F(DeviceFrozenHalfOnly, HalfOnlyRunsTakeNoMasterAndStepTheSameBits) {
  const std::unique_ptr<DeviceOptimizer> drawn = make(seeded(kPartition, 8301, -1.0f, 1.0f));
  EXPECT_EQ(packed_->half_only_elements(), kHalfOnlyElements);
  EXPECT_EQ(drawn->half_only_elements(), 0u);
  EXPECT_EQ(full_->half_only_elements(), 0u);
  std::printf("device bytes: frozen masters kept %llu, half-only %llu (%zu elements)\n",
              static_cast<unsigned long long>(drawn->device_bytes()),
              static_cast<unsigned long long>(packed_->device_bytes()), kHalfOnlyElements);
  EXPECT_EQ(packed_->device_bytes() + kHalfOnlyElements * 4,
            drawn->device_bytes() + kMasterAlignment * 4);
  // Against the full optimizer (every moment, every gradient slot): the frozen moments, the
  // frozen group's gradients, and the half-only masters are not kept; the moments' alignment
  // (3 + 16 elements, 8 bytes each), the gradients' (3) and the master's are.
  EXPECT_EQ(packed_->device_bytes() + frozen_count() * 8 + kFrozenGroupElements * 4 +
                kHalfOnlyElements * 4,
            full_->device_bytes() + (3 + 16) * 8 + 3 * 4 + kMasterAlignment * 4);
  expect_frozen_master(*packed_, master_);
  for (std::int64_t step = 1; step <= 3; ++step) {
    set_grads(1300 + static_cast<std::uint64_t>(step));
    EXPECT_EQ(packed_->sum_of_squares().value(), full_->sum_of_squares().value()) << step;
    step_both(step);
  }
  expect_same("three steps");
  expect_frozen_master(*packed_, master_);
  EXPECT_EQ(packed_->half_only_elements(), kHalfOnlyElements);
  // The f32 group's values (its master, packed after the half-only run before it) are the full
  // optimizer's.
  std::vector<float> a(3000), b(3000);
  ASSERT_TRUE(device_->copy_d2h(a.data(), packed_->values(2), a.size() * 4, *stream_).is_ok());
  ASSERT_TRUE(device_->copy_d2h(b.data(), full_->values(2), b.size() * 4, *stream_).is_ok());
  ASSERT_TRUE(device_->synchronize(*stream_, kTimeout).is_ok());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
}

// Every group f32: a frozen run whose values bf16 would hold keeps its master all the same: the
// device bytes are those over a master bf16 does not hold, and the master reads back.
TEST_F(DeviceFrozenHalfOnly, FrozenRunsOfAnF32GroupKeepTheirMaster) {
  device_optimizer_test::Partition p = kDefaultPartition;
  for (DeviceOptimizer::Group& g : p.groups) {
    g.dtype = DType::kF32;
    g.byte_offset = 0;
  }
  auto o = std::move(make_packed(*device_, p, master_)).value();
  auto drawn = std::move(make_packed(*device_, p, seeded(kPartition, 8302, -1.0f, 1.0f))).value();
  EXPECT_EQ(o->half_only_elements(), 0u);
  EXPECT_EQ(o->device_bytes(), drawn->device_bytes());
  std::vector<float> m(kPartition);
  ASSERT_TRUE(o->read_master(0, kPartition, m.data()).is_ok());
  EXPECT_EQ(std::memcmp(m.data(), master_.data(), m.size() * 4), 0);
}

// A checkpoint (master and moments read back after steps) written into a fresh optimizer over
// another exact master: it reads back the same bytes, keeps the frozen runs half-only (zero
// moments there) and the same device bytes, and steps on as the full optimizer does.
TEST_F(DeviceFrozenHalfOnly, CheckpointRoundTripReadsBackTheSameBytes) {
  train_both(1400, 1, 2);
  std::vector<std::vector<float>> saved;
  for (int which = 0; which < 3; ++which) saved.push_back(read(*packed_, which));
  std::unique_ptr<DeviceOptimizer> loaded = make(exact_bf16(8303));
  for (int which = 0; which < 3; ++which) write(*loaded, which, saved[which]);
  EXPECT_TRUE(loaded->packed());
  EXPECT_EQ(loaded->half_only_elements(), kHalfOnlyElements);
  EXPECT_EQ(loaded->device_bytes(), packed_->device_bytes());
  for (int which = 0; which < 3; ++which) {
    const std::vector<float> again = read(*loaded, which);
    EXPECT_EQ(std::memcmp(again.data(), saved[which].data(), again.size() * 4), 0)
        << "piece " << which;
  }
  packed_ = std::move(loaded);
  train_both(1400, 3, 4);
  expect_same("loaded, two steps");
}

// A value bf16 does not hold, written into the frozen run [9003, 11'003): every half-only run
// gets its master back (the master of the whole partition, 14'011 elements, where the packed one
// had 7998), the values written read back and everything steps as the full optimizer.
TEST_F(DeviceFrozenHalfOnly, AValueTheHalfCopyDoesNotHoldGivesTheRunsTheirMaster) {
  const std::uint64_t bytes = packed_->device_bytes();
  std::vector<float> master = exact_bf16(8304);
  write(*packed_, 0, master);
  write(*full_, 0, master);
  EXPECT_EQ(packed_->half_only_elements(), kHalfOnlyElements);
  EXPECT_EQ(packed_->device_bytes(), bytes);
  expect_frozen_master(*packed_, master);
  master[9500] = std::nextafter(master[9500], 2.0f);  // one bit below bf16's
  write(*packed_, 0, master);
  write(*full_, 0, master);
  EXPECT_EQ(packed_->half_only_elements(), 0u);
  EXPECT_EQ(packed_->device_bytes(),
            bytes + (kPartition - (kPartition - kHalfOnlyElements + kMasterAlignment)) * 4);
  const std::vector<float> back = read(*packed_, 0);
  EXPECT_EQ(std::memcmp(back.data(), master.data(), back.size() * 4), 0);
  train_both(1500, 1, 2);
  expect_same("two steps");
  expect_frozen_master(*packed_, master);
}

// Writes that meet part of a run: new exact values for [9003, 10'003) (the first half of the
// half-only run [9003, 11'003)) go into its half copy, then one element at 10'500 that bf16 does
// not hold, written alone, gives every half-only run its master, widened from the half copies on
// the device: every element but the one written reads back the bits it had (the earlier piece's
// new values among them), and two steps give the full optimizer's bits.
TEST_F(DeviceFrozenHalfOnly, AnInexactElementKeepsTheOtherElementsBits) {
  std::vector<float> master = master_;
  const std::vector<float> other = exact_bf16(8306);
  std::copy(other.begin() + 9003, other.begin() + 10'003, master.begin() + 9003);
  write_both(master, 9003, 1000);
  EXPECT_EQ(packed_->half_only_elements(), kHalfOnlyElements);
  write_inexact(master, 10'500, std::nextafter(master[10'500], 2.0f));  // one bit below bf16's
  train_both(1550, 1, 2);
  expect_same("two steps");
  expect_frozen_master(*packed_, master);
}

float from_bits(std::uint32_t bits) { return std::bit_cast<float>(bits); }

// Special values in a master bf16 holds exactly but for one NaN: -0, both infinities and a quiet
// NaN whose payload lies in the bits bf16 keeps (0x7fc10000) in the half-only run [1024, 2048);
// a NaN whose payload bf16 drops (0x7fc00001: narrowed, it widens to 0x7fc00000) in the frozen
// run [4000, 6003), which then keeps its master. Every element reads back its bits, after steps
// too.
TEST_F(DeviceFrozenHalfOnly, SpecialValuesAndANaNPayloadBf16Drops) {
  std::vector<float> master = master_;
  master[1030] = -0.0f;
  master[1031] = std::numeric_limits<float>::infinity();
  master[1032] = -std::numeric_limits<float>::infinity();
  master[1033] = from_bits(0x7fc10000u);
  master[4100] = from_bits(0x7fc00001u);
  packed_ = make(master);
  EXPECT_EQ(packed_->half_only_elements(), kHalfOnlyElements - 2003);
  expect_frozen_master(*packed_, master);
  for (std::int64_t step = 1; step <= 2; ++step) {
    set_grads(1700 + static_cast<std::uint64_t>(step));
    ASSERT_TRUE(packed_->step(step, 0.5f, device_optimizer_test::group_params()).is_ok());
  }
  expect_frozen_master(*packed_, master);
}

// The f16 groups' frozen runs over a master f16 holds exactly (seeded values rounded to f16,
// with -0, both infinities, f16's largest finite value and subnormals among them): half-only as
// bf16's are, their half copy the f16 bits, and the same bits as the full optimizer through
// steps. 65520 (the smallest float that f16 rounds to infinity) written into one element gives
// every run its master, and every element reads back what was written.
class DeviceFrozenHalfOnlyF16 : public DeviceOptimizerFrozenSteps {
 protected:
  void SetUp() override {
    for (DeviceOptimizer::Group& g : partition_.groups) {
      if (g.dtype == DType::kBF16) g.dtype = DType::kF16;
    }
    master_ = rounded_to_half(seeded(kPartition, 8321, -1.0f, 1.0f), DType::kF16);
    master_[1030] = -0.0f;
    master_[1031] = std::numeric_limits<float>::infinity();
    master_[1032] = -std::numeric_limits<float>::infinity();
    master_[1033] = 65504.0f;                   // f16's largest finite value
    master_[1034] = std::ldexp(1.0f, -24);      // f16's smallest subnormal
    master_[1035] = -std::ldexp(1023.0f, -24);  // its largest
    master_[1036] = std::ldexp(3.0f, -20);      // a subnormal between
    DeviceOptimizerFrozenSteps::SetUp();
  }
};

TEST_F(DeviceFrozenHalfOnlyF16, HalfOnlyRunsHoldTheF16BitsAndAnOverflowGivesMastersBack) {
  EXPECT_EQ(packed_->half_only_elements(), kHalfOnlyElements);
  const std::vector<float> back = read(*packed_, 0);
  EXPECT_EQ(std::memcmp(back.data(), master_.data(), back.size() * 4), 0);
  const std::vector<std::uint16_t> copy = half(*packed_, 0);
  for (std::size_t e = 1024; e < 2048; ++e) {
    ASSERT_EQ(copy[e], f32_to_f16(master_[e])) << "element " << e;
  }
  train_both(1800, 1, 2);
  expect_same("two steps");
  std::vector<float> master = read(*full_, 0);
  write_inexact(master, 1040, 65520.0f);
  train_both(1800, 3, 4);
  expect_same("65520 written, two steps");
}

// An opaque HostDevice of `limit_bytes` (HostDeviceOptions' default when 0).
std::unique_ptr<Device> opaque_device(std::size_t limit_bytes = 0) {
  HostDeviceOptions options;
  options.opaque = true;
  if (limit_bytes != 0) options.memory_limit_bytes = limit_bytes;
  return std::move(make_host_device(options)).value();
}

// The device memory a load of values bf16 does not hold needs, written in pieces of 1000
// elements as a checkpoint load writes its chunks, on a device whose limit holds the optimizer,
// the packed master and the whole partition's master at once, and no more: the first piece
// that meets a value the half copy does not hold gives every half-only run its master in one
// reallocation, so the load fits (where giving each run its master as a piece meets it would
// copy the growing master once per run and need more). The error of a device one byte smaller
// names the element and the run.
TEST(DeviceFrozenHalfOnlyLimit, ALoadOfInexactValuesFitsTheOldAndTheWholeMaster) {
  const device_optimizer_test::Partition& p = kDefaultPartition;
  const std::vector<float> exact = exact_bf16(8311);
  const std::vector<float> drawn = seeded(kPartition, 8312, -1.0f, 1.0f);
  auto load = [&](std::size_t limit_bytes, std::uint64_t* used_bytes) -> Status {
    std::unique_ptr<Device> device = opaque_device(limit_bytes);
    Result<std::unique_ptr<DeviceOptimizer>> o = make_packed(*device, p, exact);
    if (!o.is_ok()) return o.status();
    EXPECT_EQ(o.value()->half_only_elements(), kHalfOnlyElements);
    *used_bytes = device->memory_used_bytes();
    for (std::size_t first = 0; first < kPartition; first += 1000) {
      const std::size_t count = std::min<std::size_t>(1000, kPartition - first);
      ZINF_RETURN_IF_ERROR(o.value()->write_state(0, first, count, drawn.data() + first));
    }
    EXPECT_EQ(o.value()->half_only_elements(), 0u);
    std::vector<float> back(kPartition);
    ZINF_RETURN_IF_ERROR(o.value()->read_master(0, kPartition, back.data()));
    EXPECT_EQ(std::memcmp(back.data(), drawn.data(), back.size() * 4), 0);
    return Status::ok();
  };
  std::uint64_t used_bytes = 0;
  ASSERT_TRUE(load(std::size_t{1} << 30, &used_bytes).is_ok());
  // At the reallocation: everything the optimizer held, and the whole partition's master.
  const std::size_t peak_bytes = used_bytes + kPartition * sizeof(float);
  std::printf("device bytes: optimizer %llu, peak of the load %zu\n",
              static_cast<unsigned long long>(used_bytes), peak_bytes);
  const Status fits = load(peak_bytes, &used_bytes);
  EXPECT_TRUE(fits.is_ok()) << fits.to_string();
  const Status short_by_one = load(peak_bytes - 1, &used_bytes);
  EXPECT_EQ(short_by_one.code(), Code::kResourceExhausted) << short_by_one.to_string();
  EXPECT_NE(short_by_one.message().find("partition element 1024 (dtype group 0, parameter group "
                                        "2, frozen run [1024, 2048))"),
            std::string::npos)
      << short_by_one.to_string();
}

// Moments saved with every run trainable (non-zero on the frozen runs), written: every run is
// stepped from then on, so every half-only run gets its master (the master of the whole
// partition, as the full optimizer's), and the steps give the full optimizer's bits.
TEST_F(DeviceFrozenHalfOnly, LoadedMomentsGiveEveryRunItsMaster) {
  set_grads(1600);
  step_both(1);
  for (int which = 1; which < 3; ++which) {
    const std::vector<float> v =
        seeded(kPartition, 8305 + static_cast<std::uint64_t>(which), 0.01f, 0.1f);
    write(*packed_, which, v);
    write(*full_, which, v);
  }
  EXPECT_FALSE(packed_->packed());
  EXPECT_EQ(packed_->half_only_elements(), 0u);
  // As the full optimizer: every master and moment; the gradients without the second group (and
  // their 3-element alignment gap), a zero buffer of that group's run (and 16 to align it).
  EXPECT_EQ(packed_->device_bytes() + kFrozenGroupElements * 4,
            full_->device_bytes() + 3 * 4 + (kFrozenGroupElements + 16) * 4);
  expect_same("moments written");
  expect_frozen_master(*packed_, master_);
  train_both(1600, 2, 3);
  expect_same("two steps");
}

// Non-zero moments written into a frozen run on a device whose limit holds the half-only runs'
// masters (given back beside the packed master) but not the moments of the whole partition: the
// write fails with kResourceExhausted and changes nothing: the runs stay half-only, the device
// bytes and the state read back are those before it.
TEST(DeviceFrozenHalfOnlyLimit, MomentsWithoutRoomChangeNothing) {
  const device_optimizer_test::Partition& p = kDefaultPartition;
  const std::vector<float> exact = exact_bf16(8313);
  const std::vector<float> moments = seeded(kPartition, 8314, 0.01f, 0.1f);
  std::size_t used_bytes = 0;
  {
    std::unique_ptr<Device> probe = opaque_device();
    auto o = std::move(make_packed(*probe, p, exact)).value();
    used_bytes = probe->memory_used_bytes();
  }
  // The masters given back (the whole partition's beside the packed one) fit; the moments do not.
  std::unique_ptr<Device> device = opaque_device(used_bytes + kPartition * sizeof(float));
  auto o = std::move(make_packed(*device, p, exact)).value();
  const std::uint64_t bytes = o->device_bytes();
  const Status s = o->write_state(1, 0, kPartition, moments.data());
  EXPECT_EQ(s.code(), Code::kResourceExhausted) << s.to_string();
  EXPECT_NE(s.message().find("non-zero exp_avg written into partition elements [1024, 2048) "
                             "(dtype group 0, parameter group 2, frozen run [1024, 2048)"),
            std::string::npos)
      << s.to_string();
  EXPECT_TRUE(o->packed());
  EXPECT_EQ(o->half_only_elements(), kHalfOnlyElements);
  EXPECT_EQ(o->device_bytes(), bytes);
  EXPECT_EQ(device->memory_used_bytes(), used_bytes);
  std::vector<float> back(kPartition);
  ASSERT_TRUE(o->read_master(0, kPartition, back.data()).is_ok());
  EXPECT_EQ(std::memcmp(back.data(), exact.data(), back.size() * 4), 0);
  ASSERT_TRUE(o->read_state(1, 0, kPartition, back.data()).is_ok());
  EXPECT_TRUE(all_zero_bytes(back.data(), back.size() * 4));
}

// The engine (offload_optimizer none on an opaque device, world 1, stage 2) with a bf16 model
// whose frozen module ("base") is rounded to bf16 (`exact`) or not: each module a partitioner
// group. The base's fp32 master then takes no device memory.
engine_test::Model lora_like(bool exact) {
  engine_test::Model m;
  m.modules = {"embed", "base", "head"};
  m.params = {{"embed.w", "embed", {32, 48}, DType::kBF16},
              {"base.w", "base", {96, 128}, DType::kBF16},
              {"base.b", "base", {2500}, DType::kBF16},
              {"head.w", "head", {29, 43}, DType::kBF16}};
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    std::vector<float> v = seeded(m.params[p].element_count(), 8400 + p, -1.0f, 1.0f);
    if (exact && m.params[p].module == "base") v = rounded_to_half(std::move(v), DType::kBF16);
    m.initial.push_back(std::move(v));
  }
  m.frozen_module = "base";
  return m;
}

struct EngineRun {
  std::uint64_t finalized_bytes = 0;  // MemoryReport::device_bytes after finalize (or the load)
  std::vector<std::vector<float>> finalized, trained;  // every master, then after the steps
};

// Finalize (then load tag `load` of `ckpt` when given, then `before_steps` when given), `steps`
// steps from step `first`, save tag `save` when given; `group_max_elements`, when not 0, caps
// the partitioner's groups (zinf.group_max_elements).
EngineRun run_engine(const engine_test::Model& model, const std::string& ckpt,
                     const std::string& load, int first, int steps, const std::string& save,
                     const std::function<Status(Engine&)>& before_steps = nullptr,
                     std::size_t group_max_elements = 0) {
  EngineRun out;
  Config config = engine_test::small_config(2, OffloadDevice::kNone, OffloadDevice::kNone, "");
  if (group_max_elements != 0) config.zero.group_max_elements = group_max_elements;
  engine_test::Ranks ranks =
      engine_test::make_ranks(1, std::chrono::seconds(30), /*jitter_max_us=*/0, /*opaque=*/true);
  std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
        ZINF_RETURN_IF_ERROR(engine.finalize());
        if (!load.empty()) ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, load));
        if (before_steps) ZINF_RETURN_IF_ERROR(before_steps(engine));
        out.finalized_bytes = engine.memory().device_bytes;
        ZINF_ASSIGN_OR_RETURN(out.finalized, engine_test::read_masters(engine, model));
        engine_test::TrainOptions options;
        options.check_gathered = false;
        options.first_step = first;
        options.steps = first + steps - 1;
        options.device = ranks.devices[static_cast<std::size_t>(rank)].get();
        ZINF_RETURN_IF_ERROR(
            engine_test::train_rank(engine, model, rank, options, nullptr, nullptr));
        ZINF_ASSIGN_OR_RETURN(out.trained, engine_test::read_masters(engine, model));
        return save.empty() ? Status::ok() : engine.save_checkpoint(ckpt, save);
      });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

using engine_test::same_bits;

// `trained` (a run's masters of `model` after its steps): the base's parameters hold `base`'s
// bits; every other parameter trained away from `start` to `reference`'s bits.
void expect_trained(const engine_test::Model& model, const std::vector<std::vector<float>>& trained,
                    const std::vector<std::vector<float>>& base,
                    const std::vector<std::vector<float>>& start,
                    const std::vector<std::vector<float>>& reference) {
  ASSERT_EQ(trained.size(), model.params.size());
  ASSERT_EQ(reference.size(), model.params.size());
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const std::string& name = model.params[p].name;
    if (model.params[p].module == "base") {
      EXPECT_TRUE(same_bits(trained[p], base[p])) << name;
    } else {
      EXPECT_FALSE(same_bits(trained[p], start[p])) << name << " did not train";
      EXPECT_TRUE(same_bits(trained[p], reference[p])) << name;
    }
  }
}

// The base the half copy holds takes 4 bytes an element less device memory than the same model's
// with values bf16 does not hold, its group's padding included: the base's group ("base.w" and
// "base.b", 14,788 elements) at 1536 is padded to 14,848, and the padding, zero, is frozen
// with it (param_groups.hpp), exact in bf16 and so kept by its half copy alone too. "head.w"
// after them starts at 16'384 (0 mod 16): its master follows "embed.w"'s, ending at 1536, with
// nothing to align. The frozen values read back bit for bit after finalize and
// steps, the trainable ones train to the bits of the run that keeps the base's master (their
// gradients do not depend on the base), and a checkpoint saved, loaded and saved again is the
// same bytes, the loaded engine keeping the base half-only; two steps after the load train as
// two steps after loading the run that keeps the master.
TEST(DeviceFrozenHalfOnlyEngine, TheBaseTakesNoMasterAndTrainsAsWithItKept) {
  const engine_test::Model exact = lora_like(true);
  const engine_test::Model drawn = lora_like(false);
  engine_test::ScratchDir dir("device_frozen_half_only");
  const std::string ckpt = dir.path() + "/ckpt";
  const EngineRun half_only = run_engine(exact, ckpt, "", 1, 3, "three");
  const EngineRun kept = run_engine(drawn, ckpt, "", 1, 3, "kept");
  std::size_t base_elements = 0;
  for (const engine_test::ParamDef& d : exact.params) {
    if (d.module == "base") base_elements += d.element_count();
  }
  std::printf("device bytes after finalize: base master kept %llu, half-only %llu\n",
              static_cast<unsigned long long>(kept.finalized_bytes),
              static_cast<unsigned long long>(half_only.finalized_bytes));
  constexpr std::size_t kBasePadding = 2560 - 2500;  // "base.b"'s group
  EXPECT_EQ(half_only.finalized_bytes + (base_elements + kBasePadding) * 4, kept.finalized_bytes);
  ASSERT_EQ(half_only.finalized.size(), exact.params.size());
  for (std::size_t p = 0; p < exact.params.size(); ++p) {
    if (exact.params[p].module != "base") continue;
    EXPECT_TRUE(same_bits(half_only.finalized[p], exact.initial[p])) << exact.params[p].name;
  }
  ASSERT_NO_FATAL_FAILURE(
      expect_trained(exact, half_only.trained, exact.initial, exact.initial, kept.trained));
  // Loaded and saved again with no step between: the same bytes.
  const EngineRun loaded = run_engine(exact, ckpt, "three", 4, 0, "again");
  EXPECT_EQ(loaded.finalized_bytes, half_only.finalized_bytes);
  for (std::size_t p = 0; p < exact.params.size(); ++p) {
    EXPECT_TRUE(same_bits(loaded.finalized[p], half_only.trained[p])) << exact.params[p].name;
  }
  const std::string saved = engine_test::read_file(ckpt + "/three/rank0.zinfckpt");
  ASSERT_FALSE(saved.empty());
  EXPECT_TRUE(saved == engine_test::read_file(ckpt + "/again/rank0.zinfckpt"));
  // Loaded, then two more steps (4 and 5), beside the run that keeps the base's master loaded
  // and stepped the same: the base reads back its bits, the rest trains to the same bits.
  const EngineRun resumed = run_engine(exact, ckpt, "three", 4, 2, "");
  const EngineRun kept_resumed = run_engine(drawn, ckpt, "kept", 4, 2, "");
  EXPECT_EQ(resumed.finalized_bytes, half_only.finalized_bytes);
  expect_trained(exact, resumed.trained, exact.initial, half_only.trained, kept_resumed.trained);
}

// A write_parameters of one frozen tensor with values bf16 does not hold ("base.b", a LoRA merge
// of fp32 values) gives a master back to the runs of that tensor's group only. Groups capped at
// 4096 elements: "base.w" (12'288) has a group of its own, [1536, 13'824), and "base.b" (2500)
// the next, [13'824, 16'384) with its 60 padding elements. By hand: the master grows by
// "base.b"'s 2500 elements (and the padding's 60, where the padding is frozen with it and was
// half-only too), give or take the up to 15 elements that align a run after a half-only one;
// restoring "base.w" too would add its 12'288. It is the device memory of the run whose "base.b"
// started at those values (its master kept from finalize). The written values read back,
// "base.w" keeps its bits, and three steps train to that run's bits.
TEST(DeviceFrozenHalfOnlyEngine, AnInexactWriteOfOneFrozenTensorGivesOnlyItsRunsAMaster) {
  constexpr std::size_t kGroupMax = 4096;
  const engine_test::Model exact = lora_like(true);
  std::size_t bias = 0;
  while (exact.params[bias].name != "base.b") ++bias;
  const std::vector<float> merged = seeded(exact.params[bias].element_count(), 8477, -1.0f, 1.0f);
  engine_test::Model written = exact;
  written.initial[bias] = merged;
  engine_test::ScratchDir dir("device_frozen_half_only_write");
  const std::string ckpt = dir.path() + "/ckpt";
  const EngineRun half_only = run_engine(exact, ckpt, "", 1, 0, "", nullptr, kGroupMax);
  const EngineRun merged_run = run_engine(
      exact, ckpt, "", 1, 3, "",
      [&](Engine& engine) { return engine.write_parameters("base.b", merged.data()); }, kGroupMax);
  const EngineRun reference = run_engine(written, ckpt, "", 1, 3, "", nullptr, kGroupMax);
  std::printf("device bytes: half-only base %llu, after the write %llu, reference %llu\n",
              static_cast<unsigned long long>(half_only.finalized_bytes),
              static_cast<unsigned long long>(merged_run.finalized_bytes),
              static_cast<unsigned long long>(reference.finalized_bytes));
  EXPECT_GE(merged_run.finalized_bytes, half_only.finalized_bytes + (2500 - 15) * 4);
  EXPECT_LE(merged_run.finalized_bytes, half_only.finalized_bytes + (2560 + 15) * 4);
  EXPECT_EQ(merged_run.finalized_bytes, reference.finalized_bytes);
  ASSERT_EQ(merged_run.finalized.size(), exact.params.size());
  EXPECT_TRUE(same_bits(merged_run.finalized[bias], merged));
  ASSERT_NO_FATAL_FAILURE(
      expect_trained(exact, merged_run.trained, written.initial, exact.initial, reference.trained));
  for (std::size_t p = 0; p < exact.params.size(); ++p) {  // the reference's base: the same bits
    if (exact.params[p].module != "base") continue;
    EXPECT_TRUE(same_bits(merged_run.trained[p], reference.trained[p])) << exact.params[p].name;
  }
}

// Tests of a gated stream: a DeviceOptimizer of one bf16 group of kElements, [0, 2048) trainable
// and [2048, kElements) frozen, on a FaultDevice (never failing) whose device ops are its
// HostDevice's, waiting kWait.
class DeviceFrozenHalfOnlyTimeout : public FaultDeviceTest {
 protected:
  Result<std::unique_ptr<DeviceOptimizer>> make(const std::vector<float>& master) {
    return DeviceOptimizer::create(*device_, {{0, kElements, 0, DType::kBF16}}, kElements,
                                   master.data(), kWait, {{0, 0}, {2048, 1}}, {false, true});
  }
  // Closes the gate and writes `value` into element 3000 of piece `which` (0 the master, 1
  // exp_avg): the call returns kTimeout after one wait, not a second.
  void expect_one_timed_out_wait(DeviceOptimizer& o, int which, float value) {
    device_->close();
    const auto start = std::chrono::steady_clock::now();
    const Status s = o.write_state(which, 3000, 1, &value);
    const auto waited = std::chrono::steady_clock::now() - start;
    EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
    EXPECT_LT(waited, kWait * 2) << "waited twice";
  }
};

// A write that gives the half-only run its master back whose device work outlasts the timeout:
// the call returns the timeout after one wait (not a second, which would run out as well), and
// the new master, which the queued copy and widen still write, stays allocated until the
// optimizer, gone after the work has run, frees it.
TEST_F(DeviceFrozenHalfOnlyTimeout, ARestoreThatTimesOutKeepsItsBufferAndWaitsOnce) {
  // A trainable run and a frozen one whose seeded values bf16 holds.
  const std::vector<float> master =
      rounded_to_half(seeded(kElements, 8490, -1.0f, 1.0f), DType::kBF16);
  {
    auto made = make(master);
    ASSERT_TRUE(made.is_ok()) << made.status().to_string();
    std::unique_ptr<DeviceOptimizer> opt = std::move(made).value();
    ASSERT_EQ(opt->half_only_elements(), kElements - 2048);
    const std::size_t held = device_->memory_used_bytes();
    expect_one_timed_out_wait(*opt, 0, 0.1f);
    // The new master (the whole partition's, packed as before) is still allocated.
    EXPECT_EQ(device_->memory_used_bytes(), held + kElements * sizeof(float));
    EXPECT_EQ(opt->half_only_elements(), kElements - 2048);
    device_->open();
  }
  EXPECT_EQ(device_->memory_used_bytes(), before_bytes_);
}

// The same for non-zero moments written into a frozen run (no half-only run: the master is drawn)
// whose zeroing of the whole partition's moments outlasts the timeout: one wait, and both new
// moment arrays stay allocated until the optimizer goes.
TEST_F(DeviceFrozenHalfOnlyTimeout, AnUnpackThatTimesOutKeepsItsMomentsAndWaitsOnce) {
  const std::vector<float> master = seeded(kElements, 8491, -1.0f, 1.0f);
  {
    auto made = make(master);
    ASSERT_TRUE(made.is_ok()) << made.status().to_string();
    std::unique_ptr<DeviceOptimizer> opt = std::move(made).value();
    ASSERT_EQ(opt->half_only_elements(), 0u);
    ASSERT_TRUE(opt->packed());
    const std::size_t held = device_->memory_used_bytes();
    expect_one_timed_out_wait(*opt, 1, 0.25f);
    EXPECT_EQ(device_->memory_used_bytes(), held + 2 * kElements * sizeof(float));
    EXPECT_TRUE(opt->packed());
    device_->open();
  }
  EXPECT_EQ(device_->memory_used_bytes(), before_bytes_);
}

}  // namespace
}  // namespace zinf
