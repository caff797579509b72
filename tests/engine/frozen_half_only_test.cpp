// A frozen sub-group's fp32 master kept as its half copy alone (offload_optimizer "cpu", every
// group of one half dtype: lib/engine/store_state.cpp's header comment). A bf16 (or f16) model
// with a frozen module whose values are rounded to that dtype first, so that the half copy holds
// them exactly: the master is left out of MemoryReport::host_bytes (against the same model with
// values the half dtype does not hold), read_parameters gives the registered bits after
// finalize and after steps, the trainable masters are those of the same run with the optimizer
// state on NVMe (where every master is kept), checkpoints are the bytes that run writes, values
// the half copy does not hold (write_parameters, a checkpoint's) read back bit for bit, also past
// the first of the 256 Ki-element chunks a half-only sub-group is read and written by, and
// non-zero moments loaded into the frozen module give it its master back.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/random.hpp"
#include "engine_test_util.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::TrainOptions;

constexpr const char* kFrozen = "base";
// The master of a page of elements: frozen_cuts() cuts sub-groups at multiples of 1024 elements.
constexpr std::size_t kPageElementBytes = 1024 * sizeof(float);

// A model of `dtype` (bf16 or f16) whose frozen module ("base", 14,788 elements) spans whole
// 4 KiB pages of each rank's partition at world 1 and 2, so that it has sub-groups of its own
// (frozen_cuts), between two trainable modules; seeded values in [-1, 1). With `exact`, the
// frozen values rounded to `dtype` (each x then equals widen(narrow(x))), else as drawn (almost
// none is).
Model frozen_model(std::uint64_t seed, bool exact, DType dtype = DType::kBF16) {
  Model m;
  m.modules = {"embed", "base", "head"};
  m.params = {
      {"embed.w", "embed", {37, 41}, dtype}, {"base.w", "base", {96, 128}, dtype},
      {"base.b", "base", {2500}, dtype},     {"head.w", "head", {29, 43}, dtype},
      {"head.b", "head", {29}, dtype},
  };
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    std::vector<float> v(m.params[p].element_count());
    fill_uniform(v.data(), v.size(), seed * 1000 + p, -1.0f, 1.0f);
    m.initial.push_back(std::move(v));
  }
  m.frozen_module = kFrozen;
  if (!exact) return m;
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    if (m.params[p].module != kFrozen) continue;
    const std::vector<std::uint16_t> half = engine_test::narrow_to_half(m.initial[p], dtype);
    if (dtype == DType::kBF16) {
      convert_bf16_to_f32(half.data(), m.initial[p].data(), half.size());
    } else {
      convert_f16_to_f32(half.data(), m.initial[p].data(), half.size());
    }
  }
  return m;
}

// The frozen module's element count.
std::size_t frozen_elements(const Model& m) {
  std::size_t count = 0;
  for (const engine_test::ParamDef& d : m.params) {
    if (d.module == kFrozen) count += d.element_count();
  }
  return count;
}

using engine_test::same_bits;

// What train() saw: every master (rank 0's read) after finalize() and after the steps, and each
// rank's MemoryReport::host_bytes after finalize().
struct TrainRun {
  std::vector<std::vector<float>> finalized;
  std::vector<std::vector<float>> trained;
  std::vector<std::uint64_t> host_bytes;
};

// `model` on `world` ranks at `stage`, the optimizer state on `optimizer` (in `dir` when on
// NVMe): finalize, `steps` steps, then a checkpoint `tag` in `ckpt` when given.
TrainRun train(const Model& model, int world, int stage, OffloadDevice optimizer,
               const std::string& dir, int steps, const std::string& ckpt = "",
               const std::string& tag = "") {
  const Config config = engine_test::small_config(stage, optimizer, OffloadDevice::kNone, dir);
  TrainRun run;
  run.host_bytes.assign(world, 0);
  std::vector<Status> st =
      engine_test::with_engines(config, model, world, [&](int rank, Engine& engine) -> Status {
        run.host_bytes[rank] = engine.memory().host_bytes;
        // read_parameters is collective: every rank reads, rank 0 keeps them.
        ZINF_ASSIGN_OR_RETURN(auto finalized, engine_test::read_masters(engine, model));
        TrainOptions options;
        options.steps = steps;
        ZINF_RETURN_IF_ERROR(
            engine_test::train_rank(engine, model, rank, options, nullptr, nullptr));
        ZINF_ASSIGN_OR_RETURN(auto trained, engine_test::read_masters(engine, model));
        if (rank == 0) {
          run.finalized = std::move(finalized);
          run.trained = std::move(trained);
        }
        return ckpt.empty() ? Status::ok() : engine.save_checkpoint(ckpt, tag);
      });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  return run;
}

