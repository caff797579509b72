// Frozen parameters (ParameterSpec::trainable false): the five-module model of the engine tests
// with one module frozen trains its other modules exactly as the single-process reference trains
// them with that module left out of the step (engine_test_util.hpp, Model::frozen_module), on
// world sizes 1 and 2, stages 1-3, the optimizer state on the device, in host memory and on
// NVMe, every optimizer kind with weight decay; the frozen module's fp32 master and every gathered
// copy of it keep the bits it was registered with. The refusals (a module that mixes frozen and
// trainable parameters, reduce_gradients() of a frozen module, zinf.gradients_on_nvme), and a
// checkpoint saved with the module frozen, loaded where it is frozen and where it is trainable.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

#include "base/random.hpp"
#include "common/loop_mount.hpp"
#include "common/sanitizer.hpp"
#include "engine_test_util.hpp"
#include "io/fault.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using engine_test::big_lora_model;
using engine_test::Model;
using engine_test::Reference;
using engine_test::TrainOptions;
using test_common::LoopMount;

struct FrozenCase {
  int world = 1;
  int stage = 3;
  OffloadDevice optimizer = OffloadDevice::kHost;
  OffloadDevice params = OffloadDevice::kNone;
  std::string frozen = "block1";
  OptimizerKind kind = OptimizerKind::kAdamW;
  DType dtype = DType::kF32;
  int micro_batches = 1;
  double clipping = 0.0;
  bool fp16 = false;    // static loss scale 1: the step's pass only reads ahead in the backward
  bool opaque = false;  // the gradients accumulate on a device that is not host-accessible
  bool overlap = true;  // zinf.overlap_step
  int steps = 6;
  // zinf.sub_group_size; 0: small_config's 700, where every sub-group holds trainable elements.
  // Small enough, the frozen module's own sub-groups are passed over by the optimizer pass.
  std::size_t sub_group_size = 0;
};

std::string frozen_case_name(const FrozenCase& c) {
  return fmt::format("w{}_s{}_opt_{}_param_{}_{}_{}_{}_mb{}{}{}{}{}{}", c.world, c.stage,
                     offload_device_name(c.optimizer), offload_device_name(c.params), c.frozen,
                     optimizer_name(c.kind), dtype_name(c.dtype), c.micro_batches,
                     c.clipping > 0 ? "_clip" : "", c.fp16 ? "_fp16" : "",
                     c.opaque ? "_opaque" : "", c.overlap ? "" : "_sequential",
                     c.sub_group_size > 0 ? fmt::format("_sg{}", c.sub_group_size) : "");
}

Config case_config(const FrozenCase& c, const std::string& dir) {
  Config config = engine_test::small_config(c.stage, c.optimizer, c.params, dir);
  config.optimizer.kind = c.kind;
  config.gradient_clipping = c.clipping;
  config.overlap_step = c.overlap;
  if (c.sub_group_size > 0) config.zero.sub_group_size = c.sub_group_size;
  if (c.fp16) {
    config.fp16.enabled = true;
    config.fp16.loss_scale = 1.0;
  }
  return config;
}

// Trains the case on every rank against the reference (gathered copies compared at every step)
// and checks the final masters.
void run_frozen_case(const FrozenCase& c) {
  const std::uint64_t seed = 4321 + static_cast<std::uint64_t>(c.world) * 10 +
                             static_cast<std::uint64_t>(c.stage) +
                             static_cast<std::uint64_t>(c.kind) * 100;
  std::printf("case %s seed %llu\n", frozen_case_name(c).c_str(),
              static_cast<unsigned long long>(seed));
  engine_test::ScratchDir dir("frozen_" + frozen_case_name(c));
  const Config config = case_config(c, dir.path());
  Model model = engine_test::make_model(c.dtype, seed);
  model.frozen_module = c.frozen;
  TrainOptions options;
  options.steps = c.steps;
  options.micro_batches = c.micro_batches;
  if (c.clipping > 0) options.gathered_tolerance = 1e-5;
  options.device_adam = c.opaque && c.optimizer == OffloadDevice::kNone;
  const Reference ref = engine_test::run_reference(config, model, c.world, options);

  engine_test::Ranks ranks =
      engine_test::make_ranks(c.world, std::chrono::seconds(30), /*jitter_max_us=*/0, c.opaque);
  engine_test::RankRuns runs =
      engine_test::train_against_reference(config, ranks, model, options, ref);
  const std::vector<Status>& st = runs.status;
  const auto& finals = runs.finals;
  const auto& reports = runs.reports;
  for (int r = 0; r < c.world; ++r) {
    ASSERT_TRUE(st[static_cast<std::size_t>(r)].is_ok())
        << "rank " << r << ": " << st[static_cast<std::size_t>(r)].to_string();
  }
  const double tolerance = options.device_adam && c.clipping > 0 ? 2e-5 : 1e-6;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    const engine_test::ParamDef& d = model.params[p];
    for (int r = 0; r < c.world; ++r) {
      const std::vector<float>& got = finals[static_cast<std::size_t>(r)][p];
      if (d.module == model.frozen_module) {
        // The bits it was registered with, after steps with weight decay.
        EXPECT_EQ(std::memcmp(got.data(), model.initial[p].data(), got.size() * 4), 0)
            << "rank " << r << ": frozen " << d.name << " changed";
      } else {
        EXPECT_LE(engine_test::max_rel_diff(got, ref.master[p]), tolerance)
            << "rank " << r << ": " << d.name;
        // It trained: a run that stepped nothing would match a reference that stepped nothing.
        EXPECT_GT(engine_test::max_rel_diff(got, model.initial[p]), 1e-3) << d.name;
      }
    }
  }
  ASSERT_EQ(reports[0].size(), static_cast<std::size_t>(c.steps));
  for (const StepReport& rep : reports[0]) EXPECT_FALSE(rep.skipped);
  EXPECT_EQ(reports[0].back().step, c.steps);
  EXPECT_EQ(reports[0].back().micro_batches, c.micro_batches);
}

class FrozenEquivalence : public ::testing::TestWithParam<FrozenCase> {};

TEST_P(FrozenEquivalence, TrainsTheOthersAsTheReferenceAndKeepsTheFrozenBits) {
  run_frozen_case(GetParam());
}

std::vector<FrozenCase> equivalence_cases() {
  std::vector<FrozenCase> cases;
  for (int world : {1, 2}) {
    for (int stage : {1, 2, 3}) {
      for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
        FrozenCase c;
        c.world = world;
        c.stage = stage;
        c.optimizer = opt;
        cases.push_back(c);
      }
    }
  }
  // The first module frozen (an embedding) and the last, parameters on NVMe, several
  // micro-batches, clipping, the sequential step, bf16 and fp16 parameters (fp16: the step's
  // pass reads ahead only), and gradients accumulated on a device that is not host-accessible.
  cases.push_back({.world = 2, .stage = 3, .frozen = "embed"});
  cases.push_back({.world = 2,
                   .stage = 3,
                   .optimizer = OffloadDevice::kNvme,
                   .params = OffloadDevice::kNvme,
                   .frozen = "head"});
  cases.push_back({.world = 2, .stage = 3, .micro_batches = 2});
  cases.push_back({.world = 2, .stage = 2, .optimizer = OffloadDevice::kNvme, .clipping = 0.5});
  cases.push_back({.world = 2, .stage = 3, .clipping = 0.5});
  cases.push_back({.world = 2, .stage = 3, .overlap = false});
  cases.push_back({.world = 2, .stage = 3, .dtype = DType::kBF16});
  cases.push_back({.world = 2, .stage = 3, .dtype = DType::kF16, .fp16 = true});
  cases.push_back({.world = 2, .stage = 3, .optimizer = OffloadDevice::kNone, .opaque = true});
  cases.push_back({.world = 2, .stage = 2, .optimizer = OffloadDevice::kNone, .opaque = true});
  cases.push_back({.world = 2, .stage = 1, .optimizer = OffloadDevice::kNone, .opaque = true});
  // bf16 on the device: the frozen module's bf16 copies are rounded from its master, not stepped.
  cases.push_back({.world = 2,
                   .stage = 3,
                   .optimizer = OffloadDevice::kNone,
                   .dtype = DType::kBF16,
                   .opaque = true});
  cases.push_back({.world = 1,
                   .stage = 2,
                   .optimizer = OffloadDevice::kNone,
                   .frozen = "embed",
                   .dtype = DType::kBF16,
                   .opaque = true});
  // bf16 with the state in host-device memory (HostState): the step passes over the frozen
  // ranges, so the frozen module's bf16 copies are the ones rounded when the master was placed.
  cases.push_back(
      {.world = 2, .stage = 3, .optimizer = OffloadDevice::kNone, .dtype = DType::kBF16});
  cases.push_back({.world = 1,
                   .stage = 2,
                   .optimizer = OffloadDevice::kNone,
                   .frozen = "embed",
                   .dtype = DType::kBF16});
  // Every optimizer kind with weight decay, state in host memory and on NVMe.
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kAdagrad, OptimizerKind::kLion}) {
    for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
      cases.push_back({.world = 2, .stage = 3, .optimizer = opt, .kind = kind});
    }
  }
  // Sub-groups of 32 elements: the frozen module's are passed over by the optimizer pass (state
  // in host memory and on NVMe), with the new parameters streamed from the pass (bf16, f16,
  // parameters on NVMe), taken from the store's half array (parameters in host memory, state in
  // host memory) or narrowed from the master (f32); overlapped and sequential, every optimizer.
  for (OffloadDevice opt : {OffloadDevice::kHost, OffloadDevice::kNvme}) {
    for (int stage : {1, 2, 3}) {
      cases.push_back({.world = 2, .stage = stage, .optimizer = opt, .sub_group_size = 32});
      cases.push_back({.world = 2,
                       .stage = stage,
                       .optimizer = opt,
                       .dtype = DType::kBF16,
                       .sub_group_size = 32});
    }
    cases.push_back({.world = 1,
                     .stage = 2,
                     .optimizer = opt,
                     .dtype = DType::kBF16,
                     .overlap = false,
                     .sub_group_size = 32});
    for (OptimizerKind kind :
         {OptimizerKind::kAdam, OptimizerKind::kAdagrad, OptimizerKind::kLion}) {
      cases.push_back({.world = 2,
                       .stage = 3,
                       .optimizer = opt,
                       .kind = kind,
                       .dtype = DType::kBF16,
                       .sub_group_size = 32});
    }
  }
  cases.push_back({.world = 2,
                   .stage = 3,
                   .optimizer = OffloadDevice::kNvme,
                   .params = OffloadDevice::kNvme,
                   .frozen = "embed",
                   .dtype = DType::kBF16,
                   .sub_group_size = 32});
  cases.push_back({.world = 2,
                   .stage = 3,
                   .optimizer = OffloadDevice::kNvme,
                   .params = OffloadDevice::kHost,
                   .frozen = "head",
                   .dtype = DType::kBF16,
                   .sub_group_size = 32});
  cases.push_back({.world = 2,
                   .stage = 2,
                   .optimizer = OffloadDevice::kNvme,
                   .dtype = DType::kF16,
                   .clipping = 0.5,
                   .fp16 = true,
                   .sub_group_size = 32});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, FrozenEquivalence, ::testing::ValuesIn(equivalence_cases()),
                         [](const ::testing::TestParamInfo<FrozenCase>& info) {
                           return frozen_case_name(info.param);
                         });

