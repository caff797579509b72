// The tiered optimizer step against the same optimizer run in memory, bit for bit; faults
// injected mid-step; the host tier; telemetry and trace spans.
#include "tier/optimizer_pipeline.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "io/fault.hpp"
#include "tier_test_util.hpp"
#include "zinf/trace.hpp"

namespace zinf {
namespace {

using tier_test::Reference;
using tier_test::Rig;
using tier_test::RigOptions;

OptimizerParams adamw() {
  OptimizerParams hp;
  hp.kind = OptimizerKind::kAdamW;
  hp.lr = 1e-2;  // large enough that every step changes every value
  hp.weight_decay = 0.05;
  return hp;
}

struct Case {
  std::size_t param_count;
  std::size_t sub_group_params;
  std::size_t pool_blocks;
  DType grad_dtype;
  OptimizerKind kind;
};

// K steps through the pipeline; after each, every sub-group read back from NVMe equals the
// in-memory run.
void run_equality(const Case& c, const std::array<StoreMedium, kPieceCount>& tiers, int steps) {
  const std::uint64_t seed = 0x7e57 + c.param_count + c.sub_group_params;
  std::printf("equality: %zu params, sub-groups of %zu, %zu blocks, seed %llu\n", c.param_count,
              c.sub_group_params, c.pool_blocks, static_cast<unsigned long long>(seed));
  RigOptions so;
  so.store.param_count = c.param_count;
  so.store.sub_group_params = c.sub_group_params;
  so.store.grad_dtype = c.grad_dtype;
  so.store.optimizer = c.kind;
  so.store.tiers = tiers;
  so.pool_blocks = c.pool_blocks;
  so.pipeline.optimizer = adamw();
  so.pipeline.optimizer.kind = c.kind;
  so.pipeline.threads = 2;
  Rig s;
  Reference ref;
  Status opened = tier_test::open_loaded_rig("equal", so, seed, 0, &s, &ref);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  for (int t = 1; t <= steps; ++t) {
    ref.make_grads(c.grad_dtype, seed * 31 + t);
    ASSERT_TRUE(tier_test::load_grads(*s.store, ref).is_ok());
    const float grad_scale = 1.0f / static_cast<float>(t + 1);
    Result<StepStats> stats = s.pipeline->step({.step = t, .grad_scale = grad_scale});
    ASSERT_TRUE(stats.is_ok()) << stats.status().to_string();
    ref.step(so.pipeline.optimizer, so.store, t, grad_scale);
    EXPECT_EQ(stats->sub_groups, s.store->sub_group_count());
    EXPECT_LE(stats->blocks_peak, c.pool_blocks);
    for (std::size_t i = 0; i < s.store->sub_group_count(); ++i) {
      ASSERT_EQ(tier_test::compare_sub_group(*s.store, i, ref), "") << "step " << t << " sg " << i;
      EXPECT_EQ(s.store->version(i, t), Version::kNew);
      EXPECT_EQ(s.store->stored_step(i), t);
    }
  }
}

constexpr std::array<StoreMedium, kPieceCount> kAllNvme = {StoreMedium::kNvme, StoreMedium::kNvme,
                                                           StoreMedium::kNvme, StoreMedium::kNvme,
                                                           StoreMedium::kNvme};
constexpr std::array<StoreMedium, kPieceCount> kAllHost = {StoreMedium::kHost, StoreMedium::kHost,
                                                           StoreMedium::kHost, StoreMedium::kHost,
                                                           StoreMedium::kHost};

TEST(OptimizerPipeline, NvmeStateEqualsInMemoryRunForSubGroupSizes) {
  // Sub-group sizes that divide the partition, that do not (a short last sub-group), of one
  // parameter fewer than a page's worth, and one sub-group for everything.
  const std::size_t count = 3 * 4096 * 8 + 777;
  for (std::size_t sub : {std::size_t{4096}, std::size_t{10007}, std::size_t{1023}, count}) {
    run_equality({count, sub, 3, DType::kF32, OptimizerKind::kAdamW}, kAllNvme, 3);
  }
}

TEST(OptimizerPipeline, TwoBlocksManyBlocksAndHalfGradients) {
  run_equality({50'000, 4000, 2, DType::kBF16, OptimizerKind::kAdamW}, kAllNvme, 2);
  run_equality({50'000, 3001, 12, DType::kF16, OptimizerKind::kAdam}, kAllNvme, 2);
}

TEST(OptimizerPipeline, OtherOptimizersHaveTheirPiecesOnly) {
  run_equality({30'000, 7000, 3, DType::kF32, OptimizerKind::kLion}, kAllNvme, 2);
  run_equality({30'000, 7000, 3, DType::kF32, OptimizerKind::kAdagrad}, kAllNvme, 2);
}

TEST(OptimizerPipeline, HostTierAndMixedTiers) {
  run_equality({40'000, 9000, 3, DType::kF32, OptimizerKind::kAdamW}, kAllHost, 3);
  // Master on the host, moments on NVMe, gradients on the host, half output on NVMe.
  run_equality({40'000, 9000, 3, DType::kBF16, OptimizerKind::kAdamW},
               {StoreMedium::kHost, StoreMedium::kNvme, StoreMedium::kNvme, StoreMedium::kHost,
                StoreMedium::kNvme},
               3);
  // Only the gradients on NVMe: nothing to write back.
  run_equality({40'000, 9000, 2, DType::kF32, OptimizerKind::kAdamW},
               {StoreMedium::kHost, StoreMedium::kHost, StoreMedium::kHost, StoreMedium::kNvme,
                StoreMedium::kHost},
               2);
}

TEST(OptimizerPipeline, ThreadEngineGivesTheSameState) {
  RigOptions so;
  so.engine = EngineKind::kThread;
  so.store.param_count = 20'000;
  so.store.sub_group_params = 5000;
  so.pipeline.optimizer = adamw();
  Rig s;
  Reference ref;
  ASSERT_TRUE(tier_test::open_loaded_rig("thread", so, 99, 100, &s, &ref).is_ok());
  ASSERT_TRUE(s.pipeline->step({.step = 1}).is_ok());
  ref.step(so.pipeline.optimizer, so.store, 1, 1.0f);
  EXPECT_EQ(tier_test::compare_all(*s.store, ref), "");
}

TEST(OptimizerPipeline, TelemetryCountsBytesAndTraceHasSpansPerSubGroup) {
  Trace trace;
  RigOptions so;
  so.store.param_count = 30'000;
  so.store.sub_group_params = 4096;
  so.store.grad_dtype = DType::kBF16;
  so.pipeline.optimizer = adamw();
  so.pipeline.trace = &trace;
  Rig s;
  Reference ref;
  ASSERT_TRUE(tier_test::open_loaded_rig("trace", so, 5, 6, &s, &ref).is_ok());
  Result<StepStats> stats = s.pipeline->step({.step = 1});
  ASSERT_TRUE(stats.is_ok()) << stats.status().to_string();
  const std::uint64_t n = so.store.param_count;
  EXPECT_EQ(stats->read_bytes, n * (4 + 4 + 4 + 2));   // master, moments, bf16 gradients
  EXPECT_EQ(stats->write_bytes, n * (4 + 4 + 4 + 2));  // master, moments, bf16 half
  EXPECT_GT(stats->update_ns, 0);
  EXPECT_GE(stats->wall_ns, stats->update_ns);
  EXPECT_GE(stats->wall_ns, stats->io_wait_ns);
  const std::size_t groups = s.store->sub_group_count();
  ASSERT_EQ(groups, 8u);
  const std::vector<std::string> tracks = trace.track_names();
  std::map<std::string, std::set<std::string>> spans;
  for (const Trace::Event& e : trace.events()) {
    spans[tracks[static_cast<std::size_t>(e.track)]].insert(e.name);
    EXPECT_GE(e.duration_ns, 0);
  }
  for (const char* track : {"read", "update", "write"}) {
    EXPECT_EQ(spans[track].size(), groups) << track;
    EXPECT_EQ(spans[track].count(std::string(track) + " sg7"), 1u) << track;
  }
  // The file Perfetto opens: complete events with a thread per track, named by metadata.
  const nlohmann::json json = nlohmann::json::parse(trace.to_json());
  std::map<int, std::string> thread_names;
  std::size_t complete = 0;
  for (const nlohmann::json& e : json.at("traceEvents")) {
    if (e.at("ph") == "M" && e.at("name") == "thread_name") {
      thread_names[e.at("tid").get<int>()] = e.at("args").at("name").get<std::string>();
    } else if (e.at("ph") == "X") {
      ++complete;
      EXPECT_TRUE(e.contains("ts") && e.contains("dur") && e.contains("tid"));
    }
  }
  EXPECT_EQ(complete, 3 * groups);
  std::set<std::string> named;
  for (const auto& [tid, name] : thread_names) named.insert(name);
  EXPECT_EQ(named, (std::set<std::string>{"read", "update", "write"}));
}

// A descending step that turns (StepArgs::ascend): the sub-groups begun before the turn go on
// from the last down, the rest from the first up, on NVMe and in host memory; each one is
// updated once, to the in-memory run's values. Without a descending step a turn is refused.
struct TurnLog {
  std::size_t turn_at_left = 0;  // ascend says yes once `left` is at most this
  std::vector<std::size_t> asked_left;
  std::vector<std::size_t> updates;  // the gate's questions: one per update, in order
};

int log_ready(void* user, std::size_t sub_group) {
  static_cast<TurnLog*>(user)->updates.push_back(sub_group);
  return 1;
}

bool log_ascend(void* user, std::size_t left) {
  auto* log = static_cast<TurnLog*>(user);
  log->asked_left.push_back(left);
  return left <= log->turn_at_left;
}

TEST(OptimizerPipeline, ADescendingStepTurnsToTheFirstSubGroupsAndUpdatesEachOnce) {
  for (const auto& tiers : {kAllNvme, kAllHost}) {
    for (std::size_t turn_at : {std::size_t{0}, std::size_t{3}, std::size_t{7}}) {
      const bool nvme = tiers[0] == StoreMedium::kNvme;
      SCOPED_TRACE(fmt::format("{} turn at {}", nvme ? "nvme" : "host", turn_at));
      RigOptions so;
      so.store.param_count = 30'000;
      so.store.sub_group_params = 4096;  // 8 sub-groups, the last short
      so.store.tiers = tiers;
      so.pool_blocks = 3;
      so.pipeline.optimizer = adamw();
      so.pipeline.threads = 2;
      Rig s;
      Reference ref;
      ASSERT_TRUE(tier_test::open_loaded_rig("turn", so, 41, 42, &s, &ref).is_ok());
      TurnLog log;
      log.turn_at_left = turn_at;
      Result<StepStats> stats = s.pipeline->step({.step = 1,
                                                  .grad_scale = 0.5f,
                                                  .descending = true,
                                                  .ready = &log_ready,
                                                  .ready_user = &log,
                                                  .ascend = &log_ascend});
      ASSERT_TRUE(stats.is_ok()) << stats.status().to_string();
      ref.step(so.pipeline.optimizer, so.store, 1, 0.5f);
      // Asked before each sub-group begun after the first, until it said yes.
      std::vector<std::size_t> asked;
      for (std::size_t left = 7; left >= 1; --left) {
        asked.push_back(left);
        if (left <= turn_at) break;
      }
      EXPECT_EQ(log.asked_left, asked);
      std::vector<std::size_t> want;
      for (std::size_t i = 8; i-- > turn_at;) want.push_back(i);
      for (std::size_t i = 0; i < turn_at; ++i) want.push_back(i);
      EXPECT_EQ(log.updates, want);
      for (std::size_t i = 0; i < s.store->sub_group_count(); ++i) {
        ASSERT_EQ(tier_test::compare_sub_group(*s.store, i, ref), "") << "sg " << i;
        EXPECT_EQ(s.store->stored_step(i), 1);
      }
    }
  }
  RigOptions so;
  so.store.param_count = 10'000;
  so.store.sub_group_params = 4096;
  so.pipeline.optimizer = adamw();
  Rig s;
  Reference ref;
  ASSERT_TRUE(tier_test::open_loaded_rig("turn_up", so, 43, 44, &s, &ref).is_ok());
  TurnLog log;
  Result<StepStats> up = s.pipeline->step({.step = 1, .ascend = &log_ascend});
  EXPECT_EQ(up.status().code(), Code::kInvalidArgument) << up.status().to_string();
}

// A gate that says "not yet" for every sub-group until `open_after` questions, then yes, or
// calls the step off (< 0) once `call_off_at` sub-groups have been updated.
struct HoldLog {
  std::size_t call_off_at = SIZE_MAX;
  std::size_t updated = 0;
  int held = 0;  // questions answered "not yet"
  int open_after = 0;
  float* late_scale = nullptr;  // written when the gate first opens
  float scale_at_open = 1.0f;
};

int hold_ready(void* user, std::size_t) {
  auto* log = static_cast<HoldLog*>(user);
  if (log->updated >= log->call_off_at) return -1;
  if (log->held < log->open_after) {
    ++log->held;
    return 0;
  }
  if (log->late_scale != nullptr) *log->late_scale = log->scale_at_open;
  ++log->updated;
  return 1;
}

// A step its gate holds reads ahead, then updates with the scale written when the gate opened
// (StepArgs::late_grad_scale): the in-memory reference's values with that scale, not grad_scale.
// Called off before any update it leaves no error and every sub-group old, and the next step
// runs; called off after one, the error is sticky. On NVMe and in host memory.
TEST(OptimizerPipeline, AGateHoldsTheStepReadsAheadAndACallOffBeforeAnyUpdateIsNotSticky) {
  for (const auto& tiers : {kAllNvme, kAllHost}) {
    const bool nvme = tiers[0] == StoreMedium::kNvme;
    SCOPED_TRACE(nvme ? "nvme" : "host");
    RigOptions so;
    so.store.param_count = 30'000;
    so.store.sub_group_params = 4096;  // 8 sub-groups
    so.store.tiers = tiers;
    so.pool_blocks = 3;
    so.pipeline.optimizer = adamw();
    Rig s;
    Reference ref;
    ASSERT_TRUE(tier_test::open_loaded_rig("hold", so, 51, 52, &s, &ref).is_ok());

    HoldLog off;
    off.call_off_at = 0;
    off.open_after = 50;  // the reads run ahead meanwhile
    Result<StepStats> first =
        s.pipeline->step({.step = 1, .ready = &hold_ready, .ready_user = &off});
    EXPECT_EQ(first.status().code(), Code::kAborted) << first.status().to_string();
    EXPECT_TRUE(s.pipeline->error().is_ok()) << s.pipeline->error().to_string();
    for (std::size_t i = 0; i < s.store->sub_group_count(); ++i) {
      EXPECT_EQ(s.store->stored_step(i), 0) << "sg " << i;
      EXPECT_FALSE(s.store->torn(i)) << "sg " << i;
    }

    float late = 1.0f;
    HoldLog hold;
    hold.open_after = 50;
    hold.late_scale = &late;
    hold.scale_at_open = 0.25f;
    Result<StepStats> second = s.pipeline->step({.step = 1,
                                                 .grad_scale = 1.0f,
                                                 .late_grad_scale = &late,
                                                 .ready = &hold_ready,
                                                 .ready_user = &hold});
    ASSERT_TRUE(second.is_ok()) << second.status().to_string();
    EXPECT_EQ(hold.held, 50);
    if (nvme) {
      EXPECT_EQ(second->blocks_peak, 3u);  // every block read ahead while held
    }
    ref.step(so.pipeline.optimizer, so.store, 1, 0.25f);
    EXPECT_EQ(tier_test::compare_all(*s.store, ref), "");

    HoldLog late_off;
    late_off.call_off_at = 1;
    Result<StepStats> third =
        s.pipeline->step({.step = 2, .ready = &hold_ready, .ready_user = &late_off});
    EXPECT_EQ(third.status().code(), Code::kAborted) << third.status().to_string();
    EXPECT_FALSE(s.pipeline->error().is_ok()) << "one sub-group is new: sticky";
    EXPECT_EQ(s.pipeline->step({.step = 2}).status().code(), Code::kAborted);
  }
}

TEST(OptimizerPipeline, IoOnlyAndUpdateOnlyLeaveVersionsAlone) {
  RigOptions so;
  so.store.param_count = 20'000;
  so.store.sub_group_params = 3000;
  so.pipeline.optimizer = adamw();
  Rig s;
  Reference ref;
  ASSERT_TRUE(tier_test::open_loaded_rig("modes", so, 17, 18, &s, &ref).is_ok());
  Result<StepStats> io = s.pipeline->step({.step = 1, .mode = StepMode::kIoOnly});
  ASSERT_TRUE(io.is_ok()) << io.status().to_string();
  EXPECT_EQ(io->update_ns, 0);
  EXPECT_EQ(io->read_bytes, 20'000u * 16);
  Result<StepStats> up = s.pipeline->step({.step = 1, .mode = StepMode::kUpdateOnly});
  ASSERT_TRUE(up.is_ok()) << up.status().to_string();
  EXPECT_EQ(up->read_bytes + up->write_bytes, 0u);
  EXPECT_GT(up->update_ns, 0);
  // The master and moments on disk are still the initial ones (io-only wrote back what it read).
  Reference initial;
  initial.init(so.store.param_count, 17);
  for (std::size_t i = 0; i < s.store->sub_group_count(); ++i) {
    EXPECT_EQ(s.store->version(i, 1), Version::kOld);
    AlignedBuffer buffer(16384 * 4, 4096);
    ASSERT_TRUE(s.store->read_piece(Piece::kParams, i, buffer.data()).is_ok());
    EXPECT_EQ(std::memcmp(buffer.data(), initial.params.data() + s.store->sub_group_first(i),
                          s.store->piece_bytes(Piece::kParams, i)),
              0);
  }
  // And a real step afterwards is still step 1.
  ASSERT_TRUE(s.pipeline->step({.step = 1}).is_ok());
  ref.step(so.pipeline.optimizer, so.store, 1, 1.0f);
  EXPECT_EQ(tier_test::compare_all(*s.store, ref), "");
}

TEST(OptimizerPipeline, NewLearningRateTakesEffectWithoutReopening) {
  RigOptions so;
  so.store.param_count = 20'000;
  so.store.sub_group_params = 6000;
  so.pipeline.optimizer = adamw();
  Rig s;
  Reference ref;
  ASSERT_TRUE(tier_test::open_loaded_rig("lr", so, 41, 0, &s, &ref).is_ok());
  OptimizerParams hp = so.pipeline.optimizer;
  for (std::int64_t t = 1; t <= 3; ++t) {
    hp.lr = 1e-2 / static_cast<double>(t);  // a schedule
    ASSERT_TRUE(s.pipeline->set_optimizer_params(hp).is_ok());
    ref.make_grads(DType::kF32, 42 + static_cast<std::uint64_t>(t));
    ASSERT_TRUE(tier_test::load_grads(*s.store, ref).is_ok());
    ASSERT_TRUE(s.pipeline->step({.step = t}).is_ok());
    ref.step(hp, so.store, t, 1.0f);
  }
  EXPECT_EQ(tier_test::compare_all(*s.store, ref), "");
  hp.kind = OptimizerKind::kLion;
  EXPECT_EQ(s.pipeline->set_optimizer_params(hp).code(), Code::kInvalidArgument);
}

TEST(OptimizerPipeline, StepOutOfOrderIsRefusedWithoutTouchingState) {
  RigOptions so;
  so.store.param_count = 10'000;
  so.store.sub_group_params = 4096;
  so.pipeline.optimizer = adamw();
  Rig s;
  Reference ref;
  ASSERT_TRUE(tier_test::open_loaded_rig("order", so, 3, 4, &s, &ref).is_ok());
  Result<StepStats> r = s.pipeline->step({.step = 2});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(r.status().to_string().find("sub-group 0"), std::string::npos);
}

// Faults mid-step, many seeds: the step fails with a Status naming the sub-group, later calls
// return the same error, nothing hangs, and each sub-group reads back (with faults off) as
// exactly the version the store records: old, new, or torn where its own write failed.
struct FaultTally {
  int failed_steps = 0, torn = 0, old_groups = 0, new_groups = 0;
};

void check_failed_step(Rig& s, std::int64_t t, const Status& error, const Reference& ref,
                       const Reference& old, std::uint64_t seed, FaultTally* tally);

void run_fault_seed(std::uint64_t seed, const FaultSpec& base, FaultTally* tally) {
  std::printf("fault seed %llu\n", static_cast<unsigned long long>(seed));
  FaultSpec spec = base;
  spec.seed = seed;
  auto faults = std::make_shared<FaultInjector>(spec);
  faults->set_enabled(false);
  RigOptions so;
  so.faults = faults;
  so.io_block_bytes = 16 << 10;
  so.store.param_count = 24'000 + seed % 5 * 1000;
  so.store.sub_group_params = 2048 + seed % 3 * 1500;
  so.store.grad_dtype = DType::kBF16;
  so.pool_blocks = 3 + seed % 3;
  so.pipeline.optimizer = adamw();
  so.pipeline.threads = 1;
  so.pipeline.io_timeout = std::chrono::seconds(20);
  Rig s;
  Reference ref;
  Status opened = tier_test::open_loaded_rig("fault", so, seed, 0, &s, &ref);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  for (std::int64_t t = 1; t <= 3; ++t) {
    ref.make_grads(DType::kBF16, seed + 100 * static_cast<std::uint64_t>(t));
    ASSERT_TRUE(tier_test::load_grads(*s.store, ref).is_ok());
    Reference old = ref;
    ref.step(so.pipeline.optimizer, so.store, t, 1.0f);
    faults->set_enabled(true);
    Result<StepStats> r = s.pipeline->step({.step = t});
    faults->set_enabled(false);
    if (r.is_ok()) {
      ASSERT_EQ(tier_test::compare_all(*s.store, ref), "") << "seed " << seed;
      continue;
    }
    ++tally->failed_steps;
    check_failed_step(s, t, r.status(), ref, old, seed, tally);
    return;
  }
}

// After step t failed with `error`: the error names the step and sub-group and is sticky, and
// each sub-group reads back (faults off) as exactly the version the store records: old, new, or
// torn where its own write failed.
void check_failed_step(Rig& s, std::int64_t t, const Status& error, const Reference& ref,
                       const Reference& old, std::uint64_t seed, FaultTally* tally) {
  {
    const std::string message = error.to_string();
    EXPECT_NE(message.find(fmt::format("optimizer step {}: sub-group ", t)), std::string::npos)
        << message;
    // Sticky: the same error, whatever is asked next.
    Result<StepStats> again = s.pipeline->step({.step = t + 1});
    ASSERT_FALSE(again.is_ok());
    EXPECT_EQ(again.status().to_string(), message);
    EXPECT_EQ(s.pipeline->error().to_string(), message);
    for (std::size_t i = 0; i < s.store->sub_group_count(); ++i) {
      const Version v = s.store->version(i, t);
      for (std::size_t p = 0; p < kPieceCount; ++p) {
        const auto piece = static_cast<Piece>(p);
        const Residency res = s.store->residency(piece, i);
        EXPECT_TRUE(res == Residency::kDisk || res == Residency::kLost) << residency_name(res);
        // Only a sub-group whose write failed may hold a lost piece.
        if (res == Residency::kLost) {
          EXPECT_EQ(v, Version::kTorn) << "sg " << i;
        }
      }
      if (v == Version::kTorn) {
        ++tally->torn;
        // Its own write failed: at least one piece is lost, or reads back as neither version.
        bool lost = false;
        for (std::size_t p = 0; p < kPieceCount; ++p) {
          lost |= s.store->residency(static_cast<Piece>(p), i) == Residency::kLost;
        }
        EXPECT_TRUE(lost) << "seed " << seed << " sg " << i;
        continue;
      }
      const Reference& expect = v == Version::kNew ? ref : old;
      v == Version::kNew ? ++tally->new_groups : ++tally->old_groups;
      EXPECT_EQ(tier_test::compare_sub_group(*s.store, i, expect), "")
          << "seed " << seed << " sg " << i << " says " << version_name(v);
    }
  }
}

TEST(OptimizerPipelineFaults, EioOnReadsAndWritesManySeeds) {
  FaultSpec spec;
  spec.eio_rate = 0.004;
  spec.short_rate = 0.05;
  spec.eintr_rate = 0.02;
  FaultTally tally;
  for (std::uint64_t seed = 1; seed <= 40; ++seed) {
    run_fault_seed(seed, spec, &tally);
    if (HasFatalFailure()) return;
  }
  std::printf("failed steps %d, sub-groups torn %d, old %d, new %d\n", tally.failed_steps,
              tally.torn, tally.old_groups, tally.new_groups);
  // The test must have exercised failures, and of every outcome.
  EXPECT_GE(tally.failed_steps, 5);
  EXPECT_GT(tally.torn, 0);
  EXPECT_GT(tally.old_groups, 0);
  EXPECT_GT(tally.new_groups, 0);
}

TEST(OptimizerPipelineFaults, WriteFaultsAndFullDiskManySeeds) {
  FaultSpec spec;
  spec.reads = false;
  spec.eio_rate = 0.003;
  spec.enospc_rate = 0.003;
  spec.latency_rate = 0.01;
  spec.latency = std::chrono::microseconds(500);
  FaultTally tally;
  for (std::uint64_t seed = 101; seed <= 130; ++seed) {
    run_fault_seed(seed, spec, &tally);
    if (HasFatalFailure()) return;
  }
  std::printf("failed steps %d, sub-groups torn %d, old %d, new %d\n", tally.failed_steps,
              tally.torn, tally.old_groups, tally.new_groups);
  EXPECT_GE(tally.failed_steps, 5);
  EXPECT_GT(tally.torn, 0);
}

TEST(OptimizerPipelineFaults, BitFlipOnReadIsCorruptionAndLeavesOldState) {
  FaultSpec spec;
  spec.writes = false;
  spec.bit_flip_rate = 0.01;
  FaultTally tally;
  for (std::uint64_t seed = 201; seed <= 215; ++seed) {
    run_fault_seed(seed, spec, &tally);
    if (HasFatalFailure()) return;
  }
  EXPECT_GE(tally.failed_steps, 5);
  EXPECT_EQ(tally.torn, 0);  // reads never tear anything
}

// A read or write that never completes: the step gives up on it within the bound
// ((io_timeouts_max + 1) * io_timeout, plus one io_timeout for a read the driver polls), with a
// timeout naming the sub-group, the piece and its swap extent and how it ended; the error is
// sticky and the versions exact. When the cancel does not end it either, its block stays out of
// the pool.
struct HangCase {
  bool reads;         // hang a read (else a write)
  bool cancel_works;  // else FaultSpec::hang_ignores_cancel
  EngineKind engine;
};

void run_hang(const HangCase& c, std::uint64_t seed) {
  std::printf("hang: %s, cancel %s, engine %s, seed %llu\n", c.reads ? "read" : "write",
              c.cancel_works ? "works" : "ignored", engine_kind_name(c.engine).data(),
              static_cast<unsigned long long>(seed));
  FaultSpec spec;
  spec.seed = seed;
  spec.hang_rate = 1.0;
  spec.hang_max = 1;
  spec.hang_ignores_cancel = !c.cancel_works;
  spec.reads = c.reads;
  spec.writes = !c.reads;
  auto faults = std::make_shared<FaultInjector>(spec);
  faults->set_enabled(false);
  RigOptions so;
  so.engine = c.engine;
  so.faults = faults;
  so.io_block_bytes = 16 << 10;
  so.store.param_count = 20'000;
  so.store.sub_group_params = 3000;
  so.pool_blocks = 3;
  so.pipeline.optimizer = adamw();
  so.pipeline.threads = 1;
  // 250 ms a wait: the wait after the cancel must see a thread engine's worker run, which on a
  // loaded 2-core machine under a sanitizer took longer than 50 ms.
  so.pipeline.io_timeout = std::chrono::milliseconds(250);
  so.pipeline.io_timeouts_max = 2;
  Rig s;
  Reference ref;
  Status opened = tier_test::open_loaded_rig("hang", so, seed, seed + 1, &s, &ref);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  const Reference old = ref;
  ref.step(so.pipeline.optimizer, so.store, 1, 1.0f);
  faults->set_enabled(true);
  const auto start = std::chrono::steady_clock::now();
  Result<StepStats> r = s.pipeline->step({.step = 1});
  const auto took = std::chrono::steady_clock::now() - start;
  faults->set_enabled(false);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(faults->counts().hang, 1u);
  const Status& error = r.status();
  EXPECT_EQ(error.code(), Code::kTimeout) << error.to_string();
  const std::string message = error.to_string();
  for (const char* part : {c.reads ? ": reading " : ": writing ", "swap extent rank0/",
                           c.cancel_works ? "gave up after 2 waits of 250 ms: cancelled"
                                          : "its block is quarantined"}) {
    EXPECT_NE(message.find(part), std::string::npos) << "no '" << part << "' in " << message;
  }
  // It waited as configured, and no longer than the bound (with room for a loaded machine).
  // (Each wait's own deadline is rounded down to whole milliseconds: allow 10 ms less.)
  EXPECT_GE(took, 2 * so.pipeline.io_timeout - std::chrono::milliseconds(10));
  EXPECT_LT(took, std::chrono::seconds(3));
  std::printf(
      "step failed after %lld ms: %s\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()),
      message.c_str());
  EXPECT_EQ(s.pool->free_count(), s.pool->block_count() - (c.cancel_works ? 0 : 1));
  FaultTally tally;
  check_failed_step(s, 1, error, ref, old, seed, &tally);
  // A hung write tears its own sub-group only; a hung read tears nothing.
  EXPECT_EQ(tally.torn, c.reads ? 0 : 1);
}

TEST(OptimizerPipelineFaults, WriteThatNeverCompletesIsCancelledWithinTheBound) {
  run_hang({.reads = false, .cancel_works = true, .engine = EngineKind::kAuto}, 301);
  run_hang({.reads = false, .cancel_works = true, .engine = EngineKind::kThread}, 302);
}

TEST(OptimizerPipelineFaults, ReadThatNeverCompletesIsCancelledWithinTheBound) {
  run_hang({.reads = true, .cancel_works = true, .engine = EngineKind::kAuto}, 303);
  run_hang({.reads = true, .cancel_works = true, .engine = EngineKind::kThread}, 304);
}

TEST(OptimizerPipelineFaults, TransferThatIgnoresCancelQuarantinesItsBlock) {
  run_hang({.reads = false, .cancel_works = false, .engine = EngineKind::kAuto}, 305);
  run_hang({.reads = true, .cancel_works = false, .engine = EngineKind::kThread}, 306);
}

}  // namespace
}  // namespace zinf