// The frozen master the half copy holds exactly is left out of MemoryReport::host_bytes, which
// is 4 bytes a frozen element below the same model's with values bf16 does not hold (whose
// frozen sub-groups keep their master), but for the frozen elements in the trainable modules'
// sub-groups: those cut at whole 1024-element pages (frozen_cuts), less than a page at each end
// of the frozen run.
TEST(FrozenHalfOnly, AFrozenMasterItsHalfCopyHoldsIsLeftOutOfTheMemoryReport) {
  for (int stage : {2, 3}) {
    const Model exact = frozen_model(31, true);
    const Model drawn = frozen_model(31, false);
    const TrainRun half_only = train(exact, 1, stage, OffloadDevice::kHost, "", 2);
    const TrainRun with_master = train(drawn, 1, stage, OffloadDevice::kHost, "", 2);
    const std::uint64_t frozen_bytes = frozen_elements(exact) * sizeof(float);
    std::printf("stage %d: host bytes %llu with the frozen master kept, %llu without\n", stage,
                static_cast<unsigned long long>(with_master.host_bytes[0]),
                static_cast<unsigned long long>(half_only.host_bytes[0]));
    ASSERT_GT(with_master.host_bytes[0], half_only.host_bytes[0]);
    EXPECT_GT(with_master.host_bytes[0] - half_only.host_bytes[0],
              frozen_bytes - 2 * kPageElementBytes)
        << "stage " << stage;
    EXPECT_LE(with_master.host_bytes[0] - half_only.host_bytes[0], frozen_bytes)
        << "stage " << stage;
    // Both keep their frozen values, bit for bit.
    for (std::size_t p = 0; p < exact.params.size(); ++p) {
      if (exact.params[p].module != kFrozen) continue;
      EXPECT_TRUE(same_bits(half_only.trained[p], exact.initial[p])) << exact.params[p].name;
      EXPECT_TRUE(same_bits(with_master.trained[p], drawn.initial[p])) << drawn.params[p].name;
    }
  }
}

// read_parameters of each frozen parameter gives the registered bits after finalize() and after
// steps; every master, the trainable ones included, is the same bits as with the optimizer state
// on NVMe, where every sub-group keeps its fp32 master. World 2, stages 2 and 3, bf16 and f16.
TEST(FrozenHalfOnly, ReadsTheRegisteredBitsAndTrainsAsWithTheMasterKept) {
  constexpr int kWorld = 2;
  for (const auto& [stage, dtype] :
       {std::pair{2, DType::kBF16}, std::pair{3, DType::kBF16}, std::pair{3, DType::kF16}}) {
    const Model model = frozen_model(47, true, dtype);
    engine_test::ScratchDir dir("frozen_half_only_bits");
    const TrainRun host = train(model, kWorld, stage, OffloadDevice::kHost, "", 4);
    const TrainRun nvme = train(model, kWorld, stage, OffloadDevice::kNvme, dir.path(), 4);
    // The frozen master held by the half copy alone on each rank: fewer host bytes than with
    // values the half dtype does not hold.
    const TrainRun drawn =
        train(frozen_model(47, false, dtype), kWorld, stage, OffloadDevice::kHost, "", 1);
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_LT(host.host_bytes[r], drawn.host_bytes[r]) << "rank " << r << " stage " << stage;
    }
    ASSERT_EQ(host.trained.size(), model.params.size());
    ASSERT_EQ(nvme.trained.size(), model.params.size());
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const std::string& name = model.params[p].name;
      if (model.params[p].module == kFrozen) {
        EXPECT_TRUE(same_bits(host.finalized[p], model.initial[p])) << name << " stage " << stage;
        EXPECT_TRUE(same_bits(host.trained[p], model.initial[p])) << name << " stage " << stage;
      } else {
        EXPECT_FALSE(same_bits(host.trained[p], model.initial[p])) << name << " did not train";
      }
      EXPECT_TRUE(same_bits(host.trained[p], nvme.trained[p])) << name << " stage " << stage;
    }
  }
}