// Runs fn on one engine of `config` (world 1), nothing registered.
Status with_engine(const Config& config, const std::function<Status(Engine&)>& fn) {
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int, Engine& engine) { return fn(engine); });
  return st[0];
}

TEST(Frozen, AModuleThatMixesFrozenAndTrainableParametersIsRefused) {
  engine_test::ScratchDir dir("frozen_mixed");
  const Config config =
      engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, dir.path());
  const std::vector<float> w(6, 0.25f), b(3, 0.5f);
  Status st = with_engine(config, [&](Engine& engine) -> Status {
    ParameterSpec weight{"lin.w", "lin", {3, 2}, DType::kF32, w.data()};
    weight.trainable = false;
    ZINF_RETURN_IF_ERROR(engine.register_parameter(weight));
    Status mixed = engine.register_parameter({"lin.b", "lin", {3}, DType::kF32, b.data()});
    EXPECT_EQ(mixed.code(), Code::kInvalidArgument) << mixed.to_string();
    EXPECT_NE(mixed.message().find("module 'lin' mixes frozen and trainable"), std::string::npos)
        << mixed.to_string();
    EXPECT_NE(mixed.message().find("'lin.w' is frozen, 'lin.b' is trainable"), std::string::npos)
        << mixed.to_string();
    // Nothing changed: the bias registers under a module of its own, and the engine trains.
    ZINF_RETURN_IF_ERROR(
        engine.register_parameter({"lin.b", "lin.bias", {3}, DType::kF32, b.data()}));
    return engine.finalize();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

// Ranks that froze different modules would step their slices of a module differently (at stage
// 1 silently: every group is reduce-scattered at the step). finalize() compares the flags and
// fails on every rank naming the first parameter that differs and the ranks.
TEST(Frozen, RanksThatFreezeDifferentParametersAreRefusedAtFinalize) {
  engine_test::ScratchDir dir("frozen_ranks_differ");
  const Config config =
      engine_test::small_config(1, OffloadDevice::kHost, OffloadDevice::kNone, dir.path());
  engine_test::Ranks ranks = engine_test::make_ranks(2);
  std::vector<Status> st = engine_test::run_ranks(2, [&](int rank) -> Status {
    Model model = engine_test::make_model(DType::kF32, 78);
    model.frozen_module = rank == 0 ? "block1" : "";
    Env env;
    env.device = ranks.devices[static_cast<std::size_t>(rank)].get();
    env.comm = ranks.comms[static_cast<std::size_t>(rank)].get();
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
    ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
    return engine->finalize();
  });
  for (const Status& s : st) {
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("ranks froze different parameters: 'block1."), std::string::npos)
        << s.to_string();
    EXPECT_NE(s.message().find("is frozen on rank 0 and trainable on rank 1"), std::string::npos)
        << s.to_string();
  }
}

TEST(Frozen, ReduceGradientsOfAFrozenModuleIsRefused) {
  engine_test::ScratchDir dir("frozen_reduce");
  Config config =
      engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, dir.path());
  Model model = engine_test::make_model(DType::kF32, 77);
  model.frozen_module = "block1";
  Status st = with_engine(config, [&](Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
    std::vector<GradientRef> refs;
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      if (model.params[p].module != "block1") continue;
      refs.push_back({model.params[p].name, model.initial[p].data(), model.initial[p].size()});
    }
    ZINF_RETURN_IF_ERROR(engine.gather("block1"));
    Status refused = engine.reduce_gradients("block1", refs);
    EXPECT_EQ(refused.code(), Code::kInvalidArgument) << refused.to_string();
    EXPECT_NE(refused.message().find("reduce_gradients('block1')"), std::string::npos)
        << refused.to_string();
    EXPECT_NE(refused.message().find("takes no gradients"), std::string::npos)
        << refused.to_string();
    ZINF_RETURN_IF_ERROR(engine.release("block1"));
    // The engine stays usable: it trains.
    TrainOptions options;
    options.steps = 2;
    return engine_test::train_rank(engine, model, 0, options, nullptr, nullptr);
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

TEST(Frozen, EveryParameterFrozenHasNothingToStep) {
  engine_test::ScratchDir dir("frozen_all");
  const Config config =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, dir.path());
  const std::vector<float> w(6, 0.25f);
  Status st = with_engine(config, [&](Engine& engine) -> Status {
    ParameterSpec weight{"lin.w", "lin", {3, 2}, DType::kF32, w.data()};
    weight.trainable = false;
    ZINF_RETURN_IF_ERROR(engine.register_parameter(weight));
    Result<StepReport> step = engine.step();
    EXPECT_EQ(step.status().code(), Code::kFailedPrecondition) << step.status().to_string();
    EXPECT_NE(step.status().message().find("every parameter is frozen"), std::string::npos)
        << step.status().to_string();
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

TEST(Frozen, GradientsOnNvmeAreRefusedNamingTheKey) {
  engine_test::ScratchDir dir("frozen_spill");
  Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
  config.gradients_on_nvme = true;
  const std::vector<float> w(6, 0.25f);
  Status st = with_engine(config, [&](Engine& engine) -> Status {
    ParameterSpec weight{"lin.w", "lin", {3, 2}, DType::kF32, w.data()};
    weight.trainable = false;
    Status refused = engine.register_parameter(weight);
    EXPECT_EQ(refused.code(), Code::kInvalidArgument) << refused.to_string();
    EXPECT_NE(refused.message().find("zinf.gradients_on_nvme"), std::string::npos)
        << refused.to_string();
    EXPECT_NE(refused.message().find("'lin.w'"), std::string::npos) << refused.to_string();
    return Status::ok();
  });
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

// Trains 3 steps with block1 frozen and saves; a run that loads the checkpoint with block1
// frozen and trains steps 4-6 ends as the reference's 6 steps, and one that loads it with
// block1 trainable reads the same masters and trains block1 from there.
TEST(Frozen, CheckpointRoundTrip) {
  constexpr int kWorld = 2;
  engine_test::ScratchDir dir("frozen_checkpoint");
  const std::string ckpt = dir.path() + "/ckpt";
  const Config config =
      engine_test::small_config(3, OffloadDevice::kHost, OffloadDevice::kNone, dir.path());
  Model model = engine_test::make_model(DType::kF32, 99);
  model.frozen_module = "block1";
  TrainOptions options;
  options.steps = 6;
  const Reference ref = engine_test::run_reference(config, model, kWorld, options);

  std::vector<std::vector<float>> saved;
  std::vector<Status> st =
      engine_test::with_engines(config, model, kWorld, [&](int rank, Engine& engine) -> Status {
        TrainOptions first = options;
        first.steps = 3;
        ZINF_RETURN_IF_ERROR(
            engine_test::train_rank(engine, model, rank, first, &ref.device_per_step, nullptr));
        // read_parameters is collective: every rank reads, rank 0 keeps them.
        ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> masters,
                              engine_test::read_masters(engine, model));
        if (rank == 0) saved = std::move(masters);
        return engine.save_checkpoint(ckpt, "three");
      });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();

  // Frozen again: steps 4-6 as the reference's, the frozen bits kept.
  std::vector<std::vector<float>> resumed;
  st = engine_test::with_engines(config, model, kWorld, [&](int rank, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "three"));
    ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> loaded,
                          engine_test::read_masters(engine, model));
    for (std::size_t p = 0; p < loaded.size(); ++p) {
      EXPECT_EQ(std::memcmp(loaded[p].data(), saved[p].data(), saved[p].size() * 4), 0)
          << model.params[p].name;
    }
    TrainOptions rest = options;
    rest.first_step = 4;
    ZINF_RETURN_IF_ERROR(
        engine_test::train_rank(engine, model, rank, rest, &ref.device_per_step, nullptr));
    // read_parameters is collective: every rank reads, rank 0 keeps them.
    ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> masters,
                          engine_test::read_masters(engine, model));
    if (rank == 0) resumed = std::move(masters);
    return Status::ok();
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].module == "block1") {
      EXPECT_EQ(std::memcmp(resumed[p].data(), model.initial[p].data(), resumed[p].size() * 4), 0)
          << model.params[p].name;
    } else {
      EXPECT_LE(engine_test::max_rel_diff(resumed[p], ref.master[p]), 1e-6) << model.params[p].name;
    }
  }

  // Trainable now: the same masters, and block1 moves.
  Model thawed = model;
  thawed.frozen_module.clear();
  std::vector<std::vector<float>> after;
  st = engine_test::with_engines(config, thawed, kWorld, [&](int rank, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "three"));
    ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> loaded,
                          engine_test::read_masters(engine, thawed));
    for (std::size_t p = 0; p < loaded.size(); ++p) {
      EXPECT_EQ(std::memcmp(loaded[p].data(), saved[p].data(), saved[p].size() * 4), 0)
          << thawed.params[p].name;
    }
    TrainOptions rest = options;
    rest.first_step = 4;
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, thawed, rank, rest, nullptr, nullptr));
    // read_parameters is collective: every rank reads, rank 0 keeps them.
    ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> masters,
                          engine_test::read_masters(engine, thawed));
    if (rank == 0) after = std::move(masters);
    return Status::ok();
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (std::size_t p = 0; p < thawed.params.size(); ++p) {
    if (thawed.params[p].module != "block1") continue;
    EXPECT_GT(engine_test::max_rel_diff(after[p], model.initial[p]), 1e-3) << thawed.params[p].name;
  }
}

// The other way: saved with block1 trainable (its moments non-zero), loaded with it frozen. Its
// master loads as saved and, stepped at learning rate 0, keeps those bits through later steps,
// whatever its moments hold.
TEST(Frozen, ACheckpointOfATrainedModuleLoadsFrozenAndKeepsItsBits) {
  constexpr int kWorld = 2;
  engine_test::ScratchDir dir("frozen_checkpoint_thawed");
  const std::string ckpt = dir.path() + "/ckpt";
  Config config = engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, "");
  config.optimizer.weight_decay = 0.05;
  const Model trained = engine_test::make_model(DType::kF32, 98);
  Model frozen = trained;
  frozen.frozen_module = "block1";
  TrainOptions options;
  options.steps = 3;
  std::vector<std::vector<float>> saved;
  std::vector<Status> st =
      engine_test::with_engines(config, trained, kWorld, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(
            engine_test::train_rank(engine, trained, rank, options, nullptr, nullptr));
        ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> masters,
                              engine_test::read_masters(engine, trained));
        if (rank == 0) saved = std::move(masters);
        return engine.save_checkpoint(ckpt, "three");
      });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  std::vector<std::vector<float>> after;
  st = engine_test::with_engines(config, frozen, kWorld, [&](int rank, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "three"));
    TrainOptions rest = options;
    rest.first_step = 4;
    rest.steps = 6;
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, frozen, rank, rest, nullptr, nullptr));
    ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> masters,
                          engine_test::read_masters(engine, frozen));
    if (rank == 0) after = std::move(masters);
    return Status::ok();
  });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  for (std::size_t p = 0; p < frozen.params.size(); ++p) {
    if (frozen.params[p].module == "block1") {
      EXPECT_EQ(std::memcmp(after[p].data(), saved[p].data(), saved[p].size() * 4), 0)
          << frozen.params[p].name;
    } else {
      EXPECT_GT(engine_test::max_rel_diff(after[p], saved[p]), 1e-4) << frozen.params[p].name;
    }
  }
}

