// Engine::save_checkpoint / load_checkpoint. A resumed run must be the same run: train 3 steps,
// save, train 3 more (run A); a fresh engine registers the same model, loads, and trains the same
// 3 steps (run B): the final fp32 masters, the gathered device copies (their bytes), the step
// count and the loss scale are equal to the bit, over world sizes 1, 2 and 4, stages 1-3, the
// optimizer state on the device, in host memory or on NVMe (with bf16 parameters, NVMe shards
// and gradients on NVMe), and on opaque (GPU-like) devices. And the errors a user meets: a
// corrupted rank file, a checkpoint of another world size or stage, a save with gradients
// pending, a directory without a checkpoint.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;
using engine_test::TrainOptions;
using engine_test::with_engines;

struct CkptCase {
  int world;
  int stage;
  OffloadDevice optimizer;
  OffloadDevice params = OffloadDevice::kNone;
  DType dtype = DType::kF32;
  bool grads_on_nvme = false;
  bool opaque = false;
  bool fp16 = false;  // dynamic loss scale with a window of 2, so its state moves
};

std::string case_name(const CkptCase& c) {
  return fmt::format("w{}_s{}_opt_{}_param_{}_{}{}{}{}", c.world, c.stage,
                     offload_device_name(c.optimizer), offload_device_name(c.params),
                     dtype_name(c.dtype), c.grads_on_nvme ? "_gradnvme" : "",
                     c.opaque ? "_opaque" : "", c.fp16 ? "_fp16" : "");
}

Config case_config(const CkptCase& c, const std::string& nvme) {
  Config config = engine_test::small_config(c.stage, c.optimizer, c.params, nvme);
  config.gradients_on_nvme = c.grads_on_nvme;
  if (c.fp16) {
    config.fp16.enabled = true;
    config.fp16.initial_scale_power = 3;
    config.fp16.loss_scale_window = 2;
  }
  return config;
}

// What a user checks after training: per rank, each parameter's fp32 master (read_parameters) and
// the bytes of its gathered device copy, and the engine's step count and loss scale.
struct RankState {
  std::vector<std::vector<float>> masters;
  std::vector<std::vector<std::byte>> gathered;
  std::int64_t last_step = 0;
  double loss_scale = 0.0;
};

Status snapshot(Engine& engine, const Model& model, Device& device, RankState* out) {
  std::unique_ptr<Stream> stream;
  if (!device.host_accessible()) {
    ZINF_ASSIGN_OR_RETURN(stream, device.create_stream("checkpoint test"));
  }
  for (const std::string& m : model.modules) {
    ZINF_RETURN_IF_ERROR(engine.gather(m));
    for (const engine_test::ParamDef& d : model.params) {
      if (d.module != m) continue;
      ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(d.name));
      std::vector<std::byte> bytes(view.element_count * dtype_bytes(view.dtype));
      if (stream == nullptr) {
        std::memcpy(bytes.data(), view.data, bytes.size());
      } else {
        ZINF_RETURN_IF_ERROR(device.copy_d2h(bytes.data(), view.data, bytes.size(), *stream));
        ZINF_RETURN_IF_ERROR(device.synchronize(*stream, std::chrono::seconds(30)));
      }
      out->gathered.push_back(std::move(bytes));
    }
    ZINF_RETURN_IF_ERROR(engine.release(m));
  }
  for (const engine_test::ParamDef& d : model.params) {
    std::vector<float> values(d.element_count());
    ZINF_RETURN_IF_ERROR(engine.read_parameters(d.name, values.data()));
    out->masters.push_back(std::move(values));
  }
  out->loss_scale = engine.loss_scale();
  return Status::ok();
}

