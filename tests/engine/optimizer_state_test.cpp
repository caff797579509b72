// The optimizer-state contract (lib/engine/optimizer_state.hpp), checked against each home
// alone: the device (DeviceOptimizer, on an opaque HostDevice that runs the kernels' scalar
// references), host memory (the CPU optimizer in place), and the StateStore (host arrays, and
// NVMe extents). Every home must hold the master it was loaded with and zero moments, keep what
// write_state() writes, step as torch's AdamW does (written out here in double precision), sum
// the squares of the gradients, and report where its bytes are.
#include "engine/optimizer_state.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/engine_test_util.hpp"
#include "engine/layout.hpp"
#include "engine/publisher.hpp"
#include "engine/rank_exchange.hpp"
#include "io/io_engine.hpp"
#include "io/swap_space.hpp"
#include "tier/state_store.hpp"

namespace zinf {
namespace {

using engine_test::seeded;

enum class Home { kDevice, kHost, kStoreHost, kStoreNvme };

std::string home_name(Home h) {
  switch (h) {
    case Home::kDevice:
      return "Device";
    case Home::kHost:
      return "Host";
    case Home::kStoreHost:
      return "StoreHost";
    case Home::kStoreNvme:
      return "StoreNvme";
  }
  return "?";
}

constexpr std::size_t kCounts[] = {12'345, 7'001, 37};  // one module, one group at world 1

class OptimizerStateContract : public ::testing::TestWithParam<Home> {
 protected:
  void SetUp() override {
    const Home home = GetParam();
    ranks_ = engine_test::make_ranks(1, std::chrono::seconds(30), 0,
                                     /*opaque=*/home == Home::kDevice);
    device_ = ranks_.devices[0].get();
    config_.zero.stage = 2;
    config_.zero.sub_group_size = 4096;  // several sub-groups in the store
    config_.optimizer.kind = OptimizerKind::kAdamW;
    config_.optimizer.lr = 1e-2;
    config_.optimizer.weight_decay = 0.05;
    config_.zero.offload_optimizer.device = home == Home::kStoreHost   ? OffloadDevice::kHost
                                            : home == Home::kStoreNvme ? OffloadDevice::kNvme
                                                                       : OffloadDevice::kNone;
    std::vector<std::vector<float>> values;
    for (std::size_t i = 0; i < std::size(kCounts); ++i) {
      values.push_back(seeded(kCounts[i], 100 + i, -1.0f, 1.0f));
      ParameterSpec spec;
      spec.name = "p" + std::to_string(i);
      spec.module = "m";
      spec.shape = {static_cast<std::int64_t>(kCounts[i])};
      spec.initial_values = values.back().data();
      ASSERT_TRUE(layout_.add(spec).is_ok());
    }
    auto stream = device_->create_stream("test");
    ASSERT_TRUE(stream.is_ok());
    stream_ = std::move(stream).value();
    auto event = device_->create_event();
    ASSERT_TRUE(event.is_ok());
    event_ = std::move(event).value();
    auto exchange = RankExchange::create(*device_, *ranks_.comms[0], *stream_, *event_,
                                         std::chrono::seconds(30), sticky_);
    ASSERT_TRUE(exchange.is_ok());
    ASSERT_TRUE(layout_.lay_out(config_, 0, 1, *exchange).is_ok());
    // At world 1 the partition is every group whole, padding included (zeros).
    initial_.assign(layout_.partition_elements(), 0.0f);
    for (std::size_t i = 0; i < std::size(kCounts); ++i) {
      const ParamLocation& loc = layout_.partitioner().location(static_cast<ParamId>(i));
      ASSERT_EQ(loc.element_count, kCounts[i]);
      std::memcpy(initial_.data() + layout_.offset(loc.group) + loc.group_offset, values[i].data(),
                  kCounts[i] * sizeof(float));
    }

    StateContext ctx;
    ctx.config = &config_;
    ctx.device = device_;
    ctx.layout = &layout_;
    ctx.publisher = &publisher_;
    ctx.counters = &counters_;
    if (home == Home::kStoreNvme) {
      IoOptions io;
      auto engine = open_engine(io);
      ASSERT_TRUE(engine.is_ok()) << engine.status().to_string();
      io_ = std::move(engine).value();
      auto store_layout = StateStore::layout(store_options(config_, layout_, 0));
      ASSERT_TRUE(store_layout.is_ok());
      SwapOptions swap;
      swap.dirs = {dir_.path()};
      swap.capacity_bytes = store_layout->nvme_bytes + (std::uint64_t{64} << 20);
      swap.max_extents = static_cast<std::uint32_t>(store_layout->nvme_extents) + 16;
      auto opened = SwapSpace::open(*io_, swap);
      ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
      swap_ = std::move(opened).value();
      ctx.io = io_.get();
      ctx.swap = swap_.get();
    }
    Result<std::unique_ptr<OptimizerState>> state = home == Home::kDevice ? open_device_state(ctx)
                                                    : home == Home::kHost ? open_host_state(ctx)
                                                                          : open_store_state(ctx);
    ASSERT_TRUE(state.is_ok()) << state.status().to_string();
    state_ = std::move(state).value();
  }