// Steps [first, last] of `model` on `world` ranks, after loading tag `load` of `ckpt` (unless
// empty) and before saving tag `save` (unless empty); returns rank 0's masters. With `opaque`
// the ranks' devices are opaque HostDevices (the state of offload_optimizer none in device
// memory, stepped by DeviceOptimizer).
std::vector<std::vector<float>> train_between_checkpoints(const Config& config, const Model& model,
                                                          int world, const std::string& ckpt,
                                                          const std::string& load, int first,
                                                          int last, const std::string& save,
                                                          bool opaque = false) {
  std::vector<std::vector<float>> out;
  engine_test::Ranks ranks =
      engine_test::make_ranks(world, std::chrono::seconds(30), /*jitter_max_us=*/0, opaque);
  std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
        ZINF_RETURN_IF_ERROR(engine.finalize());
        if (!load.empty()) ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, load));
        TrainOptions run;
        run.check_gathered = false;
        run.first_step = first;
        run.steps = last;
        run.device = ranks.devices[static_cast<std::size_t>(rank)].get();
        ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, model, rank, run, nullptr, nullptr));
        if (!save.empty()) ZINF_RETURN_IF_ERROR(engine.save_checkpoint(ckpt, save));
        ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> masters,
                              engine_test::read_masters(engine, model));
        if (rank == 0) out = std::move(masters);
        return Status::ok();
      });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

// Steps 1-3 of `trained`, saved; steps 4-6 of `frozen` from it, saved; steps 7-8 of `trained`
// from that: rank 0's final masters.
std::vector<std::vector<float>> train_frozen_between(const Config& config, const Model& trained,
                                                     const Model& frozen, int world,
                                                     const std::string& ckpt) {
  train_between_checkpoints(config, trained, world, ckpt, "", 1, 3, "three");
  train_between_checkpoints(config, frozen, world, ckpt, "three", 4, 6, "six");
  return train_between_checkpoints(config, trained, world, ckpt, "six", 7, 8, "");
}

void expect_same_masters(const std::vector<std::vector<float>>& got,
                         const std::vector<std::vector<float>>& expected, const Model& model,
                         std::string_view what) {
  ASSERT_EQ(got.size(), model.params.size()) << what;
  ASSERT_EQ(expected.size(), model.params.size()) << what;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    EXPECT_EQ(std::memcmp(got[p].data(), expected[p].data(), expected[p].size() * 4), 0)
        << what << ": " << model.params[p].name;
  }
}

// Moments loaded into a frozen module (saved trainable) decay at every step as before, whether
// the module's sub-groups could be passed over (sub-groups of 32) or not (700): steps 4-6 with
// block1 frozen, saved, and resumed with block1 trainable for steps 7-8 end with the same bits
// both ways, the state in host memory and on NVMe. A pass that skipped the loaded frozen
// sub-groups would keep their moments, and block1 would train differently once thawed. With the
// state in the host device's memory (offload_optimizer none: HostState, which passes over the
// frozen ranges until non-zero moments are loaded into them) the same CPU optimizer gives the
// same bits as the state in host memory.
TEST(Frozen, LoadedMomentsOfAFrozenModuleDecayAsWhenNothingIsPassedOver) {
  constexpr int kWorld = 2;
  const Model trained = engine_test::make_model(DType::kF32, 97);
  Model frozen = trained;
  frozen.frozen_module = "block1";
  std::vector<std::vector<float>> host;
  {
    engine_test::ScratchDir dir("frozen_decay_none");
    Config config =
        engine_test::small_config(2, OffloadDevice::kNone, OffloadDevice::kNone, dir.path());
    const std::vector<std::vector<float>> none =
        train_frozen_between(config, trained, frozen, kWorld, dir.path() + "/ckpt");
    engine_test::ScratchDir host_dir("frozen_decay_cpu_sg700");
    config =
        engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, host_dir.path());
    config.zero.sub_group_size = 700;
    host = train_frozen_between(config, trained, frozen, kWorld, host_dir.path() + "/ckpt");
    expect_same_masters(none, host, trained, "none");
  }
  for (OffloadDevice opt : {OffloadDevice::kHost, OffloadDevice::kNvme}) {
    std::vector<std::vector<std::vector<float>>> finals;
    for (std::size_t sub_group_size : {std::size_t{32}, std::size_t{700}}) {
      engine_test::ScratchDir dir(
          fmt::format("frozen_decay_{}_sg{}", offload_device_name(opt), sub_group_size));
      Config config = engine_test::small_config(2, opt, OffloadDevice::kNone, dir.path());
      config.zero.sub_group_size = sub_group_size;
      finals.push_back(train_frozen_between(config, trained, frozen, kWorld, dir.path() + "/ckpt"));
    }
    expect_same_masters(finals[0], finals[1], trained, offload_device_name(opt));
  }
}

// A LoRA-shaped model: a trainable embedding (2048 elements), a frozen base of three 64 x 64
// weights and six trainable 512-element adapters, the optimizer state (AdamW) on NVMe. The
// optimizer pass moves only the trainable share: per step and rank it reads and writes the
// trainable elements' master and moments (12 bytes each), and nothing of the frozen elements:
// not even their master when the new bf16 parameters stream from the pass (a step does not
// republish a frozen group). So with sub-groups of 1024 / world elements
// (each all frozen or all trainable) and with one of the default size (1e9: the frozen base gets
// sub-groups of its own, cut at its ends). Both end with the masters, bit for bit, of the same
// run with the state in device memory (offload_optimizer none on the host device, which passes
// over the frozen ranges too, so that run's frozen masters keep their initial bits and its
// trainable ones are stepped as here). At world 1 a checkpoint is linked after step 2: the step
// after it streams the frozen master once (moving it out of the linked file; the frozen moments are
// zeros the store does not keep, StateStore::release_piece, so there is nothing of them to read or
// write), then passes over it again, and the checkpoint resumes to the same bits.
struct LoraRun {
  std::vector<StepReport> reports;         // rank 0's
  std::vector<std::vector<float>> finals;  // rank 0's masters
  bool linked = false;                     // the checkpoint was linked, not copied
};

Model lora_model(DType dtype) {
  Model m;
  m.modules = {"embed", "base", "lora"};
  m.params.push_back({"embed.w", "embed", {32, 64}, dtype});
  for (int l = 0; l < 3; ++l) {
    m.params.push_back({fmt::format("base.w{}", l), "base", {64, 64}, dtype});
  }
  for (int l = 0; l < 3; ++l) {
    m.params.push_back({fmt::format("lora.a{}", l), "lora", {8, 64}, dtype});
    m.params.push_back({fmt::format("lora.b{}", l), "lora", {64, 8}, dtype});
  }
  for (std::size_t p = 0; p < m.params.size(); ++p) {
    std::vector<float> v(m.params[p].element_count());
    fill_uniform(v.data(), v.size(), 5150 + p, -1.0f, 1.0f);
    m.initial.push_back(std::move(v));
  }
  m.frozen_module = "base";
  return m;
}

// LoadedMomentsOfAFrozenModuleDecayAsWhenNothingIsPassedOver with the checkpoint linked and then
// adopted in place (world 1, state on NVMe, sub-groups of 1024 elements, so the saved blocks line
// up with the frozen engine's): the adopted moments of the frozen module must not be taken as
// settled. Compared with the same sequence with the state in host memory, which never adopts.
TEST(Frozen, AdoptedMomentsOfAFrozenModuleDecay) {
  const Model frozen = lora_model(DType::kF32);
  Model trained = frozen;
  trained.frozen_module.clear();
  std::vector<std::vector<std::vector<float>>> finals;
  for (OffloadDevice opt : {OffloadDevice::kNvme, OffloadDevice::kHost}) {
    engine_test::ScratchDir dir(fmt::format("frozen_adopt_{}", offload_device_name(opt)));
    const std::string ckpt = dir.path() + "/ckpt";
    Config config = engine_test::small_config(2, opt, OffloadDevice::kNone, dir.path());
    config.zero.sub_group_size = 1024;
    config.overlap_step = false;
    finals.push_back(train_frozen_between(config, trained, frozen, 1, ckpt));
    if (opt == OffloadDevice::kNvme) {
      EXPECT_FALSE(engine_test::read_file(ckpt + "/three/rank0.blocks").empty())
          << "not linked: the load cannot have adopted it";
    }
  }
  expect_same_masters(finals[0], finals[1], trained, "nvme against host");
}

LoraRun run_lora(const Model& model, int world, OffloadDevice opt, std::size_t sub_group_size,
                 bool overlap, bool save, OffloadDevice params = OffloadDevice::kNone) {
  engine_test::ScratchDir dir(fmt::format("frozen_lora_w{}_{}_{}_sg{}_{}_{}{}", world,
                                          offload_device_name(opt), offload_device_name(params),
                                          sub_group_size, dtype_name(model.params[0].dtype),
                                          overlap ? "overlap" : "sequential", save ? "_save" : ""));
  const std::string ckpt = dir.path() + "/ckpt";
  // Stage 3 where the parameters are offloaded (offload_param applies to stage 3 only).
  const int stage = params == OffloadDevice::kNone ? 2 : 3;
  Config config = engine_test::small_config(stage, opt, params, dir.path());
  config.zero.sub_group_size = sub_group_size;
  config.overlap_step = overlap;
  TrainOptions options;
  options.steps = 5;
  options.check_gathered = false;
  LoraRun run;
  std::vector<Status> st =
      engine_test::with_engines(config, model, world, [&](int rank, Engine& engine) -> Status {
        std::vector<StepReport> reports;
        TrainOptions first = options;
        first.steps = save ? 2 : options.steps;
        ZINF_RETURN_IF_ERROR(
            engine_test::train_rank(engine, model, rank, first, nullptr, &reports));
        if (save) {
          ZINF_RETURN_IF_ERROR(engine.save_checkpoint(ckpt, "two"));
          TrainOptions rest = options;
          rest.first_step = 3;
          ZINF_RETURN_IF_ERROR(
              engine_test::train_rank(engine, model, rank, rest, nullptr, &reports));
        }
        ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> masters,
                              engine_test::read_masters(engine, model));
        if (rank == 0) {
          run.reports = std::move(reports);
          run.finals = std::move(masters);
        }
        return Status::ok();
      });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  if (!save) return run;
  run.linked = !engine_test::read_file(ckpt + "/two/rank0.blocks").empty();
  // Resumed from the checkpoint: steps 3-5 end where the run that saved it did.
  std::vector<std::vector<float>> resumed;
  st = engine_test::with_engines(config, model, world, [&](int rank, Engine& engine) -> Status {
    ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "two"));
    TrainOptions rest = options;
    rest.first_step = 3;
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, model, rank, rest, nullptr, nullptr));
    ZINF_ASSIGN_OR_RETURN(std::vector<std::vector<float>> masters,
                          engine_test::read_masters(engine, model));
    if (rank == 0) resumed = std::move(masters);
    return Status::ok();
  });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(resumed.size(), run.finals.size());
  for (std::size_t p = 0; p < resumed.size() && p < run.finals.size(); ++p) {
    EXPECT_EQ(std::memcmp(resumed[p].data(), run.finals[p].data(), resumed[p].size() * 4), 0)
        << "resumed " << model.params[p].name;
  }
  return run;
}

