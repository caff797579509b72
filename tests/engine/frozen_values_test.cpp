// A frozen module's values through steps after they were changed: a step does not republish
// frozen groups (their values cannot change: learning rate 0), so whatever last wrote them, the
// placement at finalize, Engine::write_parameters or a checkpoint load, must have written every
// copy a gather reads. Each case trains, writes new frozen values, steps, saves, writes others,
// steps, loads the checkpoint and steps, and checks after each phase that the gathered frozen
// copies are the written values rounded to the parameter's dtype (an independent rounding,
// engine_test::narrow_to_half) and, at the end, that the frozen masters are the loaded values bit
// for bit. Also: the frozen group's update is 0 / 0 where eps is 0, which a step must not let
// into a frozen master.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "base/random.hpp"
#include "engine_test_util.hpp"
#include "zinf/dtype.hpp"

namespace zinf {
namespace {

using engine_test::Model;

// `values` as the device holds them: rounded to `dtype` and widened back.
std::vector<float> as_device(const std::vector<float>& values, DType dtype) {
  if (dtype == DType::kF32) return values;
  const std::vector<std::uint16_t> half = engine_test::narrow_to_half(values, dtype);
  std::vector<float> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    out[i] = dtype == DType::kBF16 ? bf16_to_f32(half[i]) : f16_to_f32(half[i]);
  }
  return out;
}

// Gathers the frozen module and compares each of its parameters with want[p] as the device holds
// it; `what` names the phase in the error.
Status check_gathered(Engine& engine, const Model& model,
                      const std::vector<std::vector<float>>& want, const std::string& what) {
  ZINF_RETURN_IF_ERROR(engine.gather(model.frozen_module));
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].module != model.frozen_module) continue;
    ZINF_ASSIGN_OR_RETURN(TensorView view, engine.parameter(model.params[p].name));
    const std::vector<float> got = engine_test::widen_view(view);
    const std::vector<float> expected = as_device(want[p], model.params[p].dtype);
    if (std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) != 0) {
      std::size_t i = 0;
      while (std::memcmp(&got[i], &expected[i], sizeof(float)) == 0) ++i;
      return Status::internal(fmt::format("{}: gathered {}[{}] = {}, want {}", what,
                                          model.params[p].name, i, got[i], expected[i]));
    }
  }
  return engine.release(model.frozen_module);
}

// The model's initial values with the frozen module's replaced by seeded ones in [-3, 3).
std::vector<std::vector<float>> new_frozen_values(const Model& model, std::uint64_t seed) {
  std::vector<std::vector<float>> values = model.initial;
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].module != model.frozen_module) continue;
    fill_uniform(values[p].data(), values[p].size(), seed + p, -3.0f, 3.0f);
  }
  return values;
}

Status write_frozen(Engine& engine, const Model& model,
                    const std::vector<std::vector<float>>& values) {
  for (std::size_t p = 0; p < model.params.size(); ++p) {
    if (model.params[p].module != model.frozen_module) continue;
    ZINF_RETURN_IF_ERROR(engine.write_parameters(model.params[p].name, values[p].data(), 0));
  }
  return Status::ok();
}

struct ValuesCase {
  std::string name;
  int world;
  int stage;
  OffloadDevice optimizer;
  OffloadDevice params;
  DType dtype;
  bool overlap;
  std::size_t sub_group_size;       // 0: the config's
  std::uint64_t persist_threshold;  // 0: the config's
  std::string frozen;
};

class FrozenValues : public ::testing::TestWithParam<ValuesCase> {};