  std::vector<float> read(Piece piece) {
    std::vector<float> out(layout_.partition_elements(), -7.0f);
    Status st =
        state_->read_state(piece, [&](std::size_t first, std::size_t count, const float* values) {
          std::memcpy(out.data() + first, values, count * sizeof(float));
          return Status::ok();
        });
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return out;
  }

  // The gradients into the accumulator the reducer would add into.
  void put_gradients(const std::vector<float>& g) {
    const GradTarget t = state_->grad_target();
    if (t.custom != nullptr) {
      ASSERT_TRUE(t.custom->add(0, g.size(), g.data()).is_ok());
      ASSERT_TRUE(t.custom->flush().is_ok());
    } else if (t.on_device) {
      ASSERT_TRUE(device_->copy_h2d(t.accumulator, g.data(), g.size() * 4, *stream_).is_ok());
      ASSERT_TRUE(device_->synchronize(*stream_, std::chrono::seconds(30)).is_ok());
    } else {
      std::memcpy(t.accumulator, g.data(), g.size() * 4);
    }
  }

  engine_test::ScratchDir dir_{"optimizer-state-" + home_name(GetParam())};
  engine_test::Ranks ranks_;
  Device* device_ = nullptr;
  Config config_;
  ParameterLayout layout_;
  Publisher publisher_{layout_};
  StickyError sticky_;
  ZeroCounters counters_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> event_;
  std::unique_ptr<IoEngine> io_;
  std::unique_ptr<SwapSpace> swap_;
  std::unique_ptr<OptimizerState> state_;
  std::vector<float> initial_;
};

TEST_P(OptimizerStateContract, HoldsTheInitialMasterAndZeroMoments) {
  EXPECT_EQ(read(Piece::kParams), initial_);
  EXPECT_EQ(read(Piece::kExpAvg), std::vector<float>(initial_.size(), 0.0f));
  EXPECT_EQ(read(Piece::kExpAvgSq), std::vector<float>(initial_.size(), 0.0f));
  // read_master() covers the range asked for with the same values.
  std::vector<float> master(initial_.size(), -7.0f);
  ASSERT_TRUE(state_
                  ->read_master(100, initial_.size() - 50,
                                [&](std::size_t first, std::size_t count, const float* v) {
                                  std::memcpy(master.data() + first, v, count * 4);
                                })
                  .is_ok());
  for (std::size_t i = 100; i < initial_.size() - 50; ++i) ASSERT_EQ(master[i], initial_[i]) << i;
}

TEST_P(OptimizerStateContract, KeepsWhatWriteStateWrites) {
  std::uint64_t seed = 7;
  for (Piece piece : {Piece::kParams, Piece::kExpAvg, Piece::kExpAvgSq}) {
    const std::vector<float> values = seeded(initial_.size(), seed++, 0.0f, 2.0f);
    ASSERT_TRUE(state_
                    ->write_state(piece,
                                  [&](std::size_t first, std::size_t count, float* out) {
                                    std::memcpy(out, values.data() + first, count * 4);
                                    return Status::ok();
                                  })
                    .is_ok());
    EXPECT_EQ(read(piece), values) << static_cast<int>(piece);
  }
}

TEST_P(OptimizerStateContract, StepsAsTorchAdamW) {
  const std::vector<float> g = seeded(initial_.size(), 42, -3.0f, 3.0f);
  put_gradients(g);
  double sumsq = 0.0;
  for (float x : g) sumsq += double{x} * x;
  Result<double> local = state_->local_sum_of_squares();
  ASSERT_TRUE(local.is_ok());
  EXPECT_NEAR(*local, sumsq, sumsq * 1e-6);

  const float grad_scale = 0.25f;
  ASSERT_TRUE(state_->step(1, grad_scale).is_ok());
  // torch.optim.AdamW, step 1: p *= 1 - lr * wd; m = (1 - b1) g; v = (1 - b2) g^2;
  // p -= lr / (1 - b1) * m / (sqrt(v) / sqrt(1 - b2) + eps).
  const OptimizerParams& o = config_.optimizer;
  const std::vector<float> p = read(Piece::kParams);
  const std::vector<float> m = read(Piece::kExpAvg);
  const std::vector<float> v = read(Piece::kExpAvgSq);
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double gi = double{g[i]} * grad_scale;
    const double mi = (1 - o.beta1) * gi;
    const double vi = (1 - o.beta2) * gi * gi;
    double pi = initial_[i] * (1 - o.lr * o.weight_decay);
    pi -= o.lr / (1 - o.beta1) * mi / (std::sqrt(vi) / std::sqrt(1 - o.beta2) + o.eps);
    ASSERT_NEAR(m[i], mi, 1e-6 * std::abs(mi) + 1e-9) << i;
    // The device kernel forms 1 - beta2 in float (1.3e-5 relative off 0.001).
    ASSERT_NEAR(v[i], vi, 3e-5 * std::abs(vi) + 1e-12) << i;
    ASSERT_NEAR(p[i], pi, 1e-6 * std::abs(pi) + 5e-7) << i;
  }
  // A new learning rate is taken by the next step: lr 0 with weight decay leaves p as it was,
  // the moments move on.
  OptimizerParams zero_lr = o;
  zero_lr.lr = 0.0;
  ASSERT_TRUE(state_->set_optimizer_params(zero_lr).is_ok());
  put_gradients(g);
  ASSERT_TRUE(state_->step(2, grad_scale).is_ok());
  EXPECT_EQ(read(Piece::kParams), p);
  EXPECT_NE(read(Piece::kExpAvg), m);
}

TEST_P(OptimizerStateContract, ReportsWhereItsBytesAre) {
  MemoryReport r;
  state_->add_memory(r);
  // The fp32 master, two moments and gradient accumulator: 16 bytes an element.
  const std::uint64_t state_bytes = 16 * initial_.size();
  switch (GetParam()) {
    case Home::kDevice:
      EXPECT_GE(r.device_bytes, state_bytes);
      EXPECT_EQ(r.host_bytes, 0u);
      break;
    case Home::kHost:
      EXPECT_EQ(r.device_bytes, state_bytes);
      EXPECT_EQ(r.host_bytes, 0u);
      break;
    case Home::kStoreHost:
      EXPECT_EQ(r.device_bytes, 0u);
      EXPECT_EQ(r.host_bytes, state_bytes + state_->pinned_bytes());
      break;
    case Home::kStoreNvme:
      // Only the pinned pool (and the host gradient accumulator) stay in host memory.
      EXPECT_EQ(r.device_bytes, 0u);
      EXPECT_GT(state_->pinned_bytes(), 0u);
      EXPECT_EQ(r.host_bytes, 4 * initial_.size() + state_->pinned_bytes());
      EXPECT_GE(swap_->used_bytes(), 12 * initial_.size());
      break;
  }
}

INSTANTIATE_TEST_SUITE_P(Homes, OptimizerStateContract,
                         ::testing::Values(Home::kDevice, Home::kHost, Home::kStoreHost,
                                           Home::kStoreNvme),
                         [](const ::testing::TestParamInfo<Home>& info) {
                           return home_name(info.param);
                         });

}  // namespace
}  // namespace zinf
