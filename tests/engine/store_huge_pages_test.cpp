// StoreState (lib/engine/store_state.cpp), offload_optimizer cpu: the StateStore's host arrays of
// the moments and of the gradients are zero pages, and the frozen sub-groups' parts of them are
// advised off transparent huge pages, as HostState advises its frozen ranges.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/aligned.hpp"
#include "common/resident_memory.hpp"
#include "engine/engine_test_util.hpp"
#include "engine/layout.hpp"
#include "engine/optimizer_state.hpp"
#include "engine/param_groups.hpp"
#include "engine/publisher.hpp"
#include "engine/rank_exchange.hpp"
#include "zero/zero_counters.hpp"

namespace zinf {
namespace {

using engine_test::seeded;
using test::vm_flags;

// One rank's LoRA-shaped layout (stage 2, AdamW, the state on the host: offload_optimizer cpu):
// module "base" of `base_elements` frozen f32 elements and module "lora" of `lora_elements`
// trainable ones, and the StateContext of a StoreState over it.
class StoreStateFixture {
 public:
  StoreStateFixture(std::size_t base_elements, std::size_t lora_elements) {
    ranks_ = engine_test::make_ranks(1, std::chrono::seconds(30));
    config_.zero.stage = 2;
    config_.optimizer.kind = OptimizerKind::kAdamW;
    config_.optimizer.lr = 1e-2;
    config_.optimizer.weight_decay = 0.05;
    config_.zero.offload_optimizer.device = OffloadDevice::kHost;
    values_.push_back(seeded(base_elements, 21, -1.0f, 1.0f));
    values_.push_back(seeded(lora_elements, 22, -1.0f, 1.0f));
    const char* names[] = {"base", "lora"};
    for (std::size_t i = 0; i < 2; ++i) {
      ParameterSpec spec;
      spec.name = std::string(names[i]) + ".weight";
      spec.module = names[i];
      spec.shape = {static_cast<std::int64_t>(values_[i].size())};
      spec.initial_values = values_[i].data();
      spec.trainable = i != 0;
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

  StateContext context() {
    StateContext ctx;
    ctx.config = &config_;
    ctx.device = ranks_.devices[0].get();
    ctx.layout = &layout_;
    ctx.publisher = &publisher_;
    ctx.counters = &counters_;
    ctx.group_ranges = group_ranges_;
    ctx.groups = group_params_;
    return ctx;
  }

  engine_test::Ranks ranks_;
  Config config_;
  ParameterLayout layout_;
  Publisher publisher_{layout_};
  StickyError sticky_;
  ZeroCounters counters_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> event_;
  std::vector<std::vector<float>> values_;
  std::vector<OptimizerRange> group_ranges_;
  std::vector<OptimizerParams> group_params_;
};

// The frozen sub-group's part of both moments and of the gradient accumulator is advised off
// transparent huge pages ("nh" in its mapping's flags), so that with THP "always" the first write
// into the trainable sub-group beside it does not fault in 2 MiB pages over its zeros; the
// trainable part, and the master, are not advised.
TEST(StoreStateMemory, TheFrozenSubGroupsAreAdvisedOffHugePages) {
  {
    AlignedBuffer probe;
    ASSERT_TRUE(AlignedBuffer::zeroed_pages(std::size_t{1} << 20, "probe", &probe).is_ok());
    if (!probe.advise_no_huge_pages(0, probe.bytes())) {
      GTEST_SKIP() << "the kernel refuses MADV_NOHUGEPAGE (built without transparent huge pages)";
    }
  }
  // 8 MiB of frozen elements, 4 MiB of trainable ones an array.
  StoreStateFixture f(std::size_t{2} << 20, std::size_t{1} << 20);
  Result<std::unique_ptr<OptimizerState>> opened = open_store_state(f.context());
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  OptimizerState& state = **opened;
  std::uint32_t frozen = UINT32_MAX, trained = UINT32_MAX;
  for (std::uint32_t g = 0; g < f.layout_.group_count(); ++g) {
    (f.layout_.frozen_group(g) ? frozen : trained) = g;
  }
  ASSERT_NE(frozen, UINT32_MAX);
  ASSERT_NE(trained, UINT32_MAX);
  // The host tier hands its whole array to the visitor in one call.
  auto array = [&](Piece piece) {
    const float* out = nullptr;
    EXPECT_TRUE(state
                    .read_state(piece,
                                [&](std::size_t first, std::size_t, const float* values) {
                                  EXPECT_EQ(first, 0u);
                                  out = values;
                                  return Status::ok();
                                })
                    .is_ok());
    return out;
  };
  const GradTarget grads = state.grad_target();
  ASSERT_EQ(grads.custom, nullptr);
  const float* advised[] = {array(Piece::kExpAvg), array(Piece::kExpAvgSq), grads.accumulator};
  auto middle = [&](const float* a, std::uint32_t g) {
    return a + f.layout_.offset(g) + f.layout_.group(g).shard_element_count / 2;
  };
  for (const float* a : advised) {
    ASSERT_NE(a, nullptr);
    const std::string in_frozen = vm_flags(middle(a, frozen));
    const std::string in_trained = vm_flags(middle(a, trained));
    EXPECT_NE(in_frozen.find(" nh "), std::string::npos) << in_frozen;
    ASSERT_FALSE(in_trained.empty());
    EXPECT_EQ(in_trained.find(" nh "), std::string::npos) << in_trained;
  }
  const float* master = array(Piece::kParams);
  ASSERT_NE(master, nullptr);
  const std::string master_frozen = vm_flags(middle(master, frozen));
  ASSERT_FALSE(master_frozen.empty());
  EXPECT_EQ(master_frozen.find(" nh "), std::string::npos) << master_frozen;
}

}  // namespace
}  // namespace zinf