void check_lora_pass(int world, DType dtype, bool overlap) {
  const Model model = lora_model(dtype);
  // Rank 0's partition elements, from the specs: every group's slice is 1 / world of it (each
  // group is a multiple of 128 * world elements, so there is no padding).
  std::size_t frozen_elements = 0, trainable_elements = 0;
  for (const engine_test::ParamDef& d : model.params) {
    (d.module == model.frozen_module ? frozen_elements : trainable_elements) += d.element_count();
  }
  frozen_elements /= static_cast<std::size_t>(world);
  trainable_elements /= static_cast<std::size_t>(world);
  // Master, exp_avg and exp_avg_sq: 12 bytes an element each way (the streamed pass does not
  // read the frozen master: the frozen groups' shards are not written again); the pass after a
  // linked save reads and writes the frozen master besides the trainable share.
  const std::uint64_t trainable_bytes = trainable_elements * 12;
  const std::uint64_t full_bytes = trainable_bytes + frozen_elements * 4;

  const bool save = world == 1;
  // Every element stepped, in device memory: the bits the passes over the store must give.
  const LoraRun stepped = run_lora(model, world, OffloadDevice::kNone, 1'000'000'000, overlap,
                                   /*save=*/false);
  ASSERT_EQ(stepped.finals.size(), model.params.size());
  for (std::size_t sub_group_size :
       {1024 / static_cast<std::size_t>(world), std::size_t{1'000'000'000}}) {
    SCOPED_TRACE(fmt::format("sub_group_size {}", sub_group_size));
    const LoraRun skipped =
        run_lora(model, world, OffloadDevice::kNvme, sub_group_size, overlap, save);
    ASSERT_EQ(skipped.reports.size(), 5u);
    if (save) {
      EXPECT_TRUE(skipped.linked) << "the checkpoint was copied, not linked";
    }
    // Report s + 1 of the sequential step holds pass s + 1; the overlapped step's pass s + 1
    // runs behind the next forward and is reported by step s + 2 (step 1's report has none).
    for (std::size_t s = 0; s < skipped.reports.size(); ++s) {
      const std::size_t pass = overlap ? s : s + 1;
      const std::uint64_t none = 0;
      // The pass after the linked save (pass 3) streams the frozen master once.
      const bool full = skipped.linked && pass == 3;
      const StepReport& rep = skipped.reports[s];
      EXPECT_EQ(rep.optimizer_nvme_read_bytes, pass == 0 ? none
                                               : full    ? full_bytes
                                                         : trainable_bytes)
          << "step " << s + 1;
      EXPECT_EQ(rep.optimizer_nvme_write_bytes, pass == 0 ? none
                                                : full    ? full_bytes
                                                          : trainable_bytes)
          << "step " << s + 1;
    }
    // The same training: every master the same bits, the frozen ones those registered.
    ASSERT_EQ(skipped.finals.size(), model.params.size());
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      EXPECT_EQ(std::memcmp(skipped.finals[p].data(), stepped.finals[p].data(),
                            stepped.finals[p].size() * 4),
                0)
          << model.params[p].name;
      if (model.params[p].module == model.frozen_module) {
        EXPECT_EQ(std::memcmp(skipped.finals[p].data(), model.initial[p].data(),
                              model.initial[p].size() * 4),
                  0)
            << model.params[p].name;
      } else {
        EXPECT_GT(engine_test::max_rel_diff(skipped.finals[p], model.initial[p]), 1e-3)
            << model.params[p].name;
      }
    }
  }
}

// This process's resident bytes now (/proc/self/statm: pages).
std::uint64_t frozen_resident_bytes() {
  unsigned long long pages = 0, resident = 0;
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f != nullptr) {
    if (std::fscanf(f, "%llu %llu", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

// What finalize() and three AdamW steps of big_lora_model() add to the process's resident set
// (world 1, stage 2, the optimizer state on `opt`, its default sub-group size), and the frozen
// and trainable element counts. The step reduces the adapters' gradients only, as a LoRA
// training does.
struct LoraFootprint {
  std::uint64_t resident_growth_bytes = 0;
  std::size_t frozen_elements = 0;
  std::size_t trainable_elements = 0;
  // State on NVMe: the swap file's allocated bytes (st_blocks * 512) after the steps, and the
  // bytes this process wrote to storage across finalize() and the steps (/proc/self/io).
  std::uint64_t swap_allocated_bytes = 0;
  std::uint64_t written_bytes = 0;
  std::uint64_t host_bytes = 0;  // MemoryReport::host_bytes after the steps
};

// /proc/self/io's write_bytes: what this process sent to storage.
std::uint64_t storage_written_bytes() {
  const std::string io = engine_test::read_file("/proc/self/io");
  const std::string key = "write_bytes: ";
  const std::size_t at = io.find(key);
  return at == std::string::npos ? 0 : std::stoull(io.substr(at + key.size()));
}

// The swap files' (zinf-swap-*) logical bytes under `dir` and their allocated bytes
// (st_blocks * 512): the difference is their holes.
struct SwapFileBytes {
  std::uint64_t size = 0;
  std::uint64_t allocated = 0;
};
SwapFileBytes swap_file_bytes(const std::string& dir) {
  SwapFileBytes out;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("zinf-swap-", 0) != 0) continue;
    struct stat st {};
    if (::stat(entry.path().c_str(), &st) != 0) continue;
    out.size += static_cast<std::uint64_t>(st.st_size);
    out.allocated += static_cast<std::uint64_t>(st.st_blocks) * 512;
  }
  return out;
}

// World 1, stage 2, AdamW, the optimizer state on `opt` (in `nvme_path` when on NVMe), its
// default sub-group size: the config of the LoRA footprint tests.
Config lora_config(OffloadDevice opt, const std::string& nvme_path) {
  Config config;
  config.optimizer.kind = OptimizerKind::kAdamW;
  config.optimizer.lr = 1e-3;
  config.optimizer.weight_decay = 0.01;
  config.zero.stage = 2;
  config.zero.offload_optimizer.device = opt;
  config.zero.offload_optimizer.nvme_path = nvme_path;
  config.cpu_threads = 2;
  config.collective_timeout_ms = 120'000;
  return config;
}

// big_lora_model()'s adapters' gradients (module "lora", in order), seeded, in bf16.
std::vector<std::vector<std::uint16_t>> lora_grads(const Model& model) {
  std::vector<std::vector<std::uint16_t>> grads;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].module != "lora") continue;
    std::vector<float> g(model.params[p].element_count());
    fill_uniform(g.data(), g.size(), 7400 + p, -0.1f, 0.1f);
    grads.push_back(engine_test::narrow_to_half(g, DType::kBF16));
  }
  return grads;
}

// Three AdamW steps of big_lora_model() on `engine`, finalized: each gathers the adapters,
// reduces `grads` (lora_grads()) for them and releases them, as a LoRA training does.
Status step_lora(Engine& engine, const Model& model,
                 const std::vector<std::vector<std::uint16_t>>& grads) {
  for (int step = 1; step <= 3; ++step) {
    std::vector<GradientRef> refs;
    std::size_t k = 0;
    for (const engine_test::ParamDef& d : model.params) {
      if (d.module != "lora") continue;
      refs.push_back({d.name, grads[k++].data(), d.element_count(), d.dtype});
    }
    ZINF_RETURN_IF_ERROR(engine.gather("lora"));
    ZINF_RETURN_IF_ERROR(engine.reduce_gradients("lora", refs));
    ZINF_RETURN_IF_ERROR(engine.release("lora"));
    ZINF_ASSIGN_OR_RETURN(StepReport report, engine.step());
    (void)report;
  }
  return Status::ok();
}

// With `exact_frozen`, the frozen base's values rounded to bf16 first (as a base weight loaded
// from a bf16 checkpoint is), so that its half copy holds its master exactly.
LoraFootprint lora_footprint(OffloadDevice opt, const std::string& nvme_path,
                             bool exact_frozen = false) {
  Model model = big_lora_model();
  for (std::size_t p = 0; p < model.params.size() && exact_frozen; ++p) {
    if (model.params[p].module != model.frozen_module) continue;
    const std::vector<std::uint16_t> half =
        engine_test::narrow_to_half(model.initial[p], DType::kBF16);
    convert_bf16_to_f32(half.data(), model.initial[p].data(), half.size());
  }
  const Config config = lora_config(opt, nvme_path);
  LoraFootprint out;
  for (const engine_test::ParamDef& d : model.params) {
    (d.module == model.frozen_module ? out.frozen_elements : out.trainable_elements) +=
        d.element_count();
  }
  // The adapters' gradients, made before the first measure.
  const std::vector<std::vector<std::uint16_t>> grads = lora_grads(model);
  engine_test::Ranks ranks = engine_test::make_ranks(1, std::chrono::seconds(120));
  std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
        const std::uint64_t before = frozen_resident_bytes();
        const std::uint64_t written_before = storage_written_bytes();
        ZINF_RETURN_IF_ERROR(engine.finalize());
        ZINF_RETURN_IF_ERROR(step_lora(engine, model, grads));
        const std::uint64_t after = frozen_resident_bytes();  // a set that shrank grew by nothing
        out.resident_growth_bytes = after > before ? after - before : 0;
        out.written_bytes = storage_written_bytes() - written_before;
        out.host_bytes = engine.memory().host_bytes;
        if (!nvme_path.empty()) out.swap_allocated_bytes = swap_file_bytes(nvme_path).allocated;
        return Status::ok();
      });
  EXPECT_TRUE(st[0].is_ok()) << st[0].to_string();
  return out;
}

// Checks that lora_footprint(opt) grows the resident set by less than `every_element_bytes` an
// element of the model and 12 bytes a trainable element (their moments and gradients), plus 128
// MiB of slack (a quarter of the frozen moments), for the rest: the engine's buffers, the
// allocator, the threads. `expected_what` names what the expected bytes hold, for the print.
void check_lora_host_footprint(OffloadDevice opt, std::uint64_t every_element_bytes,
                               const char* expected_what) {
  const LoraFootprint f = lora_footprint(opt, "");
  const std::uint64_t all = f.frozen_elements + f.trainable_elements;
  const std::uint64_t expected = all * every_element_bytes + f.trainable_elements * 12;
  const std::uint64_t frozen_moments = f.frozen_elements * 8;
  std::printf("resident growth %llu bytes; %s %llu; frozen moments %llu\n",
              static_cast<unsigned long long>(f.resident_growth_bytes), expected_what,
              static_cast<unsigned long long>(expected),
              static_cast<unsigned long long>(frozen_moments));
  EXPECT_LT(f.resident_growth_bytes, expected + frozen_moments / 4);
}

// LoRA with the optimizer state in host memory: the frozen base's moments (8 bytes an element,
// 512 MiB here) never become resident. What finalize() and the steps add is the fp32 master of
// every element (4 bytes) and the trainable elements' moments and gradients (12 bytes); 128 MiB
// of slack (a quarter of the frozen moments) covers the rest (the engine's buffers, the
// allocator, the threads). With the moments of every element written, the growth is 512 MiB
// more.
TEST(Frozen, LoraFrozenMomentsTakeNoHostMemory) {
  if (test::kThreadSanitizer || test::kAddressSanitizer) {
    GTEST_SKIP() << "measures resident memory, which a sanitizer's shadow memory inflates";
  }
  check_lora_host_footprint(OffloadDevice::kHost, 4, "master and trainable moments and gradients");
}