TEST_P(FrozenValues, WrittenAndLoadedValuesStayThroughSteps) {
  const ValuesCase c = GetParam();
  engine_test::ScratchDir dir("frozen_values_" + c.name);
  Config config = engine_test::small_config(c.stage, c.optimizer, c.params, dir.path());
  config.overlap_step = c.overlap;
  if (c.sub_group_size > 0) config.zero.sub_group_size = c.sub_group_size;
  if (c.persist_threshold > 0) config.zero.stage3_param_persistence_threshold = c.persist_threshold;
  Model model = engine_test::make_model(c.dtype, 77);
  model.frozen_module = c.frozen;
  const std::string ckpt = dir.path() + "/ckpt";
  const std::vector<std::vector<float>> first = new_frozen_values(model, 1000);
  const std::vector<std::vector<float>> second = new_frozen_values(model, 2000);
  const std::vector<Status> st =
      engine_test::with_engines(config, model, c.world, [&](int rank, Engine& engine) -> Status {
        ZINF_RETURN_IF_ERROR(engine_test::train_steps(engine, model, rank, 1, 2));
        ZINF_RETURN_IF_ERROR(check_gathered(engine, model, model.initial, "after steps 1-2"));
        ZINF_RETURN_IF_ERROR(write_frozen(engine, model, first));
        ZINF_RETURN_IF_ERROR(check_gathered(engine, model, first, "after write_parameters"));
        ZINF_RETURN_IF_ERROR(engine_test::train_steps(engine, model, rank, 3, 4));
        ZINF_RETURN_IF_ERROR(check_gathered(engine, model, first, "write_parameters, steps 3-4"));
        ZINF_RETURN_IF_ERROR(engine.save_checkpoint(ckpt, "a"));
        ZINF_RETURN_IF_ERROR(write_frozen(engine, model, second));
        ZINF_RETURN_IF_ERROR(engine_test::train_steps(engine, model, rank, 5, 5));
        ZINF_RETURN_IF_ERROR(check_gathered(engine, model, second, "a second write, step 5"));
        ZINF_RETURN_IF_ERROR(engine.load_checkpoint(ckpt, "a"));
        ZINF_RETURN_IF_ERROR(engine_test::train_steps(engine, model, rank, 5, 7));
        ZINF_RETURN_IF_ERROR(check_gathered(engine, model, first, "the load, steps 5-7"));
        ZINF_ASSIGN_OR_RETURN(auto masters, engine_test::read_masters(engine, model));
        for (std::size_t p = 0; p < model.params.size(); ++p) {
          if (model.params[p].module != model.frozen_module) continue;
          if (std::memcmp(masters[p].data(), first[p].data(), first[p].size() * 4) != 0) {
            return Status::internal(fmt::format("the master of {} changed", model.params[p].name));
          }
        }
        return Status::ok();
      });
  for (std::size_t r = 0; r < st.size(); ++r) {
    EXPECT_TRUE(st[r].is_ok()) << "rank " << r << ": " << st[r].to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FrozenValues,
    ::testing::Values(
        // Streamed from the pass, overlapped and sequential.
        ValuesCase{"s3_nvme_nvme_bf16", 2, 3, OffloadDevice::kNvme, OffloadDevice::kNvme,
                   DType::kBF16, true, 32, 0, "block1"},
        ValuesCase{"s3_nvme_nvme_bf16_sequential_embed", 2, 3, OffloadDevice::kNvme,
                   OffloadDevice::kNvme, DType::kBF16, false, 32, 0, "embed"},
        // Persistent groups (gathered once, kept).
        ValuesCase{"s3_nvme_device_bf16_persistent", 2, 3, OffloadDevice::kNvme,
                   OffloadDevice::kNone, DType::kBF16, true, 32, 100000, "block1"},
        ValuesCase{"s2_nvme_bf16", 2, 2, OffloadDevice::kNvme, OffloadDevice::kNone, DType::kBF16,
                   true, 32, 0, "block1"},
        ValuesCase{"s1_cpu_bf16_head", 2, 1, OffloadDevice::kHost, OffloadDevice::kNone,
                   DType::kBF16, true, 32, 0, "head"},
        // The store's half array (state and shards in host memory).
        ValuesCase{"s3_cpu_cpu_bf16", 2, 3, OffloadDevice::kHost, OffloadDevice::kHost,
                   DType::kBF16, true, 32, 0, "block1"},
        // f32: narrowed from the master.
        ValuesCase{"s3_nvme_device_f32", 2, 3, OffloadDevice::kNvme, OffloadDevice::kNone,
                   DType::kF32, true, 32, 0, "block1"},
        // The state in device memory (HostState here).
        ValuesCase{"s3_none_bf16", 2, 3, OffloadDevice::kNone, OffloadDevice::kNone, DType::kBF16,
                   false, 0, 0, "block1"},
        ValuesCase{"s2_none_bf16_embed", 1, 2, OffloadDevice::kNone, OffloadDevice::kNone,
                   DType::kBF16, false, 0, 0, "embed"}),
    [](const ::testing::TestParamInfo<ValuesCase>& info) { return info.param.name; });

// With eps 0 a frozen element's update is 0 / (sqrt(0) + 0): its moments are zero. Adam's
// and Adagrad's steps then give NaN, and -lr * NaN is NaN even at learning rate 0. The frozen
// parameters' group steps with an eps of its own (param_groups.hpp), so the frozen masters keep
// their bits, as the gathered copies (no longer republished after a step) do; the trainable
// parameters train with the configured eps 0.
TEST(FrozenValues, AZeroEpsLeavesTheFrozenMastersAsTheyAre) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdagrad}) {
    for (OffloadDevice optimizer : {OffloadDevice::kNone, OffloadDevice::kHost}) {
      engine_test::ScratchDir dir("frozen_eps0");
      Config config = engine_test::small_config(3, optimizer, OffloadDevice::kNone, dir.path());
      config.optimizer.eps = 0.0;
      config.optimizer.kind = kind;
      // Default sub-groups: the frozen module's elements share sub-groups with trainable ones,
      // so the pass updates them rather than passing over them.
      Model model = engine_test::make_model(DType::kBF16, 78);
      model.frozen_module = "block1";
      const std::vector<Status> st =
          engine_test::with_engines(config, model, 1, [&](int rank, Engine& engine) -> Status {
            ZINF_RETURN_IF_ERROR(engine_test::train_steps(engine, model, rank, 1, 2));
            ZINF_ASSIGN_OR_RETURN(auto masters, engine_test::read_masters(engine, model));
            for (std::size_t p = 0; p < model.params.size(); ++p) {
              const std::vector<float>& got = masters[p];
              if (model.params[p].module == model.frozen_module) {
                if (std::memcmp(got.data(), model.initial[p].data(), got.size() * 4) != 0) {
                  std::size_t nans = 0;
                  for (float x : got) nans += std::isnan(x) ? 1 : 0;
                  return Status::internal(fmt::format("frozen {} changed ({} of {} NaN)",
                                                      model.params[p].name, nans, got.size()));
                }
              } else if (std::memcmp(got.data(), model.initial[p].data(), got.size() * 4) == 0) {
                return Status::internal(fmt::format("{} did not train", model.params[p].name));
              }
            }
            return check_gathered(engine, model, model.initial, "after 2 steps");
          });
      for (const Status& s : st) {
        EXPECT_TRUE(s.is_ok()) << "kind " << static_cast<int>(kind) << ", optimizer "
                               << offload_device_name(optimizer) << ": " << s.to_string();
      }
    }
  }
}

}  // namespace
}  // namespace zinf
