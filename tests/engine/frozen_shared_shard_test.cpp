// A frozen group's host shard lent by the optimizer state (stage 3, offload_param "cpu",
// offload_optimizer "cpu", every group bf16): the coordinator keeps no copy of a frozen group
// whose elements lie in frozen sub-groups alone, and gathers it from the store's half array
// (ParamCoordinatorOptions::shared_host_shards, OptimizerState::share_host_shards). The model's
// frozen module is eight 4096-element parameters, each a group of its own
// (zinf.group_max_elements 4096), so that at world 2 the six in the middle lie in frozen
// sub-groups on every rank (a trainable module's run is widened to 1024-element boundaries, so
// the first and the last frozen group share a sub-group with one). The devices delay their
// stream work at random (jitter), so that a copy the engine does not wait for shows up.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/random.hpp"
#include "device/host_device.hpp"
#include "engine/state_fixture.hpp"
#include "engine_test_util.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using engine_test::Model;

constexpr int kSharedWorld = 2;
constexpr int kFrozenParams = 8;
constexpr std::size_t kFrozenParamElements = 64 * 64;
// The frozen groups whose shards are lent on each rank: all but the first and the last.
constexpr std::size_t kLentGroups = kFrozenParams - 2;

// bf16; the frozen module "base" between two trainable ones, seeded values in [-1, 1), the
// frozen ones rounded to bf16 with `exact` (each x then equals widen(narrow(x))).
Model lent_model(std::uint64_t seed, bool exact) {
  Model m;
  m.modules = {"embed", "base", "head"};
  m.params.push_back({"embed.w", "embed", {37, 41}, DType::kBF16});
  for (int l = 0; l < kFrozenParams; ++l) {
    m.params.push_back({"base.w" + std::to_string(l), "base", {64, 64}, DType::kBF16});
  }
  m.params.push_back({"head.w", "head", {29, 43}, DType::kBF16});
  m.params.push_back({"head.b", "head", {29}, DType::kBF16});
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    std::vector<float> v(m.params[p].element_count());
    fill_uniform(v.data(), v.size(), seed * 1000 + p, -1.0f, 1.0f);
    m.initial.push_back(std::move(v));
  }
  m.frozen_module = "base";
  if (!exact) return m;
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    if (m.params[p].module != "base") continue;
    const std::vector<std::uint16_t> half = engine_test::narrow_to_half(m.initial[p], DType::kBF16);
    convert_bf16_to_f32(half.data(), m.initial[p].data(), half.size());
  }
  return m;
}

Config lent_config(OffloadDevice params, bool overlap) {
  Config c = engine_test::small_config(3, OffloadDevice::kHost, params, "");
  c.zero.group_max_elements = kFrozenParamElements;
  c.overlap_step = overlap;
  return c;
}

engine_test::Ranks checked_ranks() {
  test::HostRanksOptions o;
  o.jitter_max_us = 50;
  o.jitter_seed = 91;
  return test::make_host_ranks(kSharedWorld, o);
}

using engine_test::same_bits;

// Each rank's MemoryReport::host_bytes after finalize().
std::vector<std::uint64_t> finalized_host_bytes(const Config& config, const Model& model) {
  engine_test::Ranks ranks = checked_ranks();
  std::vector<std::uint64_t> out(kSharedWorld, 0);
  const std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
        ZINF_RETURN_IF_ERROR(engine.finalize());
        out[rank] = engine.memory().host_bytes;
        return Status::ok();
      });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

// The host bytes the shards take on each rank: offload_param "cpu" less offload_param "none".
std::vector<std::int64_t> shard_host_bytes(const Model& model) {
  const std::vector<std::uint64_t> host =
      finalized_host_bytes(lent_config(OffloadDevice::kHost, false), model);
  const std::vector<std::uint64_t> device =
      finalized_host_bytes(lent_config(OffloadDevice::kNone, false), model);
  std::vector<std::int64_t> out(kSharedWorld);
  for (int r = 0; r < kSharedWorld; ++r) {
    out[r] = static_cast<std::int64_t>(host[r]) - static_cast<std::int64_t>(device[r]);
  }
  return out;
}

// One rank's shard of each lent group: 2048 bf16 elements, one page.
constexpr std::int64_t kLentBytes = kLentGroups * kFrozenParamElements / kSharedWorld * 2;