// LoRA with the optimizer state in host memory and a frozen base whose values bf16 holds exactly
// (loaded from a bf16 checkpoint): the base's fp32 master is its half copy alone, and never
// becomes resident. Against the same model with values bf16 does not hold, the resident growth
// across finalize() and three steps is at least 3 bytes a frozen element lower (256 MiB of
// master, 64 MiB of slack), and MemoryReport::host_bytes 4 bytes a frozen element lower.
TEST(Frozen, LoraFrozenMasterHeldByItsHalfCopyTakesNoHostMemory) {
  if (test::kThreadSanitizer || test::kAddressSanitizer) {
    GTEST_SKIP() << "measures resident memory, which a sanitizer's shadow memory inflates";
  }
  const LoraFootprint with_master = lora_footprint(OffloadDevice::kHost, "");
  const LoraFootprint half_only = lora_footprint(OffloadDevice::kHost, "", true);
  std::printf(
      "resident growth %llu bytes with the frozen master, %llu without; host_bytes %llu, %llu\n",
      static_cast<unsigned long long>(with_master.resident_growth_bytes),
      static_cast<unsigned long long>(half_only.resident_growth_bytes),
      static_cast<unsigned long long>(with_master.host_bytes),
      static_cast<unsigned long long>(half_only.host_bytes));
  const std::uint64_t frozen = half_only.frozen_elements;
  EXPECT_EQ(with_master.host_bytes - half_only.host_bytes, frozen * 4);
  EXPECT_GT(with_master.resident_growth_bytes, half_only.resident_growth_bytes + frozen * 3);
}

// LoRA with the optimizer state in device memory on the host (offload_optimizer none on a
// host-accessible device: HostState): the frozen base's moments (8 bytes an element, 512 MiB
// here) and, at stage 2, its share of the gradient accumulator (4 bytes an element) never become
// resident. What finalize() and the steps add is at most the fp32 master of every element (4
// bytes), the bf16 values the step writes and the bf16 parameters on the device (2 + 2 bytes;
// less: finalize() hands the registered values' copies back to the system), and the trainable
// elements' moments and gradients (12 bytes); 128 MiB of slack (a quarter of the frozen moments)
// covers the rest. With the moments and gradients of every element written, the growth is 768 MiB
// more.
TEST(Frozen, LoraFrozenMomentsTakeNoHostMemoryWithTheStateOnTheHostDevice) {
  if (test::kThreadSanitizer || test::kAddressSanitizer) {
    GTEST_SKIP() << "measures resident memory, which a sanitizer's shadow memory inflates";
  }
  check_lora_host_footprint(OffloadDevice::kNone, 8,
                            "master, bf16 values and parameters, trainable moments and gradients");
}

// The device memory (MemoryReport::device_bytes) of big_lora_model() after finalize() and three
// AdamW steps, world 1, stage 2, offload_optimizer none on an opaque device (the state in device
// memory, DeviceOptimizer), with the base frozen, and after finalize() with the base trainable.
struct LoraDeviceBytes {
  std::uint64_t frozen_bytes = 0;     // after finalize(), base frozen
  std::uint64_t stepped_bytes = 0;    // after the three steps, base frozen
  std::uint64_t trainable_bytes = 0;  // after finalize(), base trainable
  std::size_t frozen_elements = 0;
};

LoraDeviceBytes lora_device_bytes() {
  LoraDeviceBytes out;
  Model model = big_lora_model();
  const Config config = lora_config(OffloadDevice::kNone, "");
  for (const engine_test::ParamDef& d : model.params) {
    if (d.module == model.frozen_module) out.frozen_elements += d.element_count();
  }
  const std::vector<std::vector<std::uint16_t>> grads = lora_grads(model);
  for (bool frozen : {true, false}) {
    model.frozen_module = frozen ? "base" : "";
    engine_test::Ranks ranks = engine_test::make_ranks(1, std::chrono::seconds(120),
                                                       /*jitter_max_us=*/0, /*opaque=*/true);
    std::vector<Status> st =
        engine_test::run_engines(config, ranks, [&](int, Engine& engine) -> Status {
          ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
          ZINF_RETURN_IF_ERROR(engine.finalize());
          (frozen ? out.frozen_bytes : out.trainable_bytes) = engine.memory().device_bytes;
          if (!frozen) return Status::ok();
          ZINF_RETURN_IF_ERROR(step_lora(engine, model, grads));
          out.stepped_bytes = engine.memory().device_bytes;
          return Status::ok();
        });
    EXPECT_TRUE(st[0].is_ok()) << st[0].to_string();
  }
  return out;
}

// LoRA with the optimizer state in device memory (offload_optimizer none on a GPU, here an
// opaque device): the frozen base's moments and gradients (8 + 4 bytes an element, 768 MiB here)
// take no device memory. The device bytes with the base frozen are those with it trainable less
// the frozen moments and gradients, plus the alignment of the packed moments and gradients (a
// few elements a run or group), and three steps allocate no moments.
TEST(Frozen, LoraFrozenMomentsTakeNoDeviceMemory) {
  const LoraDeviceBytes b = lora_device_bytes();
  const std::uint64_t frozen_moments = b.frozen_elements * 12;  // and gradients
  std::printf(
      "device bytes after finalize: base trainable %llu, base frozen %llu (after three steps "
      "%llu); frozen moments and gradients %llu\n",
      static_cast<unsigned long long>(b.trainable_bytes),
      static_cast<unsigned long long>(b.frozen_bytes),
      static_cast<unsigned long long>(b.stepped_bytes),
      static_cast<unsigned long long>(frozen_moments));
  EXPECT_LE(b.frozen_bytes + frozen_moments, b.trainable_bytes + 4096);
  EXPECT_GE(b.frozen_bytes + frozen_moments, b.trainable_bytes);
  EXPECT_LT(b.stepped_bytes, b.trainable_bytes - frozen_moments / 2);
}

// A frozen base of `rows` x `cols` bf16 elements (module "base") and trainable 8 x 200 adapters
// ("lora"), and when `head` > 0 a trainable bias of `head` elements ("head"), each its own
// partitioner group, registered on `world` ranks with `config` and bf16 (`opaque`: on devices
// that are not host-accessible): each rank's MemoryReport after finalize(). The base's values
// are seeded, rounded to bf16 first when `exact` (else bf16 does not hold them); the adapters'
// are seeded.
std::vector<MemoryReport> padded_base_memory(Config config, int world, int rows, bool exact,
                                             bool opaque, int cols = 200, int head = 0) {
  config.bf16_enabled = true;
  std::vector<float> base(static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols));
  fill_uniform(base.data(), base.size(), /*seed=*/71, 0.1f, 0.9f);
  if (exact) {
    const std::vector<std::uint16_t> half = engine_test::narrow_to_half(base, DType::kBF16);
    convert_bf16_to_f32(half.data(), base.data(), half.size());
  }
  std::vector<float> adapters(8 * 200);
  fill_uniform(adapters.data(), adapters.size(), /*seed=*/72, -0.05f, 0.05f);
  std::vector<MemoryReport> out(static_cast<std::size_t>(world));
  engine_test::Ranks ranks =
      engine_test::make_ranks(world, std::chrono::seconds(120), /*jitter_max_us=*/0, opaque);
  std::vector<Status> st =
      engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
        ParameterSpec b{"base.w", "base", {rows, cols}, DType::kBF16, base.data()};
        b.trainable = false;
        ZINF_RETURN_IF_ERROR(engine.register_parameter(b));
        ZINF_RETURN_IF_ERROR(
            engine.register_parameter({"lora.a", "lora", {8, 200}, DType::kBF16, adapters.data()}));
        if (head > 0) {
          ZINF_RETURN_IF_ERROR(
              engine.register_parameter({"head.b", "head", {head}, DType::kBF16, adapters.data()}));
        }
        ZINF_RETURN_IF_ERROR(engine.finalize());
        out[static_cast<std::size_t>(rank)] = engine.memory();
        return Status::ok();
      });
  for (const Status& s : st) EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

// The optimizer state in device memory (DeviceOptimizer, an opaque device), one rank: a frozen
// base whose group is padded (200 x 200 = 40,000 elements, padded to 40,064, a multiple of 128)
// takes what one without padding (256 x 200 = 51,200) takes for the same count, padding included:
// the padding of a group with no trainable element is frozen with it, so neither it nor the base
// takes a gradient slot or moments, and it needs no master (zero is exact in bf16). Per element
// of the partition P (both groups, padded): the coordinator's bf16 copy and the optimizer's half
// copy, 2 + 2 bytes; the fp32 master, 4 bytes, of the adapters' group (1,600 elements, padded to
// 1,664) and of the base's unless bf16 holds it exactly; 8 bytes of moments and 4 of gradients
// an element of the adapters' group. The runs start at multiples of 16 elements, so nothing is
// added for alignment.
TEST(Frozen, APaddedFrozenGroupTakesNoGradientsOrMomentsInDeviceMemory) {
  const Config config = lora_config(OffloadDevice::kNone, "");
  constexpr std::uint64_t kAdapters = 1664;
  for (bool exact : {false, true}) {
    for (int rows : {200, 256}) {
      const std::uint64_t base = rows == 200 ? 40064 : 51200;
      const std::uint64_t partition = base + kAdapters;
      const std::uint64_t expected =
          partition * 4 + ((exact ? 0 : base) + kAdapters) * 4 + kAdapters * 12;
      const std::vector<MemoryReport> m =
          padded_base_memory(config, 1, rows, exact, /*opaque=*/true);
      EXPECT_EQ(m[0].device_bytes, expected) << rows << " rows, exact " << exact;
    }
  }
}

// Three ranks, the optimizer state in device memory: the base's group (40,000 elements) is
// padded to 40,320 (a multiple of 3 x 128), so the last rank's shard of it (13,440 elements) ends
// in 320 elements of padding, and the adapters' (1,600, padded to 1,920) in 320 more; a trainable
// bias of 100 elements is padded to 384, so the shards of it of ranks 1 and 2 are padding alone.
// The last rank takes what the first takes (whose base and adapter shards hold no padding): the
// frozen shard, its padding included, takes no gradient slot or moments; a trainable group's
// shard of padding alone keeps its gradients and moments (the reducer writes every shard of a
// trainable group). Each rank: the coordinator's full bf16 copy of the partitioner groups, 2
// bytes an element of 42,624; its shard (14,208 elements) in the optimizer's half copy and fp32
// master, 2 + 4 bytes an element; 12 bytes of moments and gradients an element of its adapters'
// and bias's shards (640 + 128).
TEST(Frozen, ThePaddingOfTheLastRanksFrozenShardTakesNoGradientsOrMomentsInDeviceMemory) {
  const Config config = lora_config(OffloadDevice::kNone, "");
  const std::vector<MemoryReport> m = padded_base_memory(
      config, 3, 200, /*exact=*/false, /*opaque=*/true, /*cols=*/200, /*head=*/100);
  const std::uint64_t expected = 42624 * 2 + 14208 * (2 + 4) + (640 + 128) * 12;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(m[static_cast<std::size_t>(rank)].device_bytes, expected) << "rank " << rank;
  }
}

// StoreState's sub-groups come from frozen_runs(), which counted padding as untrained before
// partition_group_ranges gave a frozen group's padding to the frozen group: this guards that rule,
// not the group ranges. Stage 3, the parameter shards and the optimizer state in host memory
// (StateStore), one rank: a
// frozen base of 409 x 100 = 40,900 elements, padded to 40,960, takes the host memory of one of
// 320 x 128 = 40,960 elements without padding, with bf16 holding its values exactly and without:
// its sub-group (the adapters' run cut at 40,960) holds frozen elements and padding only, so its
// master is kept as its half copy alone when bf16 holds it, and its shard is lent from that copy.
TEST(Frozen, APaddedFrozenGroupTakesTheHostMemoryOfAnUnpaddedOneOfItsSize) {
  Config config = lora_config(OffloadDevice::kHost, "");
  config.zero.stage = 3;
  config.zero.offload_param.device = OffloadDevice::kHost;
  config.zero.stage3_param_persistence_threshold = 0;
  for (bool exact : {false, true}) {
    const std::vector<MemoryReport> padded =
        padded_base_memory(config, 1, 409, exact, /*opaque=*/false, /*cols=*/100);
    const std::vector<MemoryReport> unpadded =
        padded_base_memory(config, 1, 320, exact, /*opaque=*/false, /*cols=*/128);
    EXPECT_GT(padded[0].host_bytes, 0u);
    EXPECT_EQ(padded[0].host_bytes, unpadded[0].host_bytes) << "exact " << exact;
  }
}

