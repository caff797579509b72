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

#include <cstdio>
#include <cstring>
#include <string>

#include "base/random.hpp"
#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::Reference;
using engine_test::TrainOptions;

struct Case {
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

std::string case_name(const Case& c) {
  return fmt::format("w{}_s{}_opt_{}_param_{}_{}_{}_{}_mb{}{}{}{}{}{}", c.world, c.stage,
                     offload_device_name(c.optimizer), offload_device_name(c.params), c.frozen,
                     optimizer_name(c.kind), dtype_name(c.dtype), c.micro_batches,
                     c.clipping > 0 ? "_clip" : "", c.fp16 ? "_fp16" : "",
                     c.opaque ? "_opaque" : "", c.overlap ? "" : "_sequential",
                     c.sub_group_size > 0 ? fmt::format("_sg{}", c.sub_group_size) : "");
}

Config case_config(const Case& c, const std::string& dir) {
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
void run_case(const Case& c) {
  const std::uint64_t seed = 4321 + static_cast<std::uint64_t>(c.world) * 10 +
                             static_cast<std::uint64_t>(c.stage) +
                             static_cast<std::uint64_t>(c.kind) * 100;
  std::printf("case %s seed %llu\n", case_name(c).c_str(), static_cast<unsigned long long>(seed));
  engine_test::ScratchDir dir("frozen_" + case_name(c));
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

class FrozenEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(FrozenEquivalence, TrainsTheOthersAsTheReferenceAndKeepsTheFrozenBits) {
  run_case(GetParam());
}

std::vector<Case> equivalence_cases() {
  std::vector<Case> cases;
  for (int world : {1, 2}) {
    for (int stage : {1, 2, 3}) {
      for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kHost, OffloadDevice::kNvme}) {
        Case c;
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
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return case_name(info.param);
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
// empty) and before saving tag `save` (unless empty); returns rank 0's masters.
std::vector<std::vector<float>> train_between_checkpoints(const Config& config, const Model& model,
                                                          int world, const std::string& ckpt,
                                                          const std::string& load, int first,
                                                          int last, const std::string& save) {
  std::vector<std::vector<float>> out;
  std::vector<Status> st =
      engine_test::with_engines(config, model, world, [&](int rank, Engine& engine) -> Status {
        if (!load.empty()) ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, load));
        TrainOptions run;
        run.check_gathered = false;
        run.first_step = first;
        run.steps = last;
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
// sub-groups would keep their moments, and block1 would train differently once thawed.
TEST(Frozen, LoadedMomentsOfAFrozenModuleDecayAsWhenNothingIsPassedOver) {
  constexpr int kWorld = 2;
  const Model trained = engine_test::make_model(DType::kF32, 97);
  Model frozen = trained;
  frozen.frozen_module = "block1";
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
// trainable elements' master and moments (12 bytes each), and, when the new bf16 parameters
// stream from the pass, reads the frozen elements' master (4 bytes each) to hand their half copy
// on; with f32 parameters it reads nothing of them. So with sub-groups of 1024 / world elements
// (each all frozen or all trainable) and with one of the default size (1e9: the frozen base gets
// sub-groups of its own, cut at its ends). Both end with the masters, bit for bit, of the same
// run with the state in device memory (offload_optimizer none), which steps every element, the
// frozen base included. At world 1 a checkpoint is linked after step 2: the step after it
// streams everything once (moving the frozen state out of the linked file), then passes over it
// again, and the checkpoint resumes to the same bits.
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
                 bool overlap, bool save) {
  engine_test::ScratchDir dir(fmt::format(
      "frozen_lora_w{}_{}_sg{}_{}_{}{}", world, offload_device_name(opt), sub_group_size,
      dtype_name(model.params[0].dtype), overlap ? "overlap" : "sequential", save ? "_save" : ""));
  const std::string ckpt = dir.path() + "/ckpt";
  Config config = engine_test::small_config(2, opt, OffloadDevice::kNone, dir.path());
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
  const std::size_t all_elements = frozen_elements + trainable_elements;
  // Master, exp_avg and exp_avg_sq: 12 bytes an element each way; the streamed pass reads the
  // frozen master (4 bytes an element) for its half copy.
  const std::uint64_t trainable_bytes = trainable_elements * 12;
  const std::uint64_t frozen_read_bytes = dtype == DType::kF32 ? 0 : frozen_elements * 4;
  const std::uint64_t all_bytes = all_elements * 12;

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
      // The pass after the linked save (pass 3) streams everything once.
      const bool full = skipped.linked && pass == 3;
      const StepReport& rep = skipped.reports[s];
      EXPECT_EQ(rep.optimizer_nvme_read_bytes, pass == 0 ? none
                                               : full    ? all_bytes
                                                         : trainable_bytes + frozen_read_bytes)
          << "step " << s + 1;
      EXPECT_EQ(rep.optimizer_nvme_write_bytes, pass == 0 ? none
                                                : full    ? all_bytes
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

}  // namespace
}  // namespace zinf