// Per rank, the host bytes the shards of `model` take less those of the same model with "base"
// trainable (whose shards the coordinator keeps).
std::vector<std::int64_t> shard_host_bytes_saved(const Model& model) {
  Model trainable = model;
  trainable.frozen_module.clear();
  const std::vector<std::int64_t> lent = shard_host_bytes(model);
  const std::vector<std::int64_t> kept = shard_host_bytes(trainable);
  std::vector<std::int64_t> out(kSharedWorld);
  for (int r = 0; r < kSharedWorld; ++r) {
    std::printf("rank %d: shards take %lld host bytes with base frozen, %lld trainable\n", r,
                static_cast<long long>(lent[r]), static_cast<long long>(kept[r]));
    out[r] = kept[r] - lent[r];
  }
  return out;
}

// The lent frozen shards take no host memory of the coordinator's: with the module frozen, the
// shards in host memory take 2 bytes less a lent element (one rank's shard of each of the six
// middle groups, 2048 bf16 elements, one page) than with the same module trainable, whose shards
// the optimizer rewrites every step and the coordinator keeps. Values bf16 holds or not alike.
TEST(FrozenSharedShard, LentShardsTakeNoHostMemory) {
  for (bool exact : {true, false}) {
    const std::vector<std::int64_t> saved = shard_host_bytes_saved(lent_model(17, exact));
    for (int r = 0; r < kSharedWorld; ++r) {
      EXPECT_EQ(saved[r], kLentBytes) << "exact " << exact << " rank " << r;
    }
  }
}

// Gathered values (every module, every step: train_rank() compares each with the reference's,
// bit for bit) and the masters after the steps are those of the reference, with the overlapped
// step on and off; the frozen parameters read back as registered.
TEST(FrozenSharedShard, GathersTheRegisteredBitsAndTrainsAsTheReference) {
  const Model model = lent_model(23, true);
  for (bool overlap : {false, true}) {
    const Config config = lent_config(OffloadDevice::kHost, overlap);
    engine_test::TrainOptions options;
    options.steps = 4;
    const engine_test::Reference ref =
        engine_test::run_reference(config, model, kSharedWorld, options);
    engine_test::Ranks ranks = checked_ranks();
    const engine_test::RankRuns runs =
        engine_test::train_against_reference(config, ranks, model, options, ref);
    for (int r = 0; r < kSharedWorld; ++r) {
      ASSERT_TRUE(runs.status[r].is_ok())
          << "overlap " << overlap << ": " << runs.status[r].to_string();
      for (std::size_t p = 0; p < model.params.size(); ++p) {
        EXPECT_LE(engine_test::max_rel_diff(runs.finals[r][p], ref.master[p]), 1e-6)
            << "overlap " << overlap << " " << model.params[p].name;
        if (model.params[p].module == "base") {
          EXPECT_TRUE(same_bits(runs.finals[r][p], model.initial[p])) << model.params[p].name;
        }
      }
    }
  }
}

// Save after two steps, load into fresh engines and save again: the rank files are the same
// bytes, the loaded engine's shards take the host memory they took after finalize() (the lent
// ones none), and its gathers in two more steps are the reference's, bit for bit.
TEST(FrozenSharedShard, CheckpointRoundTripKeepsTheShardsLent) {
  const Model model = lent_model(41, true);
  engine_test::ScratchDir dir("frozen_shared_shard_ckpt");
  const std::string ckpt = dir.path() + "/ckpt";
  const Config config = lent_config(OffloadDevice::kHost, true);
  engine_test::TrainOptions options;
  options.steps = 4;
  const engine_test::Reference ref =
      engine_test::run_reference(config, model, kSharedWorld, options);
  std::vector<std::uint64_t> finalized(kSharedWorld), loaded(kSharedWorld);
  {
    engine_test::Ranks ranks = checked_ranks();
    std::vector<Status> st =
        engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
          ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
          ZINF_RETURN_IF_ERROR(engine.finalize());
          finalized[rank] = engine.memory().host_bytes;
          engine_test::TrainOptions first = options;
          first.steps = 2;
          first.device = ranks.devices[rank].get();
          ZINF_RETURN_IF_ERROR(
              engine_test::train_rank(engine, model, rank, first, &ref.device_per_step, nullptr));
          return engine.save_checkpoint(ckpt, "first");
        });
    for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  }
  engine_test::Ranks ranks = checked_ranks();
  std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
        ZINF_RETURN_IF_ERROR(engine.finalize());
        ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "first"));
        loaded[rank] = engine.memory().host_bytes;
        ZINF_RETURN_IF_ERROR(engine.save_checkpoint(ckpt, "again"));
        engine_test::TrainOptions rest = options;
        rest.first_step = 3;
        rest.device = ranks.devices[rank].get();
        return engine_test::train_rank(engine, model, rank, rest, &ref.device_per_step, nullptr);
      });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (int r = 0; r < kSharedWorld; ++r) {
    EXPECT_EQ(loaded[r], finalized[r]) << "rank " << r;
    const std::string file = "/rank" + std::to_string(r) + ".zinfckpt";
    const std::string saved = engine_test::read_file(ckpt + "/first" + file);
    ASSERT_FALSE(saved.empty()) << file;
    EXPECT_TRUE(saved == engine_test::read_file(ckpt + "/again" + file)) << file;
  }
}