// Stage 1 with lora_model() (bf16) on 2 ranks, the optimizer state in host memory: each rank
// keeps a full-size fp32 gradient copy of the trainable groups only (MemoryReport::device_bytes
// with the base frozen is 4 bytes an element of the base less than with it trainable), and each
// step reduce-scatters the trainable groups only (EngineCounters::reduce_scatter_bytes: 4 bytes
// an element of "embed" and "lora"; their groups need no padding on 2 ranks, 2048 and 3072
// elements being multiples of 2 x 128).
TEST(Frozen, Stage1ReducesAndKeepsFullGradientsOfTheTrainableGroupsOnly) {
  constexpr int kWorld = 2;
  constexpr int kSteps = 3;
  engine_test::ScratchDir dir("frozen_stage1_reduce");
  const Config config =
      engine_test::small_config(1, OffloadDevice::kHost, OffloadDevice::kNone, dir.path());
  Model model = lora_model(DType::kBF16);
  std::size_t base_elements = 0, trainable_elements = 0;
  for (const engine_test::ParamDef& d : model.params) {
    (d.module == "base" ? base_elements : trainable_elements) += d.element_count();
  }
  ASSERT_EQ(trainable_elements % (kWorld * 128), 0u);
  ASSERT_EQ(base_elements % (kWorld * 128), 0u);
  // Seeded gradients of the trainable parameters, bf16.
  std::vector<std::vector<std::uint16_t>> grads(model.params.size());
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    std::vector<float> g(model.params[p].element_count());
    fill_uniform(g.data(), g.size(), 7700 + p, -0.1f, 0.1f);
    grads[p] = engine_test::narrow_to_half(g, DType::kBF16);
  }
  std::uint64_t device_bytes[2] = {0, 0};  // base frozen, base trainable (rank 0's)
  std::vector<std::uint64_t> reduced(kWorld, 0);
  for (int trainable = 0; trainable < 2; ++trainable) {
    model.frozen_module = trainable == 1 ? "" : "base";
    engine_test::Ranks ranks = engine_test::make_ranks(kWorld);
    std::vector<Status> st =
        engine_test::run_engines(config, ranks, [&](int rank, Engine& engine) -> Status {
          ZINF_RETURN_IF_ERROR(engine_test::register_model(engine, model));
          ZINF_RETURN_IF_ERROR(engine.finalize());
          if (rank == 0) device_bytes[trainable] = engine.memory().device_bytes;
          if (trainable == 1) return Status::ok();
          const std::uint64_t before = engine.counters().reduce_scatter_bytes;
          for (int step = 0; step < kSteps; ++step) {
            for (const char* module : {"lora", "embed"}) {
              std::vector<GradientRef> refs;
              for (std::size_t p = 0; p < model.params.size(); ++p) {
                const engine_test::ParamDef& d = model.params[p];
                if (d.module != module) continue;
                refs.push_back({d.name, grads[p].data(), d.element_count(), d.dtype});
              }
              ZINF_RETURN_IF_ERROR(engine.gather(module));
              ZINF_RETURN_IF_ERROR(engine.reduce_gradients(module, refs));
              ZINF_RETURN_IF_ERROR(engine.release(module));
            }
            ZINF_ASSIGN_OR_RETURN(StepReport report, engine.step());
            if (report.skipped) return Status::internal("a step was skipped");
          }
          reduced[static_cast<std::size_t>(rank)] = engine.counters().reduce_scatter_bytes - before;
          return Status::ok();
        });
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(st[static_cast<std::size_t>(r)].is_ok())
          << "rank " << r << ": " << st[static_cast<std::size_t>(r)].to_string();
    }
  }
  std::printf("device bytes: base frozen %llu, trainable %llu; reduce-scatter bytes a step %llu\n",
              static_cast<unsigned long long>(device_bytes[0]),
              static_cast<unsigned long long>(device_bytes[1]),
              static_cast<unsigned long long>(reduced[0] / kSteps));
  EXPECT_EQ(device_bytes[1] - device_bytes[0], base_elements * 4);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(reduced[static_cast<std::size_t>(r)], kSteps * trainable_elements * 4)
        << "rank " << r << " (the base's share would be " << kSteps * base_elements * 4 << ")";
  }
}

// The optimizer state a checkpoint's rank 0 file holds: after its 4096-byte header, the master,
// exp_avg and exp_avg_sq of every partition element (f32); the partition's size is the
// manifest's. Empty when the files are not there.
struct SavedState {
  std::size_t elements = 0;
  std::vector<float> values;  // 3 * elements
  const float* piece(std::size_t k) const { return values.data() + k * elements; }
};

SavedState saved_state(const std::string& tag_dir) {
  SavedState out;
  const std::string manifest = engine_test::read_file(tag_dir + "/manifest.json");
  const std::string key = "\"partition_elements\":";
  const std::size_t at = manifest.find(key);
  if (at == std::string::npos) return out;
  out.elements = std::stoull(manifest.substr(at + key.size()));
  const std::string bytes = engine_test::read_file(tag_dir + "/rank0.zinfckpt");
  if (bytes.size() < 4096 + 3 * out.elements * 4) return out;
  out.values.resize(3 * out.elements);
  std::memcpy(out.values.data(), bytes.data() + 4096, out.values.size() * sizeof(float));
  return out;
}

bool all_zero_floats(const float* values, std::size_t count) {
  for (std::size_t k = 0; k < count; ++k) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, values + k, 4);
    if (bits != 0) return false;
  }
  return true;
}

// Where a frozen parameter's registered values lie in the saved master (its bits unchanged by
// the steps), or SIZE_MAX.
std::size_t find_in_master(const SavedState& s, const std::vector<float>& values) {
  for (std::size_t at = 0; at + values.size() <= s.elements; ++at) {
    if (std::memcmp(s.values.data() + at, values.data(), values.size() * 4) == 0) return at;
  }
  return SIZE_MAX;
}

