// The fp32 master read back after a step to narrow the f32 shards (the optimizer state on NVMe,
// f32 parameters): the runs of trainable groups are read in one walk, so a swap block that two
// runs share, around a small frozen group between them, is read once.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "io/fault.hpp"

namespace zinf {
namespace {

using engine_test::Model;

// Trainable "a", frozen "mid", trainable "b", f32, one parameter each: at world 1 the partition
// is a's 19200 elements, mid's 512 and b's 19200, in that order (each a multiple of the 128-element
// alignment: no padding). The frozen cuts widen both trainable runs to the 1024-element grid,
// where they meet, so the partition is one sub-group; in swap blocks of 64 KiB (16384 elements)
// the second block holds a's end, all of mid and b's start.
Model sandwich_model() {
  Model m;
  m.modules = {"a", "mid", "b"};
  m.params.push_back({"a.w", "a", {150, 128}, DType::kF32});
  m.params.push_back({"mid.w", "mid", {4, 128}, DType::kF32});
  m.params.push_back({"b.w", "b", {150, 128}, DType::kF32});
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    m.initial.push_back(engine_test::seeded(m.params[p].element_count(), 8100 + p, -1.0f, 1.0f));
  }
  m.frozen_module = "mid";
  return m;
}

// Each step (sequential, so its reads are all done when step() returns) reads, besides the pass's
// master and two moments of the one sub-group (whole: ceil(bytes / block) pieces each), the
// swap blocks of the master that hold trainable elements, each once: blocks 0, 1 and 2, where
// reading the two runs apart reads block 1 twice. Counted twice: the engine's
// master_nvme_read_bytes, and the read pieces (one a swap block) the I/O engine completes. The
// gathered copies at each step and the final masters are the reference's bits.
TEST(PublishReads, ASwapBlockTwoTrainableRunsShareIsReadOnce) {
  const Model model = sandwich_model();
  engine_test::ScratchDir dir("publish_reads_shared_block");
  Config config =
      engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
  config.zero.sub_group_size = 1'000'000'000;
  config.overlap_step = false;
  const std::uint64_t block_bytes = config.aio_block_bytes;
  ASSERT_EQ(block_bytes, 65536u);

  // The partition's elements and its trainable ones' swap blocks, from the model alone.
  std::size_t partition = 0;
  std::set<std::uint64_t> blocks;
  for (const engine_test::ParamDef& d : model.params) {
    const std::size_t count = d.element_count();
    if (d.module != model.frozen_module) {
      for (std::size_t e = partition; e < partition + count; ++e)
        blocks.insert(e * 4 / block_bytes);
    }
    partition += count;
  }
  const std::uint64_t partition_bytes = partition * 4;  // a multiple of 4 KiB pages here
  ASSERT_EQ(partition_bytes % 4096, 0u);
  std::uint64_t read_back_bytes = 0;
  for (std::uint64_t b : blocks) {
    read_back_bytes += std::min(block_bytes, partition_bytes - b * block_bytes);
  }
  const std::uint64_t pass_pieces = 3 * ((partition_bytes + block_bytes - 1) / block_bytes);
  const std::uint64_t want_pieces = pass_pieces + blocks.size();
  std::printf("master read back per step: %llu bytes in %zu blocks (a block read twice: %llu)\n",
              static_cast<unsigned long long>(read_back_bytes), blocks.size(),
              static_cast<unsigned long long>(read_back_bytes + block_bytes));

  engine_test::TrainOptions options;
  options.steps = 3;
  const engine_test::Reference ref = engine_test::run_reference(config, model, 1, options);
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  const std::shared_ptr<FaultInjector> reads = engine_test::io_counter(/*reads=*/true);
  Result<std::unique_ptr<Engine>> opened = engine_test::open_rank(ranks, 0, config, reads);
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  Engine& engine = **opened;
  for (int step = 1; step <= options.steps; ++step) {
    engine_test::TrainOptions one = options;
    one.first_step = step;
    one.steps = step;
    std::vector<StepReport> reports;
    const std::uint64_t before = reads->counts().latency;
    const Status st =
        engine_test::train_rank(engine, model, 0, one, &ref.device_per_step, &reports);
    ASSERT_TRUE(st.is_ok()) << "step " << step << ": " << st.to_string();
    ASSERT_EQ(reports.size(), 1u);
    EXPECT_EQ(reports[0].master_nvme_read_bytes, read_back_bytes) << "step " << step;
    EXPECT_EQ(reads->counts().latency - before, want_pieces) << "step " << step;
  }
  Result<std::vector<std::vector<float>>> finals = engine_test::read_masters(engine, model);
  ASSERT_TRUE(finals.is_ok()) << finals.status().to_string();
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    EXPECT_EQ(std::memcmp((*finals)[p].data(), ref.master[p].data(), ref.master[p].size() * 4), 0)
        << model.params[p].name;
  }
}

}  // namespace
}  // namespace zinf