// The master bytes an inexact write of parameter `p` of lent_model() restores on each rank: a
// half-only sub-group gets its master whole (StoreState's materialise()), so the write costs the
// masters of every sub-group its shard overlaps, its neighbours' elements in them too. Each
// group's shard is its elements padded to world * 128 (the partitioner's alignment_elements),
// halved; "embed"'s run is widened to a 1024-element quantum (frozen_cuts()), from which the
// frozen sub-groups are sub_group_size elements each.
std::uint64_t restored_master_bytes(const Model& model, std::size_t p, std::size_t sub_group) {
  const auto shard = [](std::size_t elements) {
    const std::size_t slice = kSharedWorld * 128;
    return (elements + slice - 1) / slice * slice / kSharedWorld;
  };
  const std::size_t frozen_first = (shard(model.params[0].element_count()) + 1023) / 1024 * 1024;
  std::size_t begin = shard(model.params[0].element_count());
  for (std::size_t q = 1; q < p; ++q) begin += shard(model.params[q].element_count());
  const std::size_t end = begin + shard(model.params[p].element_count());
  const std::size_t first = (begin - frozen_first) / sub_group;
  const std::size_t last = (end - frozen_first + sub_group - 1) / sub_group;
  return (last - first) * sub_group * sizeof(float);
}

// write_parameters on a parameter of a lent group (base.w3, in the middle), with values bf16
// holds and then with values it does not: the module then gathers the written values rounded to
// bf16 (the writes reach the lent half copy), read_parameters gives the written values, and the
// inexact write costs the host memory of the masters it restores and nothing else: those of the
// four sub-groups (zero.sub_group_size elements, 700 in engine_test::small_config()) that base.w3's
// 2048 elements a rank overlap (11,200 bytes, of which 3,008 are for the 288 elements of base.w2
// and the 464 of base.w4 that share the first and the last), not the lent shard taken back into a
// copy of the coordinator's.
TEST(FrozenSharedShard, WrittenValuesReachTheLentShards) {
  const Model model = lent_model(67, true);
  const std::vector<std::int64_t> saved = shard_host_bytes_saved(model);
  for (int r = 0; r < kSharedWorld; ++r) ASSERT_EQ(saved[r], kLentBytes) << "rank " << r;

  std::size_t w = 0;
  while (model.params[w].name != "base.w3") ++w;
  std::vector<float> drawn(kFrozenParamElements);
  fill_uniform(drawn.data(), drawn.size(), 6700, -1.0f, 1.0f);
  std::vector<float> exact(drawn.size());
  {
    const std::vector<std::uint16_t> half = engine_test::narrow_to_half(drawn, DType::kBF16);
    convert_bf16_to_f32(half.data(), exact.data(), half.size());
  }
  ASSERT_FALSE(same_bits(exact, drawn));
  const Config config = lent_config(OffloadDevice::kHost, false);
  const std::size_t sub_group = config.zero.sub_group_size;
  ASSERT_EQ(restored_master_bytes(model, w, sub_group), 4 * sub_group * sizeof(float));

  // The gathered values of every parameter of "base", widened to f32.
  const auto gathered_base = [&](Engine& engine) -> Result<std::vector<std::vector<float>>> {
    std::vector<std::vector<float>> out(model.params.size());
    ZINF_RETURN_IF_ERROR(engine.gather("base"));
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      if (model.params[p].module != "base") continue;
      ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(model.params[p].name));
      out[p].resize(view.element_count);
      convert_bf16_to_f32(static_cast<const std::uint16_t*>(view.data), out[p].data(),
                          view.element_count);
    }
    ZINF_RETURN_IF_ERROR(engine.release("base"));
    return out;
  };

  std::vector<std::uint64_t> finalized(kSharedWorld), after_exact(kSharedWorld),
      after_drawn(kSharedWorld);
  std::vector<std::vector<std::vector<float>>> gathered_exact(kSharedWorld),
      gathered_drawn(kSharedWorld);
  std::vector<float> read_exact(drawn.size()), read_drawn(drawn.size());
  engine_test::Ranks ranks = checked_ranks();
  const std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
        ZINF_RETURN_IF_ERROR(engine.finalize());
        finalized[rank] = engine.memory().host_bytes;
        ZINF_RETURN_IF_ERROR(engine.write_parameters("base.w3", exact.data()));
        after_exact[rank] = engine.memory().host_bytes;
        ZINF_ASSIGN_OR_RETURN(gathered_exact[rank], gathered_base(engine));
        std::vector<float> a(drawn.size());
        ZINF_RETURN_IF_ERROR(engine.read_parameters("base.w3", a.data()));
        ZINF_RETURN_IF_ERROR(engine.write_parameters("base.w3", drawn.data()));
        after_drawn[rank] = engine.memory().host_bytes;
        ZINF_ASSIGN_OR_RETURN(gathered_drawn[rank], gathered_base(engine));
        std::vector<float> b(drawn.size());
        ZINF_RETURN_IF_ERROR(engine.read_parameters("base.w3", b.data()));
        if (rank == 0) {
          read_exact = std::move(a);
          read_drawn = std::move(b);
        }
        return Status::ok();
      });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_TRUE(same_bits(read_exact, exact));
  EXPECT_TRUE(same_bits(read_drawn, drawn));
  for (int r = 0; r < kSharedWorld; ++r) {
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      if (model.params[p].module != "base") continue;
      const std::vector<float>& want = p == w ? exact : model.initial[p];
      EXPECT_TRUE(same_bits(gathered_exact[r][p], want)) << "rank " << r << " " << p;
      EXPECT_TRUE(same_bits(gathered_drawn[r][p], want)) << "rank " << r << " " << p;
    }
    std::printf(
        "rank %d: host bytes %llu finalized, %llu after the exact write, %llu after the "
        "inexact one\n",
        r, static_cast<unsigned long long>(finalized[r]),
        static_cast<unsigned long long>(after_exact[r]),
        static_cast<unsigned long long>(after_drawn[r]));
    EXPECT_EQ(after_exact[r], finalized[r]) << "rank " << r;
    EXPECT_EQ(after_drawn[r] - finalized[r],
              restored_master_bytes(model, w, config.zero.sub_group_size))
        << "rank " << r;
  }
}

