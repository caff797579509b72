// Engine::load_checkpoint with the optimizer state on NVMe and the parameters' shards streamed
// from the master (bf16 parameters, whose shards are on the device at stage 2 or on NVMe at
// stage 3): the load publishes the parameters from the master as it writes it into the swap, so
// it reads the checkpoint's files and nothing else; the master is not read back. Read pieces are
// counted by fault injectors that delay every read by nothing: the load into the NVMe state reads
// as many pieces as the same load into a state in host memory, which reads nothing but the
// checkpoint. The loaded masters are those saved, and the gathered parameters are the masters
// rounded to bf16, bit for bit.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine_test_util.hpp"
#include "io/fault.hpp"

namespace zinf {
namespace {

using engine_test::Model;

struct LoadCase {
  int stage;
  OffloadDevice params;
};

std::string case_name(const LoadCase& c) {
  return fmt::format("s{}_param_{}", c.stage, offload_device_name(c.params));
}

// Loads `ckpt` into engines of `config` on two ranks, each with a fault injector counting its
// read pieces; *reads: each rank's pieces read during load_checkpoint(). Checks that the masters
// are `saved` and the gathered parameters the masters rounded.
void load_counting(const Config& config, const Model& model, const std::string& ckpt,
                   const std::vector<std::vector<std::vector<float>>>& saved,
                   std::vector<std::uint64_t>* reads) {
  constexpr int kWorld = 2;
  engine_test::Ranks ranks = engine_test::make_ranks(kWorld);
  reads->assign(kWorld, 0);
  std::vector<Status> st = engine_test::run_ranks(kWorld, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    auto faults = engine_test::io_counter(/*reads=*/true);
    ZINF_ASSIGN_OR_RETURN(auto engine,
                          engine_test::open_finalized(ranks, rank, config, model, faults));
    const std::uint64_t before = faults->counts().latency;
    ZINF_RETURN_IF_ERROR(engine->load_checkpoint(ckpt));
    (*reads)[r] = faults->counts().latency - before;
    ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> masters,
                          engine_test::read_masters(*engine, model));
    if (masters != saved[r]) return Status::internal("the loaded masters are not those saved");
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const engine_test::ParamDef& def = model.params[p];
      ZINF_ASSIGN_OR_RETURN(ScopedGather g, engine->scoped_gather(def.module));
      ZINF_ASSIGN_OR_RETURN(std::span<const std::uint16_t> view, g.param<std::uint16_t>(def.name));
      const std::vector<std::uint16_t> want = engine_test::narrow_to_half(masters[p], DType::kBF16);
      if (!std::equal(view.begin(), view.end(), want.begin(), want.end())) {
        return Status::internal(
            fmt::format("{}: the gathered values are not the loaded master rounded", def.name));
      }
    }
    return Status::ok();
  });
  for (std::size_t r = 0; r < st.size(); ++r) {
    EXPECT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
  }
}

TEST(CheckpointLoadReads, AStreamedStateReadsOnlyTheCheckpoint) {
  for (const LoadCase& c : {LoadCase{2, OffloadDevice::kNone}, LoadCase{3, OffloadDevice::kNvme}}) {
    SCOPED_TRACE(case_name(c));
    constexpr int kWorld = 2;
    const Model model = engine_test::make_model(DType::kBF16, 91);
    engine_test::ScratchDir nvme("ckpt_load_reads_nvme_" + case_name(c));
    engine_test::ScratchDir ckpt("ckpt_load_reads_" + case_name(c));
    const Config on_nvme =
        engine_test::small_config(c.stage, OffloadDevice::kNvme, c.params, nvme.path());
    // Two steps, so that the moments are not zero, then the save.
    std::vector<std::vector<std::vector<float>>> saved(kWorld);
    {
      engine_test::Ranks ranks = engine_test::make_ranks(kWorld);
      std::vector<Status> st = engine_test::run_ranks(kWorld, [&](int rank) -> Status {
        const auto r = static_cast<std::size_t>(rank);
        Env env;
        env.device = ranks.devices[r].get();
        env.comm = ranks.comms[r].get();
        ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(on_nvme, env));
        engine_test::TrainOptions options;
        options.device = env.device;
        options.steps = 2;
        options.check_gathered = false;
        ZINF_RETURN_IF_ERROR(
            engine_test::train_rank(*engine, model, rank, options, nullptr, nullptr));
        ZINF_RETURN_IF_ERROR(engine->save_checkpoint(ckpt.path()));
        ZINF_ASSIGN_OR_RETURN(saved[r], engine_test::read_masters(*engine, model));
        return Status::ok();
      });
      for (std::size_t r = 0; r < kWorld; ++r) {
        ASSERT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
      }
    }
    std::uint64_t ckpt_bytes = 0;  // every file of the checkpoint, for the figure printed below
    for (const auto& entry : std::filesystem::recursive_directory_iterator(ckpt.path())) {
      if (entry.is_regular_file()) ckpt_bytes += entry.file_size();
    }
    std::vector<std::uint64_t> nvme_reads, host_reads;
    load_counting(on_nvme, model, ckpt.path(), saved, &nvme_reads);
    // The same checkpoint into the state in host memory: the checkpoint's reads alone.
    load_counting(engine_test::small_config(c.stage, OffloadDevice::kHost, c.params, nvme.path()),
                  model, ckpt.path(), saved, &host_reads);
    for (std::size_t r = 0; r < kWorld; ++r) {
      std::printf(
          "%s rank %zu: the load read %llu pieces with the state on NVMe, %llu in memory "
          "(checkpoint: %llu bytes in all)\n",
          case_name(c).c_str(), r, static_cast<unsigned long long>(nvme_reads[r]),
          static_cast<unsigned long long>(host_reads[r]),
          static_cast<unsigned long long>(ckpt_bytes));
      EXPECT_GT(host_reads[r], 0u) << "rank " << r;
      EXPECT_EQ(nvme_reads[r], host_reads[r]) << "rank " << r << ": the master was read back";
    }
  }
}

}  // namespace
}  // namespace zinf