// Save, load into a fresh engine, save again: the two rank files are the same bytes, and the
// same bytes as the run with the optimizer state on NVMe writes. The loaded engine keeps the
// frozen master as its half copy alone (host_bytes as after finalize()).
TEST(FrozenHalfOnly, CheckpointRoundTripWritesTheBytesOfTheMasterKept) {
  constexpr int kWorld = 2;
  const Model model = frozen_model(53, true);
  engine_test::ScratchDir dir("frozen_half_only_ckpt");
  const std::string ckpt = dir.path() + "/ckpt";
  const TrainRun host = train(model, kWorld, 3, OffloadDevice::kHost, "", 3, ckpt, "host");
  train(model, kWorld, 3, OffloadDevice::kNvme, dir.path(), 3, ckpt, "nvme");
  const TrainRun drawn = train(frozen_model(53, false), kWorld, 3, OffloadDevice::kHost, "", 1);

  const Config config =
      engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, "");
  std::vector<std::uint64_t> loaded_host_bytes(kWorld, 0);
  std::vector<Status> st =
      engine_test::with_engines(config, model, kWorld, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "host"));
        loaded_host_bytes[rank] = engine.memory().host_bytes;
        ZINF_ASSIGN_OR_RETURN(auto masters, engine_test::read_masters(engine, model));
        for (std::size_t p = 0; p < masters.size() && rank == 0; ++p) {
          EXPECT_TRUE(same_bits(masters[p], host.trained[p])) << model.params[p].name;
        }
        return engine.save_checkpoint(ckpt, "again");
      });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(loaded_host_bytes[r], host.host_bytes[r]) << "rank " << r;
    EXPECT_LT(loaded_host_bytes[r], drawn.host_bytes[r]) << "rank " << r;
    const std::string file = "/rank" + std::to_string(r) + ".zinfckpt";
    const std::string saved = engine_test::read_file(ckpt + "/host" + file);
    ASSERT_FALSE(saved.empty()) << file;
    EXPECT_TRUE(saved == engine_test::read_file(ckpt + "/again" + file)) << file << " again";
    EXPECT_TRUE(saved == engine_test::read_file(ckpt + "/nvme" + file)) << file << " nvme";
  }
}

// Values the half copy does not hold, written into a frozen parameter (write_parameters) or
// loaded from a checkpoint, read back bit for bit, and stay so through steps; the written
// sub-groups keep their master again (host_bytes grows). Values it holds keep it half-only.
TEST(FrozenHalfOnly, ValuesTheHalfCopyDoesNotHoldReadBackExactly) {
  constexpr int kWorld = 2;
  const Model model = frozen_model(61, true);
  engine_test::ScratchDir dir("frozen_half_only_write");
  const std::string ckpt = dir.path() + "/ckpt";
  const Config config =
      engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, "");
  std::size_t w = 0;  // base.w
  while (model.params[w].name != "base.w") ++w;
  std::vector<float> drawn(model.params[w].element_count());
  fill_uniform(drawn.data(), drawn.size(), 6100, -1.0f, 1.0f);
  std::vector<float> exact = drawn;
  {
    const std::vector<std::uint16_t> half = engine_test::narrow_to_half(drawn, DType::kBF16);
    convert_bf16_to_f32(half.data(), exact.data(), half.size());
  }
  ASSERT_FALSE(same_bits(exact, drawn));

  std::vector<std::uint64_t> finalized(kWorld), after_exact(kWorld), after_drawn(kWorld);
  std::vector<std::vector<float>> read_exact, read_drawn, trained;
  std::vector<Status> st =
      engine_test::with_engines(config, model, kWorld, [&](int rank, Engine& engine) -> Status {
        finalized[rank] = engine.memory().host_bytes;
        ZINF_RETURN_IF_ERROR(engine.write_parameters("base.w", exact.data()));
        after_exact[rank] = engine.memory().host_bytes;
        ZINF_ASSIGN_OR_RETURN(auto a, engine_test::read_masters(engine, model));
        ZINF_RETURN_IF_ERROR(engine.write_parameters("base.w", drawn.data()));
        after_drawn[rank] = engine.memory().host_bytes;
        ZINF_ASSIGN_OR_RETURN(auto b, engine_test::read_masters(engine, model));
        ZINF_RETURN_IF_ERROR(engine_test::train_steps(engine, model, rank, 1, 3));
        ZINF_ASSIGN_OR_RETURN(auto c, engine_test::read_masters(engine, model));
        if (rank == 0) {
          read_exact = std::move(a);
          read_drawn = std::move(b);
          trained = std::move(c);
        }
        return engine.save_checkpoint(ckpt, "drawn");
      });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(same_bits(read_exact[w], exact));
  EXPECT_TRUE(same_bits(read_drawn[w], drawn));
  EXPECT_TRUE(same_bits(trained[w], drawn));
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].module != kFrozen || p == w) continue;
    EXPECT_TRUE(same_bits(trained[p], model.initial[p])) << model.params[p].name;
  }
  std::uint64_t grown = 0;
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(after_exact[r], finalized[r]) << "rank " << r;
    EXPECT_GE(after_drawn[r], finalized[r]) << "rank " << r;
    grown += after_drawn[r] - finalized[r];
  }
  // base.w's elements across the ranks got a master (but for those in the trainable sub-groups
  // beside the frozen run: less than a page at each end of each rank's).
  EXPECT_GT(grown, drawn.size() * sizeof(float) - 2 * kWorld * kPageElementBytes);

  // Loaded into an engine registered with values its half copy holds: the checkpoint's bits.
  st = engine_test::with_engines(config, model, kWorld, [&](int rank, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "drawn"));
    ZINF_ASSIGN_OR_RETURN(auto loaded, engine_test::read_masters(engine, model));
    ZINF_RETURN_IF_ERROR(engine_test::train_steps(engine, model, rank, 4, 5));
    ZINF_ASSIGN_OR_RETURN(auto stepped, engine_test::read_masters(engine, model));
    if (rank == 0) {
      for (std::size_t p = 0; p < loaded.size(); ++p) {
        EXPECT_TRUE(same_bits(loaded[p], trained[p])) << model.params[p].name;
      }
      EXPECT_TRUE(same_bits(stepped[w], drawn));
    }
    return Status::ok();
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
}