// Non-zero moments loaded into the frozen module (saved with it trainable at learning rate 0):
// every pass now steps its sub-groups and rewrites their half copy while the overlapped step's
// next forward gathers, so each lent shard is taken back first (host_bytes grows by one page a
// lent group: values bf16 does not hold, so no master is made besides). The module keeps its
// values through overlapped steps.
TEST(FrozenSharedShard, LoadedMomentsTakeTheLentShardsBack) {
  const Model model = lent_model(59, false);
  Model thawed = model;
  thawed.frozen_module.clear();
  engine_test::ScratchDir dir("frozen_shared_shard_moments");
  const std::string ckpt = dir.path() + "/ckpt";
  Config still = lent_config(OffloadDevice::kHost, true);
  still.optimizer.lr = 0.0;
  still.optimizer.weight_decay = 0.0;
  const Status saved = engine_test::train_and_save(still, thawed, kSharedWorld, 3, ckpt, "moments");
  ASSERT_TRUE(saved.is_ok()) << saved.to_string();

  engine_test::Ranks ranks = checked_ranks();
  const engine_test::LoadedRun run = engine_test::load_and_train(
      lent_config(OffloadDevice::kHost, true), ranks, model, ckpt, "moments", 4, 6);
  for (const Status& s : run.status) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (int r = 0; r < kSharedWorld; ++r) {
    EXPECT_EQ(static_cast<std::int64_t>(run.loaded_host_bytes[r] - run.finalized_host_bytes[r]),
              kLentBytes)
        << "rank " << r;
  }
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].module != "base") continue;
    EXPECT_TRUE(same_bits(run.masters[p], model.initial[p])) << model.params[p].name;
  }
}

