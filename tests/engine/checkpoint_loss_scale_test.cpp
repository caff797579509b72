// The loss scale after load_checkpoint(). The saved scaler (scale, good steps, hysteresis left)
// is restored only when this engine's scaler is dynamic and the checkpoint's was dynamic fp16;
// otherwise this engine keeps its own: 1 without fp16, its fp16.loss_scale when static, its
// 2^initial_scale_power when dynamic. Each case checks the scale and the first step's gradient
// norm against a double-precision norm of the gradients the test hands in, divided by the scale
// this engine should use (the step divides the gradients by its scale: a wrong scale shows up as
// gradients off by that factor for the rest of the run).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "engine_test_util.hpp"

namespace zinf {
namespace {

using engine_test::Model;

// A config of stage 2, the state in host memory, with fp16 as given: `fp16` off, or on with a
// static `static_scale` (> 0) or a dynamic scale from 2^`power` (window 2, so it moves).
Config scaled_config(bool fp16, double static_scale, int power) {
  Config c = engine_test::small_config(2, OffloadDevice::kHost, OffloadDevice::kNone, "");
  c.fp16.enabled = fp16;
  c.fp16.loss_scale = static_scale;
  c.fp16.initial_scale_power = power;
  c.fp16.loss_scale_window = 2;
  return c;
}

struct Loaded {
  double scale_after_load = 0.0;
  double grad_norm = 0.0;        // StepReport::grad_norm of the first step after the load
  double handed_norm = 0.0;      // the double-precision norm of that step's gradients
  double step_loss_scale = 0.0;  // StepReport::loss_scale of that step
};

// One rank: opens an engine of `config`, loads `dir`/`tag`, and runs step 4.
Loaded load_and_step(const Config& config, const Model& model, const std::string& dir,
                     const std::string& tag) {
  Loaded out;
  engine_test::Ranks ranks = engine_test::make_ranks(1);
  std::vector<Status> st = engine_test::run_engines(config, ranks, [&](int rank, Engine& e) {
    ZINF_RETURN_IF_ERROR(engine_test::register_model(e, model));
    ZINF_RETURN_IF_ERROR(e.finalize());
    ZINF_RETURN_IF_ERROR(e.load_checkpoint(dir, tag));
    out.scale_after_load = e.loss_scale();
    // The gradients train_rank() hands at step 4, from the loaded masters (f32: the gathered
    // values are the masters).
    ZINF_ASSIGN_OR_RETURN(auto w, engine_test::read_masters(e, model));
    double sumsq = 0.0;
    for (std::size_t p = 0; p < model.params.size(); ++p) {
      for (float g : engine_test::make_grad(model.params[p], w[p], rank, 4, 0, p)) {
        sumsq += static_cast<double>(g) * g;
      }
    }
    out.handed_norm = std::sqrt(sumsq);
    engine_test::TrainOptions o;
    o.first_step = 4;
    o.steps = 4;
    o.check_gathered = false;
    std::vector<StepReport> reports;
    ZINF_RETURN_IF_ERROR(engine_test::train_rank(e, model, rank, o, nullptr, &reports));
    out.grad_norm = reports.at(0).grad_norm;
    out.step_loss_scale = reports.at(0).loss_scale;
    return Status::ok();
  });
  EXPECT_TRUE(st[0].is_ok()) << st[0].to_string();
  return out;
}

// The scale after the load is `scale`, and the step divides the handed gradients by it.
void expect_scale(const Loaded& got, double scale) {
  EXPECT_EQ(got.scale_after_load, scale);
  EXPECT_EQ(got.step_loss_scale, scale);
  const double want = got.handed_norm / scale;
  EXPECT_NEAR(got.grad_norm, want, want * 1e-6) << "ratio " << want / got.grad_norm;
}

TEST(CheckpointLossScale, DynamicFp16CheckpointIntoEngineWithoutFp16KeepsScaleOne) {
  engine_test::ScratchDir tmp("ckpt-ls-off");
  const std::string dir = tmp.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 7);
  ASSERT_TRUE(
      engine_test::train_and_save(scaled_config(true, 0, 10), model, 1, 3, dir, "t").is_ok());
  expect_scale(load_and_step(scaled_config(false, 0, 16), model, dir, "t"), 1.0);
}

TEST(CheckpointLossScale, CheckpointWithoutFp16IntoDynamicEngineKeepsItsInitialScale) {
  engine_test::ScratchDir tmp("ckpt-ls-init");
  const std::string dir = tmp.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 7);
  ASSERT_TRUE(
      engine_test::train_and_save(scaled_config(false, 0, 16), model, 1, 3, dir, "t").is_ok());
  expect_scale(load_and_step(scaled_config(true, 0, 12), model, dir, "t"), 4096.0);
}