// Non-zero moments loaded into a frozen module whose master its half copy holds (saved with the
// module trainable at learning rate 0: its master as registered, its moments those of three
// steps): the next steps update its sub-groups, so their master is made first (host_bytes grows
// to the kept master's), and the module keeps the registered bits, stepped at learning rate 0.
TEST(FrozenHalfOnly, LoadedMomentsGiveTheFrozenSubGroupsTheirMaster) {
  constexpr int kWorld = 2;
  const Model model = frozen_model(67, true);
  Model thawed = model;
  thawed.frozen_module.clear();
  engine_test::ScratchDir dir("frozen_half_only_moments");
  const std::string ckpt = dir.path() + "/ckpt";
  Config still = engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, "");
  still.optimizer.lr = 0.0;
  still.optimizer.weight_decay = 0.0;
  const Status saved = engine_test::train_and_save(still, thawed, kWorld, 3, ckpt, "moments");
  ASSERT_TRUE(saved.is_ok()) << saved.to_string();

  const TrainRun drawn = train(frozen_model(67, false), kWorld, 3, OffloadDevice::kHost, "", 1);
  engine_test::Ranks ranks = engine_test::make_ranks(kWorld);
  const engine_test::LoadedRun run = engine_test::load_and_train(
      engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, ""), ranks, model,
      ckpt, "moments", 4, 5);
  for (const Status& s : run.status) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_LT(run.finalized_host_bytes[r], drawn.host_bytes[r]) << "rank " << r;
    EXPECT_EQ(run.loaded_host_bytes[r], drawn.host_bytes[r]) << "rank " << r;
  }
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].module != kFrozen) continue;
    EXPECT_TRUE(same_bits(run.masters[p], model.initial[p])) << model.params[p].name;
  }
}

