// The optimizer-state tests' common ground: one rank's LoRA-shaped layout, the StateContext of an
// OptimizerState over it and, for a state that publishes, the rank's ParamCoordinator; and the
// check of which of its arrays' ranges are advised off transparent huge pages.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/aligned.hpp"
#include "common/resident_memory.hpp"
#include "engine/engine_test_util.hpp"
#include "engine/layout.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/param_groups.hpp"
#include "engine/publisher.hpp"
#include "engine/rank_exchange.hpp"
#include "zero/param_coordinator.hpp"
#include "zero/zero_counters.hpp"
#include "zinf/dtype.hpp"

namespace zinf::engine_test {

struct StateFixtureOptions {
  // Where the optimizer state lives (zero.offload_optimizer.device): kNone for a HostState on
  // the rank's host-accessible device, kHost for a StoreState's host arrays.
  OffloadDevice offload = OffloadDevice::kNone;
  // Whether "base" registers frozen (ParameterSpec::trainable false).
  bool base_frozen = true;
  // "base"'s initial values are seeded from `seed`, "lora"'s from `seed + 1`.
  std::uint64_t seed = 11;
  // The dtype both modules compute with (ParameterSpec::dtype).
  DType dtype = DType::kF32;
  // With a half `dtype`: "base"'s seeded values rounded to it first, so that its half copy holds
  // them exactly (widen(narrow(x)) is x).
  bool base_exact = false;
};

// One rank's layout (stage 2, AdamW) of modules "base" (f32 unless options.dtype) of
// `base_elements` elements and "lora" of `lora_elements`, laid out on a single-rank group, and the
// StateContext of an OptimizerState over it.
class StateFixture {
 public:
  StateFixture(std::size_t base_elements, std::size_t lora_elements, StateFixtureOptions options) {
    ranks_ = make_ranks(1, std::chrono::seconds(30));
    config_.zero.stage = 2;
    config_.optimizer.kind = OptimizerKind::kAdamW;
    config_.optimizer.lr = 1e-2;
    config_.optimizer.weight_decay = 0.05;
    config_.zero.offload_optimizer.device = options.offload;
    values_.push_back(seeded(base_elements, options.seed, -1.0f, 1.0f));
    values_.push_back(seeded(lora_elements, options.seed + 1, -1.0f, 1.0f));
    if (options.base_exact && options.dtype != DType::kF32) {
      const std::vector<std::uint16_t> half = narrow_to_half(values_[0], options.dtype);
      if (options.dtype == DType::kBF16) {
        convert_bf16_to_f32(half.data(), values_[0].data(), half.size());
      } else {
        convert_f16_to_f32(half.data(), values_[0].data(), half.size());
      }
    }
    const char* names[] = {"base", "lora"};
    for (std::size_t i = 0; i < 2; ++i) {
      ParameterSpec spec;
      spec.name = std::string(names[i]) + ".weight";
      spec.module = names[i];
      spec.shape = {static_cast<std::int64_t>(values_[i].size())};
      spec.initial_values = values_[i].data();
      spec.trainable = !(i == 0 && options.base_frozen);
      spec.dtype = options.dtype;
      EXPECT_TRUE(layout_.add(spec).is_ok());
    }
    Device& device = *ranks_.devices[0];
    stream_ = std::move(device.create_stream("test")).value();
    event_ = std::move(device.create_event()).value();
    auto exchange = RankExchange::create(device, *ranks_.comms[0], *stream_, *event_,
                                         std::chrono::seconds(30), sticky_);
    EXPECT_TRUE(exchange.is_ok()) << exchange.status().to_string();
    Status laid = layout_.lay_out(config_, 0, 1, *exchange);
    EXPECT_TRUE(laid.is_ok()) << laid.to_string();
    auto ranges = partition_group_ranges(layout_, 0, {});
    EXPECT_TRUE(ranges.is_ok()) << ranges.status().to_string();
    group_ranges_ = std::move(ranges).value();
    group_params_.resize(2);
    group_params(config_.optimizer, config_.optimizer.lr, {}, &group_params_);
  }