// Run A (resume = false): steps 1-3, save to `dir`, steps 4-6. Run B (resume = true): register,
// finalize, load `dir`, steps 4-6.
std::vector<RankState> run(const CkptCase& c, const Model& model, const std::string& nvme,
                           const std::string& dir, bool resume) {
  const Config config = case_config(c, nvme);
  engine_test::Ranks ranks =
      engine_test::make_ranks(c.world, std::chrono::seconds(30), /*jitter_max_us=*/0, c.opaque);
  std::vector<RankState> states(static_cast<std::size_t>(c.world));
  std::vector<Status> st = engine_test::run_ranks(c.world, [&](int rank) -> Status {
    const auto r = static_cast<std::size_t>(rank);
    Env env;
    env.device = ranks.devices[r].get();
    env.comm = ranks.comms[r].get();
    ZINF_ASSIGN_OR_RETURN(auto engine, Engine::open(config, env));
    TrainOptions options;
    options.device = env.device;
    std::vector<StepReport> reports;
    if (resume) {
      ZINF_RETURN_IF_ERROR(engine_test::register_model(*engine, model));
      ZINF_RETURN_IF_ERROR(engine->finalize());
      ZINF_RETURN_IF_ERROR(engine->load_checkpoint(dir));
    } else {
      options.steps = 3;
      ZINF_RETURN_IF_ERROR(
          engine_test::train_rank(*engine, model, rank, options, nullptr, nullptr));
      ZINF_RETURN_IF_ERROR(engine->save_checkpoint(dir));
    }
    options.first_step = 4;
    options.steps = 6;
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(*engine, model, rank, options, nullptr, &reports));
    if (reports.size() != 3 || reports.front().step != 4) {
      return Status::internal(fmt::format("rank {}: the first step after the save reported step {}",
                                          rank, reports.empty() ? -1 : reports.front().step));
    }
    states[r].last_step = reports.back().step;
    return snapshot(*engine, model, *env.device, &states[r]);
  });
  for (int r = 0; r < c.world; ++r) {
    EXPECT_TRUE(st[static_cast<std::size_t>(r)].is_ok())
        << (resume ? "run B" : "run A") << " rank " << r << ": "
        << st[static_cast<std::size_t>(r)].to_string();
  }
  return states;
}

class CheckpointTest : public ::testing::TestWithParam<CkptCase> {};