// Values written into a frozen parameter that spans several of the 256 Ki-element chunks a
// half-only sub-group is read and written by (one sub-group of its own: sub_group_size 4 Mi),
// exact up to partway through the second chunk and not from there on: the sub-group stays
// half-only through a write of exact values (host_bytes as after finalize()), gets its master
// back at the first value its half copy does not hold (host_bytes grows by its master), and
// every value reads back bit for bit, the neighbour in its sub-group (base.b) unchanged; saved
// and loaded into a fresh engine (half-only again after finalize()), the same bits and bytes.
TEST(FrozenHalfOnly, AWriteThatStopsBeingExactInItsSecondChunkReadsBackExactly) {
  constexpr std::size_t kChunkElements = std::size_t{1} << 18;
  Model model = frozen_model(71, true);
  std::size_t w = 0;  // base.w: 3 chunks and a part of a fourth
  while (model.params[w].name != "base.w") ++w;
  model.params[w].shape = {1024, 800};
  std::vector<float>& base_w = model.initial[w];
  base_w.resize(model.params[w].element_count());
  fill_uniform(base_w.data(), base_w.size(), 7100, -1.0f, 1.0f);
  {
    const std::vector<std::uint16_t> half = engine_test::narrow_to_half(base_w, DType::kBF16);
    convert_bf16_to_f32(half.data(), base_w.data(), half.size());
  }
  ASSERT_GT(base_w.size(), 3 * kChunkElements);
  // New values the half copy holds, then the same but drawn (not held) from a point of the
  // second chunk on.
  std::vector<float> exact(base_w.size());
  fill_uniform(exact.data(), exact.size(), 7101, -1.0f, 1.0f);
  {
    const std::vector<std::uint16_t> half = engine_test::narrow_to_half(exact, DType::kBF16);
    convert_bf16_to_f32(half.data(), exact.data(), half.size());
  }
  const std::size_t cut = kChunkElements + kChunkElements / 3;
  std::vector<float> mixed = exact;
  fill_uniform(mixed.data() + cut, mixed.size() - cut, 7102, -1.0f, 1.0f);
  ASSERT_FALSE(same_bits(mixed, exact));

  engine_test::ScratchDir dir("frozen_half_only_chunks");
  const std::string ckpt = dir.path() + "/ckpt";
  Config config = engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, "");
  config.zero.sub_group_size = std::size_t{4} << 20;
  std::uint64_t finalized = 0, after_exact = 0, after_mixed = 0;
  std::vector<std::vector<float>> read_exact, read_mixed;
  std::vector<Status> st =
      engine_test::with_engines(config, model, 1, [&](int, Engine& engine) -> Status {
        finalized = engine.memory().host_bytes;
        ZINF_RETURN_IF_ERROR(engine.write_parameters("base.w", exact.data()));
        after_exact = engine.memory().host_bytes;
        ZINF_ASSIGN_OR_RETURN(read_exact, engine_test::read_masters(engine, model));
        ZINF_RETURN_IF_ERROR(engine.write_parameters("base.w", mixed.data()));
        after_mixed = engine.memory().host_bytes;
        ZINF_ASSIGN_OR_RETURN(read_mixed, engine_test::read_masters(engine, model));
        return engine.save_checkpoint(ckpt, "mixed");
      });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(same_bits(read_exact[w], exact));
  EXPECT_TRUE(same_bits(read_mixed[w], mixed));
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].module != kFrozen || p == w) continue;
    EXPECT_TRUE(same_bits(read_exact[p], model.initial[p])) << model.params[p].name;
    EXPECT_TRUE(same_bits(read_mixed[p], model.initial[p])) << model.params[p].name;
  }
  EXPECT_EQ(after_exact, finalized);
  // The frozen sub-group's master (base's elements but for less than a page at each end, which
  // the trainable sub-groups beside it hold, and their padding) is allocated again.
  const std::uint64_t frozen_bytes = frozen_elements(model) * sizeof(float);
  EXPECT_GT(after_mixed, finalized + frozen_bytes - 2 * kPageElementBytes);
  EXPECT_LE(after_mixed, finalized + frozen_bytes + 2 * kPageElementBytes);

  std::uint64_t fresh = 0, loaded = 0;
  std::vector<std::vector<float>> read_loaded;
  st = engine_test::with_engines(config, model, 1, [&](int, Engine& engine) -> Status {
    fresh = engine.memory().host_bytes;
    ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "mixed"));
    loaded = engine.memory().host_bytes;
    ZINF_ASSIGN_OR_RETURN(read_loaded, engine_test::read_masters(engine, model));
    return engine.save_checkpoint(ckpt, "again");
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(fresh, finalized);
  EXPECT_EQ(loaded, after_mixed);
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    EXPECT_TRUE(same_bits(read_loaded[p], read_mixed[p])) << model.params[p].name;
  }
  const std::string saved = engine_test::read_file(ckpt + "/mixed/rank0.zinfckpt");
  ASSERT_FALSE(saved.empty());
  EXPECT_TRUE(saved == engine_test::read_file(ckpt + "/again/rank0.zinfckpt"));
}

}  // namespace
}  // namespace zinf