// lora_model() (f32) at world 1 saved after 3 steps with the base frozen, the state in host
// memory and on NVMe (the default sub-group size: the save links the swap file, where the frozen
// moments are holes; sub-groups of 700: not whole pages, so the save copies, reading them as
// zeros): in its rank file every base parameter's moments are zero and the other moments are not
// all zero; the checkpoint loaded into a fresh engine and saved again gives the same state bit
// for bit.
TEST(Frozen, LoraCheckpointHoldsZeroMomentsForTheFrozenBase) {
  const Model model = lora_model(DType::kF32);
  struct Home {
    OffloadDevice opt;
    std::size_t sub_group_size;
    bool opaque;  // offload_optimizer none on an opaque device: the device optimizer's state
  };
  for (const Home h :
       {Home{OffloadDevice::kHost, 1'000'000'000, false},
        Home{OffloadDevice::kNvme, 1'000'000'000, false}, Home{OffloadDevice::kNvme, 700, false},
        Home{OffloadDevice::kNone, 1'000'000'000, false},
        Home{OffloadDevice::kNone, 1'000'000'000, true}}) {
    const OffloadDevice opt = h.opt;
    const std::size_t sub_group_size = h.sub_group_size;
    const std::string name = fmt::format("{}_sg{}{}", offload_device_name(opt), sub_group_size,
                                         h.opaque ? "_opaque" : "");
    SCOPED_TRACE(name);
    engine_test::ScratchDir dir("frozen_lora_ckpt_" + name);
    const std::string ckpt = dir.path() + "/ckpt";
    Config config = engine_test::small_config(2, opt, OffloadDevice::kNone, dir.path());
    config.zero.sub_group_size = sub_group_size;
    train_between_checkpoints(config, model, 1, ckpt, "", 1, 3, "three", h.opaque);
    EXPECT_EQ(!engine_test::read_file(ckpt + "/three/rank0.blocks").empty(),
              opt == OffloadDevice::kNvme && sub_group_size > 700)
        << "linked";
    const SavedState saved = saved_state(ckpt + "/three");
    ASSERT_FALSE(saved.values.empty());
    std::vector<bool> frozen(saved.elements, false);
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      if (model.params[p].module != model.frozen_module) continue;
      const std::size_t at = find_in_master(saved, model.initial[p]);
      ASSERT_NE(at, SIZE_MAX) << model.params[p].name << " is not in the saved master";
      for (std::size_t k = 1; k < 3; ++k) {
        EXPECT_TRUE(all_zero_floats(saved.piece(k) + at, model.initial[p].size()))
            << model.params[p].name << " piece " << k;
      }
      std::fill(frozen.begin() + at, frozen.begin() + at + model.initial[p].size(), true);
    }
    for (std::size_t k = 1; k < 3; ++k) {
      bool nonzero = false;
      for (std::size_t e = 0; e < saved.elements && !nonzero; ++e) {
        nonzero = !frozen[e] && !all_zero_floats(saved.piece(k) + e, 1);
      }
      EXPECT_TRUE(nonzero) << "piece " << k << ": the trainable moments are zero";
    }
    // Loaded and saved again, with no step between.
    train_between_checkpoints(config, model, 1, ckpt, "three", 4, 3, "again", h.opaque);
    const SavedState again = saved_state(ckpt + "/again");
    ASSERT_EQ(again.values.size(), saved.values.size());
    EXPECT_EQ(std::memcmp(again.values.data(), saved.values.data(), saved.values.size() * 4), 0);
  }
}

// The other way: lora_model() saved after 3 steps with the base trainable (its moments not
// zero), loaded with the base frozen, where its sub-groups were settled (zero moments): saved
// again with no step between, every parameter's master and moments are those saved, bit for bit
// (found by its master: the two layouts differ, the frozen base having sub-groups of its own).
TEST(Frozen, NonZeroMomentsLoadedIntoAFrozenBaseAreKept) {
  const Model frozen = lora_model(DType::kF32);
  Model trained = frozen;
  trained.frozen_module.clear();
  for (auto [opt, opaque] :
       {std::pair{OffloadDevice::kHost, false}, std::pair{OffloadDevice::kNvme, false},
        std::pair{OffloadDevice::kNone, false}, std::pair{OffloadDevice::kNone, true}}) {
    const std::string name = fmt::format("{}{}", offload_device_name(opt), opaque ? "_opaque" : "");
    SCOPED_TRACE(name);
    engine_test::ScratchDir dir("frozen_lora_thawed_" + name);
    const std::string ckpt = dir.path() + "/ckpt";
    Config config = engine_test::small_config(2, opt, OffloadDevice::kNone, dir.path());
    config.zero.sub_group_size = 1'000'000'000;
    const std::vector<std::vector<float>> masters =
        train_between_checkpoints(config, trained, 1, ckpt, "", 1, 3, "three", opaque);
    train_between_checkpoints(config, frozen, 1, ckpt, "three", 4, 3, "loaded", opaque);
    const SavedState saved = saved_state(ckpt + "/three");
    const SavedState loaded = saved_state(ckpt + "/loaded");
    ASSERT_FALSE(saved.values.empty());
    ASSERT_FALSE(loaded.values.empty());
    ASSERT_EQ(masters.size(), frozen.params.size());
    for (std::size_t p = 0; p < frozen.params.size(); ++p) {
      const std::size_t from = find_in_master(saved, masters[p]);
      const std::size_t to = find_in_master(loaded, masters[p]);
      ASSERT_NE(from, SIZE_MAX) << frozen.params[p].name;
      ASSERT_NE(to, SIZE_MAX) << frozen.params[p].name;
      for (std::size_t k = 1; k < 3; ++k) {
        const std::size_t bytes = masters[p].size() * 4;
        EXPECT_FALSE(all_zero_floats(saved.piece(k) + from, masters[p].size()))
            << frozen.params[p].name << " piece " << k;
        EXPECT_EQ(std::memcmp(loaded.piece(k) + to, saved.piece(k) + from, bytes), 0)
            << frozen.params[p].name << " piece " << k;
      }
    }
  }
}

// LoRA with the optimizer state on NVMe: the frozen base's moments take no blocks of the swap
// file and are never written. The file's allocated bytes after finalize() and three steps are
// the fp32 master of every element (4 bytes) and the trainable elements' moments (8 bytes), and
// what the process writes is the master once at finalize() and the trainable share (12 bytes an
// element) at each step; 128 MiB of slack (a quarter of the frozen moments) covers the rest (a
// header page, extents rounded to swap blocks, the probe at open). With every moment stored,
// both are 512 MiB more.
TEST(Frozen, LoraFrozenMomentsTakeNoSwapBlocks) {
  engine_test::ScratchDir dir("frozen_lora_swap_blocks");
  const LoraFootprint f = lora_footprint(OffloadDevice::kNvme, dir.path());
  const std::uint64_t all = f.frozen_elements + f.trainable_elements;
  const std::uint64_t frozen_moments = f.frozen_elements * 8;
  const std::uint64_t stored = all * 4 + f.trainable_elements * 8;
  const std::uint64_t written = all * 4 + 3 * f.trainable_elements * 12;
  std::printf(
      "swap file allocated %llu bytes (master and trainable moments %llu); written %llu "
      "bytes (master once, trainable share per step %llu); frozen moments %llu\n",
      static_cast<unsigned long long>(f.swap_allocated_bytes),
      static_cast<unsigned long long>(stored), static_cast<unsigned long long>(f.written_bytes),
      static_cast<unsigned long long>(written), static_cast<unsigned long long>(frozen_moments));
  EXPECT_GE(f.swap_allocated_bytes, all * 4) << "the master is not in the swap file";
  EXPECT_LT(f.swap_allocated_bytes, stored + frozen_moments / 4);
  if (storage_written_bytes() == 0) {
    std::printf("no /proc/self/io write_bytes here: the written bytes are not checked\n");
  } else {
    EXPECT_LT(f.written_bytes, written + frozen_moments / 4);
  }
}

// lora_model() (f32) with the state on NVMe saved after 3 steps, loaded into a fresh engine: the
// frozen base's moments loaded are zero, so its sub-groups stay settled (their moments released,
// not written) and the passes after the load move what the passes of a run that never saved move:
// the trainable share. With sub-groups of 700 the save copies and the load writes the state; with
// the default size the save links the swap file and the load adopts it, whose moments are not
// known to be zero, so the first pass after it streams the frozen sub-groups once more (reading
// their master and zero moments, writing the master) and only the later ones are the trainable
// share. (Each StepReport carries the optimizer pass before it: the overlapped step runs a pass
// beside the next backward.)
TEST(Frozen, ALoadOfZeroFrozenMomentsKeepsThePassAtTheTrainableShare) {
  const Model model = lora_model(DType::kF32);
  for (std::size_t sub_group_size : {std::size_t{700}, std::size_t{1'000'000'000}}) {
    SCOPED_TRACE(fmt::format("sub_group_size {}", sub_group_size));
    engine_test::ScratchDir dir(fmt::format("frozen_zero_load_{}", sub_group_size));
    const std::string ckpt = dir.path() + "/ckpt";
    Config config =
        engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
    config.zero.sub_group_size = sub_group_size;
    train_between_checkpoints(config, model, 1, ckpt, "", 1, 3, "three");
    const bool adopted = !engine_test::read_file(ckpt + "/three/rank0.blocks").empty();
    EXPECT_EQ(adopted, sub_group_size > 700) << "linked";
    // Steps 4-7 after the load, and steps 1-4 of a run that never saved.
    std::vector<StepReport> loaded, fresh;
    for (bool load : {true, false}) {
      std::vector<Status> st =
          engine_test::with_engines(config, model, 1, [&](int rank, Engine& engine) -> Status {
            if (load) ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "three"));
            TrainOptions run;
            run.check_gathered = false;
            run.first_step = load ? 4 : 1;
            run.steps = load ? 7 : 4;
            return engine_test::train_rank(engine, model, rank, run, nullptr,
                                           load ? &loaded : &fresh);
          });
      for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
    }
    ASSERT_EQ(loaded.size(), 4u);
    ASSERT_EQ(fresh.size(), 4u);
    for (std::size_t k = 1; k < 4; ++k) {
      std::printf(
          "sub-groups of %zu, pass %zu after the load: read %llu, written %llu; without a save: "
          "read %llu, written %llu\n",
          sub_group_size, k, static_cast<unsigned long long>(loaded[k].optimizer_nvme_read_bytes),
          static_cast<unsigned long long>(loaded[k].optimizer_nvme_write_bytes),
          static_cast<unsigned long long>(fresh[k].optimizer_nvme_read_bytes),
          static_cast<unsigned long long>(fresh[k].optimizer_nvme_write_bytes));
      EXPECT_GT(fresh[k].optimizer_nvme_write_bytes, 0u) << k;
      if (adopted && k == 1) {
        EXPECT_GT(loaded[k].optimizer_nvme_write_bytes, fresh[k].optimizer_nvme_write_bytes);
        continue;
      }
      EXPECT_EQ(loaded[k].optimizer_nvme_read_bytes, fresh[k].optimizer_nvme_read_bytes) << k;
      EXPECT_EQ(loaded[k].optimizer_nvme_write_bytes, fresh[k].optimizer_nvme_write_bytes) << k;
    }
  }
}

// A checkpoint whose frozen base has exp_avg zero and exp_avg_sq not (the base trained with
// beta1 = 0 for 3 steps, then frozen for one: exp_avg = beta1 * m + (1 - beta1) * 0 is exactly
// zero, exp_avg_sq only decays), tag "four" of `ckpt`, saved with the state in host memory. Sets
// *base_elements to the base's element count, after checking in the rank file that each base
// parameter's exp_avg is zero and its exp_avg_sq is not.
void save_zero_exp_avg_checkpoint(const Model& frozen, const std::string& ckpt,
                                  const std::string& scratch, std::size_t* base_elements) {
  Model trained = frozen;
  trained.frozen_module.clear();
  Config host = engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, scratch);
  host.optimizer.beta1 = 0.0;
  train_between_checkpoints(host, trained, 1, ckpt, "", 1, 3, "three");
  const std::vector<std::vector<float>> masters =
      train_between_checkpoints(host, frozen, 1, ckpt, "three", 4, 4, "four");
  const SavedState saved = saved_state(ckpt + "/four");
  ASSERT_FALSE(saved.values.empty());
  ASSERT_EQ(masters.size(), frozen.params.size());
  *base_elements = 0;
  for (std::size_t p = 0; p < frozen.params.size(); ++p) {
    if (frozen.params[p].module != frozen.frozen_module) continue;
    const std::size_t at = find_in_master(saved, masters[p]);
    ASSERT_NE(at, SIZE_MAX) << frozen.params[p].name << " is not in the saved master";
    EXPECT_TRUE(all_zero_floats(saved.piece(1) + at, masters[p].size())) << frozen.params[p].name;
    EXPECT_FALSE(all_zero_floats(saved.piece(2) + at, masters[p].size())) << frozen.params[p].name;
    *base_elements += masters[p].size();
  }
}

// The engine that loads it: lora_model() with the state on NVMe under `nvme_path`, the base in a
// sub-group of its own, the sequential step (each report carries its own step's pass).
Config zero_exp_avg_load_config(const std::string& nvme_path) {
  Config nvme = engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, nvme_path);
  nvme.optimizer.beta1 = 0.0;
  nvme.zero.sub_group_size = 1'000'000'000;
  nvme.overlap_step = false;
  return nvme;
}

// save_zero_exp_avg_checkpoint()'s checkpoint loaded twice into one engine, with a step after
// each load. The first load leaves the base's exp_avg released (a hole of the swap file) and
// writes its exp_avg_sq, so the base's sub-group is not settled; the second load of the same
// zeros leaves the released exp_avg released too: the swap file takes no block more, and the
// pass after each load writes the same bytes (the trainable share, the base's master and
// exp_avg_sq; not its zero exp_avg, which a released piece that stays zero never writes back).
TEST(Frozen, ASecondLoadOfZeroExpAvgIntoAFrozenBaseLeavesItReleased) {
  const Model frozen = lora_model(DType::kF32);
  engine_test::ScratchDir dir("frozen_zero_exp_avg_reload");
  const std::string ckpt = dir.path() + "/ckpt";
  const std::string swap = dir.path() + "/swap";
  std::filesystem::create_directories(swap);
  std::size_t base_elements = 0;
  ASSERT_NO_FATAL_FAILURE(save_zero_exp_avg_checkpoint(frozen, ckpt, swap, &base_elements));
  SwapFileBytes after_first, after_second;
  std::vector<StepReport> first, second;
  std::vector<Status> st = engine_test::with_engines(
      zero_exp_avg_load_config(swap), frozen, 1, [&](int rank, Engine& engine) -> Status {
        TrainOptions run;
        run.check_gathered = false;
        run.first_step = 5;
        run.steps = 5;
        ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "four"));
        after_first = swap_file_bytes(swap);
        ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, frozen, rank, run, nullptr, &first));
        ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "four"));
        after_second = swap_file_bytes(swap);
        return engine_test::train_rank(engine, frozen, rank, run, nullptr, &second);
      });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  std::printf(
      "swap file %llu bytes; allocated after the first load %llu, after the second %llu; the "
      "base's exp_avg %zu bytes\n",
      static_cast<unsigned long long>(after_first.size),
      static_cast<unsigned long long>(after_first.allocated),
      static_cast<unsigned long long>(after_second.allocated), base_elements * 4);
  // (Half of it: st_blocks also counts the blocks of the file's extent tree.)
  if (after_first.size - after_first.allocated < base_elements * 4 / 2) {
    GTEST_SKIP() << "the swap file has no hole for the base's exp_avg: this filesystem cannot "
                    "punch holes";
  }
  EXPECT_EQ(after_second.allocated, after_first.allocated);
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(second.size(), 1u);
  std::printf("the pass after the first load wrote %llu bytes, after the second %llu\n",
              static_cast<unsigned long long>(first[0].optimizer_nvme_write_bytes),
              static_cast<unsigned long long>(second[0].optimizer_nvme_write_bytes));
  EXPECT_GT(first[0].optimizer_nvme_write_bytes, 0u);
  EXPECT_EQ(second[0].optimizer_nvme_write_bytes, first[0].optimizer_nvme_write_bytes);
}