TEST_P(CheckpointTest, ResumedRunEqualsUninterruptedRun) {
  const CkptCase& c = GetParam();
  engine_test::ScratchDir scratch("ckpt-" + case_name(c));
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = engine_test::make_model(c.dtype, 1234);
  const std::vector<RankState> a = run(c, model, scratch.path(), dir, /*resume=*/false);
  ASSERT_FALSE(HasFailure());
  // DeepSpeed's layout: the default tag global_step<N>, named by `latest`.
  EXPECT_TRUE(std::filesystem::exists(dir + "/global_step3/manifest.json"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/latest"));
  const std::vector<RankState> b = run(c, model, scratch.path(), dir, /*resume=*/true);
  ASSERT_FALSE(HasFailure());
  for (std::size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(a[r].last_step, 6);
    EXPECT_EQ(b[r].last_step, 6);
    EXPECT_EQ(a[r].loss_scale, b[r].loss_scale) << "rank " << r;
    ASSERT_EQ(a[r].masters.size(), model.params.size());
    ASSERT_EQ(b[r].masters.size(), model.params.size());
    ASSERT_EQ(b[r].gathered.size(), a[r].gathered.size());
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      const std::size_t bytes = a[r].masters[p].size() * sizeof(float);
      EXPECT_EQ(std::memcmp(a[r].masters[p].data(), b[r].masters[p].data(), bytes), 0)
          << "rank " << r << " master of " << model.params[p].name;
    }
    for (std::size_t p = 0; p < a[r].gathered.size(); ++p) {
      EXPECT_EQ(a[r].gathered[p], b[r].gathered[p]) << "rank " << r << " gathered parameter " << p;
    }
  }
  if (c.fp16) {
    // From 2^3 the scale doubled at every second good step (DeepSpeed's ZeRO rule, a window of
    // 2): at steps 2, 4 and 6, 2^6. The save after step 3 falls inside a window: a resume that
    // lost the scale ends at 2^5, and so does one that lost the count of good steps (3 at the
    // save), which doubles at step 5 instead of 4 and 6.
    EXPECT_EQ(b[0].loss_scale, 64.0);
  }
}

std::vector<CkptCase> ckpt_cases() {
  using D = OffloadDevice;
  return {
      {1, 1, D::kNone},
      {2, 2, D::kHost},
      {4, 3, D::kNvme, D::kNvme, DType::kBF16, /*grads_on_nvme=*/true},
      {2, 3, D::kNvme, D::kHost, DType::kBF16},
      {4, 1, D::kHost, D::kNone, DType::kBF16},
      {2, 2, D::kNvme, D::kNone, DType::kF32, /*grads_on_nvme=*/true},
      {2, 3, D::kNone, D::kNone, DType::kBF16, false, /*opaque=*/true},
      {2, 2, D::kHost, D::kNone, DType::kF16, false, false, /*fp16=*/true},
  };
}

INSTANTIATE_TEST_SUITE_P(Engine, CheckpointTest, ::testing::ValuesIn(ckpt_cases()),
                         [](const ::testing::TestParamInfo<CkptCase>& info) {
                           return case_name(info.param);
                         });

Status train_and_save(Engine& engine, const Model& model, int rank, const std::string& dir) {
  TrainOptions options;
  options.steps = 2;
  ZINF_RETURN_IF_ERROR(engine_test::train_rank(engine, model, rank, options, nullptr, nullptr));
  return engine.save_checkpoint(dir);
}

TEST(CheckpointErrors, FlippedByteIsCorruptionNamingTheFile) {
  engine_test::ScratchDir scratch("ckpt-flip");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 7);
  const Config config =
      engine_test::small_config(2, OffloadDevice::kNvme, OffloadDevice::kNone, scratch.path());
  for (const Status& st : with_engines(config, model, 2, [&](int rank, Engine&e) {
         return train_and_save(e, model, rank, dir);
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  // One byte of rank 1's optimizer state, past the header.
  const std::string victim = dir + "/global_step2/rank1.zinfckpt";
  ASSERT_TRUE(engine_test::flip_bits(victim, 4096 + 123, 0x10));
  // A load of the same layout streams each rank file into the state once, checking its checksum
  // at the end: the flip is found after the state was overwritten, so the engines then refuse
  // to train on the mixed state (the load's error is sticky), on both ranks.
  std::vector<Status> after(2);
  const std::vector<Status> st = with_engines(config, model, 2, [&](int rank, Engine& e) {
    Status loaded = e.load_checkpoint(dir);
    TrainOptions options;
    options.first_step = 3;
    options.steps = 3;
    after[static_cast<std::size_t>(rank)] =
        engine_test::train_rank(e, model, rank, options, nullptr, nullptr);
    return loaded;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(after[r].code(), st[r].code()) << after[r].to_string();
    EXPECT_EQ(after[r].message(), st[r].message()) << after[r].to_string();
  }
  EXPECT_EQ(st[1].code(), Code::kCorruption) << st[1].to_string();
  EXPECT_NE(st[1].message().find("rank1.zinfckpt"), std::string::npos) << st[1].to_string();
  EXPECT_NE(st[1].message().find("checksum"), std::string::npos) << st[1].to_string();
  // Rank 0's own file is intact; it is told which rank failed.
  EXPECT_EQ(st[0].code(), Code::kAborted) << st[0].to_string();
  EXPECT_NE(st[0].message().find("rank 1"), std::string::npos) << st[0].to_string();
}

TEST(CheckpointErrors, OtherOptimizerOrParametersIsInvalidArgumentNamingThem) {
  engine_test::ScratchDir scratch("ckpt-mismatch");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 8);
  const Config saved =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, scratch.path());
  for (const Status& st : with_engines(saved, model, 1, [&](int rank, Engine&e) {
         return train_and_save(e, model, rank, dir);
       })) {
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  Config lion = saved;
  lion.optimizer.kind = OptimizerKind::kLion;
  for (const Status& st :
       with_engines(lion, model, 2, [&](int, Engine& e) { return e.load_checkpoint(dir); })) {
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("optimizer.type adamw, this engine has optimizer.type lion"),
              std::string::npos)
        << st.to_string();
  }
  Model renamed = model;
  renamed.params[1].name += "_renamed";
  for (const Status& st :
       with_engines(saved, renamed, 2, [&](int, Engine& e) { return e.load_checkpoint(dir); })) {
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
    EXPECT_NE(
        st.message().find("parameter '" + renamed.params[1].name + "' is not in the checkpoint"),
        std::string::npos)
        << st.to_string();
  }
  Model reshaped = model;
  reshaped.params[1].shape = {reshaped.params[1].shape.back(), reshaped.params[1].shape.front()};
  if (reshaped.params[1].shape != model.params[1].shape) {
    for (const Status& st :
         with_engines(saved, reshaped, 1, [&](int, Engine& e) { return e.load_checkpoint(dir); })) {
      EXPECT_EQ(st.code(), Code::kInvalidArgument) << st.to_string();
      EXPECT_NE(st.message().find("parameter '" + model.params[1].name + "' has shape"),
                std::string::npos)
          << st.to_string();
    }
  }
  // The engine is still usable after a refused load.
  for (const Status& st : with_engines(lion, model, 1, [&](int rank, Engine&e) -> Status {
         if (e.load_checkpoint(dir).is_ok()) return Status::internal("the load was not refused");
         TrainOptions options;
         options.steps = 2;
         return engine_test::train_rank(e, model, rank, options, nullptr, nullptr);
       })) {
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
}

TEST(CheckpointErrors, SaveWithGradientsPendingIsFailedPrecondition) {
  engine_test::ScratchDir scratch("ckpt-pending");
  const std::string dir = scratch.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 9);
  const Config config =
      engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, scratch.path());
  const std::vector<Status> st = with_engines(config, model, 1, [&](int, Engine& e) -> Status {
    // A micro-batch's gradients for the last module only, as a backward pass cut short leaves.
    const std::string& m = model.modules.back();
    std::vector<std::vector<float>> grads;
    std::vector<GradientRef> refs;
    for (const engine_test::ParamDef& d : model.params) {
      if (d.module != m) continue;
      grads.emplace_back(d.element_count(), 0.25f);
    }
    std::size_t i = 0;
    for (const engine_test::ParamDef& d : model.params) {
      if (d.module != m) continue;
      refs.push_back({d.name, grads[i].data(), d.element_count(), DType::kF32});
      ++i;
    }
    ZINF_RETURN_IF_ERROR(e.gather(m));
    Status gathered = e.save_checkpoint(dir);
    if (gathered.code() != Code::kFailedPrecondition ||
        gathered.message().find("gathered") == std::string::npos) {
      return Status::internal("save while gathered: " + gathered.to_string());
    }
    ZINF_RETURN_IF_ERROR(e.reduce_gradients(m, refs));
    ZINF_RETURN_IF_ERROR(e.release(m));
    return e.save_checkpoint(dir);
  });
  EXPECT_EQ(st[0].code(), Code::kFailedPrecondition) << st[0].to_string();
  EXPECT_NE(st[0].message().find("gradients were reduced"), std::string::npos) << st[0].to_string();
  EXPECT_FALSE(std::filesystem::exists(dir + "/global_step0"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/latest"));
}

TEST(CheckpointErrors, MissingDirectoryIsNamed) {
  engine_test::ScratchDir scratch("ckpt-missing");
  const std::string dir = scratch.path() + "/no-such-checkpoint";
  const Model model = engine_test::make_model(DType::kF32, 10);
  const Config config =
      engine_test::small_config(1, OffloadDevice::kNone, OffloadDevice::kNone, scratch.path());
  const std::vector<Status> st =
      with_engines(config, model, 1, [&](int, Engine& e) { return e.load_checkpoint(dir); });
  EXPECT_EQ(st[0].code(), Code::kNotFound) << st[0].to_string();
  EXPECT_NE(st[0].message().find(dir + "/latest"), std::string::npos) << st[0].to_string();
}

}  // namespace
}  // namespace zinf