  // The state's device is `device`, or the layout's own rank device when null.
  StateContext context(Device* device = nullptr) {
    StateContext ctx;
    ctx.config = &config_;
    ctx.device = device != nullptr ? device : ranks_.devices[0].get();
    ctx.layout = &layout_;
    ctx.publisher = &publisher_;
    ctx.counters = &counters_;
    ctx.group_ranges = group_ranges_;
    ctx.groups = group_params_;
    return ctx;
  }

  // Creates rank 0's ParamCoordinator over the layout's modules, on the layout's rank device, and
  // hands it to the publisher, as the engine does before it opens the state; the fixture keeps it
  // in coordinator_. Call once.
  Status attach_coordinator() {
    ZINF_ASSIGN_OR_RETURN(
        coordinator_,
        ParamCoordinator::create(layout_.partitioner(), 0, *ranks_.devices[0], *ranks_.comms[0],
                                 layout_.take_coordinator_modules(), layout_.persistent(),
                                 ParamCoordinatorOptions{}, nullptr, nullptr, &counters_));
    publisher_.set_coordinator(coordinator_.get());
    return Status::ok();
  }

  Ranks ranks_;
  Config config_;
  ParameterLayout layout_;
  Publisher publisher_{layout_};
  StickyError sticky_;
  ZeroCounters counters_;
  std::unique_ptr<ParamCoordinator> coordinator_;  // attach_coordinator()'s
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> event_;
  std::vector<std::vector<float>> values_;
  std::vector<OptimizerRange> group_ranges_;
  std::vector<OptimizerParams> group_params_;
};

// Why a test of huge-page advice skips where the kernel has none.
inline constexpr const char* kNoHugePageAdvice =
    "the kernel refuses MADV_NOHUGEPAGE (built without transparent huge pages)";

// Whether the kernel takes MADV_NOHUGEPAGE on a zero-page mapping. A mapping the kernel refuses
// is a test failure, not a reason to skip.
inline bool kernel_advises_no_huge_pages() {
  AlignedBuffer probe;
  const Status mapped = AlignedBuffer::zeroed_pages(std::size_t{1} << 20, "probe", &probe);
  if (!mapped.is_ok()) {
    ADD_FAILURE() << mapped.to_string();
    return false;
  }
  return probe.advise_no_huge_pages(0, probe.bytes());
}

// The whole array of `piece` that `state` holds in host memory and hands to read_state()'s
// visitor in one call from element 0 (the host tiers do); null when it does not.
inline const float* whole_array(OptimizerState& state, Piece piece) {
  const float* out = nullptr;
  const Status st = state.read_state(piece, [&](std::size_t first, std::size_t, const float* v) {
    EXPECT_EQ(first, 0u);
    out = v;
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return out;
}

// Checks `array`, a partition-sized array of `layout`'s one frozen group and one trainable group:
// the middle of the frozen group's part is advised off transparent huge pages ("nh" in its
// mapping's flags) when `frozen_advised` and not otherwise; the trainable group's part never is.
inline void expect_huge_page_advice(const ParameterLayout& layout, const float* array,
                                    bool frozen_advised) {
  ASSERT_NE(array, nullptr);
  std::uint32_t frozen = UINT32_MAX, trained = UINT32_MAX;
  for (std::uint32_t g = 0; g < layout.group_count(); ++g) {
    (layout.frozen_group(g) ? frozen : trained) = g;
  }
  ASSERT_NE(frozen, UINT32_MAX);
  ASSERT_NE(trained, UINT32_MAX);
  auto middle = [&](std::uint32_t g) {
    return array + layout.offset(g) + layout.group(g).shard_element_count / 2;
  };
  const std::string in_frozen = test::vm_flags(middle(frozen));
  const std::string in_trained = test::vm_flags(middle(trained));
  ASSERT_FALSE(in_frozen.empty());
  ASSERT_FALSE(in_trained.empty());
  EXPECT_EQ(in_frozen.find(" nh ") != std::string::npos, frozen_advised)
      << "the frozen group's part " << (frozen_advised ? "is not" : "is")
      << " advised: " << in_frozen;
  EXPECT_EQ(in_trained.find(" nh "), std::string::npos) << in_trained;
}

}  // namespace zinf::engine_test