// The lent spans of the store's half array are registered with the state's device, so that a
// gather copies them asynchronously on a GPU. An engine cannot run on a device that refuses every
// copy from unregistered memory (its ranks agree on the layout by copies of a few words from the
// stack), so the state is opened alone, on such a device (require_registered_host), over a
// frozen "base" of 64 Ki bf16 elements in frozen sub-groups alone and a trainable "lora": each
// lent shard is then copied to the device and back, whole, and holds base's values; a copy from
// memory the state did not register fails on the same device. As a persistent group, "base" is
// not lent and nothing is registered.
TEST(FrozenSharedShard, LentSpansAreRegisteredWithTheDevice) {
  engine_test::StateFixture f(
      std::size_t{1} << 16, std::size_t{1} << 12,
      {.offload = OffloadDevice::kHost, .seed = 31, .dtype = DType::kBF16, .base_exact = true});
  HostDeviceOptions o;
  o.require_registered_host = true;
  std::unique_ptr<Device> strict = std::move(make_host_device(o)).value();
  auto& host = dynamic_cast<HostDevice&>(*strict);
  std::unique_ptr<Stream> stream = std::move(strict->create_stream("test")).value();
  const ParameterLayout& layout = f.layout_;
  std::vector<std::uint16_t> unregistered(16, 0);
  void* probe = std::move(strict->allocate(unregistered.size() * 2)).value();
  EXPECT_EQ(strict->copy_h2d(probe, unregistered.data(), unregistered.size() * 2, *stream).code(),
            Code::kFailedPrecondition);
  ASSERT_TRUE(strict->free(probe).is_ok());
  for (bool persistent : {false, true}) {
    SCOPED_TRACE(persistent ? "base persistent" : "base partitioned");
    Result<std::unique_ptr<OptimizerState>> opened = open_store_state(f.context(strict.get()));
    ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
    std::vector<bool> persistent_groups(layout.group_count(), false);
    for (std::uint32_t g = 0; g < layout.group_count(); ++g) {
      persistent_groups[g] = persistent && layout.frozen_group(g);
    }
    Result<std::vector<const std::byte*>> lent = (*opened)->share_host_shards(persistent_groups);
    ASSERT_TRUE(lent.is_ok()) << lent.status().to_string();
    std::size_t lent_count = 0;
    const std::byte* kept = nullptr;  // a lent shard, for the teardown's check
    for (std::uint32_t g = 0; g < layout.group_count(); ++g) {
      const std::byte* shard = (*lent)[g];
      if (shard == nullptr) continue;
      ++lent_count;
      kept = shard;
      ASSERT_TRUE(layout.frozen_group(g));
      const std::size_t elements = layout.group(g).shard_element_count;
      const std::size_t bytes = elements * 2;
      EXPECT_TRUE(host.registered(shard, bytes)) << "group " << g;
      void* on_device = std::move(strict->allocate(bytes)).value();
      std::vector<std::uint16_t> back(elements);
      ASSERT_TRUE(strict->copy_h2d(on_device, shard, bytes, *stream).is_ok()) << "group " << g;
      ASSERT_TRUE(strict->synchronize(*stream).is_ok());
      std::memcpy(back.data(), on_device, bytes);  // a HostDevice's memory, host-accessible
      ASSERT_TRUE(strict->free(on_device).is_ok());
      const std::vector<std::uint16_t> want =
          engine_test::narrow_to_half(f.values_[0], DType::kBF16);
      EXPECT_EQ(std::memcmp(back.data(), want.data(), std::min(bytes, want.size() * 2)), 0)
          << "group " << g;
    }
    EXPECT_EQ(lent_count, persistent ? 0u : 1u);
    // A load of moments that are zero over the frozen groups (seeded over the trainable ones, as
    // a checkpoint of a LoRA run holds them) steps no frozen sub-group, so it takes back no shard
    // and asks no coordinator (a state opened alone has none): each lent shard stays registered.
    for (Piece piece : {Piece::kExpAvg, Piece::kExpAvgSq}) {
      const Status loaded = (*opened)->write_state(
          piece, [&](std::size_t first, std::size_t count, float* out) -> Status {
            std::fill(out, out + count, 0.0f);
            for (std::uint32_t g = 0; g < layout.group_count(); ++g) {
              if (layout.frozen_group(g)) continue;
              const std::size_t lo = std::max(first, layout.offset(g));
              const std::size_t hi =
                  std::min(first + count, layout.offset(g) + layout.group(g).shard_element_count);
              if (lo < hi) {
                fill_uniform(out + (lo - first), hi - lo, 3100 + static_cast<std::uint64_t>(piece),
                             1e-4f, 1e-2f);
              }
            }
            return Status::ok();
          });
      EXPECT_TRUE(loaded.is_ok()) << loaded.to_string();
    }
    for (std::uint32_t g = 0; g < layout.group_count(); ++g) {
      const std::byte* shard = (*lent)[g];
      if (shard == nullptr) continue;
      EXPECT_TRUE(host.registered(shard, layout.group(g).shard_element_count * 2)) << "group " << g;
    }
    // The state unregisters what it registered when it goes.
    opened->reset();
    if (kept != nullptr) {
      EXPECT_FALSE(host.registered(kept, 1));
    }
  }
}

}  // namespace
}  // namespace zinf