TEST(CheckpointLossScale, DynamicCheckpointIntoStaticEngineKeepsTheStaticScale) {
  engine_test::ScratchDir tmp("ckpt-ls-static");
  const std::string dir = tmp.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 7);
  ASSERT_TRUE(
      engine_test::train_and_save(scaled_config(true, 0, 16), model, 1, 3, dir, "t").is_ok());
  expect_scale(load_and_step(scaled_config(true, 128, 16), model, dir, "t"), 128.0);
}

TEST(CheckpointLossScale, StaticCheckpointIntoDynamicEngineKeepsItsInitialScale) {
  engine_test::ScratchDir tmp("ckpt-ls-static-dyn");
  const std::string dir = tmp.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 7);
  ASSERT_TRUE(
      engine_test::train_and_save(scaled_config(true, 128, 16), model, 1, 3, dir, "t").is_ok());
  expect_scale(load_and_step(scaled_config(true, 0, 10), model, dir, "t"), 1024.0);
}

// From 2^3 with a window of 2 the saved scale doubled at step 2 (16), and 3 good steps were
// counted: the engine loading it, dynamic from 2^10, goes on from 16 and doubles at step 4 (the
// 4th good step), as the saved scaler would have.
TEST(CheckpointLossScale, DynamicCheckpointIntoDynamicEngineRestoresTheScaler) {
  engine_test::ScratchDir tmp("ckpt-ls-dyn");
  const std::string dir = tmp.path() + "/ckpt";
  const Model model = engine_test::make_model(DType::kF32, 7);
  ASSERT_TRUE(
      engine_test::train_and_save(scaled_config(true, 0, 3), model, 1, 3, dir, "t").is_ok());
  const Loaded got = load_and_step(scaled_config(true, 0, 10), model, dir, "t");
  expect_scale(got, 16.0);
}

// The manifest records the saving engine's scaler: "dynamic", "static" or "off".
TEST(CheckpointLossScale, ManifestNamesTheSavedScalersMode) {
  engine_test::ScratchDir tmp("ckpt-ls-manifest");
  const Model model = engine_test::make_model(DType::kF32, 7);
  const struct {
    Config config;
    const char* mode;
  } cases[] = {{scaled_config(false, 0, 16), "off"},
               {scaled_config(true, 128, 16), "static"},
               {scaled_config(true, 0, 16), "dynamic"}};
  for (const auto& c : cases) {
    const std::string dir = tmp.path() + "/" + c.mode;
    ASSERT_TRUE(engine_test::train_and_save(c.config, model, 1, 1, dir, "t").is_ok());
    const std::string text = engine_test::read_file(dir + "/t/manifest.json");
    EXPECT_NE(text.find(fmt::format("\"loss_scaler\": \"{}\"", c.mode)), std::string::npos)
        << text.substr(0, 2000);
  }
}

// A manifest written before "loss_scaler" existed: a dynamic engine restores the saved scaler
// when its scale is not 1 (an engine without fp16 always saved 1), and keeps its own otherwise.
void write_without_mode(const std::string& path) {
  const std::string text = engine_test::read_file(path);
  Result<CheckpointManifest> m = parse_checkpoint_manifest(text, path);
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  ASSERT_TRUE(m->loss_scaler.has_value());
  m->loss_scaler.reset();
  const std::string older = encode_checkpoint_manifest(*m);
  ASSERT_EQ(older.find("loss_scaler"), std::string::npos);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << older;
}

TEST(CheckpointLossScale, ManifestWithoutModeRestoresAScaleOtherThanOne) {
  engine_test::ScratchDir tmp("ckpt-ls-older");
  const Model model = engine_test::make_model(DType::kF32, 7);
  const std::string dyn = tmp.path() + "/dyn";
  ASSERT_TRUE(
      engine_test::train_and_save(scaled_config(true, 0, 3), model, 1, 3, dyn, "t").is_ok());
  write_without_mode(dyn + "/t/manifest.json");
  expect_scale(load_and_step(scaled_config(true, 0, 10), model, dyn, "t"), 16.0);
  // Still never into a static engine or one without fp16.
  expect_scale(load_and_step(scaled_config(true, 128, 10), model, dyn, "t"), 128.0);
  expect_scale(load_and_step(scaled_config(false, 0, 10), model, dyn, "t"), 1.0);

  const std::string off = tmp.path() + "/off";
  ASSERT_TRUE(
      engine_test::train_and_save(scaled_config(false, 0, 16), model, 1, 3, off, "t").is_ok());
  write_without_mode(off + "/t/manifest.json");
  expect_scale(load_and_step(scaled_config(true, 0, 10), model, off, "t"), 1024.0);
}

}  // namespace
}  // namespace zinf