// The same two loads with the swap file on a small ext4 on a loop device
// (tests/common/loop_mount.hpp) that fills up between them: the second load takes no block for
// the released exp_avg, so it succeeds, and so does the step after it (a load that wrote the zero
// exp_avg back into its hole failed with no_space naming the swap file, stickily). Skips, naming
// the reason, where the machine cannot mount a loop filesystem.
TEST(Frozen, ASecondLoadOfZeroExpAvgIntoAFrozenBaseSucceedsOnAFullDisk) {
  LoopMount mount("frozen-reload", 32);
  if (!mount.ok()) GTEST_SKIP() << mount.reason();
  const Model frozen = lora_model(DType::kF32);
  engine_test::ScratchDir dir("frozen_zero_exp_avg_full");
  const std::string ckpt = dir.path() + "/ckpt";
  std::size_t base_elements = 0;
  ASSERT_NO_FATAL_FAILURE(save_zero_exp_avg_checkpoint(frozen, ckpt, dir.path(), &base_elements));
  SwapFileBytes after_first;
  std::uint64_t filled = 0;
  Status second, stepped;
  std::vector<Status> st = engine_test::with_engines(
      zero_exp_avg_load_config(mount.path()), frozen, 1, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "four"));
        after_first = swap_file_bytes(mount.path());
        filled = mount.fill();
        second = engine.load_checkpoint(ckpt, "four");
        TrainOptions run;
        run.check_gathered = false;
        run.first_step = 5;
        run.steps = 5;
        stepped = engine_test::train_rank(engine, frozen, rank, run, nullptr, nullptr);
        return Status::ok();
      });
  for (const Status& s : st) ASSERT_TRUE(s.is_ok()) << s.to_string();
  std::printf("swap file %llu bytes, %llu allocated after the first load\n",
              static_cast<unsigned long long>(after_first.size),
              static_cast<unsigned long long>(after_first.allocated));
  std::printf("filled %s with %llu bytes; second load: %s; step after it: %s\n",
              mount.path().c_str(), static_cast<unsigned long long>(filled),
              second.to_string().c_str(), stepped.to_string().c_str());
  // (Half of it: st_blocks also counts the blocks of the file's extent tree.)
  if (after_first.size - after_first.allocated < base_elements * 4 / 2) {
    GTEST_SKIP() << "the swap file has no hole for the base's exp_avg: this filesystem cannot "
                    "punch holes";
  }
  ASSERT_GT(filled, 0u);
  EXPECT_TRUE(second.is_ok()) << second.to_string();
  EXPECT_TRUE(stepped.is_ok()) << stepped.to_string();
}

TEST(Frozen, OptimizerPassSkipsFrozenSubGroupsBf16World1Sequential) {
  check_lora_pass(1, DType::kBF16, /*overlap=*/false);
}
TEST(Frozen, OptimizerPassSkipsFrozenSubGroupsF32World1Sequential) {
  check_lora_pass(1, DType::kF32, /*overlap=*/false);
}
TEST(Frozen, OptimizerPassSkipsFrozenSubGroupsBf16World2Sequential) {
  check_lora_pass(2, DType::kBF16, /*overlap=*/false);
}
TEST(Frozen, OptimizerPassSkipsFrozenSubGroupsBf16World2Overlapped) {
  check_lora_pass(2, DType::kBF16, /*overlap=*/true);
}
TEST(Frozen, OptimizerPassSkipsFrozenSubGroupsBf16World1Overlapped) {
  check_lora_pass(1, DType::kBF16, /*overlap=*/true);
}

// A step does not republish the frozen groups: lora_model() at stage 3 with the parameter shards
// on NVMe, the optimizer state on NVMe (bf16: the new parameters stream from the pass into the
// shards) or in host memory (the store's half array), sequential and overlapped. Each step
// writes the shards of the trainable groups only (2 bytes an element, each group's shard a whole
// number of 4 KiB pages), and the pass reads the trainable state only (12 bytes an element;
// nothing of the frozen master). f32 parameters with the state on NVMe are narrowed from the
// master after the pass: only the trainable groups' master is read back (4 bytes an element).
// The masters end as those of the same training with the state in device memory
// (offload_optimizer none, stage 2), bit for bit; the gradients are computed from the gathered
// copies (engine_test::make_grad), so a shard left stale would change them.
void check_lora_publish(int world, OffloadDevice opt, DType dtype, bool overlap) {
  const Model model = lora_model(dtype);
  constexpr std::uint64_t kPage = 4096;
  // Rank 0's slice of each module's group (one group a module: each is under
  // zinf.group_max_elements; every group is a multiple of 128 * world elements, no padding).
  std::uint64_t shard_bytes = 0, frozen_shard_bytes = 0;
  std::size_t trainable_elements = 0;
  for (const std::string& m : model.modules) {
    std::size_t elements = 0;
    for (const engine_test::ParamDef& d : model.params) {
      if (d.module == m) elements += d.element_count();
    }
    elements /= static_cast<std::size_t>(world);
    const std::uint64_t bytes =
        (elements * dtype_bytes(dtype) + kPage - 1) / kPage * kPage;  // whole pages on NVMe
    if (m == model.frozen_module) {
      frozen_shard_bytes += bytes;
    } else {
      shard_bytes += bytes;
      trainable_elements += elements;
    }
  }
  const bool state_on_nvme = opt == OffloadDevice::kNvme;
  const LoraRun stepped = run_lora(model, world, OffloadDevice::kNone, 1'000'000'000, overlap,
                                   /*save=*/false);
  const LoraRun run =
      run_lora(model, world, opt, 1'000'000'000, overlap, /*save=*/false, OffloadDevice::kNvme);
  ASSERT_EQ(run.reports.size(), 5u);
  for (std::size_t s = 0; s < run.reports.size(); ++s) {
    const std::size_t pass = overlap ? s : s + 1;  // see check_lora_pass
    if (pass == 0) continue;
    const StepReport& rep = run.reports[s];
    std::printf(
        "step %zu: shards written %llu (trainable %llu, frozen %llu), optimizer read %llu, master "
        "read back %llu\n",
        s + 1, static_cast<unsigned long long>(rep.param_nvme_write_bytes),
        static_cast<unsigned long long>(shard_bytes),
        static_cast<unsigned long long>(frozen_shard_bytes),
        static_cast<unsigned long long>(rep.optimizer_nvme_read_bytes),
        static_cast<unsigned long long>(rep.master_nvme_read_bytes));
    EXPECT_EQ(rep.param_nvme_write_bytes, shard_bytes) << "step " << s + 1;
    EXPECT_EQ(rep.optimizer_nvme_read_bytes, state_on_nvme ? trainable_elements * 12 : 0)
        << "step " << s + 1;
    const std::uint64_t master_read =
        state_on_nvme && dtype == DType::kF32 ? trainable_elements * 4 : 0;
    EXPECT_EQ(rep.master_nvme_read_bytes, master_read) << "step " << s + 1;
  }
  ASSERT_EQ(run.finals.size(), model.params.size());
  ASSERT_EQ(stepped.finals.size(), model.params.size());
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    EXPECT_EQ(
        std::memcmp(run.finals[p].data(), stepped.finals[p].data(), stepped.finals[p].size() * 4),
        0)
        << model.params[p].name;
  }
}

TEST(Frozen, AStepWritesOnlyTheTrainableShardsStreamedSequential) {
  check_lora_publish(1, OffloadDevice::kNvme, DType::kBF16, /*overlap=*/false);
}
TEST(Frozen, AStepWritesOnlyTheTrainableShardsStreamedOverlappedWorld2) {
  check_lora_publish(2, OffloadDevice::kNvme, DType::kBF16, /*overlap=*/true);
}
TEST(Frozen, AStepWritesOnlyTheTrainableShardsStateInHostMemory) {
  check_lora_publish(1, OffloadDevice::kHost, DType::kBF16, /*overlap=*/true);
}
TEST(Frozen, AStepReadsBackOnlyTheTrainableMasterF32) {
  check_lora_publish(1, OffloadDevice::kNvme, DType::kF32, /*overlap=*/false);
}

// The overlapped step: a gather of the frozen module right after step() does not wait for the
// pass, which writes nothing of it. lora_model() (bf16) at stage 3 with the shards in device
// memory and the state on NVMe (streamed), every read of the engine's I/O delayed by 250 ms from
// step 2 on (seed 5), so that each pass takes seconds. After step 2, gather("base") returns while
// the pass still reads: fewer of the pass's delayed reads have happened then than when the
// trainable embedding's gather, which waits for the pass, returns (no clock is compared, so a
// slow machine cannot fail it). The training ends, bit for bit, where the same training with the
// state in device memory ends.
TEST(Frozen, AGatherOfTheFrozenModuleDoesNotWaitForThePass) {
  const Model model = lora_model(DType::kBF16);
  const LoraRun stepped = run_lora(model, 1, OffloadDevice::kNone, 1'000'000'000,
                                   /*overlap=*/true, /*save=*/false);
  ASSERT_EQ(stepped.finals.size(), model.params.size());
  engine_test::ScratchDir dir("frozen_gather_during_pass");
  Config config =
      engine_test::small_config(3, OffloadDevice::kNvme, OffloadDevice::kNone, dir.path());
  config.zero.sub_group_size = 1'000'000'000;
  config.overlap_step = true;
  FaultSpec spec;
  spec.seed = 5;
  spec.latency_rate = 1.0;
  spec.latency = std::chrono::milliseconds(250);
  spec.writes = false;
  auto slow_reads = std::make_shared<FaultInjector>(spec);
  slow_reads->set_enabled(false);
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  Result<std::unique_ptr<Engine>> opened = engine_test::open_rank(ranks, 0, config, slow_reads);
  ASSERT_TRUE(opened.is_ok()) << opened.status().to_string();
  Engine& engine = **opened;
  TrainOptions options;
  options.check_gathered = false;
  options.steps = 1;
  Status st = engine_test::train_rank(engine, model, 0, options, nullptr, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  slow_reads->set_enabled(true);
  options.first_step = 2;
  options.steps = 2;
  st = engine_test::train_rank(engine, model, 0, options, nullptr, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  // Step 2's pass runs on: each read of the embedding's and the adapters' state takes 250 ms.
  // The shards are in device memory, so the gathers themselves read nothing.
  st = engine.gather("base");
  const std::uint64_t reads_at_frozen = slow_reads->counts().latency;
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_TRUE(engine.release("base").is_ok());
  st = engine.gather("embed");
  const std::uint64_t reads_at_trainable = slow_reads->counts().latency;
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_TRUE(engine.release("embed").is_ok());
  std::printf(
      "the pass's delayed reads: %llu when gather('base') returned, %llu when "
      "gather('embed') did\n",
      static_cast<unsigned long long>(reads_at_frozen),
      static_cast<unsigned long long>(reads_at_trainable));
  EXPECT_LT(reads_at_frozen, reads_at_trainable)
      << "the frozen module's gather waited for the pass (or the pass was over before it)";
  slow_reads->set_enabled(false);
  options.first_step = 3;
  options.steps = 5;
  st = engine_test::train_rank(engine, model, 0, options, nullptr, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  Result<std::vector<std::vector<float>>> finals = engine_test::read_masters(engine, model);
  ASSERT_TRUE(finals.is_ok()) << finals.status().to_string();
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    EXPECT_EQ(
        std::memcmp((*finals)[p].data(), stepped.finals[p].data(), stepped.finals[p].size() * 4), 0)
        << model.params[p].name;
  }
}

}  // namespace
}  // namespace zinf
